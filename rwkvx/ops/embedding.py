"""Launch builders for rwkvx/cu/embedding.cu, and the host-side token sort for the deterministic gradient.

Buffers: tokens int32 ``[R]`` (validated on the host: 0 <= token < V); emb, demb float32 ``[V, C]``;
x, dx float32 ``[R, C]``; C % 4 == 0, 16-byte aligned.

Forward: ``x[r] = emb[tokens[r]]``::

    ops += embedding.forward(tokens, emb, x, R, C, V)

Backward (deterministic, no atomics): each step the host computes, with the tokens,
``order, seg_start, n_seg = sort_tokens(tokens)`` and uploads them (int32 ``[R]``, ``[R+1]``, ``[1]``)
into resident device buffers next to the tokens (e.g. from pinned memory with CopyHtoD inside the
graph). Then::

    ops += embedding.backward(dx, tokens, order, seg_start, n_seg, demb, R, C, V)

One block column per segment s < n_seg (grid fixed at max_segments = min(R, V); the rest exit) sums
``dx[order[i]]`` over the segment's entries in a fixed order and **writes** ``demb[token]``.
Rows of demb whose token does not occur are not touched: ``demb`` must be zeroed first. With
``zero_first=True`` (default) the returned list starts with ``Memset(demb, V*C*4)``; pass
``zero_first=False`` when the model zeroes demb itself.
"""
from __future__ import annotations

import math

import numpy as np

from ._common import Launch, Memset, ptr
from . import reduce as _reduce

MODULE = "embedding"
BY = 8                   # EMB_BY in embedding.cu


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


def forward(tokens, emb, x, R: int, C: int, V: int) -> list:
    """embedding_forward: x [R, C] = emb [V, C] rows at tokens [R]."""
    _reduce.check_rows("embedding.forward", R, C, emb, x)
    n4 = R * (C // 4)
    blocks = max(1, min(math.ceil(n4 / 256), 132 * 16))
    return [Launch(MODULE, "embedding_forward", grid=(blocks, 1, 1), block=(256, 1, 1),
                   args=(("p", ptr(tokens)), ("p", ptr(emb)), ("p", ptr(x)),
                         ("i", int(R)), ("i", int(C)), ("i", int(V))))]


def backward(dx, tokens, order, seg_start, n_seg, demb, R: int, C: int, V: int,
             zero_first: bool = True) -> list:
    """embedding_backward: demb [V, C] from dx [R, C] (see the module docstring)."""
    _reduce.check_rows("embedding.backward", R, C, dx, demb)
    max_seg = min(R, V)
    ops = [Memset(ptr(demb), V * C * 4)] if zero_first else []
    ops.append(Launch(MODULE, "embedding_backward", grid=(max_seg, math.ceil(C / 128), 1), block=(32, BY, 1),
                      args=(("p", ptr(dx)), ("p", ptr(tokens)), ("p", ptr(order)), ("p", ptr(seg_start)),
                            ("p", ptr(n_seg)), ("p", ptr(demb)), ("i", int(C)), ("i", int(V)))))
    return ops
