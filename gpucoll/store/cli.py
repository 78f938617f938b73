"""``gpucoll store``: a standalone store server for multi-node jobs (ranks connect to it)."""

from __future__ import annotations

import argparse
import signal
import sys

from gpucoll.store.client import env_token
from gpucoll.store.protocol import DEFAULT_MAX_VALUE_BYTES
from gpucoll.store.server import StoreServer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucoll store",
        description="Serve a gpucoll key-value store until interrupted. Point ranks at it with "
                    "GPUCOLL_STORE=tcp://HOST:PORT (and the same GPUCOLL_STORE_TOKEN).")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=29500,
                   help="port to listen on; 0 picks a free one (default 29500)")
    p.add_argument("--token", default=None,
                   help="shared secret clients must present (default: $GPUCOLL_STORE_TOKEN)")
    p.add_argument("--max-value-bytes", type=int, default=DEFAULT_MAX_VALUE_BYTES,
                   help=f"largest value accepted (default {DEFAULT_MAX_VALUE_BYTES})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = args.token if args.token is not None else env_token()
    server = StoreServer(args.host, args.port, token=token,
                         max_value_bytes=args.max_value_bytes)
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    host = args.host if ":" not in args.host else f"[{args.host}]"
    print(f"gpucoll store: serving tcp://{host}:{server.port}"
          f"{' (token required)' if token else ''}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
