"""The rendezvous on 127.0.0.1: host collectives in rank order, and every failure ending in a clear
error on every rank (a crashed rank, a reported error, a hang past the timeout, no rank 0)."""
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rwkvx.dist import DistributedError, World
from rwkvx.dist.launch import free_port
from rwkvx.dist.nccl import poll_until
from rwkvx.dist.store import StoreClient, StoreServer
from rwkvx.dist.world import _StoreGroup

from seeding import seeded_rng


def start_world(n, timeout=10.0):
    """n Worlds of one job, each rank's client in this process (rank 0 also serves)."""
    port = free_port()
    server = StoreServer("127.0.0.1", port, n)
    clients = [None] * n

    def connect(r):
        clients[r] = StoreClient("127.0.0.1", port, r, n, timeout)

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [World(r, n, r, _StoreGroup(clients[r], server if r == 0 else None), timeout)
            for r in range(n)]


def on_all(worlds, fn):
    """fn(world) on every rank at once (threads); the results, or the exception of each rank."""
    out = [None] * len(worlds)

    def run(i):
        try:
            out[i] = fn(worlds[i])
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(worlds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_collectives_in_rank_order():
    worlds = start_world(3)
    rng = seeded_rng(0)
    data = [rng.standard_normal(1000).astype(np.float32) for _ in worlds]
    for round_ in range(3):
        got = on_all(worlds, lambda w: w.allgather(f"{w.rank}:{round_}".encode() * (w.rank + 1)))
        assert all(g == [f"{r}:{round_}".encode() * (r + 1) for r in range(3)] for g in got)
    means = on_all(worlds, lambda w: w.mean(data[w.rank]))
    expect = (data[0] + data[1] + data[2]) / np.float32(3)      # summed in rank order, float32
    assert all(m.dtype == np.float32 and np.array_equal(m, expect) for m in means)
    assert on_all(worlds, lambda w: w.broadcast(b"id" if w.is_main else None)) == [b"id"] * 3
    assert on_all(worlds, lambda w: w.barrier()) == [None] * 3
    on_all(worlds, lambda w: w.close())


def test_one_rank_world_returns_its_own_data():
    w = World.single()
    x = np.arange(5, dtype=np.float64) / 3
    assert w.mean(x) is not x and np.array_equal(w.mean(x), x)
    assert w.allgather(b"a") == [b"a"] and w.broadcast(b"b") == b"b" and w.failure() is None


def test_a_crashed_rank_stops_the_others_at_once():
    worlds = start_world(3)
    victim = worlds[2].group.client
    victim._closed = True
    victim._sock.shutdown(socket.SHUT_RDWR)    # the connection ends without a goodbye, as at a crash
    t0 = time.monotonic()
    errors = on_all(worlds[:2], lambda w: w.barrier())
    assert time.monotonic() - t0 < 5
    for e in errors:
        assert isinstance(e, DistributedError) and "rank 2 exited without finishing" in str(e)
    assert "rank 2 exited" in worlds[1].failure()
    with pytest.raises(DistributedError, match="rank 1: stopping because rank 2 exited"):
        worlds[1].check()


def test_a_reported_error_reaches_every_rank():
    worlds = start_world(2)
    worlds[1].abort("FloatingPointError: loss is nan at step 7")
    err = on_all(worlds[:1], lambda w: w.barrier())[0]
    assert isinstance(err, DistributedError)
    assert "rank 1 failed: FloatingPointError: loss is nan at step 7" in str(err)


def test_a_hung_rank_times_out():
    worlds = start_world(2, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match="rank 0: timed out after 1 s in collective #1"):
        worlds[0].barrier()                    # rank 1 never joins
    assert time.monotonic() - t0 < 5


def test_losing_rank_0_stops_the_others():
    worlds = start_world(2)
    server = worlds[0].group.server
    server._sock.close()
    for conn in list(server._conns.values()):
        conn.shutdown(socket.SHUT_RDWR)         # as when rank 0's process dies
    # which of the two notices rank 1 reads first depends on timing; both name rank 0's loss
    with pytest.raises(DistributedError, match="lost the connection to the rendezvous on rank 0|"
                                               "rank 0 exited without finishing"):
        worlds[1].barrier()


def test_joining_errors():
    port = free_port()
    with pytest.raises(DistributedError, match=r"could not reach the rendezvous at 127.0.0.1:\d+ within"):
        StoreClient("127.0.0.1", port, 1, 2, timeout=0.5)
    StoreServer("127.0.0.1", port, 2)
    StoreClient("127.0.0.1", port, 1, 2, timeout=5)
    with pytest.raises(DistributedError, match="rank 1 joined twice"):
        StoreClient("127.0.0.1", port, 1, 2, timeout=5)
    with pytest.raises(DistributedError, match="joined with WORLD_SIZE=3, the job has 2"):
        StoreClient("127.0.0.1", port, 0, 3, timeout=5)


def test_poll_until():
    ticks = iter(range(1000))
    calls = []
    poll_until(lambda: len(calls) > 3 or calls.append(1), lambda: None, 10, "x")
    assert len(calls) == 4
    with pytest.raises(DistributedError, match="waiting: rank 3 failed"):
        poll_until(lambda: False, lambda: "rank 3 failed", 10, "waiting")
    clock = lambda: next(ticks) * 0.5  # noqa: E731 - half a second per poll
    with pytest.raises(DistributedError, match="waiting: no progress in 2 s"):
        poll_until(lambda: False, lambda: None, 2, "waiting", clock=clock)


def test_watchdog_ends_a_blocked_rank():
    code = ("import time\n"
            "from rwkvx.dist import World\n"
            "from rwkvx.dist.nccl import watchdog\n"
            "with watchdog(World.single(timeout=0.5), 'creating the NCCL communicator'):\n"
            "    time.sleep(30)\n")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and time.monotonic() - t0 < 20
    assert "rank 0: creating the NCCL communicator: no progress in 0.5 s" in res.stderr


class FakeComm:
    """The part of mpi4py's COMM_WORLD that rwkvx uses, for one rank of a pretend job."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Split_type(self, kind):
        return FakeComm(self.rank % 2, 2)          # two ranks per machine

    def allgather(self, payload):
        return [payload] * self.size


def test_mpi_world(monkeypatch):
    import types
    from rwkvx.dist import LaunchInfo, init_world
    fake = types.SimpleNamespace(MPI=types.SimpleNamespace(COMM_WORLD=FakeComm(3, 4), COMM_TYPE_SHARED=1))
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    world = init_world(LaunchInfo("mpi", 3, 4, None))
    assert (world.rank, world.world_size, world.local_rank) == (3, 4, 1)
    assert world.allgather(b"x") == [b"x"] * 4 and world.failure() is None
    assert init_world(LaunchInfo("mpi", 3, 4, 0)).local_rank == 0     # the launcher's local rank wins
    with pytest.raises(DistributedError, match="the launcher says rank 1 of 4, MPI says rank 3 of 4"):
        init_world(LaunchInfo("mpi", 1, 4, None))
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(DistributedError, match="mpi4py is not installed"):
        init_world(LaunchInfo("mpi", 3, 4, None))
