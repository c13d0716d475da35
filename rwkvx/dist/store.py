"""The rendezvous of a torchrun-style job: a small TCP server on rank 0 and one client per rank.

It does one collective, :meth:`StoreClient.allgather` (every rank sends bytes, every rank gets all of
them in rank order), which is enough for the NCCL unique id (rank 0's bytes), barriers, the host-side
averages of the CPU backend and of validation losses. It also watches the job: each rank keeps its
connection open for the whole run, so a rank that exits without saying goodbye (a crash, a kill) or
reports an error (:meth:`StoreClient.abort`) makes the server tell every other rank at once; a rank
blocked on the GPU sees :meth:`StoreClient.failure` in its wait loop. Every wait has a deadline.

Wire format: frames of ``op`` (1 byte), ``seq`` (uint32), payload length (uint64), payload; big-endian.
"""
from __future__ import annotations

import queue
import socket
import struct
import threading
import time

_HEADER = struct.Struct("!BIQ")
HELLO, WELCOME, GATHER, RESULT, ABORT, FAIL, BYE = range(1, 8)
_CONNECT_RETRY_S = 0.05


class DistributedError(RuntimeError):
    """A data-parallel job cannot go on: a rank failed, hung past the timeout, or cannot be reached."""


def _send(sock: socket.socket, op: int, seq: int = 0, payload: bytes = b"") -> None:
    sock.sendall(_HEADER.pack(op, seq, len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[int, int, bytes] | None:
    """The next frame, or None when the peer closed the connection."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    op, seq, length = _HEADER.unpack(head)
    payload = _recv_exact(sock, length) if length else b""
    if payload is None:
        return None
    return op, seq, payload


def pack_list(items: list[bytes]) -> bytes:
    """Length-prefixed concatenation (the RESULT payload)."""
    return b"".join(struct.pack("!Q", len(x)) + x for x in items)


def unpack_list(data: bytes) -> list[bytes]:
    """Inverse of :func:`pack_list`."""
    out, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack_from("!Q", data, pos)
        out.append(data[pos + 8:pos + 8 + n])
        pos += 8 + n
    return out


class StoreServer:
    """Serves ``world_size`` ranks on ``host:port`` from daemon threads (rank 0 runs it)."""

    def __init__(self, host: str, port: int, world_size: int):
        self.world_size = world_size
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._send_locks: dict[int, threading.Lock] = {}
        self._rounds: dict[int, dict[int, bytes]] = {}
        self._finished: set[int] = set()
        self._gone = threading.Condition(self._lock)
        self.failed: str | None = None
        self._sock = socket.create_server((host, port))  # SO_REUSEADDR: a restarted job can rebind
        self.address = self._sock.getsockname()[:2]
        threading.Thread(target=self._accept, name="rwkvx-store-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="rwkvx-store-conn", daemon=True).start()

    def _to(self, rank: int, op: int, seq: int = 0, payload: bytes = b"") -> None:
        conn, lock = self._conns.get(rank), self._send_locks.get(rank)
        if conn is None:
            return
        try:
            with lock:
                _send(conn, op, seq, payload)
        except OSError:
            pass  # that rank's own thread reports its disconnection

    def _fail(self, message: str) -> None:
        """Record the first failure and tell every connected rank (call with the lock held)."""
        if self.failed is None:
            self.failed = message
        for rank in list(self._conns):
            self._to(rank, FAIL, 0, self.failed.encode())

    def _serve(self, conn: socket.socket) -> None:
        rank = None
        try:
            frame = _recv(conn)
            if frame is None or frame[0] != HELLO:
                return
            rank, world = struct.unpack("!II", frame[2])
            with self._lock:
                if world != self.world_size or rank >= world or rank in self._conns:
                    why = (f"rank {rank} joined with WORLD_SIZE={world}, the job has {self.world_size}"
                           if world != self.world_size else f"rank {rank} joined twice (two processes "
                           "with the same RANK?)" if rank in self._conns else f"bad rank {rank}")
                    _send(conn, FAIL, 0, why.encode())
                    rank = None
                    return
                self._conns[rank] = conn
                self._send_locks[rank] = threading.Lock()
                self._to(rank, WELCOME)
                if self.failed is not None:
                    self._to(rank, FAIL, 0, self.failed.encode())
            while True:
                frame = _recv(conn)
                if frame is None:
                    with self._lock:
                        if rank not in self._finished:
                            self._fail(f"rank {rank} exited without finishing (it crashed or was "
                                       "killed: see its output)")
                    return
                op, seq, payload = frame
                with self._lock:
                    if op == BYE:
                        self._finished.add(rank)
                    elif op == ABORT:
                        self._fail(f"rank {rank} failed: {payload.decode(errors='replace')}")
                    elif op == GATHER:
                        if self.failed is not None:
                            self._to(rank, FAIL, 0, self.failed.encode())
                            continue
                        parts = self._rounds.setdefault(seq, {})
                        parts[rank] = payload
                        if len(parts) == self.world_size:
                            del self._rounds[seq]
                            result = pack_list([parts[r] for r in range(self.world_size)])
                            for r in range(self.world_size):
                                self._to(r, RESULT, seq, result)
        except OSError:
            with self._lock:
                if rank is not None and rank not in self._finished:
                    self._fail(f"lost the connection to rank {rank}")
        finally:
            with self._lock:
                if rank is not None:
                    self._conns.pop(rank, None)
                    self._gone.notify_all()
            conn.close()

    def close(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until every rank has disconnected, then stop serving."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._conns and time.monotonic() < deadline:
                self._gone.wait(max(0.0, deadline - time.monotonic()))
        self._sock.close()


class StoreClient:
    """One rank's connection to the :class:`StoreServer` at ``host:port``."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._replies: queue.Queue = queue.Queue()
        self._failure: str | None = None
        self._seq = 0
        self._closed = False
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise DistributedError(
                        f"rank {rank}: could not reach the rendezvous at {host}:{port} within {timeout:g} s "
                        f"({exc}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?") from None
                time.sleep(_CONNECT_RETRY_S)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self._post(HELLO, 0, struct.pack("!II", rank, world_size))
        threading.Thread(target=self._read, name="rwkvx-store-reader", daemon=True).start()
        op, _, payload = self._wait_reply("joining the job")
        if op != WELCOME:
            raise DistributedError(f"rank {rank}: the rendezvous refused this rank: {payload.decode()}")

    def _post(self, op: int, seq: int = 0, payload: bytes = b"") -> None:
        with self._send_lock:
            _send(self._sock, op, seq, payload)

    def _read(self) -> None:
        while True:
            try:
                frame = _recv(self._sock)
            except OSError:
                frame = None
            if frame is None:
                if not self._closed and self._failure is None:
                    self._failure = ("lost the connection to the rendezvous on rank 0 (rank 0 exited, "
                                     "crashed, or its host is unreachable)")
                self._replies.put((FAIL, 0, (self._failure or "closed").encode()))
                return
            if frame[0] == FAIL:
                self._failure = frame[2].decode(errors="replace")
            self._replies.put(frame)

    def _wait_reply(self, what: str) -> tuple[int, int, bytes]:
        try:
            frame = self._replies.get(timeout=self.timeout)
        except queue.Empty:
            raise DistributedError(f"rank {self.rank}: timed out after {self.timeout:g} s {what} (another "
                                   "rank is hung or much slower; see --dist-timeout)") from None
        if frame[0] == FAIL:
            raise DistributedError(f"rank {self.rank}: stopping because {frame[2].decode(errors='replace')}")
        return frame

    def allgather(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order (a collective: every rank must call it, in the same order)."""
        if self._failure is not None:
            raise DistributedError(f"rank {self.rank}: stopping because {self._failure}")
        self._seq += 1
        self._post(GATHER, self._seq, payload)
        op, seq, data = self._wait_reply(f"in collective #{self._seq}")
        if op != RESULT or seq != self._seq:
            raise DistributedError(f"rank {self.rank}: rendezvous protocol error (collective #{self._seq}, "
                                   f"got op {op} #{seq})")
        return unpack_list(data)

    def failure(self) -> str | None:
        """Why the job failed (another rank's error or disappearance), or None while it is healthy."""
        return self._failure

    def abort(self, message: str) -> None:
        """Tell every rank that this one failed with ``message`` (best effort)."""
        try:
            self._post(ABORT, 0, message.encode())
        except OSError:
            pass

    def close(self) -> None:
        """Leave the job cleanly (after which the server does not report this rank as failed)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._post(BYE)
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._sock.close()
