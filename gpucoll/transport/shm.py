"""Shared memory between ranks on one host: a single-producer ring per direction.

Each ring lives in an anonymous ``memfd`` whose descriptor travels to the peer over a Unix
socket, so the segment has no name in /dev/shm at any moment: nothing is left behind when a
process is killed, and the kernel frees the memory once both sides have unmapped it.

Layout: a 256-byte header of counters (the sender owns ``head`` and ``tx_sleep``, the receiver
``tail`` and ``rx_sleep``, on separate cache lines), then ``cap`` data bytes. Counters only grow.
Every message starts 16-byte aligned and pieces are whole elements, so a receiver reduces typed
views of the ring directly, without a staging copy. A side that is about to block sets its sleep
flag and the other side rings its eventfd doorbell.

Memory ordering. The sender copies data into the ring, then stores ``head``; the receiver loads
``head``, then reads the data (and symmetrically for ``tail`` and the space it frees). That is
correct only if (1) the CPU makes stores visible in program order and does not reorder loads with
older loads, and (2) the compiler keeps the copy before the counter store. (2) holds because the
copy and the counter store are separate calls into C (a memcpy inside NumPy or the memoryview
code, then a store through ``memoryview.cast("q")``) that no compiler can merge or reorder. (1)
is x86-64's total store order (TSO): stores are seen in order and loads are not reordered with
other loads. Weakly ordered CPUs (Arm, POWER, RISC-V) need a release barrier between the copy and
the store and an acquire barrier after the load, and Python has no way to issue one; so
``ordered_cpu()`` says False there and the mesh joins ranks on such hosts with Unix-domain socket
pairs instead, where the kernel's own locking orders the bytes (``gpucoll.transport.mesh``).

The small messages' exchange also exists compiled (``_shmfast.c``, built by pip where a C
compiler is found): the same protocol, byte for byte, with explicit acquire/release atomics.
"""

from __future__ import annotations

import importlib.machinery
import mmap
import os
import platform
import sys

import numpy as np

try:  # the small-message exchange compiled (pip builds it where a C compiler is found)
    from gpucoll.transport import _shmfast
except ImportError:
    _shmfast = None

FRAME_MAGIC = b"GCf1"  # how a message's frame header starts (gpucoll.backends.ring_algos)
HEADER = 256
HEAD, TX_SLEEP, TAIL, RX_SLEEP = 0, 1, 16, 17  # int64 slots of the header
PIECE = 512 << 10  # bytes moved per step: the peer works on the previous piece meanwhile
WHOLE = 1 << 20  # messages up to this size (and half a ring) never wrap: read in place
OUTBOX = 2 << 20  # data bytes of a rank's outbox: two slots, one filling while one drains
STAGED, FOLDED, TAKEN, ASLEEP = 0, 8, 16, 24  # int64 slots of an outbox's header


# CPUs whose memory model (total store order) makes the ring's counter protocol correct
TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


def ordered_cpu(machine: str | None = None) -> bool:
    """True where the shared-memory rings are safe: x86 CPUs, whose stores are seen in order
    (see the module docstring). GPUCOLL_CPU_MACHINE overrides the machine name (for tests)."""
    if machine is None:
        machine = os.environ.get("GPUCOLL_CPU_MACHINE") or platform.machine()
    return machine.lower() in TSO_MACHINES


def native() -> object | None:
    """The compiled small-message exchange (``_shmfast``), or None where it was not built or
    GPUCOLL_NATIVE=0 turns it off (the same protocol then runs in Python)."""
    return _shmfast if _native_wanted() else None


def _native_wanted() -> bool:
    raw = os.environ.get("GPUCOLL_NATIVE", "1").strip()
    if raw not in ("0", "1", ""):
        raise ValueError(f"GPUCOLL_NATIVE={raw!r}: expected 1 (the compiled small-message "
                         f"exchange where it was built, the default) or 0 (its Python form)")
    return raw != "0"


