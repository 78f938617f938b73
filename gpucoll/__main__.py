"""The ``gpucoll`` command (also ``python -m gpucoll``): one subcommand per job, each living in
the module that does it."""

from __future__ import annotations

import importlib
import sys

# subcommand -> ("module" or "module:function", one-line help); the function (default main)
# takes argv and returns the exit status
COMMANDS = {
    "run": ("gpucoll.launch.cli", "start N ranks of a script (like torchrun)"),
    "topo": ("gpucoll.topology.render", "show the NVLink/PCIe layout of this machine"),
    "bench": ("gpucoll.bench.cli", "measure collective bandwidth, nccl-tests style"),
    "info": ("gpucoll.selftest:info_main",
             "what this machine can do: CuPy, CUDA, NCCL, devices, backend"),
    "store": ("gpucoll.store.server", "run a standalone key-value store for multi-node jobs"),
    "selftest": ("gpucoll.selftest", "check the GPU path on this machine's GPUs; a report to "
                                     "paste"),
    "doctor": ("gpucoll.doctor", "say which rank is stuck where, from the flight recorders"),
}


def usage() -> str:
    lines = ["usage: gpucoll COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`gpucoll COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from gpucoll import __version__

        print(f"gpucoll {__version__}")
        return 0
    entry = COMMANDS.get(argv[0])
    if entry is None:
        print(f"gpucoll: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from gpucoll.errors import MissingPackage

    try:
        module, _, function = entry[0].partition(":")
        return int(getattr(importlib.import_module(module), function or "main")(argv[1:]) or 0)
    except MissingPackage as exc:  # one line naming the extra to install, not a traceback
        print(f"gpucoll {argv[0]}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
