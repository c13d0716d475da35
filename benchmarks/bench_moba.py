"""One MoBA attention block (rwkvx/cu/moba): the selection, the forward and the backward, both methods,
fp32 and bf16 activations, at rwkvx.workloads.MOBA_SHAPES (heads, head size and top-k of the 0.22B model);
conftest.py's ``record`` reports ms, GB/s, TFLOP/s and the share of the method's GEMM ceiling. Next to it,
the FlashAttention-class peer (torch's SDPA, an outside reference) on the same visible keys. Skipped
without a GPU (the peer also without torch)."""
from __future__ import annotations

import pytest

from rwkvx.cu import moba
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES
from rwkvx.workloads import BASE_SHAPES, MOBA_SHAPES, RandomBuffers, moba_buffers, moba_visible_keys, sdpa_dense

H, N, TOP_K = BASE_SHAPES.H, BASE_SHAPES.N, BASE_SHAPES.top_k
CEILING = {("exact", "f32"): "fp32", ("exact", "bf16"): "fp32", ("mma", "f32"): "tf32", ("mma", "bf16"): "bf16"}


def visible(shape: str) -> int:
    """Keys attended to in one block at ``shape``, over every sequence and head."""
    B, T, chunk = MOBA_SHAPES[shape]
    return B * H * moba_visible_keys(T, chunk, TOP_K)


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("method", moba.METHODS)
@pytest.mark.parametrize("shape", list(MOBA_SHAPES))
@pytest.mark.parametrize("direction", ["select", "forward", "backward"])
def test_moba(record, dev, xtype, method, shape, direction):
    """One attention block. select: the gate, top-k and query lists alone (kmean, select, scan, fill;
    the same kernels for both methods); forward: all of the forward (selection included); backward.
    TFLOP/s count the visible (selected) keys only: 4 N flops per (query, key) forward, 10 N backward."""
    B, T, chunk = MOBA_SHAPES[shape]
    if direction == "select" and method != "exact":
        pytest.skip("the selection kernels are the same for both methods")
    b = RandomBuffers(dev, xtype)
    (q, k, v, o), scratch = moba_buffers(b, B, T, H, N, chunk, TOP_K)
    rc = B * T * H * N
    x = ELEM_BYTES[xtype]
    fwd = moba.forward(q, k, v, o, scratch, B, T, H, N, chunk, TOP_K, dev.info, method=method)
    ceiling = CEILING[method, xtype]
    if direction == "select":
        record([op for op in fwd if op.name in ("moba_kmean", "moba_select", "moba_scan", "moba_fill")],
               nbytes=2 * rc * x)
    elif direction == "forward":
        record(fwd, nbytes=4 * rc * x, flops=4 * N * visible(shape), ceiling=ceiling)
    else:
        from rwkvx._core import Plan
        Plan(dev, fwd).run()                       # the selection and lse the backward reads
        ops = moba.backward(q, k, v, o, b(rc), b(rc), b(rc), b(rc), scratch, B, T, H, N, chunk, TOP_K,
                            dev.info, method=method)
        record(ops, nbytes=8 * rc * x, flops=10 * N * visible(shape), ceiling=ceiling)


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("shape", list(MOBA_SHAPES))
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_moba_sdpa_peer(record, dev, backend, shape, direction):
    """The FlashAttention-class peer: torch's SDPA (outside reference, bf16) on test_moba's visible keys in
    dense pieces (rwkvx.workloads.sdpa_dense); TFLOP/s counted as there. It has no gate, no selection, no
    gather."""
    pytest.importorskip("torch", reason="torch (an outside reference only) is not installed")
    B, T, chunk = MOBA_SHAPES[shape]
    fwd_ms, both_ms, once = sdpa_dense(B, T, H, N, chunk, TOP_K, backend)
    ms, flops = (fwd_ms, 4 * N * visible(shape)) if direction == "forward" else (both_ms - fwd_ms,
                                                                                  10 * N * visible(shape))
    record.measured(ms, once, flops=flops, ceiling="bf16")
