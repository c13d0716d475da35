"""The fused AdamW step (rwkvx/cu/adamw) over the 0.22B model's parameters (rwkvx.workloads.BASE), fp32,
with weight decay and global-norm clipping; conftest.py's ``record`` reports ms, GB/s and the copy-rate
share. Skipped without a GPU."""
from __future__ import annotations

from rwkvx import param_shapes
from rwkvx.cu import adamw
from rwkvx.optim import Schedule
from rwkvx.workloads import BASE, RandomBuffers


def test_adamw(record, dev):
    segs, n = adamw.flat_layout(param_shapes(BASE.config))
    table, lrmul = adamw.build_table(segs)
    b = RandomBuffers(dev, "f32")
    ops = adamw.step(b(n, "f32"), b(n, "f32", 1e-3), b(n, "f32", 1e-3), b(n, "f32", 1e-4, 1e-3),
                     b(table.size, "i32", values=table.reshape(-1)), b(lrmul.size, "f32", values=lrmul),
                     b(adamw.STATE_DOUBLES, "f64", values=adamw.state_from_schedule(Schedule(), 1.0)), len(table),
                     b(adamw.scratch_elems(len(table)), "f64"), weight_decay=0.1, clip=True)
    record(ops, nbytes=8 * 4 * n)     # p, g, m, v read (g twice: norm, update); p, m, v written
