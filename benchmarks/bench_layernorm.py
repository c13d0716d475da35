"""LayerNorm (rwkvx/cu/layernorm) timed at the 0.22B step's shapes (rwkvx.workloads.BASE_SHAPES: R = B·T
rows of C), in fp32 and bf16 activations; conftest.py's ``record`` reports ms, GB/s and the copy-rate share.
Skipped without a GPU."""
from __future__ import annotations

import pytest

from rwkvx.cu import layernorm
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES
from rwkvx.workloads import BASE_SHAPES, RandomBuffers

R, C = BASE_SHAPES.R, BASE_SHAPES.C


@pytest.mark.parametrize("xtype", XTYPES)
def test_layernorm_forward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    ops = layernorm.forward(b(R * C, "f32"), b(C, "f32"), b(C, "f32"), b(R * C), b(R, "f32"), b(R, "f32"), R, C)
    record(ops, nbytes=R * C * (4 + ELEM_BYTES[xtype]) + 8 * R)    # x (the residual stream) f32, y floatX


@pytest.mark.parametrize("xtype", XTYPES)
def test_layernorm_backward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    copy = b(R * C) if xtype != "f32" else None                    # the GEMMs' copy of dx, as in the step
    ops = layernorm.backward(b(R * C, "f32"), b(C, "f32"), b(R * C, "f32"), b(R * C, "f32"), b(C, "f32"), b(C, "f32"),
                             b(R, "f32", 0.1, 0), b(R, "f32", 0.1, 1.0),
                             b(layernorm.scratch_elems(R, C, dev.info), "f32"), R, C, dev.info, accumulate_dx=True,
                             dx_copy=copy)
    record(ops, nbytes=16 * R * C + (ELEM_BYTES[xtype] * R * C if copy else 0) + 8 * R)  # x, dy, dx read; dx written
