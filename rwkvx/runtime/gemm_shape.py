"""What a cuBLASLt GEMM's descriptors and algorithm depend on (:class:`GemmShape`), and the opaque
algorithm record (:class:`Algo`) chosen for each shape."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .dtypes import CUDA_TYPES, ELEM_BYTES

MAX_ALIGNMENT = 256                                 # cuBLASLt's default alignment requirement
_ELEM_BYTES = {code: ELEM_BYTES[name] for name, code in CUDA_TYPES.items()}   # by cudaDataType_t


class Algo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: 64 opaque bytes, valid with the cuBLASLt version that produced them."""
    _fields_ = [("data", ctypes.c_uint64 * 8)]


def alignment(ptr: int) -> int:
    """The largest power of two (at most MAX_ALIGNMENT) that divides address ``ptr``."""
    ptr = int(ptr)
    return MAX_ALIGNMENT if ptr % MAX_ALIGNMENT == 0 else ptr & -ptr


@dataclass(frozen=True)
class GemmShape:
    """What a GEMM's descriptors and algorithm depend on: ops.Gemm without its addresses and scalars, plus
    whether it reads C (beta != 0) and the alignment of its operands."""
    transa: bool
    transb: bool
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    types: tuple                # (A, B, C, compute) enum values (GemmPrecision.codes)
    reads_c: bool
    align: tuple                # bytes, of A, B and the output (the lesser of C's and D's)

    @classmethod
    def of(cls, op) -> "GemmShape":
        """The shape of ops.Gemm ``op``."""
        return cls(op.transa, op.transb, op.m, op.n, op.k, op.lda, op.ldb, op.ldc, op.precision.codes(),
                   op.beta != 0.0, (alignment(op.A), alignment(op.B), min(alignment(op.C), alignment(op.D))))

    def key(self) -> str:
        """A stable text form (the algorithm cache's key)."""
        ta, tb = "T" if self.transa else "N", "T" if self.transb else "N"
        return (f"{ta}{tb} m{self.m} n{self.n} k{self.k} ld{self.lda},{self.ldb},{self.ldc} "
                f"t{','.join(map(str, self.types))} beta{int(self.reads_c)} al{','.join(map(str, self.align))}")

    def c_bytes(self) -> int:
        """Bytes C spans (column-major m x n, leading dimension ldc)."""
        return (self.ldc * (self.n - 1) + self.m) * _ELEM_BYTES[self.types[2]]
