"""What every oracle twin shares: the model's constants, the float64-compute convention, the one GEMM.

Numerics (docs/SPEC.md §4): each twin computes in float64 and returns its float outputs in the dtype of its
inputs, rounded once. A float32 oracle therefore keeps float32 tensors *between* ops, as an fp32 GPU
keeps them in memory, while inside an op it behaves like a kernel that accumulates in registers
without loss. This also makes the float32 oracle independent of the CPU and the BLAS build: float32
products are exact in float64, and float64 results that differ between BLAS kernels or numpy's SIMD
paths (AVX2, AVX512) in their last bits almost never round to different float32 values; OpenBLAS's
sgemm, by contrast, gives results that depend on the core type and, with the Haswell kernels of
AVX2 CPUs, on the thread count.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

# the model's constants, shared with the kernels (rwkvx.config is their one definition)
from rwkvx.config import DECAY_SCALE, GN_EPS, L2_EPS, LN_EPS  # noqa: F401  (re-exported)


def result_dtype(*arrays: Any) -> np.dtype:
    """float32 when there is a float array among ``arrays`` and every one is float32, else float64."""
    floats = [a for a in arrays if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
    if floats and all(a.dtype == np.float32 for a in floats):
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def _upcast(a: Any) -> Any:
    if isinstance(a, np.ndarray) and a.dtype.kind == "f":
        return np.ascontiguousarray(a, dtype=np.float64)
    return a


def _round(out: Any, dtype: np.dtype) -> Any:
    if isinstance(out, np.ndarray):
        return out.astype(dtype) if out.dtype == np.float64 else out
    if isinstance(out, tuple):
        return tuple(_round(o, dtype) for o in out)
    if isinstance(out, dict):
        return {k: _round(o, dtype) for k, o in out.items()}
    return out


def float64_op(fn: Callable) -> Callable:
    """Decorator of a twin: float array arguments become C-contiguous float64, and the float64 arrays
    it returns (alone, in a tuple or in a dict) come back in :func:`result_dtype` of the arguments.
    Integer arrays (tokens, selections) and other arguments pass through unchanged. A twin calling
    another twin passes float64, so nothing is rounded twice."""
    @functools.wraps(fn)
    def twin(*args: Any, **kwargs: Any) -> Any:
        dtype = result_dtype(*args, *kwargs.values())
        out = fn(*[_upcast(a) for a in args], **{k: _upcast(v) for k, v in kwargs.items()})
        return out if dtype == np.float64 else _round(out, dtype)
    return twin


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for 2-D a, b through BLAS dgemm, returned in :func:`result_dtype` of a and b.

    The oracle's one GEMM. float32 operands are upcast: their products are exact in float64, so the
    float32 result is a float64 sum rounded once. dgemm partitions only rows/columns across threads
    (never the inner dimension), so results do not depend on the thread count."""
    dtype = result_dtype(a, b)
    c = np.matmul(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    return c if dtype == np.float64 else c.astype(dtype)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow for large |x| (float64 in, float64 out)."""
    e = np.exp(-np.abs(x))
    s = 1 / (1 + e)
    return np.where(x >= 0, s, e * s)


def shift(x: np.ndarray, T: int, prev: np.ndarray | None = None) -> np.ndarray:
    """Token shift of rows x [R, C] (R = B*T): out[r] = x[r-1]; at the first token of sequence b,
    prev[b] (prev [B, C]: the row before, carried from an earlier call) or zero."""
    out = np.zeros_like(x)
    seq = out.reshape(-1, T, x.shape[-1])
    seq[:, 1:] = x.reshape(-1, T, x.shape[-1])[:, :-1]
    if prev is not None:
        seq[:, 0] = prev
    return out


def last_rows(x: np.ndarray, T: int) -> np.ndarray:
    """[B, C]: the last row of each sequence of rows x [B*T, C] (what the next call's shift needs)."""
    return x.reshape(-1, T, x.shape[-1])[:, -1].copy()


def shift_adjoint(d: np.ndarray, T: int) -> np.ndarray:
    """Adjoint of :func:`shift`: out[r] = d[r+1], zero at the last token of a sequence."""
    out = np.zeros_like(d)
    out.reshape(-1, T, d.shape[-1])[:, :-1] = d.reshape(-1, T, d.shape[-1])[:, 1:]
    return out


def shift_mix_forward(x: np.ndarray, mixes: np.ndarray, T: int,
                      prev: np.ndarray | None = None) -> np.ndarray:
    """The token-shift mixes of channel and time mix: [n, R, C], out[j] = x + (shift(x) - x) * mixes[j]
    for x [R, C] and mixes [n, C]; ``prev`` [B, C] as in :func:`shift`."""
    return x + (shift(x, T, prev) - x) * mixes[:, None, :]


def shift_mix_backward(x: np.ndarray, mixes: np.ndarray, douts: np.ndarray,
                       T: int) -> tuple[np.ndarray, np.ndarray]:
    """(dx [R, C], dmixes [n, C]) of :func:`shift_mix_forward` for output gradients douts [n, R, C]."""
    dshifted = (douts * mixes[:, None, :]).sum(axis=0)       # gradient of shift(x)
    dx = douts.sum(axis=0) - dshifted + shift_adjoint(dshifted, T)
    return dx, (douts * (shift(x, T) - x)).sum(axis=1)


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """The one error measure of docs/SPEC.md §4: ||a - ref|| / ||ref|| over all elements, in float64
    (0 when both are zero, inf when only ref is)."""
    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    num, den = float(np.linalg.norm(a - ref)), float(np.linalg.norm(ref))
    return num / den if den else (0.0 if num == 0 else float("inf"))


def heads(x: np.ndarray, N: int) -> np.ndarray:
    """[R, C] -> [R, H, N] view (channel c = h*N + n)."""
    return x.reshape(x.shape[0], -1, N)
