# cython: language_level=3, boundscheck=True, wraparound=True, annotation_typing=False
# Python-level code keeps normal indexing; the loop kernels opt out of the checks one by one.
"""The normalisation loops of the oracle: a GroupNorm over the last axis, in double, forward and backward.

LayerNorm (oracle/layernorm.py) is its one-group case and the time mix's ln_x (oracle/timemix.py) its
one-group-per-head case. Each group of n = C / groups channels of a row is normalised, then scaled and
shifted per channel; the variance is the biased (population) one, eps inside the square root, as
torch.nn.LayerNorm. Inputs and outputs are float64 (the twins' float64_op converts).
"""
from __future__ import annotations

cimport cython
import numpy as np

from libc.math cimport sqrt


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
cdef inline void _moments(const double[:, ::1] x, Py_ssize_t row, Py_ssize_t c0, Py_ssize_t n,
                          double eps, double* mean, double* rstd) noexcept nogil:
    """Mean and 1/sqrt(var + eps) of x[row, c0 : c0+n]; two passes, so no cancellation in
    E[x^2] - E[x]^2."""
    cdef Py_ssize_t c
    cdef double m = 0, var = 0, d
    for c in range(c0, c0 + n):
        m = m + x[row, c]
    m = m / n
    for c in range(c0, c0 + n):
        d = x[row, c] - m
        var = var + d * d
    mean[0] = m
    rstd[0] = 1.0 / sqrt(var / n + eps)


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _group_norm_fwd(const double[:, ::1] x, const double[::1] w, const double[::1] b,
                    double eps, double[:, ::1] y, double[:, ::1] mean, double[:, ::1] rstd):
    cdef Py_ssize_t R = x.shape[0], C = x.shape[1], groups = mean.shape[1], n = C // groups
    cdef Py_ssize_t row, g, c, c0
    cdef double m, rs
    with nogil:
        for row in range(R):
            for g in range(groups):
                c0 = g * n
                _moments(x, row, c0, n, eps, &m, &rs)
                mean[row, g] = m
                rstd[row, g] = rs
                for c in range(c0, c0 + n):
                    y[row, c] = (x[row, c] - m) * rs * w[c] + b[c]


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _group_norm_bwd(const double[:, ::1] x, const double[::1] w, const double[:, ::1] dy,
                    Py_ssize_t groups, double eps, double[:, ::1] dx, double[::1] dw,
                    double[::1] db):
    # xhat = (x - mean) * rstd ; y = xhat * w + b
    # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dy * w
    cdef Py_ssize_t R = x.shape[0], C = x.shape[1], n = C // groups
    cdef Py_ssize_t row, g, c, c0
    cdef double m, rs, xhat, dxhat, m1, m2
    with nogil:
        for c in range(C):
            dw[c] = 0
            db[c] = 0
        for row in range(R):
            for g in range(groups):
                c0 = g * n
                _moments(x, row, c0, n, eps, &m, &rs)
                m1 = 0
                m2 = 0
                for c in range(c0, c0 + n):
                    xhat = (x[row, c] - m) * rs
                    dxhat = dy[row, c] * w[c]
                    m1 = m1 + dxhat
                    m2 = m2 + dxhat * xhat
                    dw[c] = dw[c] + dy[row, c] * xhat
                    db[c] = db[c] + dy[row, c]
                m1 = m1 / n
                m2 = m2 / n
                for c in range(c0, c0 + n):
                    xhat = (x[row, c] - m) * rs
                    dx[row, c] = rs * (dy[row, c] * w[c] - m1 - xhat * m2)


def _rows(x: np.ndarray, w: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """x [..., C] as [R, C] and w as [C], checking that ``groups`` divides C."""
    C = x.shape[-1]
    if groups < 1 or C % groups:
        raise ValueError(f"groups={groups} must divide the channel count {C}")
    return x.reshape(-1, C), np.ascontiguousarray(w.reshape(C))


def norm_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, groups: int,
                 eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y [..., C], mean [R, groups], rstd [R, groups]) of the GroupNorm of float64 x [..., C] with
    float64 w, b [C]; rstd = 1 / sqrt(var + eps)."""
    x2, w = _rows(x, w, groups)
    y = np.empty_like(x2)
    mean = np.empty((x2.shape[0], groups))
    rstd = np.empty((x2.shape[0], groups))
    _group_norm_fwd(x2, w, np.ascontiguousarray(b.reshape(-1)), eps, y, mean, rstd)
    return y.reshape(x.shape), mean, rstd


def norm_backward(x: np.ndarray, w: np.ndarray, dy: np.ndarray, groups: int,
                  eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dx [..., C], dw [C], db [C]) of :func:`norm_forward` for the float64 output gradient dy; the
    statistics are recomputed from x."""
    x2, w = _rows(x, w, groups)
    dx = np.empty_like(x2)
    dw = np.empty(x2.shape[1])
    db = np.empty(x2.shape[1])
    _group_norm_bwd(x2, w, dy.reshape(x2.shape), groups, eps, dx, dw, db)
    return dx.reshape(x.shape), dw, db
