"""The 0.22B step's three GEMM shapes (rwkvx.workloads.BASE_SHAPES: R = B·T rows; C -> C projections,
C -> F channel-mix key, C -> V head) through cuBLASLt (rwkvx.runtime.gemm) in each GEMM precision;
conftest.py's ``record`` reports ms, TFLOP/s and the share of that precision's measured GEMM rate. Skipped
without a GPU."""
from __future__ import annotations

import pytest

from rwkvx.runtime import gemm as G
from rwkvx.workloads import BASE_SHAPES, RandomBuffers

R, C, F, V = BASE_SHAPES.R, BASE_SHAPES.C, BASE_SHAPES.F, BASE_SHAPES.V
GEMMS = {"proj_CxC": (R, C, C), "ffn_key_CxF": (R, C, F), "head_CxV": (R, C, V)}


@pytest.mark.parametrize("precision", list(G.PRESETS))
@pytest.mark.parametrize("name", list(GEMMS))
def test_gemm(record, dev, precision, name):
    rows, n_in, n_out = GEMMS[name]
    prec = G.PRESETS[precision]
    b = RandomBuffers(dev, prec.a)
    op = G.linear(b(rows * n_in, prec.b), b(n_out * n_in, prec.a, 0.03), b(rows * n_out, prec.c), rows, n_in, n_out,
                  precision=prec)
    record([op], flops=2.0 * rows * n_in * n_out, ceiling=precision)
