"""The TCP key-value store ranks meet at: ``TCPStore`` (client and server), ``PrefixStore``, and
``StoreLimits`` (what one client can make a server hold).

Modules: ``client`` (``TCPStore``, ``PrefixStore``), ``server`` (the event loop serving every
client, its limits, and ``gpucoll store``), ``protocol`` (the wire format), ``gather`` (ranks
meeting in the store: one key each, a wait that names the missing ranks, wills).
"""

from gpucoll.store.client import PrefixStore, TCPStore, parse_address
from gpucoll.store.server import StoreLimits

__all__ = ["PrefixStore", "StoreLimits", "TCPStore", "parse_address"]
