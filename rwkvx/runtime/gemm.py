"""Row-major GEMM helpers: each returns a column-major :class:`~rwkvx.runtime.ops.Gemm`.

A row-major matrix M [r, c] with leading dimension ld (>= c) is, in column-major terms, M^T [c, r]
with the same ld. So a row-major product Y = P @ Q is computed as the column-major Y^T = Q^T P^T:
cuBLAS gets the operands swapped. Shapes (all row-major, float32):

=============  ==================  ==========  ==========  ===========
helper         computes            first       W           output
=============  ==================  ==========  ==========  ===========
linear         y  = x  @ W^T       x  [R,in]   [out,in]    y  [R,out]
linear_dx      dx = dy @ W         dy [R,out]  [out,in]    dx [R,in]
linear_dw      dW = dy^T @ x       x  [R,in]   (dy [R,out]) dW [out,in]
matmul         y  = x  @ W         x  [R,in]   [in,out]    y  [R,out]
matmul_dx      dx = dy @ W^T       dy [R,out]  [in,out]    dx [R,in]
matmul_dw      dW = x^T @ dy       x  [R,in]   (dy [R,out]) dW [in,out]
=============  ==================  ==========  ==========  ===========

Every helper computes ``out = alpha * product + beta * out`` (``linear`` may read the term it adds from
another buffer, ``addend``, leaving that buffer as it is) with the element and compute types of its
``precision``, given per GEMM so that one plan can mix them: a :class:`~rwkvx.runtime.ops.GemmPrecision`
(the presets below), or a :class:`GemmMode` (how a model precision runs its GEMMs), which gives the types
from the element types of the typed operands (bf16 operands: an fp32 or bf16 output, fp32 accumulation).
``ld_*`` keywords override the leading dimension (row stride, in elements) of a row-major operand, e.g. to
read or write a column slice of a wider buffer; the default is the dense row length.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ops import Gemm, GemmPrecision

FP32 = GemmPrecision()                                   # strict fp32 (the parity mode)
TF32 = GemmPrecision(compute="tf32")                     # fp32 operands on TF32 tensor cores
BF16 = GemmPrecision("bf16", "bf16", "f32", "fp32")      # bf16 operands, fp32 accumulation and output
FP64 = GemmPrecision("f64", "f64", "f64", "fp64")        # float64 throughout (the device initialisation)
PRESETS = {"fp32": FP32, "tf32": TF32, "bf16": BF16}     # one per model precision, fp32 outputs (tests, benchmarks)


@dataclass(frozen=True)
class GemmMode:
    """How a model precision runs its GEMMs: the compute type ("fp32" or "tf32") and whether the
    operands are bf16; the output's element type is its buffer's."""
    compute: str
    bf16_operands: bool = False

    def types(self, A, B, C) -> GemmPrecision:
        """The GemmPrecision of a GEMM of this mode on the typed operands A, B and output C."""
        elems = tuple(getattr(p, "elem", "f32") for p in (A, B, C))
        if self.bf16_operands and elems[:2] != ("bf16", "bf16"):
            raise TypeError(f"bf16 GEMM: operands must be bf16 buffers, got {elems[0]} and {elems[1]}")
        return GemmPrecision(*elems, self.compute)


def resolve(precision: GemmPrecision | GemmMode, A, B, C) -> GemmPrecision:
    """The GemmPrecision of one GEMM: ``precision`` itself, or the mode's types for these operands."""
    if isinstance(precision, GemmPrecision):
        return precision
    if isinstance(precision, GemmMode):
        return precision.types(A, B, C)
    raise TypeError(f"GEMM precision must be a GemmPrecision or a GemmMode, got {precision!r}")


# Each helper's operands (first, second, output) as stored, row-major, in the helper's dimensions: the
# table above as data. The product out [P, Q] = left [P, K] @ right [K, Q] reads each factor as stored or
# transposed ([K, P] / [Q, K] in memory); cuBLAS computes the column-major out^T = right^T @ left^T.
_SHAPES = {
    "linear": (("rows", "n_in"), ("n_out", "n_in"), ("rows", "n_out")),
    "linear_dx": (("rows", "n_out"), ("n_out", "n_in"), ("rows", "n_in")),
    "linear_dw": (("rows", "n_in"), ("rows", "n_out"), ("n_out", "n_in")),
    "matmul": (("rows", "n_in"), ("n_in", "n_out"), ("rows", "n_out")),
    "matmul_dx": (("rows", "n_out"), ("n_in", "n_out"), ("rows", "n_in")),
    "matmul_dw": (("rows", "n_in"), ("rows", "n_out"), ("n_in", "n_out")),
}


@dataclass(frozen=True)
class _ColumnMajor:
    """A helper's product as one cuBLAS GEMM: which operand is A (the right factor; the left is B),
    whether each is transposed, and the helper dimensions that are m, n and k."""
    a: int              # 0: the first operand, 1: the second
    transa: bool
    transb: bool
    m: str
    n: str
    k: str


