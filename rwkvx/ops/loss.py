"""Launch builder for rwkvx/cu/loss.cu: fused log-softmax cross-entropy (forward and backward).

Buffers: logits floatX ``[R, V]`` (any V; vector loads when V % 4 == 0 and aligned), targets int32
``[R]``, loss f64 ``[R]``, dlogits floatX ``[R, V]``, inv_count f64 ``[1]`` (device).
Twin: ``rwkvx.oracle.cross_entropy_rows``.

    loss[r]       = logsumexp(logits[r]) - logits[r, targets[r]]         (0 where targets[r] == ignore_index)
    dlogits[r, j] = (softmax(logits[r])_j - [j == targets[r]]) * inv_count   (0 rows where ignored)

``inv_count`` = 1 / (number of targets != ignore_index), written by the host with the targets each step
(:func:`inv_count`), read by the kernel from device memory, so the graph never changes. The mean loss is
``sum(loss) * inv_count``, reduced on the host in float64.

``dlogits`` may be ``logits`` (in place, saves the [R, V] buffer) or None (loss only, no gradient; then
``inv_count`` may be None too).
One block of THREADS threads per row; per-thread (max, sum of exp) pairs (sum accumulated in float64)
merged in a fixed tree, so results are bit-reproducible.
"""
from __future__ import annotations

import numpy as np

from rwkvx.runtime.kernel import F64_IN, F64_OUT, I32_IN, INT, X_IN, X_OUT, KernelFile
from rwkvx.validate import IGNORE_INDEX

THREADS = 512

CU = KernelFile("loss", constants={"CE_THREADS": THREADS})
CROSS_ENTROPY_LOSS = CU.kernel("cross_entropy_loss", logits=X_IN, dlogits=X_OUT.opt(), targets=I32_IN,
                               loss=F64_OUT, inv_count=F64_IN.opt(), R=INT, V=INT, ignore_index=INT)


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
    if dlogits is not None and inv_count_ptr is None:
        raise ValueError("loss.cross_entropy: dlogits needs inv_count")
    return [CROSS_ENTROPY_LOSS.launch((R, 1, 1), (THREADS, 1, 1), xtype=logits.elem, logits=logits,
                                      dlogits=dlogits, targets=targets, loss=loss, inv_count=inv_count_ptr,
                                      R=R, V=V, ignore_index=ignore_index)]