def ring_bytes_from_env() -> int | None:
    """GPUCOLL_SHM_RING_BYTES as a number of bytes (at least 4096), or None where unset."""
    raw = os.environ.get("GPUCOLL_SHM_RING_BYTES", "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 4096:
        raise ValueError(f"GPUCOLL_SHM_RING_BYTES={raw!r}: expected the data bytes of one "
                         f"shared-memory ring, an integer >= 4096")
    return value


def exchange(package: str | None = None) -> tuple[str, str | None]:
    """Which small-message exchange the gpucoll package in directory ``package`` (None: this
    process's) loads, in words, and where that is the Python one for want of the compiled one,
    how to build it (else None). Decided from the files, so a launcher can say it of the
    package its ranks will import."""
    if os.environ.get("GPUCOLL_NATIVE", "1") == "0":
        return "in Python (GPUCOLL_NATIVE=0)", None
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if package is None or os.path.samefile(package, here):
        if _shmfast is not None:
            return "compiled", None
        package = here
    elif compiled_in(package):
        return "compiled", None
    state = "does not load" if compiled_in(package) else "is not built"
    root = os.path.dirname(package)
    if os.path.exists(os.path.join(root, "pyproject.toml")):  # a source tree
        how = f"build it once with: {sys.executable} -m pip install -e {root}"
    else:
        how = ("pip found no C compiler or Python headers when it installed gpucoll: install "
               "them (e.g. gcc and python3-dev), then reinstall gpucoll")
    return (f"in Python (the compiled one {state} in {package})",
            f"small messages on shared memory take 3-4x longer without the compiled exchange; "
            f"{how}")


def compiled_in(package: str) -> bool:
    """Whether the gpucoll package in directory ``package`` holds the compiled exchange built
    for this Python."""
    base = os.path.join(package, "transport", "_shmfast")
    return any(os.path.exists(base + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _align16(n: int) -> int:
    return (n + 15) & ~15


def ring_bytes(local_peers: int) -> int:
    """Data bytes of one ring: 2 MiB (four pieces in flight, and still cache-sized), less when
    many ranks share the host; always a multiple of 16."""
    env = ring_bytes_from_env()
    if env is not None:
        return _align16(env)  # small rings only cap the in-place size
    return max(2 << 20 >> max(local_peers - 8, 0).bit_length(), 256 << 10)


def create_segment(name: str, cap: int) -> int:
    """An anonymous shared segment of ``HEADER + cap`` bytes; its file descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, HEADER + cap)
    except OSError:
        os.close(fd)
        raise
    return fd


def _skip_wrap(pos: int, nbytes: int, cap: int) -> int:
    return pos if pos % cap + nbytes <= cap else pos + cap - pos % cap


class Ring:
    """One mapped segment (a ring, or an outbox); ``cap`` is taken from its size."""

    def __init__(self, fd: int):
        size = os.fstat(fd).st_size
        self.cap = size - HEADER
        self._mm = mmap.mmap(fd, size)
        self.ctl = memoryview(self._mm)[:HEADER].cast("q")
        self.data = np.frombuffer(self._mm, dtype=np.uint8, count=self.cap, offset=HEADER)
        self.mv = memoryview(self.data)

    def typed(self, offset: int, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype`` at data byte ``offset``, in place (writable)."""
        return np.frombuffer(self._mm, dtype, count, HEADER + offset)

    def close(self) -> None:
        self.ctl.release()
        self.mv.release()
        self.data = None
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the mapping dies with the process
            pass


class ShmLink:
    """Send ring to one peer, receive ring from it, and the peer's doorbell."""

    kind = "shm"

    def __init__(self, peer: int, tx: Ring, rx: Ring, peer_bell: int):
        self.peer = peer
        self.tx = tx
        self.rx = rx
        self.bell = peer_bell
        self._head = 0  # bytes this side published into tx (aligned at message ends)
        self._pos = 0  # bytes this side consumed from rx
        # both rings of a pair have the same size, so both ends agree on this limit
        self.whole = min(WHOLE, tx.cap // 2, rx.cap // 2)
        fast = native()
        # raw views of both rings for the compiled exchange; they keep the mappings alive
        self.native = fast.Link(tx._mm, rx._mm) if fast is not None else None

    def _ring_peer(self) -> None:
        try:
            os.eventfd_write(self.bell, 1)
        except OSError:  # the peer is gone; its monitor connection reports that
            pass

    # -- message boundaries ----------------------------------------------------------------
    def begin(self, sending: bool, nbytes: int) -> None:
        """Start a message: one of at most WHOLE bytes skips to the ring's start rather than
        wrap (both sides apply the same rule, so their positions stay in step)."""
        if nbytes > self.whole:
            return
        if sending:
            self._head = _skip_wrap(self._head, nbytes, self.tx.cap)
        else:
            pos = _skip_wrap(self._pos, nbytes, self.rx.cap)
            if pos != self._pos:
                self._pos = pos
                self.rx.ctl[TAIL] = pos

    # -- sending ---------------------------------------------------------------------------
    def put(self, header: bytes, mv: memoryview) -> bool:
        """Write a whole small message, frame header then payload (after ``begin``), if there is
        room; True when written."""
        tx = self.tx
        head, h = self._head, len(header)
        n = h + len(mv)
        if tx.cap - (head - tx.ctl[TAIL]) < n:
            return False
        p = head % tx.cap
        tx.mv[p:p + h] = header
        tx.mv[p + h:p + n] = mv
        tx.ctl[HEAD] = head + n
        self._head = _align16(head + n)
        if tx.ctl[RX_SLEEP]:
            self._ring_peer()
        return True

    def send_some(self, mv: memoryview, off: int, end: int, item: int = 16) -> int:
        """Copy what fits of ``mv[off:end]`` into the ring; bytes written."""
        tx = self.tx
        head = self._head
        cap = tx.cap
        free = cap - (head - tx.ctl[TAIL])
        p = head % cap
        k = min(end - off, free, cap - p, PIECE)
        k -= k % item
        if k <= 0:
            return 0
        tx.mv[p:p + k] = mv[off:off + k]
        head += k
        self._head = head
        tx.ctl[HEAD] = head
        if tx.ctl[RX_SLEEP]:
            self._ring_peer()
        return k

    def can_put(self, nbytes: int) -> bool:
        return self.tx.cap - (self._head - self.tx.ctl[TAIL]) >= nbytes

    def can_send(self) -> bool:
        return self.tx.cap - (self._head - self.tx.ctl[TAIL]) > 0

    def end_send(self) -> None:
        self._head = _align16(self._head)

    def sent(self) -> int:
        """Bytes this side has put on the link so far (the receiver's ``received`` once read)."""
        return self._head

    def delivered(self) -> bool:
        """True once the peer has consumed everything this side sent."""
        return self.tx.ctl[TAIL] >= self._head

    def undelivered(self) -> int:
        """Bytes this side sent that the peer has not consumed."""
        return max(self._head - self.tx.ctl[TAIL], 0)

    # -- receiving -------------------------------------------------------------------------
    def _available(self, remaining: int) -> tuple[int, int]:
        rx = self.rx
        pos = self._pos
        p = pos % rx.cap
        return p, min(rx.ctl[HEAD] - pos, remaining, rx.cap - p, PIECE)

    def _consumed(self, k: int) -> None:
        rx = self.rx
        self._pos += k
        rx.ctl[TAIL] = self._pos
        if rx.ctl[TX_SLEEP]:
            self._ring_peer()

    def recv_copy(self, mv: memoryview, off: int, end: int) -> int:
        p, k = self._available(end - off)
        if k <= 0:
            return 0
        mv[off:off + k] = self.rx.mv[p:p + k]
        self._consumed(k)
        return k

    def recv_reduce(self, acc: np.ndarray, src: np.ndarray, ufunc, off: int, end: int) -> int:
        """Fold the next available bytes into ``acc``: ``acc[i] = ufunc(src[i], incoming[i])``."""
        p, k = self._available(end - off)
        if k <= 0:
            return 0
        item = acc.itemsize
        first, count = off // item, k // item
        incoming = self.rx.data[p:p + k].view(acc.dtype)
        ufunc(src[first:first + count], incoming, out=acc[first:first + count])
        self._consumed(k)
        return k

    def peek(self, nbytes: int) -> np.ndarray | None:
        """The next small message (after ``begin``), in place in the ring, once complete."""
        rx = self.rx
        pos = self._pos
        if rx.ctl[HEAD] - pos < nbytes:
            return None
        p = pos % rx.cap
        return rx.data[p:p + nbytes]

    def arrived(self, nbytes: int) -> int:
        """Where the next small message starts in the receive ring (after ``begin``), once all
        its ``nbytes`` are there; -1 before."""
        pos = self._pos
        return pos % self.rx.cap if self.rx.ctl[HEAD] - pos >= nbytes else -1

    def poll_arrival(self, nbytes: int, polls: int) -> bool:
        """Read the peer's counter up to ``polls`` times (~0.1 us each) until the next small
        message is all there; True once it is."""
        ctl, want = self.rx.ctl, self._pos + nbytes
        for _ in range(polls):
            if ctl[HEAD] >= want:
                return True
        return False

    def release(self, nbytes: int) -> None:
        """Hand a peeked message's space back to the sender, up to the next message's start
        (one counter store)."""
        self._consumed(_align16(self._pos + nbytes) - self._pos)

    def can_recv(self) -> bool:
        return self.rx.ctl[HEAD] - self._pos > 0

    def received(self) -> int:
        """Bytes consumed from the peer so far, in the units of the peer's ``sent``."""
        return self._pos

    def unread(self) -> int:
        """Bytes the peer published that this side has not consumed."""
        return max(self.rx.ctl[HEAD] - self._pos, 0)

    def next_frame(self, size: int) -> bytes | None:
        """The first ``size`` bytes of the next unread message (its frame header), wherever
        the sender placed it (a small message may have skipped to the ring's start)."""
        rx, pos = self.rx, self._pos
        for start in (pos, pos + rx.cap - pos % rx.cap):
            if rx.ctl[HEAD] - start >= size and start % rx.cap + size <= rx.cap:
                head = rx.data[start % rx.cap:start % rx.cap + size].tobytes()
                if head[:4] == FRAME_MAGIC:
                    return head
        return None

    def end_recv(self) -> None:
        aligned = _align16(self._pos)
        if aligned != self._pos:
            self._pos = aligned
            self.rx.ctl[TAIL] = aligned

    # -- sleeping --------------------------------------------------------------------------
    def sleep_flags(self, sending: bool, receiving: bool, value: int) -> None:
        """Announce (value=1) or withdraw (0) that this side waits on the peer."""
        if sending:
            self.tx.ctl[TX_SLEEP] = value
        if receiving:
            self.rx.ctl[RX_SLEEP] = value

    def close(self) -> None:
        self.native = None
        self.tx.close()
        self.rx.close()
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1


class Outboxes:
    """Every rank's outbox, when all the group's ranks share this host: one segment per rank
    that its owner writes and every rank maps, so data copied in once is read by all the
    others in place (the large all_reduce, ``ring_algos.all_reduce_outboxes``). Each header
    counts its owner's slots of work since set-up, for every rank to read: STAGED (its data
    copied in), FOLDED (its share of the fold written back), TAKEN (the others' shares copied
    out, so the slot may be reused); ASLEEP says the owner sleeps on its doorbell."""

    slots = 2

    def __init__(self, rank: int, boxes: dict[int, Ring], links: list):
        self.rank = rank
        self.ranks = sorted(boxes)
        self.boxes = boxes
        self.slot_bytes = boxes[rank].cap // self.slots // 16 * 16
        self.used = 0  # slots this rank has been through: where its next call counts from
        self._mine = boxes[rank].ctl
        self._ctls = [boxes[j].ctl for j in self.ranks]
        self._links = [links[j] for j in self.ranks if j != rank]

    def slot(self, owner: int, index: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Slot ``index`` (counted since set-up) of ``owner``'s outbox, typed, in place."""
        return self.boxes[owner].typed((index % self.slots) * self.slot_bytes, dtype, count)

    def least(self, counter: int) -> int:
        """The lowest value of ``counter`` over every rank (this one included)."""
        return min(ctl[counter] for ctl in self._ctls)

    def behind(self, counter: int, value: int) -> int:
        """A peer whose ``counter`` is below ``value`` (the one a wait waits for), else -1."""
        return next((j for j, ctl in zip(self.ranks, self._ctls, strict=True)
                     if j != self.rank and ctl[counter] < value), -1)

    def publish(self, counter: int, value: int) -> None:
        """Set this rank's ``counter``; ring the peers asleep on their doorbells."""
        self._mine[counter] = value
        for link in self._links:
            if self.boxes[link.peer].ctl[ASLEEP]:
                link._ring_peer()

    def asleep(self, value: int) -> None:
        self._mine[ASLEEP] = value

    def close(self) -> None:
        for box in self.boxes.values():
            box.close()
        self.boxes, self._ctls, self._links = {}, [], []
