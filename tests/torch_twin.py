"""A PyTorch twin of the rwkvx model (docs/SPEC.md §2): the outside reference of the bf16 yardstick.

Test-only: the package never imports torch. The twin takes the oracle's parameter dict (names and
layout of docs/SPEC.md §2.4) and computes the loss and every parameter gradient by torch autograd, in
one of two recipes (:data:`RECIPES`):

* ``float64``: every tensor float64. It equals ``rwkvx.oracle.Oracle`` in float64 to rounding
  (tests/test_torch_twin.py), and is fast on a GPU where the oracle is slow.
* ``autocast_bf16``: what a PyTorch user of RWKV-LM gets on the same model: float32 master
  weights, the forward under ``torch.autocast(device, torch.bfloat16)`` (matmuls take bf16 operands
  and return bf16; LayerNorm, GroupNorm, softmax and the loss run in fp32; element-wise ops follow
  torch's type promotion), and the WKV7 recurrence as RWKV-LM's "clampw" kernel does it: r, the
  decay's logit w, k, v, a and b rounded to bf16, the decay exp(-e^-1/2 sigmoid(w)) computed inside
  in fp32, an fp32 state and fp32 accumulation, the output and the six input gradients rounded to
  bf16. The model code is written as RWKV-LM writes it, so the dtypes fall where they fall there.

MoBA attention is written straightforwardly: dense [T, T] scores masked to the keys each query may
see (docs/SPEC.md §2.3 "Attn (MoBA)"); its block selection comes from the gate of the recipe or is
forced (``selection=``), as the oracle's is.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rwkvx.config import DECAY_SCALE, GN_EPS, L2_EPS, LN_EPS, Config
from rwkvx.oracle import rel_err
from rwkvx.params import check_params
from rwkvx.validate import IGNORE_INDEX, check_targets, check_tokens

RECIPES = ("float64", "autocast_bf16")
ORACLE_TOL = 1e-10       # the float64 recipe against the float64 oracle: only the order of the sums differs
MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


class WKV7(torch.autograd.Function):
    """The WKV7 recurrence of docs/SPEC.md §2.3 on [B, T, H, N] inputs of one dtype, with the decay given
    by its logit: decay = exp(-DECAY_SCALE * sigmoid(w)), as RWKV-LM's clampw kernel takes it.

    A plain sequential recurrence over t, vectorised over B and H. The state and every sum are float64
    for float64 inputs and float32 otherwise; the output and the input gradients come back in the
    inputs' dtype (for bf16 inputs: the kernel's bf16 y and bf16 gradients). The backward runs the
    adjoint recurrence in reverse over the states the forward kept."""

    @staticmethod
    def forward(ctx, r, w, k, v, a, b):
        dtype = r.dtype
        if any(t.dtype != dtype or t.shape != r.shape for t in (w, k, v, a, b)):
            raise ValueError("WKV7 inputs must share one dtype and one shape [B, T, H, N]")
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        with torch.autocast(r.device.type, enabled=False):
            r, w, k, v, a, b = (t.to(acc) for t in (r, w, k, v, a, b))
            decay = torch.exp(-DECAY_SCALE * torch.sigmoid(w))
            B, T, H, N = r.shape
            states = r.new_zeros((T + 1, B, H, N, N))       # states[t + 1] = S_t; row = value, column = key
            sa = r.new_empty((B, T, H, N))
            y = r.new_empty((B, T, H, N))
            for t in range(T):
                S = states[t]
                sa[:, t] = (S * a[:, t, :, None, :]).sum(-1)
                S = (S * decay[:, t, :, None, :] + sa[:, t, :, :, None] * b[:, t, :, None, :]
                     + v[:, t, :, :, None] * k[:, t, :, None, :])
                y[:, t] = (S * r[:, t, :, None, :]).sum(-1)
                states[t + 1] = S
        ctx.save_for_backward(r, w, k, v, a, b, decay, sa, states)
        ctx.dtype = dtype
        return y.to(dtype)

    @staticmethod
    def backward(ctx, dy):
        r, w, k, v, a, b, decay, sa, states = ctx.saved_tensors
        with torch.autocast(r.device.type, enabled=False):
            dy = dy.to(r.dtype)
            grads = [torch.empty_like(r) for _ in range(6)]
            dr, ddecay, dk, dv, da, db = grads
            dS = torch.zeros_like(states[0])
            for t in reversed(range(r.shape[1])):
                S, S_prev = states[t + 1], states[t]
                dr[:, t] = (S * dy[:, t, :, :, None]).sum(-2)
                dS = dS + dy[:, t, :, :, None] * r[:, t, :, None, :]
                dv[:, t] = (dS * k[:, t, :, None, :]).sum(-1)
                dk[:, t] = (dS * v[:, t, :, :, None]).sum(-2)
                db[:, t] = (dS * sa[:, t, :, :, None]).sum(-2)
                dsa = (dS * b[:, t, :, None, :]).sum(-1)
                ddecay[:, t] = (dS * S_prev).sum(-2)
                da[:, t] = (S_prev * dsa[..., :, None]).sum(-2)
                dS = dS * decay[:, t, :, None, :] + dsa[..., :, None] * a[:, t, :, None, :]
            s = torch.sigmoid(w)
            grads[1] = ddecay * decay * (-DECAY_SCALE) * s * (1 - s)
        return tuple(g.to(ctx.dtype) for g in grads)


def wkv7(r, w, k, v, a, b, head_size: int, recipe: str) -> torch.Tensor:
    """y [B, T, C] of the WKV7 recurrence on [B, T, C] inputs (w: the decay's logit); ``autocast_bf16``
    rounds the six inputs to bf16 first, as the clampw kernel's caller does."""
    B, T, C = r.shape
    ins = (r, w, k, v, a, b)
    if recipe == "autocast_bf16":
        ins = tuple(t.to(torch.bfloat16) for t in ins)
    return WKV7.apply(*(t.reshape(B, T, C // head_size, head_size) for t in ins)).reshape(B, T, C)


# ---------------------------------------------------------------- the model, written as RWKV-LM writes it

def _shift(x):
    """shift(x)_t = x_{t-1}, zero at t = 0 of every sequence ([B, T, C])."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def _layer_norm(P, name, x):
    return F.layer_norm(x, x.shape[-1:], P[name + ".weight"], P[name + ".bias"], LN_EPS)


def _time_mix(P, pre, layer, x, v_first, N, recipe):
    a = pre + "att."
    B, T, C = x.shape
    H = C // N
    xx = _shift(x) - x
    xr, xw, xk, xv, xa, xg = (x + xx * P[a + m] for m in MIXES)
    r = F.linear(xr, P[a + "receptance.weight"])
    w = P[a + "w0"] + torch.tanh(xw @ P[a + "w1"]) @ P[a + "w2"]        # the decay's logit
    k = F.linear(xk, P[a + "key.weight"])
    v = F.linear(xv, P[a + "value.weight"])
    rate = torch.sigmoid(P[a + "a0"] + (xa @ P[a + "a1"]) @ P[a + "a2"])
    g = torch.sigmoid(xg @ P[a + "g1"]) @ P[a + "g2"]
    kk = F.normalize((k * P[a + "k_k"]).view(B, T, H, N), dim=-1, p=2.0, eps=L2_EPS).view(B, T, C)
    k = k * (1 + (rate - 1) * P[a + "k_a"])
    if layer == 0:
        v_first = v
    else:
        v = v + (v_first - v) * torch.sigmoid(P[a + "v0"] + (xv @ P[a + "v1"]) @ P[a + "v2"])
    y = wkv7(r, w, k, v, -kk, kk * rate, N, recipe)
    y = F.group_norm(y.view(B * T, C), H, P[a + "ln_x.weight"], P[a + "ln_x.bias"], GN_EPS).view(B, T, C)
    bonus = (r.view(B, T, H, N) * k.view(B, T, H, N) * P[a + "r_k"]).sum(dim=-1, keepdim=True)
    y = y + (bonus * v.view(B, T, H, N)).view(B, T, C)
    return F.linear(y * g, P[a + "output.weight"]), v_first


def _channel_mix(P, pre, x):
    f = pre + "ffn."
    k = x + (_shift(x) - x) * P[f + "x_k"]
    k = torch.relu(F.linear(k, P[f + "key.weight"])) ** 2
    return F.linear(k, P[f + "value.weight"])


def moba_select(q, k, chunk: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(selection int64 [B, H, T, top_k-1], gate margins float64 [B, H, T]) from q, k [B, T, H, N], in
    the oracle's format: per query the top_k-1 past blocks by gate q . mean(k over the block), ascending,
    -1 padded; the margin is the last chosen gate minus the best one left out (+inf where nothing is
    left out). The gate is computed in the dtype of q and k; ties (which real inputs do not produce)
    may break otherwise than the oracle's lower-block rule."""
    B, T, H, N = q.shape
    K1 = top_k - 1
    nblk = -(-T // chunk)
    with torch.no_grad():
        pad = nblk * chunk - T
        counts = torch.full((nblk,), float(chunk), device=q.device, dtype=torch.float64)
        counts[-1] = chunk - pad
        sums = F.pad(k, (0, 0, 0, 0, 0, pad)).view(B, nblk, chunk, H, N).sum(2)
        means = sums / counts.to(sums.dtype)[None, :, None, None]
        gates = torch.einsum("bthn,bjhn->bhtj", q, means).double()
        blk = torch.arange(T, device=q.device) // chunk
        past = torch.arange(nblk, device=q.device)[None, :] < blk[:, None]
        gates = F.pad(gates.masked_fill(~past, -torch.inf), (0, max(0, K1 + 1 - nblk)), value=-torch.inf)
        top, idx = gates.topk(K1 + 1, dim=-1)
        gaps = torch.full((B, H, T), torch.inf, dtype=torch.float64, device=q.device)
        if K1 == 0:
            return idx[..., :0], gaps
        left_out = top[..., K1] > -torch.inf
        gaps[left_out] = (top[..., K1 - 1] - top[..., K1])[left_out]
        chosen = torch.where(top[..., :K1] > -torch.inf, idx[..., :K1], nblk).sort(dim=-1).values
        return chosen.masked_fill(chosen == nblk, -1), gaps


def _moba_attention(q, k, v, chunk: int, selection: torch.Tensor) -> torch.Tensor:
    """o [B, T, H, N]: softmax attention of each query over its visible keys (the selected blocks and
    its own block up to itself), scores scaled by 1/sqrt(N)."""
    B, T, H, N = q.shape
    nblk = -(-T // chunk)
    pos = torch.arange(T, device=q.device)
    blk = pos // chunk
    chosen = torch.zeros((B, H, T, nblk + 1), dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, selection.masked_fill(selection < 0, nblk), True)
    visible = chosen[..., blk] | ((blk[:, None] == blk[None, :]) & (pos[None, :] <= pos[:, None]))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = (qh @ kh.transpose(-1, -2)) * N ** -0.5
    p = torch.softmax(scores.masked_fill(~visible, -torch.inf), dim=-1)
    return (p @ vh).transpose(1, 2)


def _attention(P, pre, x, cfg, forced):
    a = pre + "att."
    B, T, C = x.shape
    N = cfg.head_size
    q, k, v = (F.linear(x, P[a + n + ".weight"]).view(B, T, C // N, N) for n in ("receptance", "key", "value"))
    own, gaps = moba_select(q, k, cfg.moba_chunk_size, cfg.moba_top_k)
    selection = own if forced is None else forced
    o = _moba_attention(q, k, v, cfg.moba_chunk_size, selection).reshape(B, T, C)
    return F.linear(o, P[a + "output.weight"]), own, gaps


def _loss(cfg, P, tokens, targets, ignore_index, recipe, forced):
    """(loss, own selections, gate margins) of the forward; the graph is kept for the backward."""
    x = F.embedding(tokens, P["rwkv.emb.weight"])
    if cfg.ln0:
        x = _layer_norm(P, "rwkv.blocks.0.ln0", x)
    v_first = None
    selections, gaps = [], []
    for kind, idx in cfg.block_order():
        if kind == "rwkv":
            pre = f"rwkv.blocks.{idx}."
            out, v_first = _time_mix(P, pre, idx, _layer_norm(P, pre + "ln1", x), v_first, cfg.head_size, recipe)
        else:
            pre = f"moba.{idx}."
            out, own, gap = _attention(P, pre, _layer_norm(P, pre + "ln1", x), cfg,
                                       None if forced is None else forced[idx])
            selections.append(own)
            gaps.append(gap)
        x = x + out
        x = x + _channel_mix(P, pre, _layer_norm(P, pre + "ln2", x))
    logits = F.linear(_layer_norm(P, "rwkv.ln_out", x), P["rwkv.head.weight"])
    loss = F.cross_entropy(logits.view(-1, cfg.vocab_size), targets.view(-1), ignore_index=ignore_index)
    return loss, selections, gaps


@dataclass
class TwinResult:
    """What :func:`loss_and_grads` returns: the loss; every parameter's gradient (float64 numpy, the
    params' names and shapes); per attention block the selection the recipe's own gate makes (int32
    [B, H, T, top_k-1]) and its gate margins (float64 [B, H, T]), also when another selection was forced."""

    loss: float
    grads: dict[str, np.ndarray]
    selection: list[np.ndarray]
    gate_gaps: list[np.ndarray]


def loss_and_grads(cfg: Config, params: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
                   recipe: str = "float64", device: str | torch.device = "cpu",
                   ignore_index: int = IGNORE_INDEX, selection: list | None = None) -> TwinResult:
    """The mean cross-entropy over the targets that are not ``ignore_index`` and its gradient for every
    parameter, computed by ``recipe`` (one of :data:`RECIPES`) on ``device``. ``params``: the oracle's
    dict (numpy, any float dtype; held as float64 in ``float64``, as float32 master weights in
    ``autocast_bf16``). ``selection``: per attention block the MoBA blocks to use (int [B, H, T, top_k-1],
    the oracle's format), None to use the recipe's own gate."""
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg must be an rwkvx.Config, got {type(cfg).__name__}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    check_params(cfg, params)
    tokens = check_tokens(tokens, cfg.vocab_size)
    targets = check_targets(targets, tokens.shape, cfg.vocab_size, ignore_index)
    device = torch.device(device)
    if selection is not None:
        shape = (tokens.shape[0], cfg.n_head, tokens.shape[1], cfg.moba_top_k - 1)
        if len(selection) != cfg.n_attn_layer or any(np.shape(s) != shape for s in selection):
            raise ValueError(f"selection must hold {cfg.n_attn_layer} arrays of shape {shape}")
        selection = [torch.as_tensor(np.asarray(s, dtype=np.int64), device=device) for s in selection]
    dtype = torch.float64 if recipe == "float64" else torch.float32
    P = {n: torch.tensor(np.asarray(p), dtype=dtype, device=device, requires_grad=True) for n, p in params.items()}
    tok, tgt = (torch.as_tensor(t, device=device) for t in (tokens, targets))
    context = (torch.autocast(device.type, dtype=torch.bfloat16) if recipe == "autocast_bf16"
               else contextlib.nullcontext())
    with context:
        loss, own, gaps = _loss(cfg, P, tok, tgt, int(ignore_index), recipe, selection)
    loss.backward()
    grads = {n: (np.zeros(p.shape) if p.grad is None else p.grad.double().cpu().numpy()) for n, p in P.items()}
    return TwinResult(loss.item(), grads, [s.cpu().numpy().astype(np.int32) for s in own],
                      [g.cpu().numpy() for g in gaps])


def assert_matches(result: TwinResult, loss: float, grads: dict[str, np.ndarray], tol: float = ORACLE_TOL) -> None:
    """Assert that ``result`` has the loss and every gradient of a reference (``loss``, ``grads``: the
    oracle's), each within ``tol`` relative (docs/SPEC.md §4's rel_err per tensor)."""
    assert abs(result.loss - loss) <= tol * abs(loss), (result.loss, loss)
    assert set(result.grads) == set(grads)
    errors = {n: rel_err(result.grads[n], g) for n, g in grads.items()}
    bad = {n: e for n, e in errors.items() if e > tol}
    assert not bad, bad
