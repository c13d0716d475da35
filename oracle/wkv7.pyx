# cython: language_level=3, boundscheck=True, wraparound=True, annotation_typing=False
# Python-level code keeps normal indexing; the loop kernels opt out of the checks one by one.
"""Twin of rwkvx/cu/wkv7/sequential.cu: the WKV7 recurrence, forward and backward, in double.

Per (batch, head), state S N x N (row i = value index, column j = key index), S_{-1} = s0 before
t = 0 (default 0; a stateful forward's carried state, or a tuned initial state):
  sa_t = S_{t-1} a_t ;  S_t = S_{t-1} diag(w_t) + sa_t b_t^T + v_t k_t^T ;  y_t = S_t r_t
(the model passes a = -kk, b = kk * a_rate). The backward also gives ds0 = dLoss/ds0, the gradient
dS carried back past the first token.
"""
from __future__ import annotations

cimport cython
import numpy as np

from ._common import float64_op


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _wkv7_fwd(const double[:, :, :, ::1] r, const double[:, :, :, ::1] w,
              const double[:, :, :, ::1] k, const double[:, :, :, ::1] v,
              const double[:, :, :, ::1] a, const double[:, :, :, ::1] b,
              double[:, :, :, ::1] y, const double[:, :, :, ::1] s0, double[:, :, :, ::1] s1,
              double[:, ::1] St, double[::1] sa):
    # The state is kept transposed, St[j, i] = S[i, j], so the innermost loops run over contiguous
    # value indices i with one accumulator each (the compiler vectorises them); every sum is still
    # over j in ascending order. It starts from s0 [B,H,N,N] and ends in s1 (both S[i, j]).
    cdef Py_ssize_t B = r.shape[0], T = r.shape[1], H = r.shape[2], N = r.shape[3]
    cdef Py_ssize_t bb, h, t, i, j
    cdef double s, aj, wj, bj, kj, rj
    with nogil:
        for bb in range(B):
            for h in range(H):
                for j in range(N):
                    for i in range(N):
                        St[j, i] = s0[bb, h, i, j]
                for t in range(T):
                    for i in range(N):
                        sa[i] = 0
                        y[bb, t, h, i] = 0
                    for j in range(N):
                        aj = a[bb, t, h, j]
                        for i in range(N):
                            sa[i] = sa[i] + St[j, i] * aj
                    for j in range(N):
                        wj = w[bb, t, h, j]
                        bj = b[bb, t, h, j]
                        kj = k[bb, t, h, j]
                        rj = r[bb, t, h, j]
                        for i in range(N):
                            s = St[j, i] * wj + sa[i] * bj + v[bb, t, h, i] * kj
                            St[j, i] = s
                            y[bb, t, h, i] = y[bb, t, h, i] + s * rj
                for j in range(N):
                    for i in range(N):
                        s1[bb, h, i, j] = St[j, i]


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _wkv7_bwd(const double[:, :, :, ::1] r, const double[:, :, :, ::1] w,
              const double[:, :, :, ::1] k, const double[:, :, :, ::1] v,
              const double[:, :, :, ::1] a, const double[:, :, :, ::1] b,
              const double[:, :, :, ::1] dy, const double[:, :, :, ::1] s0,
              double[:, :, :, ::1] dr, double[:, :, :, ::1] dw, double[:, :, :, ::1] dk,
              double[:, :, :, ::1] dv, double[:, :, :, ::1] da, double[:, :, :, ::1] db,
              double[:, :, :, ::1] ds0, double[:, :, ::1] Sall, double[:, ::1] dS, double[::1] sa):
    # One (batch, head) at a time: recompute and keep S_0 .. S_T (Sall[t] = state before token t),
    # starting from s0 [B,H,N,N], then walk back with dS = dLoss/dS_t:
    #   dS += dy_t r_t^T ; dr_t = S_t^T dy_t
    #   dw_t[j] = sum_i dS[i,j] S_{t-1}[i,j] ; db_t = dS^T sa_t ; dk_t = dS^T v_t ; dv_t = dS k_t
    #   dsa = dS b_t ; da_t = S_{t-1}^T dsa ; dS_{t-1} = dS diag(w_t) + dsa a_t^T
    # and ds0 = dS_{-1}, what is left after t = 0.
    cdef Py_ssize_t B = r.shape[0], T = r.shape[1], H = r.shape[2], N = r.shape[3]
    cdef Py_ssize_t bb, h, t, i, j
    cdef double s, acc, sai, vi, dyi, dsai, dvi, g
    with nogil:
        for bb in range(B):
            for h in range(H):
                # forward, saving every state
                for i in range(N):
                    for j in range(N):
                        Sall[0, i, j] = s0[bb, h, i, j]
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
                for i in range(N):
                    for j in range(N):
                        ds0[bb, h, i, j] = dS[i, j]


