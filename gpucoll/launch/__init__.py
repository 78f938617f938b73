"""The launcher behind ``gpucoll run``: N ranks with rendezvous environment, supervised.

Modules: ``cli`` (arguments), ``config`` (the checked job), ``environ`` (a rank's variables),
``devices`` (GPU discovery), ``jobstore`` (the job's store), ``procs`` (one rank's process),
``output`` (prefixed lines, logs), ``signals`` and ``supervisor`` (the event loop), ``report``.
"""