def _column_major(first: tuple, second: tuple, out: tuple) -> _ColumnMajor:
    """The GEMM of out [P, Q] = left @ right for operands stored with the shapes ``first``, ``second``:
    the left factor is the one with a dimension P, K the dimension the output lacks."""
    P, Q = out
    (K,) = {*first, *second} - {P, Q}
    left = 0 if P in first else 1
    left_shape, right_shape = (first, second)[left], (first, second)[1 - left]
    return _ColumnMajor(a=1 - left, transa=right_shape == (Q, K), transb=left_shape == (K, P), m=Q, n=P, k=K)


_COLUMN_MAJOR = {helper: _column_major(*shapes) for helper, shapes in _SHAPES.items()}


def _product(helper: str, operands: tuple, lds: tuple, rows: int, n_in: int, n_out: int, alpha: float,
             beta: float, precision: GemmPrecision | GemmMode, addend=None) -> Gemm:
    """The Gemm of ``helper`` on ``operands`` (first, second, output) with leading dimensions ``lds``
    (None: the dense row length of the operand as stored); ``addend`` (like the output): the buffer
    beta scales, when it is not the output itself."""
    size = {"rows": rows, "n_in": n_in, "n_out": n_out}
    cm = _COLUMN_MAJOR[helper]
    ld = [size[shape[1]] if given is None else given for shape, given in zip(_SHAPES[helper], lds)]
    A, B, D = operands[cm.a], operands[1 - cm.a], operands[2]
    C = D if addend is None else addend
    return Gemm(cm.transa, cm.transb, size[cm.m], size[cm.n], size[cm.k], alpha, A, ld[cm.a], B, ld[1 - cm.a],
                beta, C, ld[2], resolve(precision, A, B, D), D)


def linear(x: int, W: int, y: int, rows: int, n_in: int, n_out: int, beta: float = 0.0, *, alpha: float = 1.0,
           ld_x: int | None = None, ld_w: int | None = None, ld_y: int | None = None,
           precision: GemmPrecision | GemmMode = FP32, addend: int | None = None) -> Gemm:
    """y [rows,n_out] = alpha * x [rows,n_in] @ W[n_out,n_in]^T + beta * y, or ``+ beta * addend`` (a
    buffer like y, left unchanged) when given."""
    return _product("linear", (x, W, y), (ld_x, ld_w, ld_y), rows, n_in, n_out, alpha, beta, precision, addend)


def linear_dx(dy: int, W: int, dx: int, rows: int, n_in: int, n_out: int, beta: float = 0.0, *,
              alpha: float = 1.0, ld_dy: int | None = None, ld_w: int | None = None, ld_dx: int | None = None,
              precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """dx [rows,n_in] = alpha * dy [rows,n_out] @ W [n_out,n_in] + beta * dx."""
    return _product("linear_dx", (dy, W, dx), (ld_dy, ld_w, ld_dx), rows, n_in, n_out, alpha, beta, precision)


def linear_dw(x: int, dy: int, dW: int, rows: int, n_in: int, n_out: int, beta: float = 0.0, *,
              alpha: float = 1.0, ld_x: int | None = None, ld_dy: int | None = None, ld_dw: int | None = None,
              precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """dW [n_out,n_in] = alpha * dy^T [n_out,rows] @ x [rows,n_in] + beta * dW."""
    return _product("linear_dw", (x, dy, dW), (ld_x, ld_dy, ld_dw), rows, n_in, n_out, alpha, beta, precision)


def matmul(x: int, W: int, y: int, rows: int, n_in: int, n_out: int, beta: float = 0.0, *, alpha: float = 1.0,
           ld_x: int | None = None, ld_w: int | None = None, ld_y: int | None = None,
           precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """y [rows,n_out] = alpha * x [rows,n_in] @ W [n_in,n_out] + beta * y."""
    return _product("matmul", (x, W, y), (ld_x, ld_w, ld_y), rows, n_in, n_out, alpha, beta, precision)


def matmul_dx(dy: int, W: int, dx: int, rows: int, n_in: int, n_out: int, beta: float = 0.0, *,
              alpha: float = 1.0, ld_dy: int | None = None, ld_w: int | None = None, ld_dx: int | None = None,
              precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """dx [rows,n_in] = alpha * dy [rows,n_out] @ W[n_in,n_out]^T + beta * dx."""
    return _product("matmul_dx", (dy, W, dx), (ld_dy, ld_w, ld_dx), rows, n_in, n_out, alpha, beta, precision)


def matmul_dw(x: int, dy: int, dW: int, rows: int, n_in: int, n_out: int, beta: float = 0.0, *,
              alpha: float = 1.0, ld_x: int | None = None, ld_dy: int | None = None, ld_dw: int | None = None,
              precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """dW [n_in,n_out] = alpha * x^T [n_in,rows] @ dy [rows,n_out] + beta * dW."""
    return _product("matmul_dw", (x, dy, dW), (ld_x, ld_dy, ld_dw), rows, n_in, n_out, alpha, beta, precision)
