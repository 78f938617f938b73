"""The client's side of the wire: whole reply frames from a blocking socket.

Each value of a reply is received straight into the bytes object handed to the caller
(``BufferedReader.read(n)`` reads past its small buffer into the result), so a 64 MiB value is
copied once, by the kernel, not received into a buffer and copied out again. Small replies
still take one ``recv``: the buffer holds the whole frame and the reads are slices of it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from gpucoll.store.protocol import (
    BIG_ARG,
    HEADER,
    HEADER_SIZE,
    RECV_CHUNK,
    Frame,
    FrameError,
    decode_args,
)


class ReplyReader:
    """Reads reply frames from ``sock`` (blocking, with a kernel receive timeout: SO_RCVTIMEO).

    Whenever a receive times out, ``tick()`` is called; it raises once the caller's deadline
    has passed and may shorten the next receive's timeout. ``torn`` is True while a frame has
    been started but not finished: a deadline then leaves the stream unusable.
    """

    def __init__(self, sock: socket.socket):
        self._file = sock.makefile("rb", buffering=RECV_CHUNK)
        self.torn = False

    def read_frame(self, tick: Callable[[], None]) -> tuple[int, int, list[bytes]] | None:
        """The next frame as (code, request id, arguments); None when the peer closed the
        stream. FrameError for a frame that breaks the format."""
        head = self._exact(HEADER_SIZE, tick)
        if head is None:
            return None
        self.torn = True
        plen, code, rid, argc = HEADER.unpack(head)
        table = 4 * argc
        if plen < BIG_ARG or table > plen:  # small: one read, then slices of it
            payload = self._exact(plen, tick)
            if payload is None:
                return None
            self.torn = False
            return code, rid, decode_args(Frame(code, rid, argc, payload))
        raw = self._exact(table, tick)
        if raw is None:
            return None
        lengths = struct.unpack(f"<{argc}I", raw)
        if table + sum(lengths) != plen:
            raise FrameError(f"argument lengths add up to {sum(lengths)} bytes, frame holds "
                             f"{plen - table}", rid)
        args = []
        for n in lengths:
            arg = self._exact(n, tick)
            if arg is None:
                return None
            args.append(arg)
        self.torn = False
        return code, rid, args

    def close(self) -> None:
        """Release the socket's file object (waits for a read in progress to return)."""
        self._file.close()

    def _exact(self, n: int, tick: Callable[[], None]) -> bytes | None:
        """Exactly ``n`` bytes, or None at end of stream."""
        data = self._file.read(n)
        if data is not None and len(data) == n:
            return data  # the common case: one call
        parts: list[bytes] = []
        got = 0
        while True:
            if data is not None:
                if not data:
                    return None
                parts.append(data)
                got += len(data)
                if got == n:
                    return b"".join(parts)
                self.torn = True
            tick()  # the receive timed out (or came up short): is there time left?
            data = self._file.read(n - got)
