# cython: language_level=3, boundscheck=True, wraparound=True
"""The oracle model: RWKV-X forward and hand-written backward on the CPU (SPEC §2.3).

Readable reference, not a fast path: every sub-layer is a ``*_forward`` returning its output and
a cache of the values its backward needs, followed by the matching ``*_backward``. Heavy loops
(LayerNorm, WKV7, cross-entropy, MoBA) live in the Cython kernels of ``_layers`` / ``_moba``;
GEMMs go through numpy (BLAS); the rest is element-wise numpy in the oracle's dtype.

Memory follows the seed's scheme: the forward keeps only each block's input (plus v_first);
the backward recomputes one block's forward from its input, then backpropagates through it.
Parameter gradients accumulate with ``+=`` into one zeroed dict, so a parameter used twice
(none today) would still be right.
"""
import math

import numpy as np

from rwkvx.config import Config
from rwkvx.params import check_params
from rwkvx.validate import check_targets, check_tokens

from ._layers import (cross_entropy, group_norm_backward, group_norm_forward, wkv7_backward,
                      wkv7_forward)
from ._moba import moba_attention_backward, moba_attention_forward, moba_gate_gaps

LN_EPS = 1e-5              # every LayerNorm
GN_EPS = 64e-5             # ln_x GroupNorm, for every head size (SPEC §2.3)
DECAY_SCALE = math.exp(-0.5)  # decay = exp(-exp(-0.5) * sigmoid(.)) lies in (0.5452, 1)
L2_EPS = 1e-12             # l2-normalise: x / max(||x||, 1e-12)
MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


# ---------------------------------------------------------------- element-wise helpers

def _sigmoid(x):
    # Stable for large |x| and keeps the dtype of x.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _shift(x):
    """Token shift of x [B,T,C]: out[:, t] = x[:, t-1], zero at t = 0 of every sequence."""
    out = np.zeros_like(x)
    out[:, 1:] = x[:, :-1]
    return out


def _shift_back(d):
    """Adjoint of :func:`_shift`: out[:, t] = d[:, t+1], zero at the last token."""
    out = np.zeros_like(d)
    out[:, :-1] = d[:, 1:]
    return out


def _rows(x):
    """[B,T,X] -> [B*T,X] view for GEMMs."""
    return x.reshape(-1, x.shape[-1])


def _lin(x, W):
    """Lin(x; W) = x @ W^T for W [out, in] (PyTorch layout)."""
    return x @ W.T


def _lin_backward(x, W, dy, dW):
    """Backward of y = x @ W^T: accumulates dW += dy^T x, returns dx = dy @ W."""
    dW += _rows(dy).T @ _rows(x)
    return dy @ W


def _mm_backward(x, W, dy, dW):
    """Backward of y = x @ W (LoRA layout W [in, out]): dW += x^T dy, returns dx = dy @ W^T."""
    dW += _rows(x).T @ _rows(dy)
    return dy @ W.T


def _vec(P, name, C):
    return P[name].reshape(C)


def _sum_rows(x):
    """Sum over every axis but the last: the gradient of a broadcast [C] vector."""
    return _rows(x).sum(axis=0)


# ---------------------------------------------------------------- LayerNorm on [B,T,C]

def _layernorm_forward(x, P, name):
    return group_norm_forward(x, P[name + ".weight"], P[name + ".bias"], 1, LN_EPS)


def _layernorm_backward(x, P, G, name, dy):
    dx, dw, db = group_norm_backward(x, P[name + ".weight"], dy, 1, LN_EPS)
    G[name + ".weight"] += dw
    G[name + ".bias"] += db
    return dx


# ---------------------------------------------------------------- token-shift mix
# xm = x + (shift(x) - x) * mu, one learned mu [C] per use.

def _mix_backward(dxm, mu, xx, G, name):
    """Backward of xm = x + xx * mu with xx = shift(x) - x: dmu += sum(dxm * xx); returns
    (dx through the direct path, dxx) so callers can add several mixes before un-shifting."""
    G[name] += _sum_rows(dxm * xx).reshape(G[name].shape)
    return dxm, dxm * mu


