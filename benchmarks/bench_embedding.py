"""The embedding gather and its deterministic gradient (rwkvx/cu/embedding) timed at the 0.22B step's
shapes (rwkvx.workloads.BASE_SHAPES: R = B·T random tokens of V, width C), in fp32 and bf16 activations;
conftest.py's ``record`` reports ms, GB/s and the copy-rate share. Skipped without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from rwkvx.cu import embedding
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES
from rwkvx.workloads import BASE_SHAPES, RandomBuffers

R, C, V = BASE_SHAPES.R, BASE_SHAPES.C, BASE_SHAPES.V


def tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(0, V, R)


@pytest.mark.parametrize("xtype", XTYPES)
def test_embedding_forward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    ops = embedding.forward(b(R, "i32", values=tokens()), b(V * C, "f32"), b(R * C), R, C, V, dev.info)
    record(ops, nbytes=R * C * (4 + ELEM_BYTES[xtype]) + 4 * R)


@pytest.mark.parametrize("xtype", XTYPES)
def test_embedding_backward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    tok = tokens()
    order, seg, nseg = embedding.sort_tokens(tok)
    ops = embedding.backward(b(R * C), b(R, "i32", values=tok), b(R, "i32", values=order),
                             b(R + 1, "i32", values=seg), b(1, "i32", values=nseg), b(V * C, "f32"), R, C, V)
    record(ops, nbytes=R * C * ELEM_BYTES[xtype] + V * C * 4)    # dx read, demb zeroed / written
