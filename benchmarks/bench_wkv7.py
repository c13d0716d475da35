"""The WKV7 recurrence (rwkvx/cu/wkv7), forward and backward, every method × element type × shape
(rwkvx.workloads.WKV7_SHAPES, head size N of the 0.22B model), and from a shared initial state s0 with its
gradient ds0 (state tuning) at the 0.22B step's shape; conftest.py's ``record`` reports ms, GB/s, TFLOP/s
and the copy-rate share. Skipped without a GPU."""
from __future__ import annotations

import pytest

from rwkvx.cu import wkv7
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES
from rwkvx.workloads import BASE_SHAPES, WKV7_SHAPES, RandomBuffers, wkv7_inputs

N = BASE_SHAPES.N


def wkv_flops(n: int) -> float:
    return 8.0 * n * N          # per token and state row: sa, update (3 FMA), y: ~4 multiply-adds per element


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("shape", list(WKV7_SHAPES))
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("method", wkv7.METHODS)
def test_wkv7(record, dev, xtype, shape, direction, method):
    """One row per method x element type x shape x direction. The roofline is the copy rate over the
    bytes the op must move (inputs, outputs, what the forward saves for the backward): the chunked
    method's work buffer (chunk records, dS) is traffic on top of that floor, so it lowers the share."""
    _bench(record, dev, xtype, shape, direction, method, state=False)


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("method", wkv7.METHODS)
def test_wkv7_initial_state(record, dev, xtype, direction, method):
    """test_wkv7's rows at B8 T4096 H12 from an initial state s0 [H, N, N], the backward also writing
    ds0 (each sequence's share, then their ordered sum): the cost of state tuning's WKV7."""
    _bench(record, dev, xtype, "B8_T4096_H12", direction, method, state=True)


def _bench(record, dev, xtype: str, shape: str, direction: str, method: str, state: bool) -> None:
    from rwkvx._core import Plan
    if method == "chunked_exact" and xtype != "f32":
        pytest.skip("chunked_exact takes f32 inputs (the fp32 precision's path)")
    B, T, H = WKV7_SHAPES[shape]
    b = RandomBuffers(dev, xtype)
    inp, n = wkv7_inputs(b, B, T, H, N)
    sizes = wkv7.scratch_elems(B, T, H, N, dev.info, method=method, ds0=state)
    sa, ckpt = b(sizes["sa"], "f32"), b(sizes["ckpt"], "f32")
    part = b(sizes["partials"], "f32") if sizes["partials"] else None
    extra = {"method": method, "partials": part} if method in wkv7.CHUNKED_METHODS else {}
    s0 = {"s0": b(H * N * N, "f32", scale=0.5)} if state else {}
    fwd = wkv7.forward(*inp, b(n), B, T, H, N, dev.info, sa=sa, ckpt=ckpt, **extra, **s0)
    saved_bytes = 4 * (sizes["sa"] + sizes["ckpt"])
    x = ELEM_BYTES[xtype]
    if direction == "forward":
        record(fwd, nbytes=(6 * x + 4) * n + saved_bytes, flops=wkv_flops(n))    # the decay w is f32
        return
    Plan(dev, fwd).run()                          # real checkpoints of these inputs
    ds0 = {"ds0": b(H * N * N, "f32"), "ds0_partials": b(sizes["ds0_partials"], "f32")} if state else {}
    ops = wkv7.backward(*inp, b(n), sa, ckpt, b(n), *[b(n, "f32") for _ in range(5)], B, T, H, N, dev.info,
                        partials=part, method=method, **s0, **ds0)
    record(ops, nbytes=(7 * x + 4 + 5 * 4) * n + saved_bytes, flops=2 * wkv_flops(n))
