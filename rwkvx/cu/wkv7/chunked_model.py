"""A numpy model of the chunked WKV7 kernels (rwkvx/cu/wkv7/chunked.cu), step for step: the same chunk
length, the same intermediate matrices, the same split into an intra-chunk part, a sequential pass over
chunk states and (backward) a per-chunk gradient part. ``rnd`` is applied where the kernels round an
operand of a tensor-core product with the state or its gradient (tf32), so that the model also predicts the
kernels' rounding error (v and dy enter the products as hi + lo tf32 pairs: :func:`_split`); ``op`` is applied
to the operands of the chunk operators' products (intra's Gram matrices and products with M, the gradient
part's [L, L] products): 3xTF32 (about fp32) with fp32 inputs, one tf32 pass with bf16 inputs
(ops.SPLIT_OPERATORS), identity (exact in ``dt``) by default. ``rnd`` = :func:`split3` is the chunked_exact
kernels (WKV_EXACT), which also take the Gram matrices' diagonals r.k, r.b, dy.v, dy.u as compensated
dots (:func:`row_dots`).
Tested against the float64 oracle in tests/test_wkv7_chunked_model.py; the GPU kernels are tested
against the oracle directly (tests/gpu/test_wkv7.py).

Per chunk of L tokens with entering state S0 (row i = value, column j = key), cw_t = prod_{s<=t} w_s,
cx_t = cw_t / w_t, PL = cw_{L-1}:  rt = r cw, at = a cx, kh = k / cw, bh = b / cw;
Aab = strict_lower(at bh^T), Aak = strict_lower(at kh^T), Arb = lower(rt bh^T), Ark = lower(rt kh^T),
M = (I - Aab)^-1.  Intra operators: Qa = M at, Ca = M Aak, Qr = rt + Arb Qa, Cr = Ark + Arb Ca,
Kt = kh PL, Bt = bh PL (forward); Qb = M^T Bt, Db = (Arb M)^T (backward).

Forward state pass:  U = Qa S0^T + Ca V  (rows: sa_t) ;  Y = Qr S0^T + Cr V ;
                     S_L^T = diag(PL) S0^T + Kt^T V + Bt^T U.
Backward state pass (chunks in reverse, dS = dL/dS_L from later chunks, 0 after the last):
                     dX = Qb dS^T + Db dY ;  dV = Kt dS^T + Ark^T dY + Aak^T dX ;
                     dS0^T = diag(PL) dS^T + rt^T dY + at^T dX.
Backward gradient part (per chunk, from S0, dS, U, V, dY, dX): see :func:`chunk_grads`.
An initial state s0 is chunk 0's S0 (the kernels' carried state starts from it); its gradient is the
dS0 the backward state pass leaves after chunk 0.
Segmented scan (``segments`` > 1): both state passes cut the chunks into segments; each segment's exit is
linear in its entry, S_exit = S_entry Tr + Z (rows independent), so the segments are walked in parallel
from 0 (Z) and from the identity without inputs (Tr), the true entering states follow from a short pass
over the segments, and the segments are walked again from them (:func:`_scan`).
"""
from __future__ import annotations

import numpy as np

from rwkvx.runtime.dtypes import round_tf32

from .ops import CHUNKED_L as L, segment_layout


def identity(x):
    return x


def _split(x, rnd):
    """x as the kernels feed v and dy to the tensor cores: hi + lo parts, each rounded by ``rnd``."""
    hi = rnd(x)
    return hi.astype(np.float64) + rnd(x - hi)


def split3(x):
    """x as a 3xTF32 operand: tf32 hi + lo, summed in float32 (the lo x lo product that 3xTF32 leaves out is
    at most 2^-22 of a product, the size of the rounding of lo, which this keeps)."""
    return _split(np.asarray(x, np.float32), round_tf32).astype(np.float32)


def row_dots(x: np.ndarray, y: np.ndarray, dt) -> np.ndarray:
    """x_t . y_t for each row t, as the chunked_exact kernels take the Gram matrices' diagonals (compensated
    fp32 dots, chunked.cu's quad_dot2): modelled as the float64 dot rounded once to ``dt``, which the kernel's
    doubled-precision sum matches up to a condition number of ~1e7."""
    return (np.asarray(x, np.float64) * np.asarray(y, np.float64)).sum(axis=1).astype(dt)


