"""NCCL for data-parallel training: nccl4py's low-level bindings over the library of ``nvidia-nccl-cu13``.

Both belong to the ``cu13`` extra and are imported only when a job of GPU ranks starts
(:func:`load_nccl`). One communicator per process and GPU; NCCL works on raw device pointers and the
raw handle of a second ("communication") stream that the step forks to and joins from with events
(:meth:`NcclCommunicator.fork` / :meth:`~NcclCommunicator.join`), which a CUDA graph captures too.

A dead or hung rank never hangs the others: :meth:`NcclCommunicator.wait` polls the compute stream and,
between polls, NCCL's asynchronous error state, the rendezvous' failure reports and a deadline; on any
of them it aborts the communicator (which ends NCCL's kernels) and raises DistributedError. Creating
the communicator blocks inside NCCL, so a watchdog thread bounds it instead (:func:`watchdog`).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from .store import DistributedError

_CHECK_EVERY_S = 0.05    # NCCL / rendezvous health checks while waiting
_SPIN_S = 0.002          # yield-spin this long before sleeping between stream polls
_SLEEP_S = 0.0002
_state: dict = {}


def _preload_libnccl() -> None:
    """Load libnccl.so.2 of the nvidia-nccl-cu13 wheel found on sys.path (so that nccl4py's loader
    also finds it when the wheel was installed outside site-packages, e.g. with --target)."""
    for entry in sys.path:
        lib = Path(entry or ".") / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if lib.is_file():
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            return


def load_nccl():
    """nccl4py's ``nccl.bindings.nccl`` with a loadable NCCL library; RuntimeError saying what to
    install otherwise."""
    if "bindings" not in _state:
        try:
            _preload_libnccl()
            from nccl.bindings import nccl as bindings
            bindings.get_version()
        except (ImportError, OSError, RuntimeError) as exc:
            raise RuntimeError("multi-GPU training needs NCCL: nccl4py and nvidia-nccl-cu13 (pip install "
                               f"'rwkvx[cu13]'): {type(exc).__name__}: {exc}") from None
        _state["bindings"] = bindings
    return _state["bindings"]


def nccl_unavailable_reason() -> str | None:
    """None when :func:`load_nccl` works here, else why not."""
    try:
        load_nccl()
    except RuntimeError as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def watchdog(world, what: str) -> Iterator[None]:
    """Bound a blocking call every rank makes together: if it has not returned within ``world.timeout``
    or another rank fails meanwhile, print why, tell the other ranks and end this process (status 1)."""
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + world.timeout
        while not done.wait(_CHECK_EVERY_S):
            why = world.failure()
            if why is None and time.monotonic() < deadline:
                continue
            message = (f"rank {world.rank}: {what}: " + (f"stopping because {why}" if why else
                       f"no progress in {world.timeout:g} s (another rank is hung or gone; see --dist-timeout)"))
            print(f"error: {message}", file=sys.stderr, flush=True)
            world.abort(message)
            os._exit(1)

    thread = threading.Thread(target=watch, name="rwkvx-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def poll_until(ready: Callable[[], bool], health: Callable[[], str | None], timeout: float,
               what: str, clock: Callable[[], float] = time.monotonic) -> None:
    """Return once ``ready()``; raise DistributedError with ``health()``'s message when it reports one,
    or when ``timeout`` seconds pass. Spins briefly (yielding), then sleeps between polls."""
    start = clock()
    next_check = start
    while not ready():
        now = clock()
        if now >= next_check:
            why = health()
            if why is not None:
                raise DistributedError(f"{what}: {why}")
            if now - start > timeout:
                raise DistributedError(f"{what}: no progress in {timeout:g} s (another rank is hung or "
                                       "gone; see --dist-timeout)")
            next_check = now + _CHECK_EVERY_S
        if now - start < _SPIN_S:
            os.sched_yield()
        else:
            time.sleep(_SLEEP_S)


class NcclCommunicator:
    """This rank's NCCL communicator over ``world`` on ``dev`` (a collective: every rank builds one),
    with the communication stream and the two events that fork it from and join it to ``dev.stream``."""

    def __init__(self, world, dev):
        nccl = load_nccl()
        from cuda.bindings import driver
        from ..runtime.errors import check
        self.world, self.dev, self._nccl, self._driver, self._check = world, dev, nccl, driver, check
        self.rank, self.world_size = world.rank, world.world_size
        uid = world.broadcast(bytes(nccl.get_unique_id()) if world.is_main else None)
        check(driver.cuCtxSetCurrent(dev.context), "cuCtxSetCurrent")  # NCCL binds to the current GPU
        with watchdog(world, "creating the NCCL communicator"):
            self._comm = nccl.comm_init_rank(self.world_size, nccl.UniqueId.from_buffer(uid), self.rank)
        self.stream = check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value),
                            "cuStreamCreate")
        flags = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        self._forked = check(driver.cuEventCreate(flags), "cuEventCreate")
        self._joined = check(driver.cuEventCreate(flags), "cuEventCreate")
        self._avg, self._f32, self._f64 = (int(nccl.RedOp.Avg), int(nccl.DataType.Float32),
                                           int(nccl.DataType.Float64))

    def __repr__(self) -> str:
        return f"NcclCommunicator(rank={self.rank}, world_size={self.world_size})"

    # -- enqueued on the streams (eagerly or under capture) ---------------------------------------
    def fork(self) -> None:
        """The communication stream waits for the work enqueued on the compute stream so far."""
        d, check = self._driver, self._check
        check(d.cuEventRecord(self._forked, self.dev.stream), "cuEventRecord")
        check(d.cuStreamWaitEvent(self.stream, self._forked, 0), "cuStreamWaitEvent")

    def join(self) -> None:
        """The compute stream waits for every collective enqueued so far."""
        d, check = self._driver, self._check
        check(d.cuEventRecord(self._joined, self.stream), "cuEventRecord")
        check(d.cuStreamWaitEvent(self.dev.stream, self._joined, 0), "cuStreamWaitEvent")

    def all_reduce_mean_f32(self, ptr: int, count: int) -> None:
        """Average ``count`` float32 at device ``ptr`` over the ranks, in place (NCCL's Avg), on the
        communication stream."""
        self._nccl.all_reduce(ptr, ptr, count, self._f32, self._avg, self._comm, int(self.stream))

    def all_gather_f64(self, send: int, recv: int, count: int) -> None:
        """``recv[r*count:(r+1)*count]`` = rank r's ``send[:count]`` (float64), on the communication stream."""
        self._nccl.all_gather(send, recv, count, self._f64, self._comm, int(self.stream))

    # -- host side --------------------------------------------------------------------------------
    def health(self) -> str | None:
        """Another rank's failure, or NCCL's asynchronous error; None while healthy."""
        why = self.world.failure()
        if why is not None:
            return f"stopping because {why}"
        nccl = self._nccl
        err = int(nccl.comm_get_async_error(self._comm))
        if err not in (int(nccl.Result.Success), int(nccl.Result.InProgress)):
            return f"NCCL error {nccl.get_error_string(err)} ({nccl.get_last_error(self._comm)})"
        return None

    def wait(self, dev) -> None:
        """Wait for the work on ``dev.stream`` (the step and its collectives); on a failure or after the
        world's timeout abort NCCL, tell the other ranks and raise DistributedError."""
        d = self._driver
        not_ready = int(d.CUresult.CUDA_ERROR_NOT_READY)

        def ready() -> bool:
            res = int(d.cuStreamQuery(dev.stream)[0])
            if res == 0:
                return True
            if res != not_ready:
                dev.synchronize()   # raises the CudaError of the failed work
            return False

        try:
            poll_until(ready, self.health, self.world.timeout, f"rank {self.rank}: waiting for the step")
        except DistributedError as exc:
            self.abort()
            self.world.abort(str(exc))
            raise

    def abort(self) -> None:
        """End the communicator at once (its in-flight kernels exit); it cannot be used afterwards."""
        comm, self._comm = self._comm, None
        if comm is not None:
            self._nccl.comm_abort(comm)

    def close(self) -> None:
        """Free the communicator, the stream and the events (after the last step)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            self._nccl.comm_destroy(comm)
        d = self._driver
        for ev in (self._forked, self._joined):
            d.cuEventDestroy(ev)
        d.cuStreamDestroy(self.stream)
