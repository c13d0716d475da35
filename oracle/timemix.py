"""Twin of rwkvx/cu/timemix/timemix.cu: the element-wise parts of the RWKV-7 time mix (docs/SPEC.md §2.3 TimeMix).

The GEMMs (r, k, v, the LoRAs, the output) are the model's (oracle/model.py), the recurrence is
oracle/wkv7.pyx; here is everything between them, as the GPU fuses it:
  * the token shift making the six mixed inputs xr, xw, xk, xv, xa, xg;
  * tanh / sigmoid of the LoRA hidden layers (decay and gate);
  * "prep": decay, the in-context rate a, kk = l2normalize(k * k_k), k' = k * (1 + (a - 1) * k_a),
    the value residual v' and the WKV inputs wa = -kk, wb = kk * a;
  * "gn": ln_x GroupNorm of the WKV output, plus the bonus term, times the gate; the GroupNorm alone is
    group_norm_forward / group_norm_backward (its loops: oracle/_norm.pyx).
Rows [R, C] (R = B*T, channel c = h*N + n); per-channel vectors are [C] (any shape with C elements).
"""
from __future__ import annotations

import numpy as np

from ._common import (DECAY_SCALE, GN_EPS, L2_EPS, float64_op, heads, shift_mix_backward,
                      shift_mix_forward, sigmoid)
from ._norm import norm_backward, norm_forward
from .reduce import column_sums


# ------------------------------------------------------------------ token shift (six mixes)

@float64_op
def time_shift_forward(x: np.ndarray, mixes: np.ndarray, T: int,
                       prev: np.ndarray | None = None) -> np.ndarray:
    """[6, R, C]: x + (shift(x) - x) * mixes[j] for mixes [6, C] (x_r, x_w, x_k, x_v, x_a, x_g);
    ``prev`` [B, C]: the row before each sequence (a stateful forward's carry), default zero."""
    return shift_mix_forward(x, mixes, T, prev)


@float64_op
def time_shift_backward(x: np.ndarray, mixes: np.ndarray, douts: np.ndarray,
                        T: int) -> tuple[np.ndarray, np.ndarray]:
    """(dx [R, C], dmix [6, C]) of :func:`time_shift_forward` for output gradients douts [6, R, C]."""
    return shift_mix_backward(x, mixes, douts, T)


# ------------------------------------------------------------------ LoRA activations

@float64_op
def tanh_forward(x: np.ndarray) -> np.ndarray:
    """tanh(x) (the decay LoRA's hidden layer)."""
    return np.tanh(x)


@float64_op
def tanh_backward(act: np.ndarray, dact: np.ndarray) -> np.ndarray:
    """dx = dact * (1 - act^2) from the saved output act = tanh(x)."""
    return dact * (1 - act * act)


@float64_op
def sigmoid_forward(x: np.ndarray) -> np.ndarray:
    """sigmoid(x) (the gate LoRA's hidden layer)."""
    return sigmoid(x)


@float64_op
def sigmoid_backward(act: np.ndarray, dact: np.ndarray) -> np.ndarray:
    """dx = dact * act * (1 - act) from the saved output act = sigmoid(x)."""
    return dact * act * (1 - act)


# ------------------------------------------------------------------ prep

def _prep(k, wl, al, w0, a0, k_k, N):
    """What forward and backward of the prep share: sigmoid of the decay LoRA, the decay, the rate
    a, the per-head norm of k * k_k (and the floored one) and kk [R, H, N]."""
    sw = sigmoid(w0.reshape(-1) + wl)
    decay = np.exp(-DECAY_SCALE * sw)
    a = sigmoid(a0.reshape(-1) + al)
    kr = heads(k * k_k.reshape(-1), N)
    nrm = np.sqrt((kr * kr).sum(axis=-1, keepdims=True))
    den = np.maximum(nrm, L2_EPS)
    return sw, decay, a, nrm, den, kr / den


@float64_op
def time_mix_prep_forward(k: np.ndarray, v: np.ndarray, wl: np.ndarray, al: np.ndarray,
                          vl: np.ndarray | None, v_first: np.ndarray | None, w0: np.ndarray,
                          a0: np.ndarray, v0: np.ndarray | None, k_k: np.ndarray, k_a: np.ndarray,
                          N: int, layer: int) -> dict[str, np.ndarray]:
    """The prep of RWKV layer ``layer`` from k, v [R, C] and the LoRA outputs wl = tanh(xw@w1)@w2,
    al = (xa@a1)@a2, vl = (xv@v1)@v2 [R, C] (vl, v_first, v0 unused, may be None, at layer 0).

    Returns dict(decay, kp, vp, wa, wb, v_first): decay = exp(-e^-0.5 sigmoid(w0 + wl)),
    a = sigmoid(a0 + al), kk = l2normalize_per_head(k * k_k), kp = k * (1 + (a - 1) * k_a),
    vp = v + (v_first - v) * sigmoid(v0 + vl) (layer 0: vp = v and v_first = v),
    wa = -kk, wb = kk * a."""
    R, C = k.shape
    _, decay, a, _, _, kk = _prep(k, wl, al, w0, a0, k_k, N)
    kk = kk.reshape(R, C)
    kp = k * (1 + (a - 1) * k_a.reshape(-1))
    if layer > 0:
        vp = v + (v_first - v) * sigmoid(v0.reshape(-1) + vl)
    else:
        vp = v_first = v
    return dict(decay=decay, kp=kp, vp=vp, wa=-kk, wb=kk * a, v_first=v_first)


