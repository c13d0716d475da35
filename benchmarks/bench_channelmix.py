"""The channel mix's kernels (rwkvx/cu/channelmix) timed at the 0.22B step's shapes
(rwkvx.workloads.BASE_SHAPES: R = B·T rows, C, hidden width F), in fp32 and bf16 activations;
conftest.py's ``record`` reports ms, GB/s and the copy-rate share. Skipped without a GPU."""
from __future__ import annotations

import pytest

from rwkvx.cu import channelmix
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES
from rwkvx.workloads import BASE_SHAPES, RandomBuffers

R, T, C, F = BASE_SHAPES.R, BASE_SHAPES.T, BASE_SHAPES.C, BASE_SHAPES.F


@pytest.mark.parametrize("xtype", XTYPES)
def test_channelmix_shift_mix(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    record(channelmix.shift_mix(b(R * C, "f32"), b(C, "f32", 0.2, 0.5), b(R * C), R, T, C, dev.info),
           nbytes=R * C * (4 + ELEM_BYTES[xtype]))                 # LN2's output f32, xk floatX


@pytest.mark.parametrize("xtype", XTYPES)
def test_channelmix_relu_sq(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    record(channelmix.relu_sq(b(R * F, "f32"), b(R * F), R * F, dev.info),
           nbytes=R * F * (4 + ELEM_BYTES[xtype]))                 # the key GEMM's fp32 output, k floatX


@pytest.mark.parametrize("xtype", XTYPES)
def test_channelmix_relu_sq_backward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    dk = b(R * F)
    record(channelmix.relu_sq_backward(dk, b(R * F, offset=1.0), dk, R * F, dev.info, src_is_k=True),
           nbytes=3 * R * F * ELEM_BYTES[xtype])


@pytest.mark.parametrize("xtype", XTYPES)
def test_channelmix_mix_backward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    ops = channelmix.mix_backward(b(R * C), b(R * C, "f32"), b(C, "f32", 0.2, 0.5), b(R * C, "f32"), b(C, "f32"),
                                  b(channelmix.scratch_elems(R, C, dev.info), "f32"), R, T, C, dev.info)
    record(ops, nbytes=R * C * (8 + ELEM_BYTES[xtype]))            # dxk floatX; x read, dx written f32
