"""``gpucoll store``: a standalone store server for multi-node jobs (ranks connect to it)."""

from __future__ import annotations

import argparse
import signal
import sys

from gpucoll.store.client import env_token
from gpucoll.store.protocol import DEFAULT_MAX_VALUE_BYTES
from gpucoll.store.server import StoreLimits, StoreServer


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
    d = StoreLimits()
    p.add_argument("--max-hello-bytes", type=int, default=d.hello_bytes,
                   help=f"largest first message, read before the token is checked "
                        f"(default {d.hello_bytes})")
    p.add_argument("--max-buffered-bytes", type=int, default=d.buffered_bytes,
                   help=f"unread replies per client before the server stops reading its "
                        f"requests until it catches up (default {d.buffered_bytes})")
    p.add_argument("--max-waiting", type=int, default=d.waiting,
                   help=f"requests one client may have waiting for keys (default {d.waiting})")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    token = args.token if args.token is not None else env_token()
    try:
        limits = StoreLimits(hello_bytes=args.max_hello_bytes,
                             buffered_bytes=args.max_buffered_bytes, waiting=args.max_waiting)
        server = StoreServer(args.host, args.port, token=token,
                             max_value_bytes=args.max_value_bytes, limits=limits)
    except ValueError as exc:
        parser.error(str(exc))
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
