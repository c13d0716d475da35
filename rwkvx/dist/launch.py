"""``python -m rwkvx train --gpus N``: start N local ranks of the same command and watch them.

Each rank is ``python -m rwkvx train <the same arguments, --gpus removed>`` with the torchrun-style
variables of :mod:`rwkvx.dist.env` (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port); rank 0 hosts the rendezvous, which hands out
the NCCL unique id. The ranks run in their own process group: Ctrl-C reaches this launcher, which
passes it on once to every rank (each stops after the same step and rank 0 checkpoints; a second
Ctrl-C aborts). When a rank exits with an error the launcher stops the others (SIGTERM, then SIGKILL
after a grace period) and exits with that rank's status.
"""
from __future__ import annotations

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


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spawn(nprocs: int, command: Sequence[str], grace_s: float = 10.0,
          env: Mapping[str, str] | None = None) -> int:
    """Run ``command`` as ranks 0..nprocs-1 and wait for them; returns the job's exit status (0, 130
    when every rank was interrupted, else the first failing rank's status)."""
    if nprocs < 2:
        raise ValueError(f"spawn needs at least 2 ranks, got {nprocs}")
    port = free_port()
    base = os.environ if env is None else env
    procs: list[subprocess.Popen] = []
    interrupts = 0

    def forward(signum, frame):
        nonlocal interrupts
        interrupts += 1
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, forward)
    try:
        for rank in range(nprocs):
            procs.append(subprocess.Popen(list(command), env=rank_env(base, rank, nprocs, port),
                                          start_new_session=True))
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0, INTERRUPTED)]
            if bad:
                rank, code = bad[0]
                running = [r for r, c in enumerate(codes) if c is None]
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                if running:
                    print(f"rwkvx: rank {rank} {how}; stopping ranks {', '.join(map(str, running))}",
                          file=sys.stderr, flush=True)
                _stop(procs, grace_s)
                return code if code > 0 else 1
            if all(c is not None for c in codes):
                return INTERRUPTED if INTERRUPTED in codes else 0
            time.sleep(_POLL_S)
    except BaseException:
        _stop(procs, grace_s)
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


def train_command(argv: Sequence[str]) -> list[str]:
    """The command every rank of ``python -m rwkvx train <argv>`` runs."""
    return [sys.executable, "-m", "rwkvx", "train", *strip_gpus(argv)]
