# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# cython: annotation_typing=False
"""Twin of the kernels of rwkvx/cu/moba/ (select.cu, exact.cu, mma.cu): MoBA sparse attention (docs/SPEC.md
§2.3 "Attn (MoBA)"), forward and backward.

Arrays are [B, T, H, N] (batch, time, head, head channel), float64 or float32; everything is computed in
double and the outputs come back in the inputs' dtype (float32 only when all inputs are float32), except
the gates, gaps, block means and log-sum-exps, which are float64 always.

Per sequence b, head h, query t (scale s = 1/sqrt(N), blocks of `chunk` tokens from the sequence start,
block(t) = t // chunk):
  * gate g_j = q_t . mean(k over block j) for every block j < block(t) (wholly in the past);
  * the top_k - 1 past blocks with the largest gate are selected (ties: the lower j wins); all past
    blocks if fewer exist; none if top_k == 1;
  * visible keys: every position of the selected blocks, plus block(t)*chunk .. t;
  * o_t = softmax over visible u of (s * q_t . k_u), applied to v_u.

Selection format (shared with the GPU kernels): int32 [B, H, T, top_k - 1], the selected block indices
of query t in ascending order, padded at the end with -1.

A stateful forward (generation) attends with the queries of the newest positions only, over a cache of
every key and value so far and the means of the cache's complete blocks: ``moba_attention_cached``. It
runs the same selection and attention loops, with the queries' positions offset by the cached length.
"""
from __future__ import annotations

import numpy as np

from libc.math cimport INFINITY, exp, log, sqrt

from ._common import float64_op, result_dtype

__all__ = ["moba_attention_forward", "moba_attention_backward", "moba_attention_cached", "moba_logsumexp",
           "moba_select", "moba_gate_gaps", "moba_block_means", "moba_gates"]


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------

def _check_chunk_topk(chunk, top_k):
    if int(chunk) != chunk or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    if int(top_k) != top_k or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    return int(chunk), int(top_k)


def _check_qkv(*arrays):
    """q (, k, v, do): real arrays of one shape [B, T, H, N], returned C-contiguous float64."""
    out = []
    for a, name in zip(arrays, ("q", "k", "v", "do")):
        a = np.asarray(a)
        if a.dtype.kind not in "fiu":
            raise TypeError(f"{name}: expected a real numeric array, got dtype {a.dtype}")
        if a.ndim != 4:
            raise ValueError(f"{name}: expected shape [B, T, H, N], got {a.shape}")
        if out and a.shape != out[0].shape:
            raise ValueError(f"{name}: shape {a.shape} differs from q's {out[0].shape}")
        out.append(np.ascontiguousarray(a, dtype=np.float64))
    return out


