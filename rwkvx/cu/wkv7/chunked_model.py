"""A numpy model of the chunked WKV7 kernels (rwkvx/cu/wkv7/chunked.cu), step for step: the same chunk
length, the same intermediate matrices, the same split into an intra-chunk part, a sequential pass over
chunk states and (backward) a per-chunk gradient part. ``rnd`` is applied where the kernels round an
operand of a tensor-core product (tf32), so that the model also predicts the kernels' rounding error
(v and dy enter the products as hi + lo tf32 pairs: :func:`_split`).
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
"""
from __future__ import annotations

import numpy as np

from .ops import CHUNKED_L as L


def identity(x):
    return x


def _split(x, rnd):
    """x as the kernels feed v and dy to the tensor cores: hi + lo parts, each rounded by ``rnd``."""
    hi = rnd(x)
    return hi.astype(np.float64) + rnd(x - hi)


def _pad(x: np.ndarray, Tp: int, fill: float) -> np.ndarray:
    T = x.shape[0]
    if T == Tp:
        return x
    return np.concatenate([x, np.full((Tp - T,) + x.shape[1:], fill, x.dtype)])


def intra(r, w, k, a, b, dt=np.float64):
    """The intra-chunk operators of one chunk (inputs [L, N]): a dict of arrays."""
    r, w, k, a, b = (np.asarray(x, dt) for x in (r, w, k, a, b))
    cw = np.cumprod(w, axis=0)
    cx = cw / w
    rt, at, kh, bh = r * cw, a * cx, k / cw, b / cw
    PL = cw[-1]
    low, slow = np.tril(np.ones((L, L), dt)), np.tril(np.ones((L, L), dt), -1)
    Aab, Aak = slow * (at @ bh.T), slow * (at @ kh.T)
    Arb, Ark = low * (rt @ bh.T), low * (rt @ kh.T)
    M = np.linalg.inv(np.eye(L, dtype=dt) - Aab).astype(dt)    # the kernel: forward substitution
    Qa, Ca = M @ at, M @ Aak
    Kt, Bt = kh * PL, bh * PL
    return dict(cw=cw, cx=cx, rt=rt, at=at, kh=kh, bh=bh, PL=PL, Aab=Aab, Aak=Aak, Arb=Arb, Ark=Ark,
                Qa=Qa, Ca=Ca, Qr=rt + Arb @ Qa, Cr=Ark + Arb @ Ca, Kt=Kt, Bt=Bt,
                Qb=M.T @ Bt, Db=(Arb @ M).T)


def forward(r, w, k, v, a, b, rnd=identity, dt=np.float64, s0=None):
    """One (sequence, head): inputs [T, N], from the initial state ``s0`` [N, N] (None: 0). Returns
    y [T, N], U (= sa) [T, N] and the chunk-entering states S0 [nC, N, N]."""
    T, N = r.shape
    nC = (T + L - 1) // L
    Tp = nC * L
    r, k, v, a, b = (_pad(np.asarray(x, dt), Tp, 0.0) for x in (r, k, v, a, b))
    w = _pad(np.asarray(w, dt), Tp, 1.0)
    y, U = np.zeros((Tp, N), dt), np.zeros((Tp, N), dt)
    S = np.zeros((N, N), dt) if s0 is None else np.asarray(s0, dt)
    S0 = np.zeros((nC, N, N), dt)
    for c in range(nC):
        t = slice(c * L, c * L + L)
        o = intra(r[t], w[t], k[t], a[t], b[t], dt)
        S0[c] = S
        V = v[t]
        Vs = _split(V, rnd)
        Ut = rnd(o["Qa"]) @ rnd(S).T + rnd(o["Ca"]) @ Vs
        y[t] = rnd(o["Qr"]) @ rnd(S).T + rnd(o["Cr"]) @ Vs
        S = (o["PL"][:, None] * S.T + rnd(o["Kt"]).T @ Vs + rnd(o["Bt"]).T @ rnd(Ut)).T
        U[t] = Ut
    return y[:T], U[:T], S0


def chunk_grads(o, S0, dS, U, V, dY, dX, r, w, k, b, rnd=identity):
    """The key-space gradients of one chunk (all [L, N]): dr, dw, dk, da, db; ``rnd`` rounds the operands
    of the products with S0 and dS (on tensor cores in the kernel).

    The diagonal of Ark / Arb (r_t . k_t, r_t . b_t) does not depend on w: its gradient goes to dr, dk,
    db directly and stays out of the log-decay sums, where its two halves would only cancel (dw of the
    sequence's first token is then exactly 0, as it must be: S_{-1} = 0)."""
    dt = S0.dtype
    slow = np.tril(np.ones((L, L), dt), -1)
    rt, at, kh, bh, PL = o["rt"], o["at"], o["kh"], o["bh"], o["PL"]
    def mm(x, y):                               # a product with S0 or dS (tensor cores)
        return (rnd(x).astype(np.float64) @ rnd(y).astype(np.float64)).astype(dt)

    # [t, s] in fp32: at small T each entry is a whole gradient's coefficient (tf32 would show)
    dYV, dYU = dY @ V.T, dY @ U.T
    dArk, dArb = slow * dYV, slow * dYU
    dAak, dAab = slow * (dX @ V.T), slow * (dX @ U.T)
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
    dv_rk, du_rb = np.diag(dYV)[:, None], np.diag(dYU)[:, None]
    return dict(dr=drt * o["cw"] + k * dv_rk + b * du_rb, dw=dlw / w, dk=dkh / o["cw"] + r * dv_rk,
                da=dat * o["cx"], db=dbh / o["cw"] + r * du_rb)


def backward(r, w, k, v, a, b, dy, rnd=identity, dt=np.float64, s0=None):
    """One (sequence, head): inputs [T, N]; the forward (from ``s0``, as :func:`forward`) recomputed here.
    Returns dr, dw, dk, dv, da, db, and given ``s0`` its gradient ds0 [N, N] too."""
    T, N = r.shape
    _, U, S0 = forward(r, w, k, v, a, b, rnd, dt, s0)
    nC = S0.shape[0]
    Tp = nC * L
    r, k, v, a, b, dy, U = (_pad(np.asarray(x, dt), Tp, 0.0) for x in (r, k, v, a, b, dy, U))
    w = _pad(np.asarray(w, dt), Tp, 1.0)
    g = {n: np.zeros((Tp, N), dt) for n in ("dr", "dw", "dk", "dv", "da", "db")}
    dS = np.zeros((N, N), dt)
    for c in reversed(range(nC)):
        t = slice(c * L, c * L + L)
        o = intra(r[t], w[t], k[t], a[t], b[t], dt)
        dY = dy[t]
        dYs = _split(dY, rnd)
        dX = rnd(o["Qb"]) @ rnd(dS).T + rnd(o["Db"]) @ dYs
        g["dv"][t] = rnd(o["Kt"]) @ rnd(dS).T + rnd(o["Ark"]).T @ dYs + rnd(o["Aak"]).T @ rnd(dX)
        dS0 = (o["PL"][:, None] * dS.T + rnd(o["rt"]).T @ dYs + rnd(o["at"]).T @ rnd(dX)).T
        for n, x in chunk_grads(o, S0[c], dS, U[t], v[t], dY, dX, r[t], w[t], k[t], b[t], rnd).items():
            g[n][t] = x
        dS = dS0
    grads = tuple(g[n][:T] for n in ("dr", "dw", "dk", "dv", "da", "db"))
    return grads if s0 is None else (*grads, dS)