def _pad(x: np.ndarray, Tp: int, fill: float) -> np.ndarray:
    T = x.shape[0]
    if T == Tp:
        return x
    return np.concatenate([x, np.full((Tp - T,) + x.shape[1:], fill, x.dtype)])


def intra(r, w, k, a, b, dt=np.float64, op=identity, exact=False):
    """The intra-chunk operators of one chunk (inputs [L, N]): a dict of arrays; ``op`` rounds the operands
    of the Gram matrices and of the products with M; ``exact`` (chunked_exact): the diagonals of Arb and
    Ark are :func:`row_dots` of r with b and k."""
    r, w, k, a, b = (np.asarray(x, dt) for x in (r, w, k, a, b))
    cw = np.cumprod(w, axis=0)
    cx = cw / w
    rt, at, kh, bh = r * cw, a * cx, k / cw, b / cw
    PL = cw[-1]
    low, slow = np.tril(np.ones((L, L), dt)), np.tril(np.ones((L, L), dt), -1)
    def mm(x, y):                               # a chunk operator's product (tensor cores)
        return (op(x) @ op(y)).astype(dt)

    Aab, Aak = slow * mm(at, bh.T), slow * mm(at, kh.T)
    Arb, Ark = low * mm(rt, bh.T), low * mm(rt, kh.T)
    if exact:
        np.fill_diagonal(Arb, row_dots(r, b, dt))
        np.fill_diagonal(Ark, row_dots(r, k, dt))
    M = np.linalg.inv(np.eye(L, dtype=dt) - Aab).astype(dt)    # the kernel: forward substitution
    Qa, Ca = mm(M, at), mm(M, Aak)
    Kt, Bt = kh * PL, bh * PL
    return dict(cw=cw, cx=cx, rt=rt, at=at, kh=kh, bh=bh, PL=PL, Aab=Aab, Aak=Aak, Arb=Arb, Ark=Ark,
                Qa=Qa, Ca=Ca, Qr=rt + mm(Arb, Qa), Cr=Ark + mm(Arb, Ca), Kt=Kt, Bt=Bt,
                Qb=mm(M.T, bh) * PL, Db=mm(Arb, M).T)


def _padded(T, r, w, k, v, a, b, dt, op, exact, *extra):
    """The inputs padded to whole chunks (w = 1, the rest 0) and the records of every chunk."""
    nC = (T + L - 1) // L
    Tp = nC * L
    r, k, v, a, b, *extra = (_pad(np.asarray(x, dt), Tp, 0.0) for x in (r, k, v, a, b, *extra))
    w = _pad(np.asarray(w, dt), Tp, 1.0)
    o = [intra(r[c * L:c * L + L], w[c * L:c * L + L], k[c * L:c * L + L], a[c * L:c * L + L],
               b[c * L:c * L + L], dt, op, exact) for c in range(nC)]
    return nC, (r, w, k, v, a, b, *extra), o


def _segments(nC, segments):
    """The chunk ranges of the segments (ops.segment_layout)."""
    m, S = segment_layout(nC * L, segments)
    return [range(s * m, min(s * m + m, nC)) for s in range(S)]


def _carry(E, Tr, Z, dt):
    """A segment's exit state from its entering state E: E Tr + Z, accumulated in ``dt`` (fp32 FMA on CUDA
    cores in the kernel)."""
    return (E.astype(dt) @ Tr.astype(dt) + Z).astype(dt)


