"""The fused softmax cross-entropy (rwkvx/cu/loss) timed at the 0.22B step's shapes
(rwkvx.workloads.BASE_SHAPES: R = B·T rows of V logits, dlogits written in place), in fp32 and bf16
activations; conftest.py's ``record`` reports ms, GB/s and the copy-rate share. Skipped without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from rwkvx.cu import loss
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES
from rwkvx.workloads import BASE_SHAPES, RandomBuffers

R, V = BASE_SHAPES.R, BASE_SHAPES.V


@pytest.mark.parametrize("xtype", XTYPES)
def test_cross_entropy(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    logits = b(R * V, scale=3.0)
    targets = np.random.default_rng(2).integers(0, V, R)
    ops = loss.cross_entropy(logits, b(R, "i32", values=targets), b(R, "f64"), logits,
                             b(1, "f64", values=[1.0 / R]), R, V)
    record(ops, nbytes=2 * R * V * ELEM_BYTES[xtype] + 12 * R)   # logits read, dlogits written in place