def _shift_diff_backward(dxx):
    """Backward of xx = shift(x) - x."""
    return _shift_back(dxx) - dxx


# ---------------------------------------------------------------- ChannelMix
# k = relu(Lin(x + (shift(x)-x)*x_k; key))^2 ; out = Lin(k; value)

def channel_mix_forward(P, pre, x):
    C = x.shape[-1]
    xx = _shift(x) - x
    mu = _vec(P, pre + "ffn.x_k", C)
    xk = x + xx * mu
    hpre = _lin(xk, P[pre + "ffn.key.weight"])
    h = np.maximum(hpre, 0)
    h = h * h
    out = _lin(h, P[pre + "ffn.value.weight"])
    return out, (x, xx, mu, xk, hpre, h)


def channel_mix_backward(P, G, pre, cache, dout):
    x, xx, mu, xk, hpre, h = cache
    dh = _lin_backward(h, P[pre + "ffn.value.weight"], dout, G[pre + "ffn.value.weight"])
    dhpre = dh * (2 * np.maximum(hpre, 0))
    dxk = _lin_backward(xk, P[pre + "ffn.key.weight"], dhpre, G[pre + "ffn.key.weight"])
    dx, dxx = _mix_backward(dxk, mu, xx, G, pre + "ffn.x_k")
    return dx + _shift_diff_backward(dxx)


# ---------------------------------------------------------------- TimeMix (RWKV-7 x070)

def time_mix_forward(P, pre, i, x, v_first, H, N):
    """TimeMix of RWKV block i on x = LN1 output [B,T,C]. Returns (out, v, cache); v is the
    value before the residual mix, which block 0 hands on as v_first."""
    B, T, C = x.shape
    a = pre + "att."
    xx = _shift(x) - x
    mus = [_vec(P, a + m, C) for m in MIXES]
    xr, xw, xk, xv, xa, xg = [x + xx * mu for mu in mus]

    r = _lin(xr, P[a + "receptance.weight"])
    k = _lin(xk, P[a + "key.weight"])
    v = _lin(xv, P[a + "value.weight"])

    wl = np.tanh(xw @ P[a + "w1"])
    sw = _sigmoid(_vec(P, a + "w0", C) + wl @ P[a + "w2"])
    decay = np.exp(-DECAY_SCALE * sw)

    if i == 0:
        vl = vs = None
        vm = v                                    # block 0 defines v_first = v
    else:
        vl = xv @ P[a + "v1"]
        vs = _sigmoid(_vec(P, a + "v0", C) + vl @ P[a + "v2"])
        vm = v + (v_first - v) * vs               # value residual towards block 0's value

    al = xa @ P[a + "a1"]
    ar = _sigmoid(_vec(P, a + "a0", C) + al @ P[a + "a2"])   # in-context learning rate
    gl = _sigmoid(xg @ P[a + "g1"])
    g = gl @ P[a + "g2"]

    kk_k = _vec(P, a + "k_k", C)
    k_a = _vec(P, a + "k_a", C)
    kk0 = (k * kk_k).reshape(B, T, H, N)
    nrm = np.sqrt((kk0 * kk0).sum(axis=-1, keepdims=True))
    den = np.maximum(nrm, L2_EPS)
    kk = (kk0 / den).reshape(B, T, C)
    k2 = k * (1 + (ar - 1) * k_a)

    heads = (B, T, H, N)
    y = wkv7_forward(r.reshape(heads), decay.reshape(heads), k2.reshape(heads),
                     vm.reshape(heads), (-kk).reshape(heads), (kk * ar).reshape(heads))
    yn = group_norm_forward(y.reshape(B, T, C), P[a + "ln_x.weight"], P[a + "ln_x.bias"], H, GN_EPS)

    r_k = P[a + "r_k"]                               # [H, N]
    s = (r.reshape(heads) * k2.reshape(heads) * r_k).sum(axis=-1, keepdims=True)
    y2 = yn + (s * vm.reshape(heads)).reshape(B, T, C)   # the "bonus" term
    yg = y2 * g
    out = _lin(yg, P[a + "output.weight"])
    cache = dict(x=x, xx=xx, mus=mus, xs=(xr, xw, xk, xv, xa, xg), r=r, k=k, v=v, wl=wl, sw=sw,
                 decay=decay, vl=vl, vs=vs, vm=vm, v_first=v_first, al=al, ar=ar, gl=gl, g=g,
                 kk_k=kk_k, k_a=k_a, nrm=nrm, den=den, kk=kk, k2=k2, y=y, s=s, y2=y2, yg=yg)
    return out, v, cache