def _scan(walk, segs, start, N, dt, reverse=False):
    """The segmented scan as the kernels run it, walking the segments ``segs`` forwards or (``reverse``,
    the backward's pass) backwards; returns every segment's true entering state, for the last walk.
    seg [S, 2, N, N] is the kernels' scratch (NaN until written, as the GPU tests poison it): the summary
    walk writes each segment's exit from 0 into slot (s, 0) -- the first one walked from ``start``, its
    true exit -- and its transition, the exit from the identity without inputs (each state row maps on
    its own, linearly), into slot (s, 1), except for the first one walked; the last one walked needs
    neither. wkv7c_segment_carry then makes the exits true in place, in walking order."""
    S = len(segs)
    if S == 1:
        return [start]
    seg = np.full((S, 2, N, N), np.nan, dt)
    d, first, last = (-1, S - 1, 0) if reverse else (1, 0, S - 1)
    for s in range(S):
        if s != last:
            seg[s, 0] = walk(segs[s], start if s == first else np.zeros((N, N), dt), True)
        if s not in (first, last):
            seg[s, 1] = walk(segs[s], np.eye(N, dtype=dt), False)
    for s in range(first + d, last, d):
        seg[s, 0] = _carry(seg[s - d, 0], seg[s, 1], seg[s, 0], dt)
    return [start if s == first else seg[s - d, 0] for s in range(S)]


def forward(r, w, k, v, a, b, rnd=identity, dt=np.float64, s0=None, segments=1, op=identity):
    """One (sequence, head): inputs [T, N], from the initial state ``s0`` [N, N] (None: 0). Returns
    y [T, N], U (= sa) [T, N] and the chunk-entering states S0 [nC, N, N]. ``segments`` > 1: the
    segmented scan of the kernels (:func:`_scan`; the chunk walks of a segment as the unsegmented one)."""
    T, N = r.shape
    nC, (r, w, k, v, a, b), o = _padded(T, r, w, k, v, a, b, dt, op, rnd is split3)
    y, U = np.zeros((nC * L, N), dt), np.zeros((nC * L, N), dt)
    S0 = np.zeros((nC, N, N), dt)

    def walk(chunks, S, inputs, out=False):
        for c in chunks:
            t = slice(c * L, c * L + L)
            if out:
                S0[c] = S
            Vs = _split(v[t] if inputs else np.zeros((L, N), dt), rnd)
            Ut = rnd(o[c]["Qa"]) @ rnd(S).T + rnd(o[c]["Ca"]) @ Vs
            if out:
                y[t] = rnd(o[c]["Qr"]) @ rnd(S).T + rnd(o[c]["Cr"]) @ Vs
                U[t] = Ut
            S = (o[c]["PL"][:, None] * S.T + rnd(o[c]["Kt"]).T @ Vs + rnd(o[c]["Bt"]).T @ rnd(Ut)).T
        return S

    start = np.zeros((N, N), dt) if s0 is None else np.asarray(s0, dt)
    segs = _segments(nC, segments)
    for chunks, E in zip(segs, _scan(walk, segs, start, N, dt)):
        walk(chunks, E, True, out=True)
    return y[:T], U[:T], S0


