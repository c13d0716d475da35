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

Every helper computes ``out = alpha * product + beta * out`` with the element and compute types of its
``precision``, given per GEMM so that one plan can mix them: a :class:`~rwkvx.runtime.ops.GemmPrecision`
(the presets below), or a :class:`GemmMode` (how a model precision runs its GEMMs), which gives the types
from the element types of the typed operands (bf16 operands: an fp32 or bf16 output, fp32 accumulation). ``ld_*`` keywords override the leading dimension (row stride, in elements) of a
row-major operand, e.g. to read or write a column slice of a wider buffer; the default is the dense row
length.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ops import Gemm, GemmPrecision

FP32 = GemmPrecision()                                   # strict fp32 (the parity mode)
TF32 = GemmPrecision(compute="tf32")                     # fp32 operands on TF32 tensor cores
BF16 = GemmPrecision("bf16", "bf16", "f32", "fp32")      # bf16 operands, fp32 accumulation and output
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


def _gemm(transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, precision) -> Gemm:
    return Gemm(transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, resolve(precision, A, B, C))


def _ld(v, default):
    return default if v is None else v


def linear(x, W, y, rows, n_in, n_out, beta=0.0, *, alpha=1.0, ld_x=None, ld_w=None, ld_y=None,
           precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """y [rows,n_out] = alpha * x [rows,n_in] @ W[n_out,n_in]^T + beta * y."""
    # y^T (n_out x rows) = W (col-major view W^T [n_in,n_out], transposed) @ x^T (view [n_in,rows])
    return _gemm("T", "N", n_out, rows, n_in, alpha, W, _ld(ld_w, n_in), x, _ld(ld_x, n_in),
                beta, y, _ld(ld_y, n_out), precision)


def linear_dx(dy, W, dx, rows, n_in, n_out, beta=0.0, *, alpha=1.0, ld_dy=None, ld_w=None, ld_dx=None,
              precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """dx [rows,n_in] = alpha * dy [rows,n_out] @ W [n_out,n_in] + beta * dx."""
    # dx^T (n_in x rows) = W^T (view [n_in,n_out]) @ dy^T (view [n_out,rows])
    return _gemm("N", "N", n_in, rows, n_out, alpha, W, _ld(ld_w, n_in), dy, _ld(ld_dy, n_out),
                beta, dx, _ld(ld_dx, n_in), precision)


def linear_dw(x, dy, dW, rows, n_in, n_out, beta=0.0, *, alpha=1.0, ld_x=None, ld_dy=None, ld_dw=None,
              precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """dW [n_out,n_in] = alpha * dy^T [n_out,rows] @ x [rows,n_in] + beta * dW."""
    # dW^T (n_in x n_out) = x^T (view [n_in,rows]) @ dy (view of dy^T [n_out,rows], transposed)
    return _gemm("N", "T", n_in, n_out, rows, alpha, x, _ld(ld_x, n_in), dy, _ld(ld_dy, n_out),
                beta, dW, _ld(ld_dw, n_in), precision)


def matmul(x, W, y, rows, n_in, n_out, beta=0.0, *, alpha=1.0, ld_x=None, ld_w=None, ld_y=None,
           precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """y [rows,n_out] = alpha * x [rows,n_in] @ W [n_in,n_out] + beta * y."""
    # y^T (n_out x rows) = W^T (view [n_out,n_in]) @ x^T (view [n_in,rows])
    return _gemm("N", "N", n_out, rows, n_in, alpha, W, _ld(ld_w, n_out), x, _ld(ld_x, n_in),
                beta, y, _ld(ld_y, n_out), precision)


def matmul_dx(dy, W, dx, rows, n_in, n_out, beta=0.0, *, alpha=1.0, ld_dy=None, ld_w=None, ld_dx=None,
              precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """dx [rows,n_in] = alpha * dy [rows,n_out] @ W[n_in,n_out]^T + beta * dx."""
    # dx^T (n_in x rows) = W (view W^T [n_out,n_in], transposed) @ dy^T (view [n_out,rows])
    return _gemm("T", "N", n_in, rows, n_out, alpha, W, _ld(ld_w, n_out), dy, _ld(ld_dy, n_out),
                beta, dx, _ld(ld_dx, n_in), precision)


def matmul_dw(x, dy, dW, rows, n_in, n_out, beta=0.0, *, alpha=1.0, ld_x=None, ld_dy=None, ld_dw=None,
              precision: GemmPrecision | GemmMode = FP32) -> Gemm:
    """dW [n_in,n_out] = alpha * x^T [n_in,rows] @ dy [rows,n_out] + beta * dW."""
    # dW^T (n_out x n_in) = dy^T (view [n_out,rows]) @ x (view of x^T [n_in,rows], transposed)
    return _gemm("N", "T", n_out, n_in, rows, alpha, dy, _ld(ld_dy, n_out), x, _ld(ld_x, n_in),
                beta, dW, _ld(ld_dw, n_out), precision)
