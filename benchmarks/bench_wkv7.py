"""The WKV7 recurrence (rwkvx/cu/wkv7), forward and backward, every method × element type × shape
(rwkvx.workloads.WKV7_SHAPES, head size N of the 0.22B model), and from a shared initial state s0 with its
gradient ds0 (state tuning) at the 0.22B step's shape, and the chunked methods' segmented state passes
against one walk per sequence where B*H leaves the device idle; conftest.py's ``record`` reports ms, GB/s,
TFLOP/s and the copy-rate share. Skipped without a GPU."""
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
    _bench(record, dev, xtype, WKV7_SHAPES[shape], direction, method, state=False)


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("method", wkv7.METHODS)
def test_wkv7_initial_state(record, dev, xtype, direction, method):
    """test_wkv7's rows at B8 T4096 H12 from an initial state s0 [H, N, N], the backward also writing
    ds0 (each sequence's share, then their ordered sum): the cost of state tuning's WKV7."""
    _bench(record, dev, xtype, WKV7_SHAPES["B8_T4096_H12"], direction, method, state=True)


SEGMENT_SHAPES = {"B1_T16384_H12": (1, 16384, 12), "B1_T4096_H32": (1, 4096, 32)}


@pytest.mark.parametrize("segments", ["chosen", 1])
@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("shape", list(SEGMENT_SHAPES))
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("method", wkv7.CHUNKED_METHODS)
def test_wkv7_segments(record, dev, xtype, shape, direction, method, segments):
    """The chunked methods where B*H leaves the device idle (B1 T16384 H12; B1 T4096 H32, state tuning and
    LoRA fine-tuning at B1): the state passes cut into the segments chunked_segments chooses, against one
    walk per sequence (segments = 1)."""
    _bench(record, dev, xtype, SEGMENT_SHAPES[shape], direction, method, state=False,
           segments=None if segments == "chosen" else segments)


def _bench(record, dev, xtype: str, shape: tuple[int, int, int], direction: str, method: str, state: bool,
           segments: int | None = None) -> None:
    from rwkvx._core import Plan
    if method == "chunked_exact" and xtype != "f32":
        pytest.skip("chunked_exact takes f32 inputs (the fp32 precision's path)")
    B, T, H = shape
    b = RandomBuffers(dev, xtype)
    inp, n = wkv7_inputs(b, B, T, H, N)
    seg = {"segments": segments} if method in wkv7.CHUNKED_METHODS else {}
    sizes = wkv7.scratch_elems(B, T, H, N, dev.info, method=method, ds0=state, **seg)
    sa, ckpt = b(sizes["sa"], "f32"), b(sizes["ckpt"], "f32")
    part = b(sizes["partials"], "f32") if sizes["partials"] else None
    s0 = {"s0": b(H * N * N, "f32", scale=0.5)} if state else {}
    fwd = wkv7.forward(*inp, b(n), B, T, H, N, dev.info, sa=sa, ckpt=ckpt, method=method, partials=part, **seg, **s0)
    saved_bytes = 4 * (sizes["sa"] + sizes["ckpt"])
    x = ELEM_BYTES[xtype]
    if direction == "forward":
        record(fwd, nbytes=(6 * x + 4) * n + saved_bytes, flops=wkv_flops(n))    # the decay w is f32
        return
    Plan(dev, fwd).run()                          # real checkpoints of these inputs
    ds0 = {"ds0": b(H * N * N, "f32"), "ds0_partials": b(sizes["ds0_partials"], "f32")} if state else {}
    ops = wkv7.backward(*inp, b(n), sa, ckpt, b(n), *[b(n, "f32") for _ in range(5)], B, T, H, N, dev.info,
                        partials=part, method=method, **seg, **s0, **ds0)
    record(ops, nbytes=(7 * x + 4 + 5 * 4) * n + saved_bytes, flops=2 * wkv_flops(n))
