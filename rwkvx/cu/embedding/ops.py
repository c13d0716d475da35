"""Launch builders for rwkvx/cu/embedding/embedding.cu, and the host-side token sort for the deterministic gradient.

Buffers: tokens int32 ``[R]`` (validated on the host: 0 <= token < V); emb, demb f32 ``[V, C]`` (the
weights and their gradient); x, dx floatX ``[R, C]``; C % 4 == 0, aligned to 4 elements.
Twin: ``rwkvx.oracle.embedding_forward`` / ``embedding_backward``.

Forward: ``x[r] = emb[tokens[r]]``::

    ops += embedding.forward(tokens, emb, x, R, C, V, dev)

Backward (deterministic, no atomics): each step the host computes, with the tokens,
``order, seg_start, n_seg = sort_tokens(tokens)`` and uploads them (int32 ``[R]``, ``[R+1]``, ``[1]``)
into resident device buffers next to the tokens (e.g. from pinned memory with CopyHtoD inside the
graph). Then::

    ops += embedding.backward(dx, tokens, order, seg_start, n_seg, demb, R, C, V)

One block column per segment s < n_seg (grid fixed at max_segments = min(R, V); the rest exit) sums
``dx[order[i]]`` over the segment's entries in a fixed order and **writes** ``demb[token]``.
Rows of demb whose token does not occur are not touched: ``demb`` must be zeroed first. With
``zero_first=True`` (default) the returned list starts with a Memset of demb; pass
``zero_first=False`` when the model zeroes demb itself.
"""
from __future__ import annotations

import math

import numpy as np

from rwkvx.runtime.dtypes import ELEM_BYTES
from rwkvx.runtime.kernel import F32_IN, F32_OUT, I32_IN, INT, X_IN, X_OUT, KernelFile
from rwkvx.runtime.ops import Memset

from .._common import DeviceInfo, check_rows, grid_stride_blocks

BY = 8                   # segment entries summed in parallel per block (its summation order)

CU = KernelFile("embedding/embedding", constants={"EMB_BY": BY})
EMBEDDING_FORWARD = CU.kernel("embedding_forward", tok=I32_IN, emb=F32_IN, x=X_OUT, R=INT, C=INT, V=INT)
EMBEDDING_BACKWARD = CU.kernel("embedding_backward", dx=X_IN, tok=I32_IN, order=I32_IN, seg_start=I32_IN,
                               n_seg=I32_IN, demb=F32_OUT, C=INT, V=INT)


def sort_tokens(tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host helper for :func:`backward`.

    ``tokens``: int array of any shape (flattened row-major, R elements). Returns int32 arrays
    ``order [R]`` (stable argsort of the flat tokens), ``seg_start [R+1]`` (``seg_start[s]`` is the
    first index into ``order`` of the s-th distinct token in ascending order; ``seg_start[n_seg:] = R``)
    and ``n_seg [1]`` (number of distinct tokens).
    """
    flat = np.asarray(tokens).reshape(-1)
    R = flat.size
    order = np.argsort(flat, kind="stable").astype(np.int32)
    seg_start = np.full(R + 1, R, dtype=np.int32)
    if R == 0:
        return order, seg_start, np.zeros(1, dtype=np.int32)
    srt = flat[order]
    starts = np.flatnonzero(np.concatenate(([True], srt[1:] != srt[:-1])))
    seg_start[:starts.size] = starts
    return order, seg_start, np.array([starts.size], dtype=np.int32)


def forward(tokens, emb, x, R: int, C: int, V: int, dev: DeviceInfo) -> list:
    """embedding_forward: x [R, C] = emb [V, C] rows at tokens [R]."""
    check_rows("embedding.forward", R, C, emb, x)
    blocks = grid_stride_blocks(R * (C // 4), dev)
    return [EMBEDDING_FORWARD.launch((blocks, 1, 1), (256, 1, 1), xtype=x.elem, tok=tokens, emb=emb, x=x,
                                     R=R, C=C, V=V)]


def backward(dx, tokens, order, seg_start, n_seg, demb, R: int, C: int, V: int,
             zero_first: bool = True) -> list:
    """embedding_backward: demb [V, C] from dx [R, C] (see the module docstring)."""
    check_rows("embedding.backward", R, C, dx, demb)
    ops = [Memset(demb, V * C * ELEM_BYTES[demb.elem])] if zero_first else []
    ops.append(EMBEDDING_BACKWARD.launch((min(R, V), math.ceil(C / 128), 1), (32, BY, 1), xtype=dx.elem,
                                         dx=dx, tok=tokens, order=order, seg_start=seg_start, n_seg=n_seg,
                                         demb=demb, C=C, V=V))
    return ops
