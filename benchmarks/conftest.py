"""The fixtures of the GPU benchmarks: the device (skipped, with the reason, where no GPU is usable) and
``record``, the one way a kernel benchmark times its work and reports it against the measured ceilings.

Report, don't assert. ``record(ops, nbytes=, flops=, ceiling=)`` times ``ops`` as one plan with CUDA events
(after a warm-up run, about 50 ms of device time: rwkvx.runtime.warm_time_ms) and stores in the
benchmark's ``extra_info``: ms per call, GB/s (``nbytes``: the fewest bytes the op must move, every input
read once and every output written once), TFLOP/s (``flops``, where the op is arithmetic) and the share of
the ceiling (``ceiling``: "copy" for the copy rate, or a GEMM precision for its measured GEMM rate).
``record.measured(ms, once, ...)`` stores a time the benchmark measured itself. pytest-benchmark's own
rounds (three synchronised calls) follow. scripts/gpu_check.sh prints the table (scripts/gpu_summary.py).
"""
from __future__ import annotations

from typing import Callable

import pytest

# Ceilings measured on the H200 (docs/PERFORMANCE.md): device-to-device copy, and 8192^3 GEMMs per precision
COPY_GBS = 4300.0
GEMM_TFLOPS = {"fp32": 51.0, "tf32": 401.0, "bf16": 790.0}


@pytest.fixture(scope="module")
def dev():
    """The process-wide rwkvx Device."""
    try:
        from rwkvx.runtime import Device
        return Device.get()
    except Exception as exc:  # noqa: BLE001 - no usable GPU
        pytest.skip(f"no CUDA GPU: {exc}")


class Recorder:
    """Times a kernel benchmark's work and stores the timing against its roofline in ``extra_info``."""

    def __init__(self, benchmark, dev):
        self.benchmark, self.dev = benchmark, dev

    def __call__(self, ops: list, nbytes: float = 0.0, flops: float = 0.0, ceiling: str = "copy") -> None:
        """Time ``ops`` (one plan, CUDA events) and store ms, GB/s, TFLOP/s and the roofline share."""
        from rwkvx._core import Plan
        from rwkvx.runtime import warm_time_ms
        plan = Plan(self.dev, ops)

        def once():
            plan.run()
            self.dev.synchronize()

        self.measured(warm_time_ms(self.dev, plan.run), once, nbytes, flops, ceiling)

    def measured(self, ms: float, once: Callable[[], None], nbytes: float = 0.0, flops: float = 0.0,
                 ceiling: str = "copy") -> None:
        """Store ``ms`` (timed by the caller) with its GB/s, TFLOP/s and roofline share; ``once`` runs the
        work for pytest-benchmark's own rounds."""
        if ceiling != "copy" and ceiling not in GEMM_TFLOPS:
            raise ValueError(f"ceiling must be 'copy' or one of {', '.join(GEMM_TFLOPS)}, got {ceiling!r}")
        gbs = nbytes / ms / 1e6
        tflops = flops / ms / 1e9
        share = tflops / GEMM_TFLOPS[ceiling] if ceiling in GEMM_TFLOPS else gbs / COPY_GBS
        # data that fits in L2 twice over is re-read from L2, not HBM, between calls
        l2 = " (L2-resident)" if nbytes and nbytes < 2 * self.dev.info.l2_bytes else ""
        self.benchmark.extra_info.update({"ms": round(ms, 4), "GB/s": round(gbs, 1), "TFLOP/s": round(tflops, 2),
                                          "roofline_%": round(100 * share, 1), "ceiling": ceiling + l2})
        self.benchmark.pedantic(once, rounds=3, iterations=1)


@pytest.fixture
def record(benchmark, dev) -> Recorder:
    """A :class:`Recorder` for this benchmark on the device."""
    return Recorder(benchmark, dev)
