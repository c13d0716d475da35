"""The six row-major GEMM helpers of rwkvx.runtime.gemm as test cases, for the CPU mapping test and the
GPU test alike: each helper's operands (first, second, output) as row-major shapes in the dimensions
``R`` (rows), ``in`` and ``out``, its leading-dimension keywords in the same order, and the product
numpy computes from the first two operands."""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


class GemmCase(NamedTuple):
    """One helper: operand shapes, ``ld_*`` keywords and the product as numpy states it."""
    shapes: tuple[tuple[str, str], ...]
    ld_keywords: tuple[str, str, str]
    product: Callable[[np.ndarray, np.ndarray], np.ndarray]

    def sizes(self, rows: int, n_in: int, n_out: int) -> list[tuple[int, int]]:
        """The operands' shapes (first, second, output) for these dimensions."""
        dims = {"R": rows, "in": n_in, "out": n_out}
        return [(dims[r], dims[c]) for r, c in self.shapes]


GEMM_CASES = {
    "linear": GemmCase((("R", "in"), ("out", "in"), ("R", "out")), ("ld_x", "ld_w", "ld_y"),
                       lambda x, w: x @ w.T),
    "linear_dx": GemmCase((("R", "out"), ("out", "in"), ("R", "in")), ("ld_dy", "ld_w", "ld_dx"),
                          lambda dy, w: dy @ w),
    "linear_dw": GemmCase((("R", "in"), ("R", "out"), ("out", "in")), ("ld_x", "ld_dy", "ld_dw"),
                          lambda x, dy: dy.T @ x),
    "matmul": GemmCase((("R", "in"), ("in", "out"), ("R", "out")), ("ld_x", "ld_w", "ld_y"),
                       lambda x, w: x @ w),
    "matmul_dx": GemmCase((("R", "out"), ("in", "out"), ("R", "in")), ("ld_dy", "ld_w", "ld_dx"),
                          lambda dy, w: dy @ w.T),
    "matmul_dw": GemmCase((("R", "in"), ("R", "out"), ("in", "out")), ("ld_x", "ld_dy", "ld_dw"),
                          lambda x, dy: x.T @ dy),
}