def chunk_grads(o, S0, dS, U, V, dY, dX, r, w, k, b, rnd=identity, op=identity, exact=False):
    """The key-space gradients of one chunk (all [L, N]): dr, dw, dk, da, db; ``rnd`` rounds the operands
    of the products with S0 and dS, ``op`` those of the [L, L] products (on tensor cores in the kernel);
    ``exact`` (chunked_exact): dy_t . v_t and dy_t . u_t are :func:`row_dots`.

    The diagonal of Ark / Arb (r_t . k_t, r_t . b_t) does not depend on w: its gradient goes to dr, dk,
    db directly and stays out of the log-decay sums, where its two halves would only cancel (dw of the
    sequence's first token is then exactly 0, as it must be: S_{-1} = 0)."""
    dt = S0.dtype
    slow = np.tril(np.ones((L, L), dt), -1)
    rt, at, kh, bh, PL = o["rt"], o["at"], o["kh"], o["bh"], o["PL"]
    def mm(x, y):                               # a product with S0 or dS (tensor cores)
        return (rnd(x).astype(np.float64) @ rnd(y).astype(np.float64)).astype(dt)

    # [t, s]: at small T each entry is a whole gradient's coefficient (3xTF32 in the kernel with fp32 inputs)
    dYV, dYU = (op(dY) @ op(V.T)).astype(dt), (op(dY) @ op(U.T)).astype(dt)
    dArk, dArb = slow * dYV, slow * dYU
    dAak, dAab = slow * (op(dX) @ op(V.T)).astype(dt), slow * (op(dX) @ op(U.T)).astype(dt)
    dKt, dBt = mm(V, dS), mm(U, dS)                               # S_L = V^T Kt + U^T Bt + ...
    drt = mm(dY, S0) + dArk @ kh + dArb @ bh
    dat = mm(dX, S0) + dAak @ kh + dAab @ bh
    dkh = dArk.T @ rt + dAak.T @ at + dKt * PL
    dbh = dArb.T @ rt + dAab.T @ at + dBt * PL
    dPL = (S0 * dS).sum(0) + (dKt * kh).sum(0) + (dBt * bh).sum(0)
    dlcw = drt * rt - dkh * kh - dbh * bh
    dlcx = dat * at
    # dlog w_s = sum_{t>=s} dlcw_t + sum_{t>s} dlcx_t + dlog PL
    rev = lambda x: np.cumsum(x[::-1], axis=0)[::-1]          # noqa: E731
    dlw = rev(dlcw) + rev(dlcx) - dlcx + (dPL * PL)[None, :]
    if exact:
        dv_rk, du_rb = row_dots(dY, V, dt)[:, None], row_dots(dY, U, dt)[:, None]
    else:
        dv_rk, du_rb = np.diag(dYV)[:, None], np.diag(dYU)[:, None]
    return dict(dr=drt * o["cw"] + k * dv_rk + b * du_rb, dw=dlw / w, dk=dkh / o["cw"] + r * dv_rk,
                da=dat * o["cx"], db=dbh / o["cw"] + r * du_rb)


def backward(r, w, k, v, a, b, dy, rnd=identity, dt=np.float64, s0=None, segments=1, op=identity):
    """One (sequence, head): inputs [T, N]; the forward (from ``s0``, as :func:`forward`) recomputed here.
    Returns dr, dw, dk, dv, da, db, and given ``s0`` its gradient ds0 [N, N] too. ``segments`` > 1: the
    forward and the reverse pass as segmented scans (:func:`_scan` over the segments in reverse)."""
    T, N = r.shape
    _, U, S0 = forward(r, w, k, v, a, b, rnd, dt, s0, segments, op)
    exact = rnd is split3
    nC, (r, w, k, v, a, b, dy, U), o = _padded(T, r, w, k, v, a, b, dt, op, exact, dy, U)
    g = {n: np.zeros((nC * L, N), dt) for n in ("dr", "dw", "dk", "dv", "da", "db")}
    dS_end, dX = np.zeros((nC, N, N), dt), np.zeros((nC * L, N), dt)

    def walk(chunks, dS, inputs, out=False):
        for c in reversed(chunks):
            t = slice(c * L, c * L + L)
            if out:
                dS_end[c] = dS
            dYs = _split(dy[t] if inputs else np.zeros((L, N), dt), rnd)
            X = rnd(o[c]["Qb"]) @ rnd(dS).T + rnd(o[c]["Db"]) @ dYs
            if out:
                dX[t] = X
                g["dv"][t] = rnd(o[c]["Kt"]) @ rnd(dS).T + rnd(o[c]["Ark"]).T @ dYs + rnd(o[c]["Aak"]).T @ rnd(X)
            dS = (o[c]["PL"][:, None] * dS.T + rnd(o[c]["rt"]).T @ dYs + rnd(o[c]["at"]).T @ rnd(X)).T
        return dS

    segs = _segments(nC, segments)
    for chunks, E in reversed(list(zip(segs, _scan(walk, segs, np.zeros((N, N), dt), N, dt, reverse=True)))):
        ds0 = walk(chunks, E, True, out=True)          # the last one walked is segment 0: dS after chunk 0
    for c in range(nC):
        t = slice(c * L, c * L + L)
        for n, x in chunk_grads(o[c], S0[c], dS_end[c], U[t], v[t], dy[t], dX[t], r[t], w[t], k[t], b[t],
                                rnd, op, exact).items():
            g[n][t] = x
    grads = tuple(g[n][:T] for n in ("dr", "dw", "dk", "dv", "da", "db"))
    return grads if s0 is None else (*grads, ds0)