def _check_selection(selection, B, H, T, chunk, K1):
    """Validate a forced selection and return it as a C-contiguous int32 array [B, H, T, K1]."""
    sel = np.asarray(selection)
    if sel.shape != (B, H, T, K1):
        raise ValueError(f"selection: expected shape {(B, H, T, K1)} = [B, H, T, top_k-1], got {sel.shape}")
    if sel.dtype.kind not in "iu":
        raise TypeError(f"selection: expected an integer array (int32), got dtype {sel.dtype}")
    if K1 == 0:
        return np.zeros((B, H, T, 0), dtype=np.int32)
    s64 = sel.astype(np.int64)
    if np.any(s64 < -1):
        raise ValueError("selection: entries must be block indices >= 0 or the padding -1")
    bt = (np.arange(T, dtype=np.int64) // chunk)[None, None, :, None]
    valid = s64 >= 0
    if np.any(valid & (s64 >= bt)):
        bad = np.argwhere(valid & (s64 >= bt))[0]
        raise ValueError(f"selection: query t={bad[2]} (b={bad[0]}, h={bad[1]}) selects block "
                         f"{s64[tuple(bad)]}, which is not wholly in its past (block(t)={bad[2] // chunk})")
    if np.any(valid[..., 1:] & ~valid[..., :-1]):
        raise ValueError("selection: the padding -1 must come after every selected block")
    if np.any(valid[..., 1:] & (s64[..., 1:] <= s64[..., :-1])):
        raise ValueError("selection: the selected blocks of a query must be strictly ascending")
    return np.ascontiguousarray(s64, dtype=np.int32)


# ----------------------------------------------------------------------------------------------
# gate and selection
# ----------------------------------------------------------------------------------------------

cdef void _block_means(const double[:, :, :, ::1] k, double[:, :, :, ::1] km, int chunk) noexcept nogil:
    """km[b,h,j,:] = mean of k[b, u, h, :] over the positions u of block j."""
    cdef Py_ssize_t B = k.shape[0], T = k.shape[1], H = k.shape[2], N = k.shape[3]
    cdef Py_ssize_t nblk = km.shape[2]
    cdef Py_ssize_t b, h, j, u, n, u0, u1
    cdef double inv
    for b in range(B):
        for h in range(H):
            for j in range(nblk):
                u0 = j * chunk
                u1 = min(u0 + chunk, T)
                for n in range(N):
                    km[b, h, j, n] = 0.0
                for u in range(u0, u1):
                    for n in range(N):
                        km[b, h, j, n] += k[b, u, h, n]
                inv = 1.0 / <double>(u1 - u0)
                for n in range(N):
                    km[b, h, j, n] *= inv


cdef void _select(const double[:, :, :, ::1] q, const double[:, :, :, ::1] km, int chunk, int K1,
                  Py_ssize_t t0, int[:, :, :, ::1] sel, double[:, :, ::1] gap, double[::1] topg,
                  int[::1] topj) noexcept nogil:
    """Top-(K1) past blocks by gate for every query (ties: lower j); gap = K1-th minus (K1+1)-th gate.
    Query tq sits at position t = t0 + tq.

    topg/topj: scratch of length K1 + 1 holding the running best list, sorted by descending gate; a
    candidate only moves ahead of an entry with a strictly smaller gate, and candidates arrive in
    ascending j, so equal gates keep the lower j first."""
    cdef Py_ssize_t B = q.shape[0], T = q.shape[1], H = q.shape[2], N = q.shape[3]
    cdef Py_ssize_t b, h, t, j, n, bt, nf, pos, cap = K1 + 1, s, i
    cdef double g
    cdef int tmp
    for b in range(B):
        for h in range(H):
            for t in range(T):
                bt = (t0 + t) // chunk
                nf = 0
                for j in range(bt):
                    g = 0.0
                    for n in range(N):
                        g += q[b, t, h, n] * km[b, h, j, n]
                    if nf < cap:
                        pos = nf
                        nf += 1
                    elif g > topg[cap - 1]:
                        pos = cap - 1
                    else:
                        continue
                    while pos > 0 and g > topg[pos - 1]:
                        topg[pos] = topg[pos - 1]
                        topj[pos] = topj[pos - 1]
                        pos -= 1
                    topg[pos] = g
                    topj[pos] = <int>j
                # gap between the last selected and the first unselected gate
                if K1 >= 1 and nf > K1:
                    gap[b, h, t] = topg[K1 - 1] - topg[K1]
                else:
                    gap[b, h, t] = INFINITY
                # the selected blocks (first min(K1, nf) of the list), ascending, -1 padded
                s = min(K1, nf)
                for i in range(1, s):   # insertion sort by block index
                    tmp = topj[i]
                    pos = i
                    while pos > 0 and topj[pos - 1] > tmp:
                        topj[pos] = topj[pos - 1]
                        pos -= 1
                    topj[pos] = tmp
                for i in range(K1):
                    sel[b, h, t, i] = topj[i] if i < s else -1


def _means(k, int chunk):
    B, T, H, N = k.shape
    km = np.zeros((B, H, (T + chunk - 1) // chunk, N))
    _block_means(k, km, chunk)
    return km


def moba_block_means(k: np.ndarray, chunk: int) -> np.ndarray:
    """float64 [B, H, nblk, N]: the mean of k over each block of `chunk` positions (the last block may be
    partial; its mean is over the positions it has)."""
    (k,) = _check_qkv(k)
    chunk, _ = _check_chunk_topk(chunk, 1)
    return _means(k, chunk)


def moba_gates(q: np.ndarray, k: np.ndarray, chunk: int) -> np.ndarray:
    """float64 [B, H, T, nblk]: g[b,h,t,j] = q_t . mean(k over block j) for j < block(t), -inf elsewhere
    (plain numpy; for tests and inspection)."""
    q, k = _check_qkv(q, k)
    chunk, _ = _check_chunk_topk(chunk, 1)
    km = _means(k, chunk)
    g = np.einsum("bthn,bhjn->bhtj", q, km)
    bt = np.arange(q.shape[1]) // chunk
    past = np.arange(km.shape[2])[None, :] < bt[:, None]
    return np.where(past[None, None], g, -np.inf)


def _select_and_gap(q, km, int chunk, int top_k, Py_ssize_t t0=0):
    """(sel, gap) of the queries q at positions t0 .. t0+T-1 from the block means km."""
    B, T, H, N = q.shape
    cdef int K1 = top_k - 1
    sel = np.full((B, H, T, K1), -1, dtype=np.int32)
    gap = np.full((B, H, T), np.inf)
    if K1 == 0 or T == 0:
        return sel, gap
    cdef const double[:, :, :, ::1] q_v = q
    cdef const double[:, :, :, ::1] km_v = km
    cdef int[:, :, :, ::1] sel_v = sel
    cdef double[:, :, ::1] gap_v = gap
    cdef double[::1] topg = np.zeros(K1 + 1)
    cdef int[::1] topj = np.zeros(K1 + 1, dtype=np.int32)
    with nogil:
        _select(q_v, km_v, chunk, K1, t0, sel_v, gap_v, topg, topj)
    return sel, gap


def moba_select(q: np.ndarray, k: np.ndarray, chunk: int, top_k: int) -> np.ndarray:
    """The MoBA block selection, int32 [B, H, T, top_k-1] (ascending, -1 padded); gate in float64."""
    q, k = _check_qkv(q, k)
    chunk, top_k = _check_chunk_topk(chunk, top_k)
    return _select_and_gap(q, _means(k, chunk), chunk, top_k)[0]


def moba_gate_gaps(q: np.ndarray, k: np.ndarray, chunk: int, top_k: int) -> np.ndarray:
    """float64 [B, H, T]: per query, the gate of the last selected block minus the largest gate among the
    past blocks left out (>= 0; float64 gates). +inf where nothing is ambiguous (top_k == 1, or at most
    top_k-1 past blocks, so all are selected). A GPU selection computed with fp32 gates may
    legitimately differ from the oracle's where this gap is tiny (e.g. < 1e-4)."""
    q, k = _check_qkv(q, k)
    chunk, top_k = _check_chunk_topk(chunk, top_k)
    return _select_and_gap(q, _means(k, chunk), chunk, top_k)[1]


# ----------------------------------------------------------------------------------------------
# attention over the visible keys
# ----------------------------------------------------------------------------------------------

cdef Py_ssize_t _visible(const int[:, :, :, ::1] sel, Py_ssize_t b, Py_ssize_t h, Py_ssize_t tq,
                         Py_ssize_t t, int chunk, int K1, int[::1] pos) noexcept nogil:
    """Fill pos with the key positions visible to query tq at position t (ascending); return their
    count."""
    cdef Py_ssize_t cnt = 0, s, u, j, bt = t // chunk
    for s in range(K1):
        j = sel[b, h, tq, s]
        if j < 0:
            break
        for u in range(j * chunk, (j + 1) * chunk):
            pos[cnt] = <int>u
            cnt += 1
    for u in range(bt * chunk, t + 1):
        pos[cnt] = <int>u
        cnt += 1
    return cnt


cdef double _softmax(const double[:, :, :, ::1] q, const double[:, :, :, ::1] k, Py_ssize_t b,
                     Py_ssize_t h, Py_ssize_t t, const int[::1] pos, Py_ssize_t nv, double scale,
                     double[::1] p) noexcept nogil:
    """p[i] = softmax over the nv visible keys pos[i] of s * q_t . k_u; returns their log-sum-exp."""
    cdef Py_ssize_t N = q.shape[3], i, n, u
    cdef double acc, mx = -INFINITY, den = 0
    for i in range(nv):
        u = pos[i]
        acc = 0
        for n in range(N):
            acc = acc + q[b, t, h, n] * k[b, u, h, n]
        p[i] = scale * acc
        if p[i] > mx:
            mx = p[i]
    for i in range(nv):
        p[i] = exp(p[i] - mx)
        den = den + p[i]
    for i in range(nv):
        p[i] = p[i] / den
    return mx + log(den)


cdef void _forward(const double[:, :, :, ::1] q, const double[:, :, :, ::1] k,
                   const double[:, :, :, ::1] v, const int[:, :, :, ::1] sel, double[:, :, :, ::1] o,
                   double[:, :, ::1] lse, int chunk, int K1, double scale, Py_ssize_t t0, double[::1] p,
                   int[::1] pos) noexcept nogil:
    """o (and lse [B, H, T]) of every query; query t sits at position t0 + t of k and v."""
    cdef Py_ssize_t B = q.shape[0], T = q.shape[1], H = q.shape[2], N = q.shape[3]
    cdef Py_ssize_t b, h, t, n, i, nv, u
    for b in range(B):
        for h in range(H):
            for t in range(T):
                nv = _visible(sel, b, h, t, t0 + t, chunk, K1, pos)
                lse[b, h, t] = _softmax(q, k, b, h, t, pos, nv, scale, p)
                for n in range(N):
                    o[b, t, h, n] = 0
                for i in range(nv):
                    u = pos[i]
                    for n in range(N):
                        o[b, t, h, n] = o[b, t, h, n] + p[i] * v[b, u, h, n]


cdef void _backward(const double[:, :, :, ::1] q, const double[:, :, :, ::1] k,
                    const double[:, :, :, ::1] v, const double[:, :, :, ::1] do,
                    const int[:, :, :, ::1] sel, double[:, :, :, ::1] dq, double[:, :, :, ::1] dk,
                    double[:, :, :, ::1] dv, int chunk, int K1, double scale,
                    double[::1] p, double[::1] dp, int[::1] pos) noexcept nogil:
    """Exact gradient with the selection fixed. Per query t with probabilities p_u over its visible
    keys: dp_u = do_t . v_u, D = sum_u p_u dp_u, ds_u = p_u (dp_u - D);
    dq_t = s sum_u ds_u k_u ; dk_u += s ds_u q_t ; dv_u += p_u do_t."""
    cdef Py_ssize_t B = q.shape[0], T = q.shape[1], H = q.shape[2], N = q.shape[3]
    cdef Py_ssize_t b, h, t, n, i, nv, u
    cdef double acc, D, ds
    for b in range(B):
        for h in range(H):
            for t in range(T):
                nv = _visible(sel, b, h, t, t, chunk, K1, pos)
                _softmax(q, k, b, h, t, pos, nv, scale, p)
                D = 0
                for i in range(nv):
                    u = pos[i]
                    acc = 0
                    for n in range(N):
                        acc = acc + do[b, t, h, n] * v[b, u, h, n]
                    dp[i] = acc
                    D = D + p[i] * acc
                for i in range(nv):
                    u = pos[i]
                    ds = p[i] * (dp[i] - D)
                    for n in range(N):
                        dq[b, t, h, n] = dq[b, t, h, n] + scale * ds * k[b, u, h, n]
                        dk[b, u, h, n] = dk[b, u, h, n] + scale * ds * q[b, t, h, n]
                        dv[b, u, h, n] = dv[b, u, h, n] + p[i] * do[b, t, h, n]


def _resolve_selection(q, k, chunk, top_k, selection):
    B, T, H, N = q.shape
    if selection is None:
        return _select_and_gap(q, _means(k, chunk), chunk, top_k)[0]
    return _check_selection(selection, B, H, T, chunk, top_k - 1)


def _attend(q, k, v, sel, int chunk, int top_k, Py_ssize_t t0=0):
    """(o [B,T,H,N], lse [B,H,T]) for a checked selection; query t at position t0 + t of k, v."""
    B, T, H, N = q.shape
    o = np.zeros_like(q)
    lse = np.zeros((B, H, T))
    if q.size == 0:
        return o, lse
    cdef double[::1] p = np.zeros(top_k * chunk)
    cdef int[::1] pos = np.zeros(top_k * chunk, dtype=np.int32)
    cdef const double[:, :, :, ::1] q_v = q, k_v = k, v_v = v
    cdef const int[:, :, :, ::1] sel_v = sel
    cdef double[:, :, :, ::1] o_v = o
    cdef double[:, :, ::1] lse_v = lse
    cdef double scale = 1.0 / sqrt(<double>N)
    with nogil:
        _forward(q_v, k_v, v_v, sel_v, o_v, lse_v, chunk, top_k - 1, scale, t0, p, pos)
    return o, lse


@float64_op
def moba_attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, chunk: int, top_k: int,
                           selection: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """MoBA attention forward.

    q, k, v: [B, T, H, N]. Returns (o, sel): o [B, T, H, N] in the inputs' dtype; sel int32
    [B, H, T, top_k-1] (the selection used: computed from the float64 gate, or `selection` after
    validation; a forced selection may hold fewer than min(top_k-1, block(t)) blocks)."""
    q, k, v = _check_qkv(q, k, v)
    chunk, top_k = _check_chunk_topk(chunk, top_k)
    sel = _resolve_selection(q, k, chunk, top_k, selection)
    return _attend(q, k, v, sel, chunk, top_k)[0], sel


def moba_attention_cached(q: np.ndarray, k: np.ndarray, v: np.ndarray, kmean: np.ndarray, chunk: int,
                          top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """MoBA attention of the newest positions over a key/value cache (a stateful forward).

    q [B, Tq, H, N]: the queries of positions Tk-Tq .. Tk-1; k, v [B, Tk, H, N]: every key and value
    of positions 0 .. Tk-1 (those of the queries' own positions included); kmean [B, H, nb, N] (any
    float dtype, used as given): the means of the complete blocks, nb >= (Tk-1) // chunk (what
    ``moba_block_means`` gives for them; more blocks are ignored; none needed when top_k == 1). The same selection and attention as
    ``moba_attention_forward`` on the whole sequence: (o [B, Tq, H, N], sel int32 [B, H, Tq, top_k-1]),
    o in the dtype of q, k, v (float32 only when all three are)."""
    dtype = result_dtype(q, k, v)
    (q,) = _check_qkv(q)
    k, v = _check_qkv(k, v)
    chunk, top_k = _check_chunk_topk(chunk, top_k)
    B, Tq, H, N = q.shape
    Tk = k.shape[1]
    if k.shape != (B, Tk, H, N) or Tk < Tq:
        raise ValueError(f"k, v: expected [B, Tk >= {Tq}, H, N] = [{B}, >= {Tq}, {H}, {N}], got {k.shape}")
    km = np.ascontiguousarray(kmean, dtype=np.float64)
    need = (Tk - 1) // chunk if Tk and top_k > 1 else 0      # top_k == 1 gates nothing
    if km.ndim != 4 or km.shape[:2] != (B, H) or km.shape[3] != N or km.shape[2] < need:
        raise ValueError(f"kmean: expected [B, H, >= {need}, N] = [{B}, {H}, >= {need}, {N}], got {km.shape}")
    sel = _select_and_gap(q, km, chunk, top_k, Tk - Tq)[0]
    o = _attend(q, k, v, sel, chunk, top_k, Tk - Tq)[0]
    return o.astype(dtype, copy=False), sel


def moba_logsumexp(q: np.ndarray, k: np.ndarray, chunk: int, selection: np.ndarray) -> np.ndarray:
    """float64 [B, H, T]: natural-log log-sum-exp of the scaled scores s * q_t . k_u over the keys
    visible to each query under ``selection`` (int32 [B, H, T, top_k-1]) — what the GPU forward
    saves for its backward."""
    q, k = _check_qkv(q, k)
    sel = np.asarray(selection)
    if sel.ndim != 4:
        raise ValueError(f"selection: expected shape [B, H, T, top_k-1], got {sel.shape}")
    chunk, top_k = _check_chunk_topk(chunk, sel.shape[3] + 1)
    sel = _resolve_selection(q, k, chunk, top_k, sel)
    return _attend(q, k, k, sel, chunk, top_k)[1]


@float64_op
def moba_attention_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray,
                            chunk: int, top_k: int,
                            sel: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact gradient of moba_attention_forward with the selection `sel` held fixed (the selection is
    not differentiable). q, k, v, do: [B, T, H, N]; sel: int32 [B, H, T, top_k-1] (None: recompute it
    from the gate). Returns (dq, dk, dv), [B, T, H, N] each, in the inputs' dtype."""
    q, k, v, do = _check_qkv(q, k, v, do)
    chunk, top_k = _check_chunk_topk(chunk, top_k)
    B, T, H, N = q.shape
    sel = _resolve_selection(q, k, chunk, top_k, sel)
    dq = np.zeros_like(q)
    dk = np.zeros_like(q)
    dv = np.zeros_like(q)
    if q.size == 0:
        return dq, dk, dv
    cdef double[::1] p = np.zeros(top_k * chunk)
    cdef double[::1] dp = np.zeros(top_k * chunk)
    cdef int[::1] pos = np.zeros(top_k * chunk, dtype=np.int32)
    cdef const double[:, :, :, ::1] q_v = q, k_v = k, v_v = v, do_v = do
    cdef const int[:, :, :, ::1] sel_v = sel
    cdef double[:, :, :, ::1] dq_v = dq, dk_v = dk, dv_v = dv
    cdef int c = chunk, K1 = top_k - 1
    cdef double scale = 1.0 / sqrt(<double>N)
    with nogil:
        _backward(q_v, k_v, v_v, do_v, sel_v, dq_v, dk_v, dv_v, c, K1, scale, p, dp, pos)
    return dq, dk, dv