@float64_op
def time_mix_prep_backward(k: np.ndarray, v: np.ndarray, wl: np.ndarray, al: np.ndarray,
                           vl: np.ndarray | None, v_first: np.ndarray | None, w0: np.ndarray,
                           a0: np.ndarray, v0: np.ndarray | None, k_k: np.ndarray,
                           k_a: np.ndarray, N: int, layer: int, d_decay: np.ndarray,
                           dkp: np.ndarray, dvp: np.ndarray, dwa: np.ndarray, dwb: np.ndarray,
                           dvf_in: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Gradients of L = <d_decay,decay> + <dkp,kp> + <dvp,vp> + <dwa,wa> + <dwb,wb> (+ at layer 0
    <dvf_in, v_first>, since v_first = v there) through :func:`time_mix_prep_forward`.

    dkp / dvp are the total gradients of kp / vp (WKV + bonus). Returns dict(dk, dv, dwl, dal, dw0,
    da0, dk_k, dk_a) and, at layers > 0, dvl, dv0 and dvf: the contribution to the v_first gradient
    (the model adds it to the running dv_first that layer 0 consumes as dvf_in)."""
    R, C = k.shape
    k_k, k_a = k_k.reshape(-1), k_a.reshape(-1)
    sw, decay, a, nrm, den, kk = _prep(k, wl, al, w0, a0, k_k, N)
    # kk = kr / max(||kr||, eps): below the floor it is a plain scale
    dkk = heads(dwb * a - dwa, N)
    proj = (dkk * kk).sum(axis=-1, keepdims=True)
    dkr = (np.where(nrm > L2_EPS, dkk - kk * proj, dkk) / den).reshape(R, C)
    kk = kk.reshape(R, C)
    out = dict(dk=dkp * (1 + (a - 1) * k_a) + dkr * k_k,
               dk_k=column_sums(dkr * k), dk_a=column_sums(dkp * k * (a - 1)))
    out["dal"] = (dwb * kk + dkp * k * k_a) * a * (1 - a)
    out["da0"] = column_sums(out["dal"])
    out["dwl"] = d_decay * decay * (-DECAY_SCALE) * sw * (1 - sw)
    out["dw0"] = column_sums(out["dwl"])
    if layer > 0:
        sv = sigmoid(v0.reshape(-1) + vl)
        out["dv"] = dvp * (1 - sv)
        out["dvf"] = dvp * sv
        out["dvl"] = dvp * (v_first - v) * sv * (1 - sv)
        out["dv0"] = column_sums(out["dvl"])
    else:
        out["dv"] = dvp if dvf_in is None else dvp + dvf_in
    return out


# ------------------------------------------------------------------ GroupNorm (ln_x: one group per head)

@float64_op
def group_norm_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, groups: int,
                       eps: float) -> np.ndarray:
    """y = GroupNorm(x) over the last axis split into ``groups`` groups; x [..., C], w, b [C]."""
    return norm_forward(x, w, b, groups, eps)[0]


@float64_op
def group_norm_backward(x: np.ndarray, w: np.ndarray, dy: np.ndarray, groups: int,
                        eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients (dx [..., C], dw [C], db [C]) of :func:`group_norm_forward` for output gradient dy;
    the bias is not needed, the statistics are recomputed from x."""
    return norm_backward(x, w, dy, groups, eps)


# ------------------------------------------------------------------ gn: GroupNorm + bonus, gated

def _bonus(r, kp, r_k, N):
    """s [R, H, 1] = sum over each head's channels of r * kp * r_k."""
    return heads(r * kp * r_k.reshape(-1), N).sum(axis=-1, keepdims=True)


def _ungated(y, r, kp, vp, ln_w, ln_b, r_k, N):
    """(u [R, C], s) with u = GroupNorm(y; ln_x) + s * vp."""
    R, C = y.shape
    s = _bonus(r, kp, r_k, N)
    return group_norm_forward(y, ln_w, ln_b, C // N, GN_EPS) + (s * heads(vp, N)).reshape(R, C), s


@float64_op
def time_mix_gn_forward(y: np.ndarray, r: np.ndarray, kp: np.ndarray, vp: np.ndarray,
                        g: np.ndarray, ln_w: np.ndarray, ln_b: np.ndarray, r_k: np.ndarray,
                        N: int) -> np.ndarray:
    """z [R, C] = (GroupNorm(y; ln_w, ln_b, one group per head, eps 64e-5) + s * vp) * g with the
    bonus s = sum over the head's channels of r * kp * r_k; y is the WKV output, r_k [C] ([H, N])."""
    return _ungated(y, r, kp, vp, ln_w, ln_b, r_k, N)[0] * g


@float64_op
def time_mix_gn_backward(y: np.ndarray, r: np.ndarray, kp: np.ndarray, vp: np.ndarray,
                         g: np.ndarray, ln_w: np.ndarray, ln_b: np.ndarray, r_k: np.ndarray,
                         N: int, dz: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of :func:`time_mix_gn_forward` for dz: dict(dy, dg, dvp, dr, dkp, dln_w, dln_b,
    dr_k); dr, dkp, dvp are the bonus term's share only (the model adds the WKV's); dr_k is [C]."""
    R, C = y.shape
    u, s = _ungated(y, r, kp, vp, ln_w, ln_b, r_k, N)
    du = dz * g
    dy, dln_w, dln_b = group_norm_backward(y, ln_w, du, C // N, GN_EPS)
    ds = heads(du * vp, N).sum(axis=-1, keepdims=True)
    r_k = r_k.reshape(-1)
    return dict(dy=dy, dg=dz * u, dvp=(s * heads(du, N)).reshape(R, C),
                dr=(ds * heads(kp * r_k, N)).reshape(R, C), dkp=(ds * heads(r * r_k, N)).reshape(R, C),
                dln_w=dln_w, dln_b=dln_b, dr_k=column_sums((ds * heads(r * kp, N)).reshape(R, C)))
