"""Element types of device buffers, and the host-side bf16 conversions.

An element type is a short name: ``"f32"``, ``"bf16"``, ``"f64"``, ``"i32"``. Kernels are written once for
the *activation* element type ``floatX`` (``float`` or ``__nv_bfloat16``, see rwkvx/cu/common.cuh); a
launch chooses it with its ``xtype`` (one of :data:`XTYPES`). Host arrays of bf16 data are numpy
``uint16`` arrays holding the raw bits (numpy has no bfloat16).
"""
from __future__ import annotations

import numpy as np

ELEM_BYTES = {"f32": 4, "bf16": 2, "f64": 8, "i32": 4}
# cudaDataType_t of GEMM operands/outputs and cublasComputeType_t, by rwkvx's names (ops.GemmPrecision)
CUDA_TYPES = {"f32": 0, "bf16": 14, "f64": 1}       # CUDA_R_32F, CUDA_R_16BF, CUDA_R_64F
# CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F
COMPUTE_TYPES = {"fp32": 68, "tf32": 77, "fp64": 70}
XTYPES = ("f32", "bf16")               # activation element types a kernel compiles for
_STORAGE = {"f32": np.float32, "bf16": np.uint16, "f64": np.float64, "i32": np.int32}


def check_elem(elem: str, what: str = "element type") -> str:
    """``elem`` itself, or ValueError when it is not one of ELEM_BYTES."""
    if elem not in ELEM_BYTES:
        raise ValueError(f"{what}: expected one of {', '.join(ELEM_BYTES)}, got {elem!r}")
    return elem


def storage_dtype(elem: str) -> np.dtype:
    """The numpy dtype holding ``elem`` data on the host (bf16: uint16 bit patterns)."""
    return np.dtype(_STORAGE[check_elem(elem)])


_BF16_SLICE = 1 << 18          # float32 values rounded to bf16 at a time (1 MiB)


def f32_to_bf16_bits(x) -> np.ndarray:
    """bf16 bit patterns (uint16) of ``x`` rounded to nearest, ties to even (NaN stays NaN).

    Rounds in 32-bit integers, a cache-sized slice at a time (a 7B-parameter model's bf16 copy is made on
    the host); only NaN bit patterns can wrap around 2^32, and they are rewritten."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.reshape(-1).view(np.uint32)
    rounded = np.empty(u.size, np.uint16)
    work = np.empty(min(_BF16_SLICE, u.size), np.uint32)
    for start in range(0, u.size, _BF16_SLICE):
        src = u[start:start + _BF16_SLICE]
        w = work[:src.size]
        np.right_shift(src, 16, out=w)
        w &= 1                                  # ties to even: add 0x7FFF plus the kept part's lowest bit
        w += 0x7FFF
        w += src
        w >>= 16
        nan = (src & 0x7FFFFFFF) > 0x7F800000
        if nan.any():
            w[nan] = (src[nan] >> 16) | 0x40    # keep NaNs quiet NaNs
        rounded[start:start + src.size] = w
    return rounded.reshape(f.shape)


def bf16_bits_to_f32(bits) -> np.ndarray:
    """float32 values of bf16 bit patterns (exact)."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def to_storage(elem: str, x) -> np.ndarray:
    """``x`` converted to the host storage of ``elem`` (float types round to nearest)."""
    if check_elem(elem) == "bf16":
        return f32_to_bf16_bits(x)
    return np.ascontiguousarray(x, dtype=_STORAGE[elem])


def from_storage(elem: str, data) -> np.ndarray:
    """Host storage of ``elem`` back to numbers (bf16 -> float32; the others unchanged)."""
    if check_elem(elem) == "bf16":
        return bf16_bits_to_f32(data)
    return np.asarray(data, dtype=_STORAGE[elem])


def round_to(elem: str, x) -> np.ndarray:
    """float64 values of ``x`` after rounding to ``elem``: what a kernel reads once ``x`` is uploaded."""
    return from_storage(elem, to_storage(elem, x)).astype(np.float64)



def round_tf32(x) -> np.ndarray:
    """float32 values of ``x`` rounded to tf32 (10 explicit mantissa bits), to nearest, ties away from zero:
    what ``cvt.rna.tf32.f32`` gives a tensor-core operand."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def poison_bits(elem: str, shape) -> np.ndarray:
    """Host storage filled with a value no kernel writes by accident: NaN for floats, -0x5eadbeef for ints."""
    if check_elem(elem) == "i32":
        return np.full(shape, -0x5EADBEEF, np.int32)
    return to_storage(elem, np.full(shape, np.nan, np.float32 if elem != "f64" else np.float64))
