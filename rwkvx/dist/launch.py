"""``python -m rwkvx train --gpus N``: start N local ranks of the same command and watch them.

Each rank is ``python -m rwkvx train <the same arguments, --gpus removed>`` with the torchrun-style
variables of :mod:`rwkvx.dist.env` (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port); rank 0 hosts the rendezvous, which hands out
the NCCL unique id. The ranks run in their own process group: Ctrl-C reaches this launcher, which
passes it on once to every rank (each stops after the same step and rank 0 checkpoints; a second
Ctrl-C aborts); SIGTERM to the launcher stops every rank. When a rank exits with an error the others learn it from the rendezvous and end with
their own error; the launcher waits a grace period for that, then stops the rest (SIGTERM, then
SIGKILL) and exits with the failed rank's status.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Mapping, Sequence

INTERRUPTED = 130          # the exit status of a run stopped by Ctrl-C (checkpointed, resumable)
_POLL_S = 0.1


def strip_gpus(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--gpus N`` / ``--gpus=N`` (any unambiguous abbreviation argparse takes)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = token.partition("=")
        if len(name) >= 4 and "--gpus".startswith(name):
            skip = not eq
            continue
        out.append(token)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for the local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(base: Mapping[str, str], rank: int, nprocs: int, port: int) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``nprocs``."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def visible_gpus() -> int:
    """CUDA devices the driver shows this process (0 without a driver); creates no GPU context."""
    try:
        from cuda.bindings import driver
        if int(driver.cuInit(0)[0]) != 0:
            return 0
        res = driver.cuDeviceGetCount()
        return int(res[1]) if int(res[0]) == 0 else 0
    except Exception:  # noqa: BLE001 - no bindings or no driver: no GPU
        return 0


def _describe(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _reap(pids: dict[int, int], timeout: float) -> None:
    """Wait up to ``timeout`` s for the processes ``pids`` (pid -> rank) to exit; reaped ones are removed."""
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            if os.waitpid(pid, os.WNOHANG)[0]:
                del pids[pid]
        time.sleep(_POLL_S)


def _stop(pids: dict[int, int], grace_s: float, patient: bool = True) -> None:
    """Let the ranks ``pids`` end on their own (``patient``: the rendezvous has told them of a failed
    rank), then SIGTERM, then SIGKILL."""
    if patient:
        _reap(pids, grace_s)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        _reap(pids, grace_s)


def spawn(nprocs: int, command: Sequence[str], grace_s: float = 10.0,
          env: Mapping[str, str] | None = None) -> int:
    """Run ``command`` as ranks 0..nprocs-1 and wait for them; returns the job's exit status: 0, 130
    when the ranks were interrupted, else the status of the first rank to fail (in time order).
    This process must have no other children (it reaps any)."""
    if nprocs < 2:
        raise ValueError(f"spawn needs at least 2 ranks, got {nprocs}")
    port = free_port()
    base = os.environ if env is None else env
    pids: dict[int, int] = {}
    procs: list[subprocess.Popen] = []     # kept so that their finalizers see them reaped

    def forward(signum, frame):
        for pid in pids:
            os.kill(pid, signal.SIGINT)

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGINT, forward)
    previous_term = signal.signal(signal.SIGTERM, terminate)   # the ranks go with the launcher
    status = 0
    try:
        for rank in range(nprocs):
            proc = subprocess.Popen(list(command), env=rank_env(base, rank, nprocs, port),
                                    start_new_session=True)
            pids[proc.pid] = rank
            procs.append(proc)
        while pids:
            pid, wait_status = os.waitpid(-1, 0)
            rank = pids.pop(pid, None)
            if rank is None:
                continue
            code = os.waitstatus_to_exitcode(wait_status)
            procs[rank].returncode = code
            if code == INTERRUPTED:
                status = INTERRUPTED
            elif code != 0:
                if pids:
                    print(f"rwkvx: rank {rank} {_describe(code)}; stopping ranks "
                          f"{', '.join(str(r) for r in sorted(pids.values()))}", file=sys.stderr, flush=True)
                _stop(pids, grace_s)
                return code if code > 0 else 1
        return status
    except BaseException:
        _stop(pids, grace_s, patient=False)
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
        for proc in procs:
            if proc.returncode is None:
                proc.returncode = -signal.SIGKILL   # reaped by _stop


def train_command(argv: Sequence[str]) -> list[str]:
    """The command every rank of ``python -m rwkvx train <argv>`` runs."""
    return [sys.executable, "-m", "rwkvx", "train", *strip_gpus(argv)]