def time_mix_backward(P, G, pre, i, cache, dout, dv_first, H, N):
    """Backward of :func:`time_mix_forward`. ``dv_first`` [B,T,C] is the running gradient of
    v_first: blocks i > 0 add to it (in place), block 0 consumes it into its own value.
    Returns dx."""
    c = cache
    a = pre + "att."
    B, T, C = c["x"].shape
    heads = (B, T, H, N)
    xr, xw, xk, xv, xa, xg = c["xs"]
    r, k, vm, k2, ar, kk = c["r"], c["k"], c["vm"], c["k2"], c["ar"], c["kk"]

    dyg = _lin_backward(c["yg"], P[a + "output.weight"], dout, G[a + "output.weight"])
    dy2 = dyg * c["g"]
    dg = dyg * c["y2"]

    # gate g = sigmoid(xg @ g1) @ g2
    gl = c["gl"]
    dgl = _mm_backward(gl, P[a + "g2"], dg, G[a + "g2"])
    dxg = _mm_backward(xg, P[a + "g1"], dgl * gl * (1 - gl), G[a + "g1"])

    # bonus y2 = yn + s * vm with s = sum_n(r * k2 * r_k) per head
    r_k = P[a + "r_k"]
    dy2h = dy2.reshape(heads)
    ds = (dy2h * vm.reshape(heads)).sum(axis=-1, keepdims=True)
    dvm = (c["s"] * dy2h).reshape(B, T, C)
    dr = (ds * k2.reshape(heads) * r_k).reshape(B, T, C)
    dk2 = (ds * r.reshape(heads) * r_k).reshape(B, T, C)
    G[a + "r_k"] += (ds * r.reshape(heads) * k2.reshape(heads)).reshape(-1, H, N).sum(axis=0)

    # GroupNorm (ln_x), one group per head
    dy, dlw, dlb = group_norm_backward(c["y"].reshape(B, T, C), P[a + "ln_x.weight"], dy2, H, GN_EPS)
    G[a + "ln_x.weight"] += dlw
    G[a + "ln_x.bias"] += dlb

    # WKV7 with a = -kk, b = kk * ar
    gr, gw, gk, gv, ga, gb = wkv7_backward(
        r.reshape(heads), c["decay"].reshape(heads), k2.reshape(heads), vm.reshape(heads),
        (-kk).reshape(heads), (kk * ar).reshape(heads), dy.reshape(heads))
    dr = dr + gr.reshape(B, T, C)
    ddecay = gw.reshape(B, T, C)
    dk2 = dk2 + gk.reshape(B, T, C)
    dvm = dvm + gv.reshape(B, T, C)
    dkk = -ga.reshape(B, T, C) + gb.reshape(B, T, C) * ar
    dar = gb.reshape(B, T, C) * kk

    # k2 = k * (1 + (ar - 1) * k_a)
    k_a = c["k_a"]
    dk = dk2 * (1 + (ar - 1) * k_a)
    dar = dar + dk2 * k * k_a
    G[a + "k_a"] += _sum_rows(dk2 * k * (ar - 1)).reshape(1, 1, C)

    # kk = l2normalize(k * k_k) per head; below the 1e-12 floor it is a plain scale
    kkh = kk.reshape(heads)
    dkkh = dkk.reshape(heads)
    proj = (dkkh * kkh).sum(axis=-1, keepdims=True)
    dkk0 = np.where(c["nrm"] > L2_EPS, dkkh - kkh * proj, dkkh) / c["den"]
    dkk0 = dkk0.reshape(B, T, C)
    dk = dk + dkk0 * c["kk_k"]
    G[a + "k_k"] += _sum_rows(dkk0 * k).reshape(1, 1, C)

    # ar = sigmoid(a0 + (xa @ a1) @ a2)
    dapre = dar * ar * (1 - ar)
    G[a + "a0"] += _sum_rows(dapre).reshape(1, 1, C)
    dal = _mm_backward(c["al"], P[a + "a2"], dapre, G[a + "a2"])
    dxa = _mm_backward(xa, P[a + "a1"], dal, G[a + "a1"])

    # value residual
    if i == 0:
        dv = dvm + dv_first                       # v_first = v: collect every later block's share
        dxv = None
    else:
        vs, v = c["vs"], c["v"]
        dv = dvm * (1 - vs)
        dv_first += dvm * vs
        dvpre = dvm * (c["v_first"] - v) * vs * (1 - vs)
        G[a + "v0"] += _sum_rows(dvpre).reshape(1, 1, C)
        dvl = _mm_backward(c["vl"], P[a + "v2"], dvpre, G[a + "v2"])
        dxv = _mm_backward(xv, P[a + "v1"], dvl, G[a + "v1"])

    # decay = exp(-e^-0.5 * sigmoid(w0 + tanh(xw @ w1) @ w2))
    sw, wl = c["sw"], c["wl"]
    dwpre = ddecay * c["decay"] * (-DECAY_SCALE) * sw * (1 - sw)
    G[a + "w0"] += _sum_rows(dwpre).reshape(1, 1, C)
    dwl = _mm_backward(wl, P[a + "w2"], dwpre, G[a + "w2"])
    dxw = _mm_backward(xw, P[a + "w1"], dwl * (1 - wl * wl), G[a + "w1"])

    # r, k, v projections
    dxr = _lin_backward(xr, P[a + "receptance.weight"], dr, G[a + "receptance.weight"])
    dxk = _lin_backward(xk, P[a + "key.weight"], dk, G[a + "key.weight"])
    dxv_lin = _lin_backward(xv, P[a + "value.weight"], dv, G[a + "value.weight"])
    dxv = dxv_lin if dxv is None else dxv + dxv_lin

    # the six token-shift mixes share x and xx
    dx = np.zeros_like(c["x"])
    dxx = np.zeros_like(c["x"])
    for m, mu, dxm in zip(MIXES, c["mus"], (dxr, dxw, dxk, dxv, dxa, dxg)):
        ddirect, dshift = _mix_backward(dxm, mu, c["xx"], G, a + m)
        dx += ddirect
        dxx += dshift
    return dx + _shift_diff_backward(dxx)


