"""``gpucoll bench``: nccl-tests-style bandwidth of gpucoll's collectives (and its peers').

From a shell it starts the ranks itself (``-g N``, through ``gpucoll run``); inside a job that
some launcher started it measures with the ranks it is given.
"""

from __future__ import annotations

import sys

from gpucoll.bench.options import check_outputs, parse_args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parse_args(argv)
    check_outputs(opts)
    from gpucoll.bench import ranks

    if opts.results or ranks.inside_job():
        return ranks.main(opts, argv)
    from gpucoll.bench import driver

    return driver.main(opts, argv)


if __name__ == "__main__":
    sys.exit(main())
