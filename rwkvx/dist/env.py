"""Where this process sits in a data-parallel job, read from the launcher's environment variables.

Three ways to start a job of N ranks (one process per GPU):

* ``python -m rwkvx train --gpus N``: :mod:`rwkvx.dist.launch` starts N local processes and gives each
  the torchrun-style variables below (rank 0 hosts the rendezvous on 127.0.0.1, a free port).
* torchrun-style (torchrun, or any launcher that sets them): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
  (``LOCAL_WORLD_SIZE`` optional), ``MASTER_ADDR``, ``MASTER_PORT``: rank 0 hosts the rendezvous
  (:mod:`rwkvx.dist.store`) on MASTER_ADDR:MASTER_PORT, the other ranks connect to it. Under torchrun
  (``TORCHELASTIC_RUN_ID`` set) its agent already serves its own store on MASTER_PORT, so ours takes
  MASTER_PORT + 1; ``RWKVX_MASTER_PORT`` overrides the port in any case.
* MPI (``mpirun`` / ``srun``): detected from ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``, ``PMIX_RANK`` or
  Slurm's ``SLURM_STEP_NUM_TASKS``; rank and size then come from ``mpi4py``'s ``COMM_WORLD`` and the
  NCCL id is broadcast over MPI.

:func:`launch_info` validates the variables and raises ``ValueError`` naming the variable that is
missing or wrong; a job of one process (no variables, or a world size of 1) is ``None``: the plain
single-process path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# (size variable, rank variable, local rank variable) of the MPI launchers we recognise
MPI_VARS = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
            ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"),
            ("PMIX_SIZE", "PMIX_RANK", "PMIX_LOCAL_RANK"),
            ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID"))


@dataclass(frozen=True)
class LaunchInfo:
    """One rank's place in a job of ``world_size`` > 1 processes.

    ``method`` is ``"env"`` (torchrun-style variables; ``master_addr``/``master_port`` set) or
    ``"mpi"`` (rank and size confirmed by mpi4py when the job starts; ``local_rank`` may be None,
    then MPI's shared-memory split gives it)."""
    method: str
    rank: int
    world_size: int
    local_rank: int | None
    master_addr: str | None = None
    master_port: int | None = None


def _int_var(env: Mapping[str, str], name: str, low: int = 0) -> int:
    text = env.get(name)
    if text is None:
        raise ValueError(f"{name} is not set")
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return value


def _torchrun_info(env: Mapping[str, str]) -> LaunchInfo | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        given = "RANK" if "RANK" in env else "WORLD_SIZE"
        missing = "WORLD_SIZE" if given == "RANK" else "RANK"
        raise ValueError(f"{given} is set but {missing} is not: a data-parallel job needs RANK, "
                         "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torchrun sets them all)")
    world = _int_var(env, "WORLD_SIZE", 1)
    rank = _int_var(env, "RANK")
    if rank >= world:
        raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world}")
    if world == 1:
        return None
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name, "").strip():
            raise ValueError(f"WORLD_SIZE={world} but {name} is not set (torchrun-style launch: "
                             "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    local = _int_var(env, "LOCAL_RANK")
    if "LOCAL_WORLD_SIZE" in env:
        local_world = _int_var(env, "LOCAL_WORLD_SIZE", 1)
        if local >= local_world:
            raise ValueError(f"LOCAL_RANK={local} must be < LOCAL_WORLD_SIZE={local_world}")
    if "RWKVX_MASTER_PORT" in env:
        port, name = _int_var(env, "RWKVX_MASTER_PORT", 1), "RWKVX_MASTER_PORT"
    else:
        port, name = _int_var(env, "MASTER_PORT", 1), "MASTER_PORT"
        if "TORCHELASTIC_RUN_ID" in env:
            port += 1
    if port > 65535:
        raise ValueError(f"{name}={port} is not a TCP port (1..65535)")
    return LaunchInfo("env", rank, world, local, env["MASTER_ADDR"].strip(), port)


def _mpi_info(env: Mapping[str, str]) -> LaunchInfo | None:
    for size_var, rank_var, local_var in MPI_VARS:
        if size_var in env:
            world = _int_var(env, size_var, 1)
            if world == 1:
                return None
            rank = _int_var(env, rank_var) if rank_var in env else 0
            if rank >= world:
                raise ValueError(f"{rank_var}={rank} must be < {size_var}={world}")
            local = _int_var(env, local_var) if local_var in env else None
            return LaunchInfo("mpi", rank, world, local)
    return None


def launch_info(env: Mapping[str, str]) -> LaunchInfo | None:
    """This process's :class:`LaunchInfo` from ``env`` (``os.environ``), or None for a single process.

    torchrun-style variables win over MPI ones (a torchrun job inside a Slurm allocation); ValueError
    for a partial or inconsistent set."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun_info(env)
    return _mpi_info(env)


def launched_by(env: Mapping[str, str]) -> str | None:
    """The launcher variables present in ``env`` (for the error of ``--gpus`` inside a launched job)."""
    names = [n for n in ("RANK", "WORLD_SIZE") if n in env]
    names += [size for size, _, _ in MPI_VARS if size in env]
    return ", ".join(names) or None


def device_ordinal(local_rank: int, device_count: int) -> int:
    """The GPU a rank uses: its local rank, or GPU 0 when the launcher left each rank one visible GPU
    (``srun --gpus-per-task=1``, a per-rank ``CUDA_VISIBLE_DEVICES``). ValueError otherwise."""
    if device_count < 1:
        raise ValueError("no CUDA GPU is visible to this rank")
    if local_rank < device_count:
        return local_rank
    if device_count == 1:
        return 0
    raise ValueError(f"LOCAL_RANK={local_rank} needs GPU {local_rank}, but only {device_count} GPUs are "
                     "visible here: start at most one rank per GPU on each machine")