# ---------------------------------------------------------------- MoBA attention

def attention_forward(P, pre, x, H, N, chunk, top_k, selection):
    """Attention of block ``pre`` (moba.j.) on x = LN1 output [B,T,C]; returns (out, sel, cache)."""
    B, T, C = x.shape
    a = pre + "att."
    heads = (B, T, H, N)
    q = _lin(x, P[a + "receptance.weight"])
    k = _lin(x, P[a + "key.weight"])
    v = _lin(x, P[a + "value.weight"])
    o, sel = moba_attention_forward(q.reshape(heads), k.reshape(heads), v.reshape(heads),
                                    chunk, top_k, selection=selection)
    o = np.asarray(o, dtype=x.dtype).reshape(B, T, C)
    out = _lin(o, P[a + "output.weight"])
    return out, sel, (x, q, k, v, o, sel)


def attention_backward(P, G, pre, cache, dout, H, N, chunk, top_k):
    x, q, k, v, o, sel = cache
    B, T, C = x.shape
    a = pre + "att."
    heads = (B, T, H, N)
    do = _lin_backward(o, P[a + "output.weight"], dout, G[a + "output.weight"])
    dq, dk, dv = moba_attention_backward(q.reshape(heads), k.reshape(heads), v.reshape(heads),
                                         do.reshape(heads), chunk, top_k, sel)
    dx = _lin_backward(x, P[a + "receptance.weight"], np.asarray(dq, x.dtype).reshape(B, T, C),
                       G[a + "receptance.weight"])
    dx += _lin_backward(x, P[a + "key.weight"], np.asarray(dk, x.dtype).reshape(B, T, C),
                        G[a + "key.weight"])
    dx += _lin_backward(x, P[a + "value.weight"], np.asarray(dv, x.dtype).reshape(B, T, C),
                        G[a + "value.weight"])
    return dx


