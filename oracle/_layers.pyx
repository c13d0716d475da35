# cython: language_level=3, cdivision=True, boundscheck=True, wraparound=True
# Python-level code keeps normal indexing; the loop kernels below opt out of checks one by one.
"""Op-level reference kernels of the oracle: LayerNorm/GroupNorm, WKV7, cross-entropy.

Each op has a forward and a hand-written backward next to each other. Kernels are written for
clarity first: plain loops over typed memoryviews, run without the GIL. They are generic over the
float type (``real`` = float or double) so the float32 oracle does all its math in float32; the
cross-entropy is the exception and always works in float64 (SPEC §3).
"""
cimport cython
import numpy as np

from libc.math cimport sqrt, exp, log
from libc.stdint cimport int64_t

ctypedef fused real:
    float
    double


def _float_array(x, dtype=None):
    """C-contiguous float32/float64 array; other dtypes become float64."""
    x = np.asarray(x)
    if dtype is None:
        dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.float64
    return np.ascontiguousarray(x, dtype=dtype)


# --------------------------------------------------------------------------------------------
# LayerNorm / GroupNorm: normalise each group of n = C / groups channels of a row, then scale
# and shift per channel. LayerNorm is the one-group case; RWKV's ln_x is one group per head.
# Variance is the biased (population) one, eps inside the square root, as torch.nn.LayerNorm.
# --------------------------------------------------------------------------------------------

@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _group_norm_fwd(real[:, ::1] x, real[::1] w, real[::1] b, Py_ssize_t groups, double eps,
                    real[:, ::1] y):
    cdef Py_ssize_t R = x.shape[0], C = x.shape[1], n = C // groups
    cdef Py_ssize_t row, g, c, c0
    cdef real mean, var, d, rstd
    with nogil:
        for row in range(R):
            for g in range(groups):
                c0 = g * n
                mean = 0
                for c in range(c0, c0 + n):
                    mean = mean + x[row, c]
                mean = mean / n
                var = 0
                for c in range(c0, c0 + n):  # two passes: no cancellation in E[x^2] - E[x]^2
                    d = x[row, c] - mean
                    var = var + d * d
                var = var / n
                rstd = <real>(1.0 / sqrt(var + <real>eps))
                for c in range(c0, c0 + n):
                    y[row, c] = (x[row, c] - mean) * rstd * w[c] + b[c]


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _group_norm_bwd(real[:, ::1] x, real[::1] w, real[:, ::1] dy, Py_ssize_t groups, double eps,
                    real[:, ::1] dx, real[::1] dw, real[::1] db):
    # xhat = (x - mean) * rstd ; y = xhat * w + b
    # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dy * w
    cdef Py_ssize_t R = x.shape[0], C = x.shape[1], n = C // groups
    cdef Py_ssize_t row, g, c, c0
    cdef real mean, var, d, rstd, xhat, dxhat, m1, m2
    with nogil:
        for c in range(C):
            dw[c] = 0
            db[c] = 0
        for row in range(R):
            for g in range(groups):
                c0 = g * n
                mean = 0
                for c in range(c0, c0 + n):
                    mean = mean + x[row, c]
                mean = mean / n
                var = 0
                for c in range(c0, c0 + n):
                    d = x[row, c] - mean
                    var = var + d * d
                var = var / n
                rstd = <real>(1.0 / sqrt(var + <real>eps))
                m1 = 0
                m2 = 0
                for c in range(c0, c0 + n):
                    xhat = (x[row, c] - mean) * rstd
                    dxhat = dy[row, c] * w[c]
                    m1 = m1 + dxhat
                    m2 = m2 + dxhat * xhat
                    dw[c] = dw[c] + dy[row, c] * xhat
                    db[c] = db[c] + dy[row, c]
                m1 = m1 / n
                m2 = m2 / n
                for c in range(c0, c0 + n):
                    xhat = (x[row, c] - mean) * rstd
                    dx[row, c] = rstd * (dy[row, c] * w[c] - m1 - xhat * m2)


def group_norm_forward(x, w, b, groups, eps):
    """y = GroupNorm(x) over the last axis split into ``groups`` groups; x [..., C], w, b [C]."""
    x = _float_array(x)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    C = x2.shape[1]
    if C % groups:
        raise ValueError(f"groups={groups} must divide the channel count {C}")
    w = _float_array(w, x.dtype).reshape(C)
    b = _float_array(b, x.dtype).reshape(C)
    y = np.empty_like(x2)
    _group_norm_fwd(x2, w, b, groups, eps, y)
    return y.reshape(shape)


