"""Bandwidth benchmarks measured and printed the way nccl-tests does (``gpucoll bench``).

Modules: ``options`` (flags, and what each operation moves: algbw/busbw), ``engine`` (timed
loops, the correctness pass, buffers and timers, ceilings), ``libraries`` (gpucoll, gloo and mpi
behind one adapter), ``report`` (tables, JSON, CSV, the plot), ``cli`` (``gpucoll bench``: the
driver from a shell, a rank inside a job, and where events go: the console with its progress
bar, or the driver's event file).
"""
