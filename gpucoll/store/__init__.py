"""The TCP key-value store ranks meet at: ``TCPStore`` (client and server), ``PrefixStore``, and
``StoreLimits`` (what one client can make a server hold).

Modules: ``client`` (``TCPStore``, ``PrefixStore``, and ranks meeting in the store: one key
each, a wait that names the missing ranks, wills), ``server`` (the event loop serving every
client, its limits, and ``gpucoll store``), ``protocol`` (the wire format), ``forks`` (what a
forked child closes of what it inherited: connections, servers, a transport's sockets).
"""

from gpucoll.store.client import (
    CLOSED_AFTER,
    POLL,
    Liveness,
    PrefixStore,
    TCPStore,
    aborted_reason,
    agree_survivors,
    fetch,
    gather,
    gone_failure,
    leave_group,
    parse_address,
    relayed_failure,
    share,
    wait_for_ranks,
)
from gpucoll.store.server import StoreLimits

__all__ = ["CLOSED_AFTER", "POLL", "Liveness", "PrefixStore", "StoreLimits", "TCPStore",
           "aborted_reason", "agree_survivors", "fetch", "gather", "gone_failure", "leave_group",
           "parse_address", "relayed_failure", "share", "wait_for_ranks"]
