"""How bytes travel between ranks: TCP (any hosts), shared memory (one host), the mesh that
connects a group through the store, and the monitor that notices dead peers.

Modules: ``mesh`` (every pair of ranks connected through the store; the monitor, ``Monitor``:
peer liveness on the control connections, abort and close messages, and a peer's "where are
you?"; and the TCP side: socket set-up helpers and ``TcpLink``, the non-blocking link over a TCP
or Unix-domain socket), ``shm`` (shared-memory rings between ranks on one host, ``ShmLink``),
``engine`` (sends and receives driven to completion from one thread, with deadlines).
"""
