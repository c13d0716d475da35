"""The fused AdamW step (rwkvx/cu/adamw) over the 0.22B model's parameters (rwkvx.workloads.BASE), fp32,
with weight decay and global-norm clipping, float32 and lean (bf16) moments; conftest.py's ``record``
reports ms, GB/s and the copy-rate share. Skipped without a GPU."""
from __future__ import annotations

import pytest

from rwkvx import param_shapes
from rwkvx.cu import adamw
from rwkvx.optim import Schedule
from rwkvx.workloads import BASE, RandomBuffers


@pytest.mark.parametrize("moments", ["f32", "bf16"])
def test_adamw(record, dev, moments):
    segs, n = adamw.flat_layout(param_shapes(BASE.config))
    table, lrmul = adamw.build_table(segs)
    b = RandomBuffers(dev, "f32")
    ops = adamw.step(b(n, "f32"), b(n, "f32", 1e-3), b(n, moments, 1e-3), b(n, moments, 1e-4, 1e-3),
                     b(table.size, "i32", values=table.reshape(-1)), b(lrmul.size, "f32", values=lrmul),
                     b(adamw.STATE_DOUBLES, "f64", values=adamw.state_from_schedule(Schedule(), 1.0)), len(table),
                     b(adamw.scratch_elems(len(table)), "f64"), weight_decay=0.1, clip=True)
    moment_bytes = 2 if moments == "bf16" else 4
    # p, g (twice: norm, update) read, p written: 4 x 4 bytes; m, v read and written
    record(ops, nbytes=(4 * 4 + 4 * moment_bytes) * n)