def group_norm_backward(x, w, dy, groups, eps):
    """Gradients (dx, dw, db) of :func:`group_norm_forward` for output gradient ``dy``."""
    x = _float_array(x)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    C = x2.shape[1]
    w = _float_array(w, x.dtype).reshape(C)
    dy2 = _float_array(dy, x.dtype).reshape(x2.shape)
    dx = np.empty_like(x2)
    dw = np.empty(C, x.dtype)
    db = np.empty(C, x.dtype)
    _group_norm_bwd(x2, w, dy2, groups, eps, dx, dw, db)
    return dx.reshape(shape), dw, db


def layernorm_forward(x, w, b, eps=1e-5):
    """LayerNorm over the last axis: x [..., C] (typically [R, C]), w, b [C]."""
    return group_norm_forward(x, w, b, 1, eps)


def layernorm_backward(x, w, dy, eps=1e-5):
    """(dx, dw, db) of :func:`layernorm_forward`; the bias is not needed."""
    return group_norm_backward(x, w, dy, 1, eps)


# --------------------------------------------------------------------------------------------
# WKV7 recurrence, per (batch, head), state S N x N (row i = value index, column j = key index):
#   sa_t = S_{t-1} a_t ;  S_t = S_{t-1} diag(w_t) + sa_t b_t^T + v_t k_t^T ;  y_t = S_t r_t
# Row i of S only ever mixes with itself, so the forward runs row by row.
# --------------------------------------------------------------------------------------------

@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _wkv7_fwd(real[:, :, :, ::1] r, real[:, :, :, ::1] w, real[:, :, :, ::1] k,
              real[:, :, :, ::1] v, real[:, :, :, ::1] a, real[:, :, :, ::1] b,
              real[:, :, :, ::1] y, real[:, ::1] S):
    cdef Py_ssize_t B = r.shape[0], T = r.shape[1], H = r.shape[2], N = r.shape[3]
    cdef Py_ssize_t bb, h, t, i, j
    cdef real sa, s, acc, vi
    with nogil:
        for bb in range(B):
            for h in range(H):
                for i in range(N):
                    for j in range(N):
                        S[i, j] = 0
                for t in range(T):
                    for i in range(N):
                        sa = 0
                        for j in range(N):
                            sa = sa + S[i, j] * a[bb, t, h, j]
                        vi = v[bb, t, h, i]
                        acc = 0
                        for j in range(N):
                            s = S[i, j] * w[bb, t, h, j] + sa * b[bb, t, h, j] + vi * k[bb, t, h, j]
                            S[i, j] = s
                            acc = acc + s * r[bb, t, h, j]
                        y[bb, t, h, i] = acc


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _wkv7_bwd(real[:, :, :, ::1] r, real[:, :, :, ::1] w, real[:, :, :, ::1] k,
              real[:, :, :, ::1] v, real[:, :, :, ::1] a, real[:, :, :, ::1] b,
              real[:, :, :, ::1] dy,
              real[:, :, :, ::1] dr, real[:, :, :, ::1] dw, real[:, :, :, ::1] dk,
              real[:, :, :, ::1] dv, real[:, :, :, ::1] da, real[:, :, :, ::1] db,
              real[:, :, ::1] Sall, real[:, ::1] dS, real[::1] sa):
    # One (batch, head) at a time: recompute and keep S_0 .. S_T (Sall[t] = state before token t),
    # then walk back with dS = dLoss/dS_t:
    #   dS += dy_t r_t^T ; dr_t = S_t^T dy_t
    #   dw_t[j] = sum_i dS[i,j] S_{t-1}[i,j] ; db_t = dS^T sa_t ; dk_t = dS^T v_t ; dv_t = dS k_t
    #   dsa = dS b_t ; da_t = S_{t-1}^T dsa ; dS_{t-1} = dS diag(w_t) + dsa a_t^T
    cdef Py_ssize_t B = r.shape[0], T = r.shape[1], H = r.shape[2], N = r.shape[3]
    cdef Py_ssize_t bb, h, t, i, j
    cdef real s, acc, sai, vi, dyi, dsai, dvi, g
    with nogil:
        for bb in range(B):
            for h in range(H):
                # forward, saving every state
                for i in range(N):
                    for j in range(N):
                        Sall[0, i, j] = 0
                for t in range(T):
                    for i in range(N):
                        sai = 0
                        for j in range(N):
                            sai = sai + Sall[t, i, j] * a[bb, t, h, j]
                        vi = v[bb, t, h, i]
                        for j in range(N):
                            Sall[t + 1, i, j] = (Sall[t, i, j] * w[bb, t, h, j] + sai * b[bb, t, h, j]
                                                 + vi * k[bb, t, h, j])
                # backward
                for i in range(N):
                    for j in range(N):
                        dS[i, j] = 0
                for t in range(T - 1, -1, -1):
                    for j in range(N):
                        dr[bb, t, h, j] = 0
                        dw[bb, t, h, j] = 0
                        dk[bb, t, h, j] = 0
                        da[bb, t, h, j] = 0
                        db[bb, t, h, j] = 0
                    for i in range(N):
                        sai = 0
                        for j in range(N):
                            sai = sai + Sall[t, i, j] * a[bb, t, h, j]
                        sa[i] = sai
                    for i in range(N):
                        dyi = dy[bb, t, h, i]
                        vi = v[bb, t, h, i]
                        sai = sa[i]
                        dsai = 0
                        dvi = 0
                        for j in range(N):
                            g = dS[i, j] + dyi * r[bb, t, h, j]
                            dS[i, j] = g
                            dsai = dsai + g * b[bb, t, h, j]
                            dvi = dvi + g * k[bb, t, h, j]
                        dv[bb, t, h, i] = dvi
                        for j in range(N):
                            g = dS[i, j]
                            dr[bb, t, h, j] += Sall[t + 1, i, j] * dyi
                            dw[bb, t, h, j] += g * Sall[t, i, j]
                            db[bb, t, h, j] += g * sai
                            dk[bb, t, h, j] += g * vi
                            da[bb, t, h, j] += dsai * Sall[t, i, j]
                            dS[i, j] = g * w[bb, t, h, j] + dsai * a[bb, t, h, j]


