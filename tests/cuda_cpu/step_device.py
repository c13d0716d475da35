"""The training step on the CPU with rwkvx's real kernels: :class:`CpuStepDevice` stands in for
rwkvx.runtime.Device, so that ``Model(...)`` and ``Trainer(backend="gpu", ...)`` build and run their plans
(the step, the forward, the head, AdamW) on host memory.

It is tests/lazy_device.py's :class:`~lazy_device.LazyDevice` (a stream that runs enqueued work when the
host waits for it, events, graphs as their plans, an idle H200's memory info; :func:`install` puts them
in place) whose memory is real host memory at real addresses — :class:`~cuda_cpu.executor.CpuBuffer`\\ s,
device and pinned alike, each between canaries — and whose plans run every op through
:class:`~cuda_cpu.executor.CpuDevice`: every launch by the kernel's own code compiled by g++, every GEMM
in float64 from its stored operands rounded once to D's type, copies and memsets; an op the CPU cannot
run fails naming it. Plans run with a block's threads in increasing order, then
decreasing, alternately, so a missing barrier changes results between runs.
"""
from __future__ import annotations

import lazy_device
from cuda_cpu.executor import CpuBuffer, CpuDevice

class CpuStepDevice(lazy_device.LazyDevice):
    """A :class:`~lazy_device.LazyDevice` over real host memory whose plans run on a
    :class:`~cuda_cpu.executor.CpuDevice` (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.cpu = CpuDevice(self.info)
        self._held: dict[int, CpuBuffer] = {}       # the live allocations (CpuDevice keeps weak references)
        self.plans_run = 0

    def _region(self, nbytes: int) -> int:
        buf = self.cpu.alloc(nbytes)
        self._held[buf.ptr] = buf
        self.mem.add(buf.ptr, buf.nbytes, buf.view)
        return buf.ptr

    def _release(self, addr: int) -> None:
        super()._release(addr)
        self._held.pop(addr, None)

    def execute(self, ops) -> None:
        """Run a plan's ``ops`` on the CPU device, threads in decreasing order every other plan."""
        descending = self.plans_run % 2 == 1
        self.plans_run += 1
        for op in ops:
            self.cpu.execute(op, descending)


def install(monkeypatch) -> CpuStepDevice:
    """A fresh :class:`CpuStepDevice` as the process's device, with its plans, events and graphs."""
    return lazy_device.install(monkeypatch, CpuStepDevice())
