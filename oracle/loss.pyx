# cython: language_level=3, boundscheck=True, wraparound=True, annotation_typing=False
# Python-level code keeps normal indexing; the loop kernel opts out of the checks.
"""Twin of rwkvx/cu/loss/loss.cu: the cross-entropy, always in float64 (docs/SPEC.md §3).

Per row: loss = logsumexp(z) - z[target]; its gradient softmax(z) - onehot(target). Rows whose
target is ignore_index contribute nothing. The target's entries are formed from the sum of the other
classes' exponentials, rest (dz[target] = -rest / sum; loss = log1p(rest / own) where the target's
own term is near the row's maximum), as the kernel forms dz[target], so they stay accurate on near
one-hot rows.
"""
from __future__ import annotations

cimport cython
import numpy as np

from libc.math cimport exp, log, log1p
from libc.stdint cimport int64_t


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _cross_entropy(const double[:, ::1] z, const int64_t[::1] target, int64_t ignore_index,
                   double[::1] loss, double[:, ::1] dz):
    cdef Py_ssize_t R = z.shape[0], V = z.shape[1], row, c
    cdef double m, rest, own, s, lse
    cdef int64_t tgt
    with nogil:
        for row in range(R):
            tgt = target[row]
            if tgt == ignore_index:
                loss[row] = 0
                for c in range(V):
                    dz[row, c] = 0
                continue
            m = z[row, 0]
            for c in range(1, V):
                if z[row, c] > m:
                    m = z[row, c]
            # The target's term is kept apart from the rest: on a near one-hot row p_t - 1 and
            # lse - z_t are tiny differences of numbers near 1 and z_t, so both are formed from the
            # rest's sum instead.
            rest = 0
            for c in range(V):
                if c != tgt:
                    rest = rest + exp(z[row, c] - m)
            own = exp(z[row, tgt] - m)
            s = rest + own
            lse = m + log(s)
            # log(s / own) = log1p(rest / own); where the target is far below the maximum the
            # quotient could overflow, and lse - z_t > log 2 has no cancellation anyway.
            loss[row] = log1p(rest / own) if own >= 0.5 else lse - z[row, tgt]
            for c in range(V):
                dz[row, c] = exp(z[row, c] - lse)
            dz[row, tgt] = -rest / s


def cross_entropy_rows(logits: np.ndarray, targets: np.ndarray,
                       ignore_index: int = -100) -> tuple[np.ndarray, np.ndarray]:
    """Per-row cross-entropy of logits [R, V] (any float dtype, computed in float64) against int
    targets [R] (already validated: each in [0, V) or ignore_index).

    Returns (loss float64 [R], dlogits float64 [R, V] = softmax - onehot); both are zero on the rows
    whose target is ignore_index."""
    z = np.ascontiguousarray(logits, dtype=np.float64)
    tgt = np.ascontiguousarray(targets, dtype=np.int64).reshape(-1)
    if z.ndim != 2 or tgt.shape[0] != z.shape[0]:
        raise ValueError(f"logits must be [R, V] and targets [R], got {z.shape} and {tgt.shape}")
    loss = np.empty(z.shape[0])
    dz = np.empty_like(z)
    _cross_entropy(z, tgt, ignore_index, loss, dz)
    return loss, dz


def cross_entropy(logits: np.ndarray, targets: np.ndarray,
                  ignore_index: int = -100) -> tuple[float, np.ndarray, int]:
    """Mean cross-entropy (float64) over rows whose target != ignore_index, and its gradient.

    logits [R, V], targets int [R] as :func:`cross_entropy_rows`. Returns (loss, dlogits float64
    [R, V], count). No valid row: loss 0 and zero gradient."""
    loss, dz = cross_entropy_rows(logits, targets, ignore_index)
    count = int(np.count_nonzero(np.asarray(targets).reshape(-1) != ignore_index))
    if count == 0:
        return 0.0, dz, 0          # every row was ignored: dz is all zero already
    dz /= count
    return float(loss.sum() / count), dz, count
