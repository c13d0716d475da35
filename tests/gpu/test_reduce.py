"""GPU tests of rwkvx/cu/reduce/reduce.cu through rwkvx.cu.reduce: the fixed-order sum of per-tile partial sums,
against its twin rwkvx.oracle.column_sums (harness.KernelCase: seeded random inputs, poisoned outputs, two
bit-identical runs), and bit for bit against a float32 replay of the summation order the kernel documents
(``by`` is part of that order). The partials and the gradients are float32 whatever the activation type:
these tests run once. fp32 limit: 1e-5."""
from __future__ import annotations

import numpy as np
import pytest

from harness import KernelCase, check
from rwkvx.cu import reduce as rd
from rwkvx.oracle import column_sums
from rwkvx.workloads import BASE_SHAPES

TOL = 1e-5
# (P, nout, C, by): one partial of one column, fewer partials than rows of threads, a width not a multiple
# of 32, every output slot, the model width, a wide row, many partials, the largest block
CASES = [(1, 1, 1, 1), (3, 2, 5, 16), (37, 3, 40, 8), (37, 3, 40, 16), (64, 6, 33, 4), (600, 6, 768, 16),
         (5, 2, 4096, 8), (1000, 1, 24, 3), (97, 4, 768, rd.MAX_BY)]


def replay(part: np.ndarray, by: int) -> np.ndarray:
    """The kernel's order in float32: row y of threads sums p = y, y + by, ... in turn, then the by sums are
    added in y order. part [P, W] -> [W]."""
    rows = np.zeros((by, part.shape[1]), np.float32)
    for y in range(by):
        for p in range(y, part.shape[0], by):
            rows[y] += part[p]
    total = rows[0].copy()
    for y in range(1, by):
        total += rows[y]
    return total


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("P,nout,C,by", CASES)
def test_partials(dev, P, nout, C, by, accumulate):
    rng = np.random.default_rng([P, nout, C, by, int(accumulate)])
    case = KernelCase(dev)
    part = case.input("part", rng.standard_normal((P, nout, C)) * 2.0 + 0.5, "f32")
    outs = [case.inout(f"o{j}", rng.standard_normal(C), "f32") if accumulate else case.output(f"o{j}", C, "f32")
            for j in range(nout)]
    got = case.run(rd.partials(part, P, C, outs, by, accumulate=accumulate))
    seen = case.seen["part"]
    order = replay(seen.astype(np.float32).reshape(P, nout * C), by).reshape(nout, C)
    for j in range(nout):
        start = case.seen[f"o{j}"] if accumulate else np.zeros(C)
        check(f"o{j}", got[f"o{j}"], start + column_sums(seen[:, j]), TOL)
        want = start.astype(np.float32) + order[j] if accumulate else order[j]
        assert np.array_equal(got[f"o{j}"].astype(np.float32), want), \
            f"o{j}: not the documented summation order (by = {by})"


@pytest.mark.parametrize("by", [4, 16])
def test_partials_of_the_callers_tiles(dev, by):
    """As many partials as the row tiles of the 0.22B step's rows on this GPU (rwkvx.cu.reduce.tiles)."""
    R, C = BASE_SHAPES.R, BASE_SHAPES.C
    P = rd.tiles(R, C, dev.info)[1]
    rng = np.random.default_rng([P, by])
    case = KernelCase(dev)
    part = case.input("part", rng.standard_normal((P, 2, C)), "f32")
    outs = [case.output(f"o{j}", C, "f32") for j in range(2)]
    got = case.run(rd.partials(part, P, C, outs, by))
    for j in range(2):
        check(f"o{j}", got[f"o{j}"], column_sums(case.seen["part"][:, j]), TOL)
