"""The TCP key-value store ranks meet at: ``TCPStore`` (client and server) and ``PrefixStore``."""

from gpucoll.store.client import TCPStore, parse_address
from gpucoll.store.prefix import PrefixStore

__all__ = ["PrefixStore", "TCPStore", "parse_address"]
