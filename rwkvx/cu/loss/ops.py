"""Launch builder for rwkvx/cu/loss/loss.cu: fused log-softmax cross-entropy (forward and backward).

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
One thread-block cluster per row, grid ``(R, CE_CLUSTER)`` (the cluster shape, from :func:`shape`, is
compiled into the kernel): rows of up to :data:`ROW_CAPACITY` elements are held in registers and read from
memory once; longer rows stream. Per-thread (reference, sum of exp) pairs are merged in a fixed order, so
results are bit-reproducible. Numerics and layout: rwkvx/cu/loss/loss.cu.
"""
from __future__ import annotations

import numpy as np

from rwkvx.runtime.dtypes import ELEM_BYTES
from rwkvx.runtime.kernel import F64_IN, F64_OUT, I32_IN, INT, X_IN, X_OUT, KernelFile
from rwkvx.validate import IGNORE_INDEX

ROW_CAPACITY = 65536     # elements of a row one cluster holds in registers (the model's vocabulary)
ROW_BYTES = 128          # bytes of the row each thread holds in registers (32 of its <= 64 registers)
# 512-thread CTAs, 2 per SM (the register budget is cut for 2): 128 KB of rows per SM. 256-thread CTAs,
# 4 per SM, measured the same on the H200 (bf16 2.123 ms both, fp32 4.246 / 4.217 ms at R 32768, V 65536).
THREADS, CTAS_PER_SM = 512, 2


def shape(xtype: str) -> dict:
    """Defines of one compile: CTA size, quads per thread, cluster size (CTAs per row), CTAs per SM."""
    quads = ROW_BYTES // (4 * ELEM_BYTES[xtype])
    return {"CE_THREADS": THREADS, "CE_QUADS": quads, "CE_CLUSTER": ROW_CAPACITY // (4 * quads * THREADS),
            "CE_MIN_BLOCKS": CTAS_PER_SM}


CU = KernelFile("loss/loss", derived=lambda v, x: shape(x))
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
    sh = shape(logits.elem)                   # grid: row r is the cluster of CTAs (r, 0..CE_CLUSTER-1)
    return [CROSS_ENTROPY_LOSS.launch((R, sh["CE_CLUSTER"], 1), (THREADS, 1, 1), xtype=logits.elem,
                                      logits=logits, dlogits=dlogits, targets=targets, loss=loss,
                                      inv_count=inv_count_ptr, R=R, V=V, ignore_index=ignore_index)]