# ---------------------------------------------------------------- the Oracle

class Oracle:
    """CPU reference of the RWKV-X model: forward, loss and every parameter gradient.

    ``dtype`` float64 (default, the ground truth) or float32: all math in that dtype except the
    cross-entropy, which is float64 always. Parameters are copied (converted) on construction.
    """

    def __init__(self, cfg, params, dtype=np.float64):
        if not isinstance(cfg, Config):
            raise TypeError(f"cfg must be an rwkvx.Config, got {type(cfg).__name__}")
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise ValueError(f"Oracle dtype must be float32 or float64, got {dtype}")
        check_params(cfg, params)
        self.cfg = cfg
        self.dtype = dtype
        self.params = {n: np.array(p, dtype=dtype, order="C", copy=True) for n, p in params.items()}

    # -- plumbing

    def _check_selection(self, selection, B, T):
        cfg = self.cfg
        if selection is None:
            return [None] * cfg.n_attn_layer
        selection = list(selection)
        if len(selection) != cfg.n_attn_layer:
            raise ValueError(f"selection must hold one array per attention block "
                             f"({cfg.n_attn_layer}), got {len(selection)}")
        shape = (B, cfg.n_head, T, cfg.moba_top_k - 1)
        out = []
        for j, s in enumerate(selection):
            s = np.asarray(s)
            if s.dtype.kind not in "iu":
                raise TypeError(f"selection[{j}] must be an integer array, got {s.dtype}")
            if s.shape != shape:
                raise ValueError(f"selection[{j}] has shape {s.shape}, expected {shape}")
            out.append(np.ascontiguousarray(s, dtype=np.int32))
        return out

    def _block_forward(self, kind, idx, x, v_first, sel, cache=False):
        """One block on x [B,T,C]; returns (x_out, v_first, sel, caches or None)."""
        cfg, P = self.cfg, self.params
        H, N = cfg.n_head, cfg.head_size
        if kind == "rwkv":
            pre = f"rwkv.blocks.{idx}."
            h1 = _layernorm_forward(x, P, pre + "ln1")
            tm, v, tm_cache = time_mix_forward(P, pre, idx, h1, v_first, H, N)
            if idx == 0:
                v_first = v
        else:
            pre = f"moba.{idx}."
            h1 = _layernorm_forward(x, P, pre + "ln1")
            tm, sel, tm_cache = attention_forward(P, pre, h1, H, N, cfg.moba_chunk_size,
                                                  cfg.moba_top_k, sel)
        x1 = x + tm
        h2 = _layernorm_forward(x1, P, pre + "ln2")
        cm, cm_cache = channel_mix_forward(P, pre, h2)
        out = x1 + cm
        caches = (pre, x1, tm_cache, cm_cache) if cache else None
        return out, v_first, sel, caches

    def _block_backward(self, kind, idx, x, v_first, sel, dout, dv_first, G):
        """Recompute block (kind, idx) from its input x, then backpropagate dout; returns dx."""
        cfg, P = self.cfg, self.params
        H, N = cfg.n_head, cfg.head_size
        _, _, _, (pre, x1, tm_cache, cm_cache) = self._block_forward(kind, idx, x, v_first, sel,
                                                                     cache=True)
        dh2 = channel_mix_backward(P, G, pre, cm_cache, dout)
        dx1 = dout + _layernorm_backward(x1, P, G, pre + "ln2", dh2)
        if kind == "rwkv":
            dh1 = time_mix_backward(P, G, pre, idx, tm_cache, dx1, dv_first, H, N)
        else:
            dh1 = attention_backward(P, G, pre, tm_cache, dx1, H, N, cfg.moba_chunk_size,
                                     cfg.moba_top_k)
        return dx1 + _layernorm_backward(x, P, G, pre + "ln1", dh1)

    def _forward(self, tokens, selection):
        """Forward to the final hidden state; keeps what the backward needs."""
        cfg, P = self.cfg, self.params
        B, T = tokens.shape
        sels = self._check_selection(selection, B, T)
        emb = P["rwkv.emb.weight"][tokens]            # [B,T,C]
        x = _layernorm_forward(emb, P, "rwkv.blocks.0.ln0") if cfg.ln0 else emb
        v_first = None
        inputs = []                                   # (kind, idx, block input)
        out_sels = []
        for kind, idx in cfg.block_order():
            inputs.append((kind, idx, x))
            sel = sels[idx] if kind == "attn" else None
            x, v_first, sel, _ = self._block_forward(kind, idx, x, v_first, sel)
            if kind == "attn":
                out_sels.append(np.ascontiguousarray(sel, dtype=np.int32))
        return dict(emb=emb, inputs=inputs, x=x, v_first=v_first, sels=out_sels)

    def _head_forward(self, x):
        P = self.params
        hn = _layernorm_forward(x, P, "rwkv.ln_out")
        return _lin(hn, P["rwkv.head.weight"]), hn

    # -- public API

    def forward(self, tokens, selection=None):
        """Logits [B,T,V] (oracle dtype) for int tokens [B,T]."""
        tokens = check_tokens(tokens, self.cfg.vocab_size)
        state = self._forward(tokens, selection)
        return self._head_forward(state["x"])[0]

    def moba_selection(self, tokens):
        """The MoBA block selection of every attention block: list of int32 [B,H,T,top_k-1]."""
        tokens = check_tokens(tokens, self.cfg.vocab_size)
        return self._forward(tokens, None)["sels"]

    def moba_gate_gaps(self, tokens):
        """Per attention block, float64 [B,H,T]: each query's gate margin between the last selected
        past block and the best one left out (+inf where nothing is left out). A GPU computing the
        gates in float32 may break ties differently where the margin is tiny."""
        cfg = self.cfg
        tokens = check_tokens(tokens, cfg.vocab_size)
        B, T = tokens.shape
        heads = (B, T, cfg.n_head, cfg.head_size)
        state = self._forward(tokens, None)
        gaps = []
        for kind, idx, x in state["inputs"]:
            if kind == "attn":
                caches = self._block_forward(kind, idx, x, state["v_first"], None, cache=True)[3]
                q, k = caches[2][1], caches[2][2]
                gaps.append(moba_gate_gaps(q.reshape(heads), k.reshape(heads), cfg.moba_chunk_size,
                                           cfg.moba_top_k))
        return gaps

    def loss_and_grads(self, tokens, targets, ignore_index=-100, selection=None):
        """(loss, grads): mean cross-entropy over targets != ignore_index (float64) and the
        gradient of every parameter (same names and shapes as the params, oracle dtype).
        If every target is ignored the loss is 0 and every gradient is 0."""
        cfg, P = self.cfg, self.params
        tokens = check_tokens(tokens, cfg.vocab_size)
        targets = check_targets(targets, tokens.shape, cfg.vocab_size, ignore_index)
        B, T = tokens.shape
        G = {n: np.zeros_like(p) for n, p in P.items()}

        state = self._forward(tokens, selection)
        logits, hn = self._head_forward(state["x"])
        loss, dlogits, _ = cross_entropy(_rows(logits), targets.reshape(-1), int(ignore_index))
        dlogits = dlogits.astype(self.dtype).reshape(logits.shape)

        # head and final LayerNorm
        dhn = _lin_backward(hn, P["rwkv.head.weight"], dlogits, G["rwkv.head.weight"])
        dx = _layernorm_backward(state["x"], P, G, "rwkv.ln_out", dhn)

        # blocks in reverse; v_first's gradient collects over RWKV blocks > 0 and reaches block 0
        dv_first = np.zeros_like(dx)
        sels = state["sels"]
        for kind, idx, x_in in reversed(state["inputs"]):
            sel = sels[idx] if kind == "attn" else None
            dx = self._block_backward(kind, idx, x_in, state["v_first"], sel, dx, dv_first, G)

        if cfg.ln0:
            dx = _layernorm_backward(state["emb"], P, G, "rwkv.blocks.0.ln0", dx)
        # embedding rows: ordered scatter-add (np.add.at accumulates repeated tokens)
        np.add.at(G["rwkv.emb.weight"], tokens.reshape(-1), _rows(dx))
        return float(loss), G
