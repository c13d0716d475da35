"""The oracle model: RWKV-X forward and hand-written backward on the CPU (docs/SPEC.md §2.3).

Readable reference, not a fast path. The model is the op twins of the GPU kernel families (one
module each: embedding, layernorm, timemix, wkv7, moba, channelmix, loss) chained by GEMMs
(``_common.matmul``), so each formula is written once and the GPU unit tests check the same
functions the model runs. Every sub-layer is a ``*_forward`` returning its output and a cache of
what its backward needs, followed by the matching ``*_backward``.

Activations are rows [R, C] in the oracle's dtype (R = B*T, row r = token r % T of sequence
r // T). A float32 oracle keeps float32 tensors between ops and each op computes in float64,
rounding its outputs once (see _common); the cross-entropy is float64 always. Element-wise sums
of op outputs (residuals, gradient contributions) are plain, exactly rounded, IEEE adds.

Memory is kept small: the forward keeps only each block's input (plus v_first); the
backward recomputes one block's forward from its input, then backpropagates through it. Parameter
gradients accumulate with ``+=`` into one zeroed dict, so a parameter used twice would still be
right.

Generation runs the same sub-layers statefully (:meth:`Oracle.stateful_forward`): each block's
forward takes a ``carry`` dict, the :class:`DecodeState` of that block, reads what the tokens before
need (the token shifts' previous rows, the WKV state, the MoBA keys, values and block means) and
writes it back for the next call. A call on T new tokens processes them in parallel; the prompt is
one call, every generated token another.

Initial states (state tuning, :mod:`rwkvx.state_tuning`): an Oracle built with ``states`` starts the
WKV recurrence of every RWKV block from its state s0 [H, N, N] (shared by the batch) instead of 0, in
every forward, and :meth:`Oracle.loss_and_grads` then also returns each state's gradient.

LoRA (:mod:`rwkvx.lora`): an Oracle built with ``lora`` factors computes every adapted projection as
x·Wᵀ + s·(x·A)·B (``_proj``) and returns the factors' gradients too. It holds the factors among its
parameters, B multiplied by s beforehand, so the block functions read them by name like any weight;
the gradient of s·B times s is B's.
"""
from __future__ import annotations

import numpy as np

from rwkvx.config import Config
from rwkvx.lora import check_factors, check_scale, factor_names
from rwkvx.params import check_params
from rwkvx.state_tuning import check_states, state_name
from rwkvx.validate import check_targets, check_tokens

from ._common import LN_EPS, last_rows, matmul
from .channelmix import (channel_mix_shift_backward, channel_mix_shift_forward, relu_sq_backward,
                         relu_sq_forward)
from .embedding import embedding_backward, embedding_forward
from .layernorm import layernorm_backward, layernorm_forward
from .loss import cross_entropy
from .moba import (moba_attention_backward, moba_attention_cached, moba_attention_forward,
                   moba_block_means, moba_gate_gaps)
from .timemix import (sigmoid_backward, sigmoid_forward, tanh_backward, tanh_forward,
                      time_mix_gn_backward, time_mix_gn_forward, time_mix_prep_backward,
                      time_mix_prep_forward, time_shift_backward, time_shift_forward)
from .wkv7 import wkv7_backward, wkv7_forward

MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")   # time_shift_forward's order
QKV = ("receptance", "key", "value")


# ---------------------------------------------------------------- GEMMs and gradient bookkeeping

def _linear(x, W):
    """Lin(x; W) = x @ W^T for W [out, in] (PyTorch layout)."""
    return matmul(x, W.T)


def _linear_backward(x, W, dy):
    """(dx, dW) of y = x @ W^T: dx = dy @ W, dW = dy^T @ x."""
    return matmul(dy, W), matmul(dy.T, x)


def _lora_backward(x, W, dy):
    """(dx, dW) of y = x @ W (LoRA layout W [in, out]): dx = dy @ W^T, dW = x^T @ dy."""
    return matmul(dy, W.T), matmul(x.T, dy)


