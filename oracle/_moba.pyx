# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""CPU reference of MoBA sparse attention (SPEC §2.3 "Attn (MoBA)"), forward and backward.

Arrays are [B, T, H, N] (batch, time, head, head channel), float64 or float32. The arithmetic runs in
the arrays' dtype (float32 inputs: float32 scores, softmax and sums), except the block gate, which is
always computed in float64.

Per sequence b, head h, query t (scale s = 1/sqrt(N), blocks of `chunk` tokens from the sequence start,
block(t) = t // chunk):
  * gate g_j = q_t . mean(k over block j) for every block j < block(t) (wholly in the past);
  * the top_k - 1 past blocks with the largest gate are selected (ties: the lower j wins); all past
    blocks if fewer exist; none if top_k == 1;
  * visible keys: every position of the selected blocks, plus block(t)*chunk .. t;
  * o_t = softmax over visible u of (s * q_t . k_u), applied to v_u.

Selection format (shared with the GPU kernels): int32 [B, H, T, top_k - 1], the selected block indices
of query t in ascending order, padded at the end with -1.
"""
import numpy as np

from cython cimport floating
from libc.math cimport exp, sqrt, INFINITY

__all__ = ["moba_attention_forward", "moba_attention_backward", "moba_select", "moba_gate_gaps",
           "moba_block_means", "moba_gates"]


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------

def _common_dtype(*arrays):
    """float32 when every array is float32, else float64."""
    for a in arrays:
        if a.dtype != np.float32:
            return np.float64
    return np.float32


def _as_float_array(x, name, dtype):
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected a real numeric array, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=dtype)


def _check_chunk_topk(chunk, top_k):
    if int(chunk) != chunk or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    if int(top_k) != top_k or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    return int(chunk), int(top_k)


def _check_qkv(q, k, v=None):
    arrays = [np.asarray(q), np.asarray(k)] + ([np.asarray(v)] if v is not None else [])
    names = ["q", "k", "v"]
    for a, name in zip(arrays, names):
        if a.ndim != 4:
            raise ValueError(f"{name}: expected shape [B, T, H, N], got {a.shape}")
    for a, name in zip(arrays[1:], names[1:]):
        if a.shape != arrays[0].shape:
            raise ValueError(f"{name}: shape {a.shape} differs from q's {arrays[0].shape}")
    dtype = _common_dtype(*arrays)
    return [_as_float_array(a, name, dtype) for a, name in zip(arrays, names)], dtype


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
# gate and selection (float64)
# ----------------------------------------------------------------------------------------------

cdef void _block_means(const floating[:, :, :, ::1] k, double[:, :, :, ::1] km, int chunk) noexcept nogil:
    """km[b,h,j,:] = mean of k[b, u, h, :] over the positions u of block j (float64)."""
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
                        km[b, h, j, n] += <double>k[b, u, h, n]
                inv = 1.0 / <double>(u1 - u0)
                for n in range(N):
                    km[b, h, j, n] *= inv


cdef void _select(const floating[:, :, :, ::1] q, const double[:, :, :, ::1] km, int chunk, int K1,
                  int[:, :, :, ::1] sel, double[:, :, ::1] gap, double[::1] topg, int[::1] topj) noexcept nogil:
    """Top-(K1) past blocks by gate for every query (ties: lower j); gap = K1-th minus (K1+1)-th gate.

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
                bt = t // chunk
                nf = 0
                for j in range(bt):
                    g = 0.0
                    for n in range(N):
                        g += <double>q[b, t, h, n] * km[b, h, j, n]
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


def moba_block_means(k, chunk):
    """float64 [B, H, nblk, N]: the mean of k over each block of `chunk` positions (the last block may be
    partial; its mean is over the positions it has)."""
    (k_, _unused), _ = _check_qkv(k, k)
    chunk, _ = _check_chunk_topk(chunk, 1)
    B, T, H, N = k_.shape
    nblk = (T + chunk - 1) // chunk
    km = np.zeros((B, H, nblk, N), dtype=np.float64)
    if k_.dtype == np.float32:
        _bm_f32(k_, km, chunk)
    else:
        _bm_f64(k_, km, chunk)
    return km


cdef void _bm_f32(const float[:, :, :, ::1] k, double[:, :, :, ::1] km, int chunk) noexcept nogil:
    _block_means(k, km, chunk)


cdef void _bm_f64(const double[:, :, :, ::1] k, double[:, :, :, ::1] km, int chunk) noexcept nogil:
    _block_means(k, km, chunk)


def moba_gates(q, k, chunk):
    """float64 [B, H, T, nblk]: g[b,h,t,j] = q_t . mean(k over block j) for j < block(t), -inf elsewhere
    (plain numpy; for tests and inspection)."""
    (q_, k_), _ = _check_qkv(q, k)
    chunk, _ = _check_chunk_topk(chunk, 1)
    B, T, H, N = q_.shape
    km = moba_block_means(k_, chunk)
    g = np.einsum("bthn,bhjn->bhtj", q_.astype(np.float64), km)
    bt = np.arange(T) // chunk
    past = np.arange(km.shape[2])[None, :] < bt[:, None]
    return np.where(past[None, None], g, -np.inf)


def _select_and_gap(q_, k_, chunk, top_k):
    B, T, H, N = q_.shape
    K1 = top_k - 1
    sel = np.full((B, H, T, K1), -1, dtype=np.int32)
    gap = np.full((B, H, T), np.inf, dtype=np.float64)
    if K1 == 0 or T == 0:
        return sel, gap
    km = moba_block_means(k_, chunk)
    topg = np.zeros(K1 + 1, dtype=np.float64)
    topj = np.zeros(K1 + 1, dtype=np.int32)
    cdef double[:, :, :, ::1] km_v = km
    cdef int[:, :, :, ::1] sel_v = sel
    cdef double[:, :, ::1] gap_v = gap
    cdef double[::1] topg_v = topg
    cdef int[::1] topj_v = topj
    cdef const float[:, :, :, ::1] q32
    cdef const double[:, :, :, ::1] q64
    cdef int c = chunk, k1 = K1
    if q_.dtype == np.float32:
        q32 = q_
        with nogil:
            _select(q32, km_v, c, k1, sel_v, gap_v, topg_v, topj_v)
    else:
        q64 = q_
        with nogil:
            _select(q64, km_v, c, k1, sel_v, gap_v, topg_v, topj_v)
    return sel, gap


def moba_select(q, k, chunk, top_k):
    """The MoBA block selection, int32 [B, H, T, top_k-1] (ascending, -1 padded); gate in float64."""
    (q_, k_), _ = _check_qkv(q, k)
    chunk, top_k = _check_chunk_topk(chunk, top_k)
    return _select_and_gap(q_, k_, chunk, top_k)[0]


def moba_gate_gaps(q, k, chunk, top_k):
    """float64 [B, H, T]: per query, the gate of the last selected block minus the largest gate among the
    past blocks left out (>= 0; float64 gates). +inf where nothing is ambiguous (top_k == 1, or at most
    top_k-1 past blocks, so all are selected). A GPU selection computed with fp32 gates may
    legitimately differ from the oracle's where this gap is tiny (e.g. < 1e-4)."""
    (q_, k_), _ = _check_qkv(q, k)
    chunk, top_k = _check_chunk_topk(chunk, top_k)
    return _select_and_gap(q_, k_, chunk, top_k)[1]


# ----------------------------------------------------------------------------------------------
# attention over the visible keys
# ----------------------------------------------------------------------------------------------

cdef Py_ssize_t _visible(const int[:, :, :, ::1] sel, Py_ssize_t b, Py_ssize_t h, Py_ssize_t t,
                         int chunk, int K1, int[::1] pos) noexcept nogil:
    """Fill pos with the key positions visible to query t (ascending); return their count."""
    cdef Py_ssize_t cnt = 0, s, u, j, bt = t // chunk
    for s in range(K1):
        j = sel[b, h, t, s]
        if j < 0:
            break
        for u in range(j * chunk, (j + 1) * chunk):
            pos[cnt] = <int>u
            cnt += 1
    for u in range(bt * chunk, t + 1):
        pos[cnt] = <int>u
        cnt += 1
    return cnt


cdef void _forward(const floating[:, :, :, ::1] q, const floating[:, :, :, ::1] k,
                   const floating[:, :, :, ::1] v, const int[:, :, :, ::1] sel, floating[:, :, :, ::1] o,
                   int chunk, int K1, floating scale, floating[::1] p, int[::1] pos) noexcept nogil:
    cdef Py_ssize_t B = q.shape[0], T = q.shape[1], H = q.shape[2], N = q.shape[3]
    cdef Py_ssize_t b, h, t, n, i, nv, u
    cdef floating acc, mx, den, w
    for b in range(B):
        for h in range(H):
            for t in range(T):
                nv = _visible(sel, b, h, t, chunk, K1, pos)
                mx = -INFINITY
                for i in range(nv):
                    u = pos[i]
                    acc = 0
                    for n in range(N):
                        acc = acc + q[b, t, h, n] * k[b, u, h, n]
                    p[i] = scale * acc
                    if p[i] > mx:
                        mx = p[i]
                den = 0
                for i in range(nv):
                    p[i] = <floating>exp(p[i] - mx)
                    den = den + p[i]
                for n in range(N):
                    o[b, t, h, n] = 0
                for i in range(nv):
                    u = pos[i]
                    w = p[i] / den
                    for n in range(N):
                        o[b, t, h, n] = o[b, t, h, n] + w * v[b, u, h, n]


cdef void _backward(const floating[:, :, :, ::1] q, const floating[:, :, :, ::1] k,
                    const floating[:, :, :, ::1] v, const floating[:, :, :, ::1] do,
                    const int[:, :, :, ::1] sel, floating[:, :, :, ::1] dq, floating[:, :, :, ::1] dk,
                    floating[:, :, :, ::1] dv, int chunk, int K1, floating scale,
                    floating[::1] p, floating[::1] dp, int[::1] pos) noexcept nogil:
    """Exact gradient with the selection fixed. Per query t with probabilities p_u over its visible
    keys: dp_u = do_t . v_u, D = sum_u p_u dp_u, ds_u = p_u (dp_u - D);
    dq_t = s sum_u ds_u k_u ; dk_u += s ds_u q_t ; dv_u += p_u do_t."""
    cdef Py_ssize_t B = q.shape[0], T = q.shape[1], H = q.shape[2], N = q.shape[3]
    cdef Py_ssize_t b, h, t, n, i, nv, u
    cdef floating acc, mx, den, D, ds
    for b in range(B):
        for h in range(H):
            for t in range(T):
                nv = _visible(sel, b, h, t, chunk, K1, pos)
                mx = -INFINITY
                for i in range(nv):
                    u = pos[i]
                    acc = 0
                    for n in range(N):
                        acc = acc + q[b, t, h, n] * k[b, u, h, n]
                    p[i] = scale * acc
                    if p[i] > mx:
                        mx = p[i]
                den = 0
                for i in range(nv):
                    p[i] = <floating>exp(p[i] - mx)
                    den = den + p[i]
                D = 0
                for i in range(nv):
                    u = pos[i]
                    p[i] = p[i] / den
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


def _resolve_selection(q_, k_, chunk, top_k, selection):
    B, T, H, N = q_.shape
    if selection is None:
        return _select_and_gap(q_, k_, chunk, top_k)[0]
    return _check_selection(selection, B, H, T, chunk, top_k - 1)


def moba_attention_forward(q, k, v, chunk, top_k, selection=None):
    """MoBA attention forward.

    q, k, v: [B, T, H, N] float64 or float32 (float32 only when all three are float32).
    Returns (o, sel): o [B, T, H, N] in that dtype; sel int32 [B, H, T, top_k-1] (the selection used:
    computed from the float64 gate, or `selection` after validation; a forced selection may hold fewer
    than min(top_k-1, block(t)) blocks)."""
    (q_, k_, v_), dtype = _check_qkv(q, k, v)
    chunk, top_k = _check_chunk_topk(chunk, top_k)
    B, T, H, N = q_.shape
    K1 = top_k - 1
    sel = _resolve_selection(q_, k_, chunk, top_k, selection)
    o = np.zeros_like(q_)
    if q_.size == 0:
        return o, sel
    p = np.zeros(top_k * chunk, dtype=dtype)
    pos = np.zeros(top_k * chunk, dtype=np.int32)
    cdef const int[:, :, :, ::1] sel_v = sel
    cdef int[::1] pos_v = pos
    cdef int c = chunk, k1 = K1
    cdef double sc = 1.0 / sqrt(<double>N)
    cdef const float[:, :, :, ::1] q32, k32, v32
    cdef float[:, :, :, ::1] o32
    cdef float[::1] p32
    cdef const double[:, :, :, ::1] q64, k64, v64
    cdef double[:, :, :, ::1] o64
    cdef double[::1] p64
    if dtype == np.float32:
        q32, k32, v32, o32, p32 = q_, k_, v_, o, p
        with nogil:
            _forward(q32, k32, v32, sel_v, o32, c, k1, <float>sc, p32, pos_v)
    else:
        q64, k64, v64, o64, p64 = q_, k_, v_, o, p
        with nogil:
            _forward(q64, k64, v64, sel_v, o64, c, k1, sc, p64, pos_v)
    return o, sel


def moba_attention_backward(q, k, v, do, chunk, top_k, sel):
    """Exact gradient of moba_attention_forward with the selection `sel` held fixed (the selection is
    not differentiable). q, k, v, do: [B, T, H, N]; sel: int32 [B, H, T, top_k-1] (None: recompute it
    from the gate). Returns (dq, dk, dv), [B, T, H, N] each, in the inputs' dtype."""
    (q_, k_, v_), dtype = _check_qkv(q, k, v)
    do_a = np.asarray(do)
    if do_a.shape != q_.shape:
        raise ValueError(f"do: shape {do_a.shape} differs from q's {q_.shape}")
    if dtype == np.float32 and do_a.dtype != np.float32:
        dtype = np.float64
        q_, k_, v_ = (np.ascontiguousarray(a, dtype=np.float64) for a in (q_, k_, v_))
    do_ = _as_float_array(do_a, "do", dtype)
    chunk, top_k = _check_chunk_topk(chunk, top_k)
    B, T, H, N = q_.shape
    K1 = top_k - 1
    sel_ = _resolve_selection(q_, k_, chunk, top_k, sel)
    dq = np.zeros_like(q_)
    dk = np.zeros_like(q_)
    dv = np.zeros_like(q_)
    if q_.size == 0:
        return dq, dk, dv
    p = np.zeros(top_k * chunk, dtype=dtype)
    dp = np.zeros(top_k * chunk, dtype=dtype)
    pos = np.zeros(top_k * chunk, dtype=np.int32)
    cdef const int[:, :, :, ::1] sel_v = sel_
    cdef int[::1] pos_v = pos
    cdef int c = chunk, k1 = K1
    cdef double sc = 1.0 / sqrt(<double>N)
    cdef const float[:, :, :, ::1] q32, k32, v32, do32
    cdef float[:, :, :, ::1] dq32, dk32, dv32
    cdef float[::1] p32, dp32
    cdef const double[:, :, :, ::1] q64, k64, v64, do64
    cdef double[:, :, :, ::1] dq64, dk64, dv64
    cdef double[::1] p64, dp64
    if dtype == np.float32:
        q32, k32, v32, do32 = q_, k_, v_, do_
        dq32, dk32, dv32, p32, dp32 = dq, dk, dv, p, dp
        with nogil:
            _backward(q32, k32, v32, do32, sel_v, dq32, dk32, dv32, c, k1,
                      <float>sc, p32, dp32, pos_v)
    else:
        q64, k64, v64, do64 = q_, k_, v_, do_
        dq64, dk64, dv64, p64, dp64 = dq, dk, dv, p, dp
        with nogil:
            _backward(q64, k64, v64, do64, sel_v, dq64, dk64, dv64, c, k1,
                      sc, p64, dp64, pos_v)
    return dq, dk, dv
