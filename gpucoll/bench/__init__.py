"""Bandwidth benchmarks measured and printed the way nccl-tests does (``gpucoll bench``).

Modules: options (flags), formulas (algbw/busbw), engine (timed loop + correctness pass),
libraries/peers (gpucoll, gloo, mpi adapters), report/session (tables, JSON, CSV), plot,
ceilings (memory and copy bandwidth), ranks (the rank side), driver (starts the ranks).
"""
