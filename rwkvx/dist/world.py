"""A data-parallel job as one process sees it: rank, size, host-side collectives and the failure watch.

:func:`init_world` joins the job a :class:`~rwkvx.dist.env.LaunchInfo` describes: the TCP rendezvous
of :mod:`rwkvx.dist.store` for torchrun-style launches (rank 0 serves it), ``mpi4py``'s COMM_WORLD
under mpirun/srun. :meth:`World.single` is a job of one rank (the world-size-1 path of the tests).
Host collectives are for small or infrequent data (the NCCL id, validation losses, the CPU backend's
gradients); the GPU backend reduces gradients with NCCL (:mod:`rwkvx.dist.nccl`).
"""
from __future__ import annotations

import sys
from typing import Protocol

import numpy as np

from .env import LaunchInfo
from .store import DistributedError, StoreClient, StoreServer

DEFAULT_TIMEOUT_S = 600.0   # how long any rank waits for the others before the job ends with an error


class HostGroup(Protocol):
    """The transport under a :class:`World`."""

    def allgather(self, payload: bytes) -> list[bytes]: ...
    def failure(self) -> str | None: ...
    def abort(self, message: str) -> None: ...
    def close(self) -> None: ...


class _SingleGroup:
    def allgather(self, payload: bytes) -> list[bytes]:
        return [payload]

    def failure(self) -> None:
        return None

    def abort(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass


class _MPIGroup:
    """COMM_WORLD of mpi4py; MPI's runtime ends the job when a rank dies, so failure() has nothing to add."""

    def __init__(self, comm):
        self.comm = comm

    def allgather(self, payload: bytes) -> list[bytes]:
        return self.comm.allgather(payload)

    def failure(self) -> None:
        return None

    def abort(self, message: str) -> None:
        print(f"error: {message}", file=sys.stderr, flush=True)   # MPI_Abort ends this process too
        self.comm.Abort(1)

    def close(self) -> None:
        pass


class _StoreGroup:
    """A :class:`StoreClient`, plus the server on rank 0 (closed after every rank has left)."""

    def __init__(self, client: StoreClient, server: StoreServer | None):
        self.client, self.server = client, server
        self.allgather, self.failure, self.abort = client.allgather, client.failure, client.abort

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.close(self.client.timeout)


class World:
    """Rank ``rank`` of ``world_size``; ``local_rank`` picks its GPU on its machine.

    Collectives (every rank calls them in the same order): :meth:`allgather`, :meth:`broadcast`,
    :meth:`barrier`, :meth:`mean`. :meth:`failure` is another rank's error, :meth:`abort` reports this
    rank's to the others. ``timeout`` (seconds) bounds every wait, host or GPU."""

    def __init__(self, rank: int, world_size: int, local_rank: int, group: HostGroup,
                 timeout: float = DEFAULT_TIMEOUT_S):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.group, self.timeout = group, float(timeout)

    @classmethod
    def single(cls, timeout: float = DEFAULT_TIMEOUT_S) -> "World":
        """A job of one rank: collectives return this rank's own data."""
        return cls(0, 1, 0, _SingleGroup(), timeout)

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that writes checkpoints, logs, plots and the progress bar."""
        return self.rank == 0

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank})"

    # -- collectives ----------------------------------------------------------------------------
    def allgather(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order."""
        return self.group.allgather(payload)

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0's ``payload`` on every rank (the others pass None)."""
        if self.is_main and payload is None:
            raise ValueError("broadcast: rank 0 must give the payload")
        return self.allgather(payload if self.is_main else b"")[0]

    def barrier(self) -> None:
        """Return once every rank has called it."""
        self.allgather(b"")

    def mean(self, array: np.ndarray) -> np.ndarray:
        """The mean over ranks of ``array`` (same shape and dtype on every rank), summed in rank order in
        its dtype: identical on every rank, and ``array`` itself for one rank."""
        array = np.ascontiguousarray(array)
        parts = self.allgather(array.tobytes())
        total = np.frombuffer(parts[0], array.dtype).reshape(array.shape).copy()
        for part in parts[1:]:
            total += np.frombuffer(part, array.dtype).reshape(array.shape)
        if self.world_size > 1:
            total /= self.world_size
        return total

    # -- health ---------------------------------------------------------------------------------
    def failure(self) -> str | None:
        """Why the job cannot go on (another rank failed or vanished), or None."""
        return self.group.failure()

    def check(self) -> None:
        """Raise DistributedError if another rank has failed."""
        why = self.failure()
        if why is not None:
            raise DistributedError(f"rank {self.rank}: stopping because {why}")

    def abort(self, message: str) -> None:
        """Tell the other ranks that this one failed (they stop with ``message``)."""
        self.group.abort(message)

    def close(self) -> None:
        """Leave the job (rank 0 waits for the others to leave before its rendezvous stops)."""
        self.group.close()


def _init_mpi(info: LaunchInfo, timeout: float) -> World:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise DistributedError(f"started by an MPI launcher (world size {info.world_size}) but mpi4py is "
                               f"not installed: pip install 'rwkvx[mpi]' ({exc})") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.world_size or comm.Get_rank() != info.rank:
        raise DistributedError(
            f"the launcher says rank {info.rank} of {info.world_size}, MPI says rank {comm.Get_rank()} of "
            f"{comm.Get_size()}: mpi4py is not using the launcher's MPI (with srun, try --mpi=pmix)")
    local = info.local_rank
    if local is None:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return World(info.rank, info.world_size, local, _MPIGroup(comm), timeout)


def init_world(info: LaunchInfo, timeout: float = DEFAULT_TIMEOUT_S) -> World:
    """Join the job ``info`` describes (rank 0 of a torchrun-style job starts the rendezvous); every rank
    returns once all have joined, or raises DistributedError after ``timeout`` seconds."""
    if info.method == "mpi":
        world = _init_mpi(info, timeout)
    else:
        server = None
        if info.rank == 0:
            try:
                server = StoreServer(info.master_addr, info.master_port, info.world_size)
            except OSError as exc:
                raise DistributedError(f"rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = "
                                       f"{info.master_addr}:{info.master_port}: {exc}") from None
        client = StoreClient(info.master_addr, info.master_port, info.rank, info.world_size, timeout)
        world = World(info.rank, info.world_size, info.local_rank, _StoreGroup(client, server), timeout)
    world.barrier()
    return world
