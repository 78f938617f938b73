"""The launcher behind ``gpucoll run``: N ranks with rendezvous environment, supervised.

Modules: ``cli`` (arguments, the job's store, ``main``), ``config`` (the checked job, its GPUs,
each rank's environment and ``--bind`` placement), ``supervisor`` (rank processes, their
output, signals, the event loop that stops every rank when one fails, the failure report, and
asking ``gpucoll doctor`` about the job: at ``--timeout``, on SIGUSR1).
"""