def _wkv7_inputs(arrays):
    arrays = [_float_array(x) for x in arrays]
    dtype = np.result_type(*arrays)
    arrays = [np.ascontiguousarray(x, dtype=dtype) for x in arrays]
    shape = arrays[0].shape
    if len(shape) != 4:
        raise ValueError(f"wkv7 inputs must be [B, T, H, N], got shape {shape}")
    for x in arrays:
        if x.shape != shape:
            raise ValueError(f"wkv7 inputs must all have shape {shape}, got {x.shape}")
    return arrays


def wkv7_forward(r, w, k, v, a, b):
    """WKV7 outputs y [B,T,H,N]; all inputs [B,T,H,N], w = decay in (0, 1), S = 0 before t = 0."""
    r, w, k, v, a, b = _wkv7_inputs((r, w, k, v, a, b))
    N = r.shape[3]
    y = np.empty_like(r)
    S = np.empty((N, N), r.dtype)
    _wkv7_fwd(r, w, k, v, a, b, y, S)
    return y


def wkv7_backward(r, w, k, v, a, b, dy):
    """Gradients (dr, dw, dk, dv, da, db) of :func:`wkv7_forward` for output gradient ``dy``.

    The states are recomputed here (T+1 of them per batch/head, one batch/head at a time)."""
    r, w, k, v, a, b, dy = _wkv7_inputs((r, w, k, v, a, b, dy))
    T, N = r.shape[1], r.shape[3]
    grads = [np.empty_like(r) for _ in range(6)]
    Sall = np.empty((T + 1, N, N), r.dtype)
    dS = np.empty((N, N), r.dtype)
    sa = np.empty(N, r.dtype)
    _wkv7_bwd(r, w, k, v, a, b, dy, *grads, Sall, dS, sa)
    return tuple(grads)


# --------------------------------------------------------------------------------------------
# Cross-entropy, always in float64: per row logsumexp(z) - z[target]; its gradient
# softmax(z) - onehot(target). Rows whose target is ignore_index contribute nothing.
# --------------------------------------------------------------------------------------------

@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _cross_entropy(double[:, ::1] z, int64_t[::1] target, int64_t ignore_index,
                   double[::1] loss, double[:, ::1] dz):
    cdef Py_ssize_t R = z.shape[0], V = z.shape[1], row, c
    cdef double m, s, lse
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
            s = 0
            for c in range(V):
                s = s + exp(z[row, c] - m)
            lse = m + log(s)
            loss[row] = lse - z[row, tgt]
            for c in range(V):
                dz[row, c] = exp(z[row, c] - lse)
            dz[row, tgt] -= 1


def cross_entropy(logits, targets, ignore_index=-100):
    """Mean cross-entropy (float64) over rows whose target != ignore_index, and its gradient.

    logits [R, V] (any float dtype, converted to float64), targets int [R] already validated.
    Returns (loss: float, dlogits float64 [R, V], count). No valid row: loss 0 and zero gradient.
    """
    z = np.ascontiguousarray(logits, dtype=np.float64)
    tgt = np.ascontiguousarray(targets, dtype=np.int64).reshape(-1)
    R = z.shape[0]
    per_row = np.empty(R, np.float64)
    dz = np.empty_like(z)
    _cross_entropy(z, tgt, ignore_index, per_row, dz)
    count = int(np.count_nonzero(tgt != ignore_index))
    if count == 0:
        return 0.0, dz, 0  # every row was ignored: dz is all zero already
    dz /= count
    # math.fsum-like care is not needed: float64 sum of per-token losses, fixed order.
    return float(per_row.sum() / count), dz, count