def _proj(P, name, x):
    """Lin(x; P[name]) for the projection ``name``, plus its LoRA update (x·A)·(s·B) when P holds
    factors for it (the Oracle keeps B already multiplied by the scale s)."""
    y = _linear(x, P[name])
    a, b = factor_names(name)
    if a in P:
        y = y + matmul(matmul(x, P[a]), P[b])
    return y


def _proj_backward(P, G, name, x, dy):
    """Backward of :func:`_proj`: adds the gradient of W (and of A and of s·B, under the factors'
    names) to G; returns dx."""
    dx, dW = _linear_backward(x, P[name], dy)
    G[name] += dW
    a, b = factor_names(name)
    if a in P:
        dh, dsb = _lora_backward(matmul(x, P[a]), P[b], dy)
        dxa, dA = _lora_backward(x, P[a], dh)
        G[a] += dA
        G[b] += dsb
        dx = dx + dxa
    return dx


def _accumulate(G, prefix, grads):
    """G[prefix + name] += grad for each (name, grad), reshaped to the parameter's shape."""
    for name, grad in grads.items():
        G[prefix + name] += grad.reshape(G[prefix + name].shape)


def _bthn(T, N, x):
    """[R, C] -> [B, T, H, N] view, the layout of the WKV7 and MoBA twins."""
    R, C = x.shape
    return x.reshape(R // T, T, C // N, N)


# ---------------------------------------------------------------- LayerNorm

def _layernorm_forward(P, name, x):
    return layernorm_forward(x, P[name + ".weight"], P[name + ".bias"], LN_EPS)


def _layernorm_backward(P, G, name, x, dy):
    dx, dw, db = layernorm_backward(x, P[name + ".weight"], dy, LN_EPS)
    _accumulate(G, name, {".weight": dw, ".bias": db})
    return dx


# ---------------------------------------------------------------- ChannelMix
# k = relu(Lin(x + (shift(x)-x)*x_k; key))^2 ; out = Lin(k; value)

def channel_mix_forward(P: dict, pre: str, x: np.ndarray, T: int,
                        carry: dict | None = None) -> tuple[np.ndarray, tuple]:
    """ChannelMix of block ``pre`` on x = LN2 output [R, C]; returns (out, cache). ``carry``
    (stateful forward): cm_x [B, C], the LN2 output before these tokens, replaced by their last."""
    f = pre + "ffn."
    xk = channel_mix_shift_forward(x, P[f + "x_k"], T, None if carry is None else carry["cm_x"])
    if carry is not None:
        carry["cm_x"] = last_rows(x, T)
    h = _proj(P, f + "key.weight", xk)
    k = relu_sq_forward(h)
    return _proj(P, f + "value.weight", k), (x, xk, h, k)


def channel_mix_backward(P: dict, G: dict, pre: str, cache: tuple, dout: np.ndarray,
                         T: int) -> np.ndarray:
    """Backward of :func:`channel_mix_forward`; returns dx."""
    f = pre + "ffn."
    x, xk, h, k = cache
    dk = _proj_backward(P, G, f + "value.weight", k, dout)
    dxk = _proj_backward(P, G, f + "key.weight", xk, relu_sq_backward(dk, h))
    dx, dmix = channel_mix_shift_backward(dxk, x, P[f + "x_k"], T)
    _accumulate(G, f, {"x_k": dmix})
    return dx


# ---------------------------------------------------------------- TimeMix (RWKV-7 x070)

def time_mix_forward(P: dict, pre: str, layer: int, x: np.ndarray, v_first: np.ndarray | None,
                     T: int, N: int, carry: dict | None = None,
                     s0: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """TimeMix of RWKV block ``layer`` on x = LN1 output [R, C]: token shift, the r/k/v GEMMs and
    LoRAs, the prep, WKV7, GroupNorm + bonus + gate, the output GEMM. Returns (out, v_first, cache);
    block 0 defines v_first (its value before the residual mix), later blocks pass it on.
    ``carry`` (stateful forward): tm_x [B, C] (the LN1 output before these tokens) and wkv
    [B, H, N, N] (the WKV state before them), replaced by those after the last token. ``s0``
    [1, H, N, N]: the WKV state before each sequence (None: zero) when there is no carry."""
    a = pre + "att."
    C = x.shape[1]
    mixes = np.stack([P[a + m].reshape(C) for m in MIXES])
    xs = time_shift_forward(x, mixes, T, None if carry is None else carry["tm_x"])
    xr, xw, xk, xv, xa, xg = xs
    r, k, v = (_proj(P, a + n + ".weight", xi) for xi, n in zip((xr, xk, xv), QKV))
    wh = tanh_forward(matmul(xw, P[a + "w1"]))          # decay LoRA hidden layer
    ah = matmul(xa, P[a + "a1"])                        # in-context rate LoRA
    gh = sigmoid_forward(matmul(xg, P[a + "g1"]))       # gate LoRA
    vh = matmul(xv, P[a + "v1"]) if layer > 0 else None  # value-residual LoRA (no v1 in block 0)
    prep_in = (k, v, matmul(wh, P[a + "w2"]), matmul(ah, P[a + "a2"]),
               matmul(vh, P[a + "v2"]) if layer > 0 else None, v_first,
               P[a + "w0"], P[a + "a0"], P[a + "v0"] if layer > 0 else None,
               P[a + "k_k"], P[a + "k_a"], N, layer)
    pr = time_mix_prep_forward(*prep_in)
    wkv_in = [_bthn(T, N, t) for t in (r, pr["decay"], pr["kp"], pr["vp"], pr["wa"], pr["wb"])]
    if carry is None:
        y = wkv7_forward(*wkv_in, state=s0)
    else:
        y, carry["wkv"] = wkv7_forward(*wkv_in, state=carry["wkv"], return_state=True)
        carry["tm_x"] = last_rows(x, T)
    y = y.reshape(x.shape)
    gn_in = (y, r, pr["kp"], pr["vp"], matmul(gh, P[a + "g2"]), P[a + "ln_x.weight"],
             P[a + "ln_x.bias"], P[a + "r_k"], N)
    z = time_mix_gn_forward(*gn_in)
    cache = dict(x=x, mixes=mixes, xs=xs, wh=wh, ah=ah, gh=gh, vh=vh, prep_in=prep_in,
                 wkv_in=wkv_in, s0=s0, gn_in=gn_in, z=z)
    return _proj(P, a + "output.weight", z), pr["v_first"], cache


def time_mix_backward(P: dict, G: dict, pre: str, layer: int, cache: dict, dout: np.ndarray,
                      dv_first: np.ndarray, T: int, N: int) -> np.ndarray:
    """Backward of :func:`time_mix_forward`; returns dx. ``dv_first`` [R, C] is the running
    gradient of v_first: blocks > 0 add to it (in place), block 0 consumes it into its value. With
    an initial state s0, its gradient goes to ``G[state_name(layer)]``."""
    a = pre + "att."
    c = cache
    xr, xw, xk, xv, xa, xg = c["xs"]
    dz = _proj_backward(P, G, a + "output.weight", c["z"], dout)
    gn = time_mix_gn_backward(*c["gn_in"], dz)
    wkv_grads = wkv7_backward(*c["wkv_in"], _bthn(T, N, gn["dy"]), state=c["s0"])
    dr, d_decay, dkp, dvp, dwa, dwb = (d.reshape(dout.shape) for d in wkv_grads[:6])
    if c["s0"] is not None:
        G[state_name(layer)] += wkv_grads[6][0]
    pb = time_mix_prep_backward(*c["prep_in"], d_decay, dkp + gn["dkp"], dvp + gn["dvp"], dwa, dwb,
                                dv_first if layer == 0 else None)
    grads = {"ln_x.weight": gn["dln_w"], "ln_x.bias": gn["dln_b"],
             "r_k": gn["dr_k"], "w0": pb["dw0"], "a0": pb["da0"], "k_k": pb["dk_k"],
             "k_a": pb["dk_a"]}

    dgh, grads["g2"] = _lora_backward(c["gh"], P[a + "g2"], gn["dg"])
    dxg, grads["g1"] = _lora_backward(xg, P[a + "g1"], sigmoid_backward(c["gh"], dgh))
    dwh, grads["w2"] = _lora_backward(c["wh"], P[a + "w2"], pb["dwl"])
    dxw, grads["w1"] = _lora_backward(xw, P[a + "w1"], tanh_backward(c["wh"], dwh))
    dah, grads["a2"] = _lora_backward(c["ah"], P[a + "a2"], pb["dal"])
    dxa, grads["a1"] = _lora_backward(xa, P[a + "a1"], dah)
    dxr = _proj_backward(P, G, a + "receptance.weight", xr, dr + gn["dr"])
    dxk = _proj_backward(P, G, a + "key.weight", xk, pb["dk"])
    dxv = _proj_backward(P, G, a + "value.weight", xv, pb["dv"])
    if layer > 0:
        dv_first += pb["dvf"]
        grads["v0"] = pb["dv0"]
        dvh, grads["v2"] = _lora_backward(c["vh"], P[a + "v2"], pb["dvl"])
        dxv_lora, grads["v1"] = _lora_backward(xv, P[a + "v1"], dvh)
        dxv = dxv + dxv_lora

    dx, dmixes = time_shift_backward(c["x"], c["mixes"], np.stack([dxr, dxw, dxk, dxv, dxa, dxg]), T)
    grads.update(zip(MIXES, dmixes))
    _accumulate(G, a, grads)
    return dx


# ---------------------------------------------------------------- MoBA attention

def attention_forward(P: dict, pre: str, x: np.ndarray, T: int, N: int, chunk: int, top_k: int,
                      selection: np.ndarray | None,
                      carry: dict | None = None) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Attention of block ``pre`` (moba.j.) on x = LN1 output [R, C]; returns (out, sel, cache).
    ``carry`` (stateful forward; no forced selection): k, v [B, t0, H, N] (every key and value
    before these tokens) and kmean [B, H, t0 // chunk, N] (the means of their complete blocks),
    extended by these tokens."""
    a = pre + "att."
    q, k, v = (_proj(P, a + n + ".weight", x) for n in QKV)
    if carry is None:
        o, sel = moba_attention_forward(_bthn(T, N, q), _bthn(T, N, k), _bthn(T, N, v), chunk, top_k,
                                        selection=selection)
    else:
        k_all = np.concatenate([carry["k"], _bthn(T, N, k)], axis=1)
        v_all = np.concatenate([carry["v"], _bthn(T, N, v)], axis=1)
        done, full = carry["kmean"].shape[2], k_all.shape[1] // chunk   # complete blocks before, after
        kmean = np.concatenate([carry["kmean"],
                                moba_block_means(k_all[:, done * chunk:full * chunk], chunk)], axis=2)
        o, sel = moba_attention_cached(_bthn(T, N, q), k_all, v_all, kmean, chunk, top_k)
        carry.update(k=k_all, v=v_all, kmean=kmean)
    o = o.reshape(x.shape)
    return _proj(P, a + "output.weight", o), sel, (x, q, k, v, o, sel)


def attention_backward(P: dict, G: dict, pre: str, cache: tuple, dout: np.ndarray, T: int, N: int,
                       chunk: int, top_k: int) -> np.ndarray:
    """Backward of :func:`attention_forward` with its selection held fixed; returns dx."""
    a = pre + "att."
    x, q, k, v, o, sel = cache
    do = _proj_backward(P, G, a + "output.weight", o, dout)
    dqkv = moba_attention_backward(_bthn(T, N, q), _bthn(T, N, k), _bthn(T, N, v),
                                   _bthn(T, N, do), chunk, top_k, sel)
    dx = np.zeros_like(x)
    for n, d in zip(QKV, dqkv):
        dx += _proj_backward(P, G, a + n + ".weight", x, d.reshape(x.shape))
    return dx


# ---------------------------------------------------------------- the Oracle

class DecodeState:
    """What :meth:`Oracle.stateful_forward` carries from one call to the next: ``batch`` sequences
    that have seen ``length`` tokens each, and per block ``blocks[(kind, idx)]`` (the order of
    ``Config.block_order``) a dict of arrays in the oracle's dtype:

    * every block: ``cm_x`` [B, C], the last LN2 output (the channel mix's token shift);
    * RWKV blocks: ``tm_x`` [B, C], the last LN1 output (the time mix's token shift), and ``wkv``
      [B, H, N, N], the WKV state (row = value index, column = key index);
    * MoBA blocks: ``k``, ``v`` [B, length, H, N], every key and value so far, and ``kmean``
      [B, H, length // chunk, N] (float64, as the gate), the means of the complete key blocks.
    """

    def __init__(self, batch: int, length: int, blocks: dict) -> None:
        self.batch, self.length, self.blocks = batch, length, blocks


class Oracle:
    """CPU reference of the RWKV-X model: forward, loss and every parameter gradient.

    ``dtype`` float64 (default, the ground truth) or float32: the dtype of the parameters and of
    every tensor between ops; each op computes in float64 (an ideal fp32 GPU in float32 mode), the
    cross-entropy is float64 always. Parameters are copied (converted) on construction.

    ``states``: the initial WKV state of every RWKV block (``{"blocks.{i}.att.state": [H, N, N]}``,
    :mod:`rwkvx.state_tuning`), copied in the oracle's dtype; None: zero. They start every forward
    (and :meth:`initial_state`), and :meth:`loss_and_grads` returns their gradients too.

    ``lora``: LoRA factors (``{"<matrix>.lora_A": [in, r], "<matrix>.lora_B": [r, out]}``,
    :mod:`rwkvx.lora`) and ``lora_scale`` their s = alpha / r, copied in the oracle's dtype; the
    adapted model runs everywhere and :meth:`loss_and_grads` returns the factors' gradients too.
    """

    def __init__(self, cfg: Config, params: dict, dtype=np.float64, states: dict | None = None,
                 lora: dict | None = None, lora_scale: float = 1.0) -> None:
        if not isinstance(cfg, Config):
            raise TypeError(f"cfg must be an rwkvx.Config, got {type(cfg).__name__}")
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise ValueError(f"Oracle dtype must be float32 or float64, got {dtype}")
        check_params(cfg, params)
        self.cfg = cfg
        self.dtype = dtype
        self.params = {n: np.array(p, dtype=dtype, order="C", copy=True) for n, p in params.items()}
        self.states = None if states is None else {
            n: s.astype(dtype) for n, s in check_states(cfg, states).items()}
        self.lora_scale = check_scale(lora_scale)
        for name, f in check_factors(cfg, {} if lora is None else lora).items():
            scale = self.lora_scale if name.endswith(".lora_B") else 1.0
            self.params[name] = np.array(f.astype(np.float64) * scale, dtype=dtype, order="C")

    def _s0(self, layer):
        """RWKV block ``layer``'s initial state as [1, H, N, N], or None (zero)."""
        return None if self.states is None else self.states[state_name(layer)][None]

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

    def _block_forward(self, kind, idx, x, v_first, sel, T, cache=False, carry=None):
        """One block on x [R, C]; returns (x_out, v_first, sel, caches or None). ``carry``: the
        block's DecodeState entry (stateful forward), updated in place."""
        cfg, P = self.cfg, self.params
        N = cfg.head_size
        if kind == "rwkv":
            pre = f"rwkv.blocks.{idx}."
            h1 = _layernorm_forward(P, pre + "ln1", x)
            tm, v_first, tm_cache = time_mix_forward(P, pre, idx, h1, v_first, T, N, carry,
                                                     self._s0(idx))
        else:
            pre = f"moba.{idx}."
            h1 = _layernorm_forward(P, pre + "ln1", x)
            tm, sel, tm_cache = attention_forward(P, pre, h1, T, N, cfg.moba_chunk_size,
                                                  cfg.moba_top_k, sel, carry)
        x1 = x + tm
        h2 = _layernorm_forward(P, pre + "ln2", x1)
        cm, cm_cache = channel_mix_forward(P, pre, h2, T, carry)
        caches = (pre, x1, tm_cache, cm_cache) if cache else None
        return x1 + cm, v_first, sel, caches

    def _block_backward(self, kind, idx, x, v_first, sel, dout, dv_first, G, T):
        """Recompute block (kind, idx) from its input x, then backpropagate dout; returns dx."""
        cfg, P = self.cfg, self.params
        N = cfg.head_size
        pre, x1, tm_cache, cm_cache = self._block_forward(kind, idx, x, v_first, sel, T,
                                                          cache=True)[3]
        dh2 = channel_mix_backward(P, G, pre, cm_cache, dout, T)
        dx1 = dout + _layernorm_backward(P, G, pre + "ln2", x1, dh2)
        if kind == "rwkv":
            dh1 = time_mix_backward(P, G, pre, idx, tm_cache, dx1, dv_first, T, N)
        else:
            dh1 = attention_backward(P, G, pre, tm_cache, dx1, T, N, cfg.moba_chunk_size,
                                     cfg.moba_top_k)
        return dx1 + _layernorm_backward(P, G, pre + "ln1", x, dh1)

    def _embed(self, tokens):
        """(emb, x): the embedding rows of tokens and the first block's input."""
        P = self.params
        emb = embedding_forward(tokens, P["rwkv.emb.weight"])
        return emb, (_layernorm_forward(P, "rwkv.blocks.0.ln0", emb) if self.cfg.ln0 else emb)

    def _forward(self, tokens, selection):
        """Forward to the final hidden state [R, C]; keeps what the backward needs."""
        cfg = self.cfg
        B, T = tokens.shape
        sels = self._check_selection(selection, B, T)
        emb, x = self._embed(tokens)
        v_first = None
        inputs = []                                   # (kind, idx, block input)
        out_sels = []
        for kind, idx in cfg.block_order():
            inputs.append((kind, idx, x))
            sel = sels[idx] if kind == "attn" else None
            x, v_first, sel, _ = self._block_forward(kind, idx, x, v_first, sel, T)
            if kind == "attn":
                out_sels.append(sel)
        return dict(emb=emb, inputs=inputs, x=x, v_first=v_first, sels=out_sels, T=T)

    def _head_forward(self, x):
        P = self.params
        hn = _layernorm_forward(P, "rwkv.ln_out", x)
        return _linear(hn, P["rwkv.head.weight"]), hn

    # -- public API

    def forward(self, tokens: np.ndarray, selection: list | None = None) -> np.ndarray:
        """Logits [B,T,V] (oracle dtype) for int tokens [B,T]; ``selection`` forces the MoBA blocks."""
        tokens = check_tokens(tokens, self.cfg.vocab_size)
        logits = self._head_forward(self._forward(tokens, selection)["x"])[0]
        return logits.reshape(*tokens.shape, -1)

    def initial_state(self, batch: int) -> "DecodeState":
        """The state before any token of ``batch`` sequences (zeros, or the initial WKV states the
        oracle holds; empty caches)."""
        cfg, dt = self.cfg, self.dtype
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        B, C, H, N = int(batch), cfg.n_embd, cfg.n_head, cfg.head_size
        blocks = {}
        for kind, idx in cfg.block_order():
            carry = {"cm_x": np.zeros((B, C), dt)}
            if kind == "rwkv":
                s0 = self._s0(idx)
                wkv = np.zeros((B, H, N, N), dt) if s0 is None else np.repeat(s0, B, axis=0)
                carry.update(tm_x=np.zeros((B, C), dt), wkv=wkv)
            else:
                carry.update(k=np.zeros((B, 0, H, N), dt), v=np.zeros((B, 0, H, N), dt),
                             kmean=np.zeros((B, H, 0, N)))
            blocks[(kind, idx)] = carry
        return DecodeState(B, 0, blocks)

    def stateful_forward(self, tokens: np.ndarray, state: "DecodeState | None" = None
                         ) -> tuple[np.ndarray, "DecodeState"]:
        """(logits [B,T,V], the state after them) for int tokens [B,T] that follow ``state`` (None:
        the start of the sequences). The T tokens are processed in parallel; the result equals
        :meth:`forward` on the whole sequence so far, at the T new positions. ``state`` is not
        modified (the returned one is new), so one prompt's state can start several continuations."""
        cfg = self.cfg
        tokens = check_tokens(tokens, cfg.vocab_size)
        B, T = tokens.shape
        if state is None:
            state = self.initial_state(B)
        elif not isinstance(state, DecodeState):
            raise TypeError(f"state must be a DecodeState, got {type(state).__name__}")
        elif state.batch != B:
            raise ValueError(f"state holds {state.batch} sequences, tokens {B}")
        x = self._embed(tokens)[1]
        v_first = None
        blocks = {}
        for kind, idx in cfg.block_order():
            carry = dict(state.blocks[(kind, idx)])
            x, v_first, _, _ = self._block_forward(kind, idx, x, v_first, None, T, carry=carry)
            blocks[(kind, idx)] = carry
        logits = self._head_forward(x)[0].reshape(B, T, -1)
        return logits, DecodeState(B, state.length + T, blocks)

    def moba_selection(self, tokens: np.ndarray) -> list:
        """The MoBA block selection of every attention block: list of int32 [B,H,T,top_k-1]."""
        tokens = check_tokens(tokens, self.cfg.vocab_size)
        return self._forward(tokens, None)["sels"]

    def moba_gate_gaps(self, tokens: np.ndarray) -> list:
        """Per attention block, float64 [B,H,T]: each query's gate margin between the last selected
        past block and the best one left out (+inf where nothing is left out). A GPU computing the
        gates in float32 may break ties differently where the margin is tiny."""
        cfg = self.cfg
        tokens = check_tokens(tokens, cfg.vocab_size)
        T, N = tokens.shape[1], cfg.head_size
        state = self._forward(tokens, None)
        gaps = []
        for kind, idx, x in state["inputs"]:
            if kind == "attn":
                _, q, k, _, _, _ = self._block_forward(kind, idx, x, state["v_first"], None, T,
                                                       cache=True)[3][2]
                gaps.append(moba_gate_gaps(_bthn(T, N, q), _bthn(T, N, k), cfg.moba_chunk_size,
                                           cfg.moba_top_k))
        return gaps

    def loss_and_grads(self, tokens: np.ndarray, targets: np.ndarray, ignore_index: int = -100,
                       selection: list | None = None) -> tuple[float, dict]:
        """(loss, grads): mean cross-entropy over targets != ignore_index (float64) and the
        gradient of every parameter (same names and shapes as the params, oracle dtype), plus, for
        an oracle with initial states or LoRA factors, of every state and factor (under their names;
        a weight's gradient is then the adapted model's, dL/dW at W + s·(A·B)ᵀ).
        If every target is ignored the loss is 0 and every gradient is 0."""
        cfg, P = self.cfg, self.params
        tokens = check_tokens(tokens, cfg.vocab_size)
        targets = check_targets(targets, tokens.shape, cfg.vocab_size, ignore_index)
        G = {n: np.zeros_like(p) for n, p in {**P, **(self.states or {})}.items()}

        state = self._forward(tokens, selection)
        T = state["T"]
        logits, hn = self._head_forward(state["x"])
        loss, dlogits, _ = cross_entropy(logits, targets.reshape(-1), int(ignore_index))

        # head and final LayerNorm
        dhn, dW_head = _linear_backward(hn, P["rwkv.head.weight"], dlogits.astype(self.dtype))
        _accumulate(G, "rwkv.head.", {"weight": dW_head})
        dx = _layernorm_backward(P, G, "rwkv.ln_out", state["x"], dhn)

        # blocks in reverse; v_first's gradient collects over RWKV blocks > 0 and reaches block 0
        dv_first = np.zeros_like(dx)
        sels = state["sels"]
        for kind, idx, x_in in reversed(state["inputs"]):
            sel = sels[idx] if kind == "attn" else None
            dx = self._block_backward(kind, idx, x_in, state["v_first"], sel, dx, dv_first, G, T)

        if cfg.ln0:
            dx = _layernorm_backward(P, G, "rwkv.blocks.0.ln0", state["emb"], dx)
        _accumulate(G, "rwkv.emb.", {"weight": embedding_backward(tokens, dx, cfg.vocab_size)})
        for name in G:
            if name.endswith(".lora_B"):      # P holds s·B
                G[name] *= self.lora_scale
        return float(loss), G
