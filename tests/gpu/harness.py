"""The one GPU test harness of tests/gpu: buffers for a kernel test, run twice, compared bit for bit. It
also drives tests/cuda_cpu's CPU device, which runs the same kernels on the CPU (tests/test_kernels_cpu.py).

A :class:`KernelCase` owns the device buffers of one test. ``input`` uploads values rounded to the
buffer's element type and keeps, in ``case.seen[name]``, the float64 values the kernel reads (the
twin runs on exactly those, docs/SPEC.md §4); ``output`` buffers are poisoned (NaN / an impossible int) before
every run; ``inout`` buffers are reset to their initial values before every run; ``scratch`` buffers
are poisoned and not read back. :meth:`KernelCase.run` runs the ops twice from the same state, asserts
that every output is bit-identical between the runs, and returns the outputs as float64 arrays.
Element type ``"x"`` means the case's activation type (``f32`` or ``bf16``, the ``xtype`` fixture).
:func:`check` compares with the twin through the one relative error, ``rwkvx.oracle.rel_err``.
tests/gpu has no __init__.py: test modules import this as ``harness`` (pytest's prepend import mode).
"""
from __future__ import annotations

import numpy as np

from rwkvx.oracle import rel_err
from rwkvx.runtime.dtypes import from_storage, poison_bits, to_storage

BF16_TOL = 1e-2          # docs/SPEC.md §4: a kernel in bf16 against its float64 twin on the same rounded inputs


def tolerance(xtype: str, f32_tol: float) -> float:
    """The limit of a kernel test: ``f32_tol`` in fp32, the bf16 kernel limit of docs/SPEC.md §4 in bf16."""
    return f32_tol if xtype == "f32" else BF16_TOL


def check(name: str, got, want, tol: float) -> float:
    """Assert ``got`` is finite and within ``tol`` of ``want`` (norm-wise relative); returns the error."""
    got = np.asarray(got, np.float64)
    bad = np.count_nonzero(~np.isfinite(got))
    assert not bad, f"{name}: {bad} non-finite values (unwritten or overflowed)"
    err = rel_err(got, want)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"
    return err


class KernelCase:
    """The buffers of one kernel test on ``dev`` with activation element type ``xtype``."""

    def __init__(self, dev, xtype: str = "f32"):
        self.dev, self.xtype = dev, xtype
        self.seen: dict[str, np.ndarray] = {}
        self._bufs: dict[str, tuple] = {}        # name -> (DeviceBuffer, elem, shape, init storage, role)

    def _elem(self, elem: str) -> str:
        return self.xtype if elem == "x" else elem

    def _add(self, name: str, shape, elem: str, init, role: str):
        assert name not in self._bufs, f"buffer {name} added twice"
        elem = self._elem(elem)
        shape = tuple(np.shape(init)) if init is not None else tuple(np.atleast_1d(shape))
        storage = to_storage(elem, init) if init is not None else poison_bits(elem, shape)
        buf = self.dev.alloc(max(storage.nbytes, 256))
        self._bufs[name] = (buf, elem, shape, storage, role)
        if init is not None:
            self.seen[name] = from_storage(elem, storage).astype(np.float64)
        return buf.typed(elem)

    def input(self, name: str, values, elem: str = "x"):
        """A buffer the kernel reads; ``seen[name]`` holds the values after rounding to ``elem``."""
        return self._add(name, None, elem, np.asarray(values), "in")

    def inout(self, name: str, values, elem: str = "x"):
        """A buffer read and written (accumulation, in place); reset before each run, returned."""
        return self._add(name, None, elem, np.asarray(values), "inout")

    def output(self, name: str, shape, elem: str = "x"):
        """A buffer the kernel must write: poisoned before each run, returned."""
        return self._add(name, shape, elem, None, "out")

    def scratch(self, name: str, count: int, elem: str = "f32"):
        """Poisoned working memory, not read back."""
        return self._add(name, max(int(count), 1), elem, None, "scratch")

    def set(self, name: str, values) -> None:
        """New initial values for input/inout ``name`` (same buffer, so a built plan reads them)."""
        buf, elem, shape, _, role = self._bufs[name]
        storage = to_storage(elem, np.asarray(values))
        assert storage.shape == shape and role in ("in", "inout"), f"{name}: shape or role mismatch"
        self._bufs[name] = (buf, elem, shape, storage, role)
        self.seen[name] = from_storage(elem, storage).astype(np.float64)

    def reset(self) -> None:
        """Upload every buffer's initial contents (inputs, inouts) or poison (outputs, scratch)."""
        for buf, elem, shape, storage, role in self._bufs.values():
            self.dev.upload(buf, storage)

    def _read(self) -> dict[str, np.ndarray]:
        self.dev.synchronize()
        return {name: self.dev.download(buf, storage.shape, storage.dtype)
                for name, (buf, elem, shape, storage, role) in self._bufs.items() if role in ("out", "inout")}

    def run(self, ops=None, plan=None) -> dict[str, np.ndarray]:
        """Run ``ops`` (or a ``plan`` built on these buffers) twice from the same buffer contents; outputs
        must agree bit for bit. Returns them (float64)."""
        plan = plan or self.plan(ops)
        runs = []
        for _ in range(2):
            self.reset()
            plan.run()
            runs.append(self._read())
        for name, first in runs[0].items():
            assert np.array_equal(first.view(np.uint8), runs[1][name].view(np.uint8)), \
                f"{name}: the second run differs from the first (not deterministic)"
        return {name: from_storage(self._bufs[name][1], raw).astype(np.float64) for name, raw in runs[0].items()}

    def plan(self, ops):
        """A plan of ``ops`` on the case's device, for :meth:`run` (``plan=``: one plan over inputs changed by
        :meth:`set`): the device's own where it has one (tests/cuda_cpu's CPU device, whose runs alternate
        the order of a block's threads), else rwkvx._core.Plan."""
        make = getattr(self.dev, "plan", None)
        if make is not None:
            return make(ops)
        from rwkvx._core import Plan
        return Plan(self.dev, ops)

    def untouched(self, name: str, out: np.ndarray) -> bool:
        """True when output ``name`` still holds its poison everywhere (the kernel did not write it)."""
        return bool(np.isnan(out).all()) if self._bufs[name][1] != "i32" else bool(
            (out == poison_bits("i32", 1)[0]).all())
