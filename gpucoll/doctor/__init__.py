"""``gpucoll doctor``: what went wrong in a job, read from its ranks' flight recorders.

``records`` gathers the evidence (dump files in a directory, or a live job's answers and
summaries through its store), ``diagnosis`` turns it into a verdict per communicator,
``timeline`` into a Chrome trace, and ``cli`` is the command.
"""
