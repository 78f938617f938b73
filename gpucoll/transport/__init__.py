"""How bytes travel between ranks: TCP (any hosts), shared memory (one host), the mesh that
connects a group through the store, and the monitor that notices dead peers."""
