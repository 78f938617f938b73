"""The TCP key-value store ranks meet at: ``TCPStore`` (client and server), ``PrefixStore``, and
``StoreLimits`` (what one client can make a server hold)."""

from gpucoll.store.client import PrefixStore, TCPStore, parse_address
from gpucoll.store.server import StoreLimits

__all__ = ["PrefixStore", "StoreLimits", "TCPStore", "parse_address"]
