"""Launch builder for rwkvx/cu/loss.cu: fused log-softmax cross-entropy (forward and backward).

Buffers: logits float32 ``[R, V]`` (any V; float4 when V % 4 == 0 and 16-byte aligned), targets int32
``[R]``, loss float64 ``[R]``, dlogits float32 ``[R, V]``, inv_count float64 ``[1]`` (device).

    loss[r]       = logsumexp(logits[r]) - logits[r, targets[r]]         (0 where targets[r] == ignore_index)
    dlogits[r, j] = (softmax(logits[r])_j - [j == targets[r]]) * inv_count   (0 rows where ignored)

``inv_count`` = 1 / (number of targets != ignore_index), written by the host with the targets each step
(:func:`inv_count`), read by the kernel from device memory, so the graph never changes. The mean loss is
``sum(loss) * inv_count``, reduced on the host in float64.

``dlogits`` may be ``logits`` (in place, saves the [R, V] buffer) or None (loss only, no gradient; then
``inv_count`` may be None too).
One block of 512 threads per row; per-thread (max, sum of exp) pairs (sum accumulated in float64) merged
in a fixed tree, so results are bit-reproducible.
"""
from __future__ import annotations

import numpy as np

from ._common import Launch, ptr

MODULE = "loss"
THREADS = 512            # CE_THREADS in loss.cu
IGNORE_INDEX = -100


def inv_count(targets, ignore_index: int = IGNORE_INDEX) -> np.ndarray:
    """float64 [1]: 1 / (number of targets != ignore_index) (0 when every target is ignored)."""
    n = int(np.count_nonzero(np.asarray(targets) != ignore_index))
    return np.array([1.0 / n if n else 0.0], dtype=np.float64)


def cross_entropy(logits, targets, loss, dlogits, inv_count_ptr, R: int, V: int,
                  ignore_index: int = IGNORE_INDEX) -> list:
    """cross_entropy_loss: per-row loss [R] float64 and, unless dlogits is None, dlogits [R, V]."""
    if R <= 0 or V <= 0:
        raise ValueError(f"loss.cross_entropy: R={R} and V={V} must be positive")
    if R > 0x7FFFFFFF:
        raise ValueError(f"loss.cross_entropy: R={R} too large")
    return [Launch(MODULE, "cross_entropy_loss", grid=(int(R), 1, 1), block=(THREADS, 1, 1),
                   args=(("p", ptr(logits)), ("p", ptr(dlogits)), ("p", ptr(targets)), ("p", ptr(loss)),
                         ("p", ptr(inv_count_ptr)), ("i", int(R)), ("i", int(V)), ("i", int(ignore_index))))]