def _check_shapes(arrays: tuple) -> tuple:
    shape = arrays[0].shape
    if len(shape) != 4:
        raise ValueError(f"wkv7 inputs must be [B, T, H, N], got shape {shape}")
    for x in arrays:
        if x.shape != shape:
            raise ValueError(f"wkv7 inputs must all have shape {shape}, got {x.shape}")
    return shape


def _initial_state(state, B: int, H: int, N: int) -> np.ndarray:
    """The state before t = 0 as [B,H,N,N] float64: zeros for None; [1,H,N,N] is shared by every
    sequence (broadcast); anything else must be [B,H,N,N]."""
    if state is None:
        return np.zeros((B, H, N, N))
    if state.shape not in ((B, H, N, N), (1, H, N, N)):
        raise ValueError(f"wkv7 state must have shape {(B, H, N, N)} or {(1, H, N, N)}, "
                         f"got {state.shape}")
    return np.ascontiguousarray(np.broadcast_to(state, (B, H, N, N)))


@float64_op
def wkv7_forward(r: np.ndarray, w: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray,
                 b: np.ndarray, state: np.ndarray | None = None,
                 return_state: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """WKV7 outputs y [B,T,H,N]; all inputs [B,T,H,N], w = decay in (0, 1).

    ``state`` [B,H,N,N] or [1,H,N,N] (shared by the B sequences; S[i, j], row = value index) is the
    state before t = 0 (default zero: a sequence's start; given: where a previous call left off, or
    a tuned initial state). With ``return_state`` the result is (y, the state after the last token
    [B,H,N,N])."""
    B, _, H, N = _check_shapes((r, w, k, v, a, b))
    state = _initial_state(state, B, H, N)
    y = np.empty_like(r)
    final = np.empty((B, H, N, N))
    _wkv7_fwd(r, w, k, v, a, b, y, state, final, np.empty((N, N)), np.empty(N))
    return (y, final) if return_state else y


@float64_op
def wkv7_backward(r: np.ndarray, w: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray,
                  b: np.ndarray, dy: np.ndarray,
                  state: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Gradients (dr, dw, dk, dv, da, db) of :func:`wkv7_forward` for output gradient ``dy``; given
    the initial ``state`` (as for :func:`wkv7_forward`), also its gradient ds0 (7 results), shaped
    like ``state`` ([1,H,N,N]: summed over the sequences that share it).

    The states are recomputed here (T+1 of them per batch/head, one batch/head at a time)."""
    B, T, H, N = _check_shapes((r, w, k, v, a, b, dy))
    grads = [np.empty_like(r) for _ in range(6)]
    ds0 = np.empty((B, H, N, N))
    _wkv7_bwd(r, w, k, v, a, b, dy, _initial_state(state, B, H, N), *grads, ds0,
              np.empty((T + 1, N, N)), np.empty((N, N)), np.empty(N))
    if state is None:
        return tuple(grads)
    return (*grads, ds0.sum(axis=0, keepdims=True) if state.shape[0] == 1 and B > 1 else ds0)
