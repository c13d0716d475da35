"""A PyTorch twin of the rwkvx model (docs/SPEC.md §2): the outside reference of the bf16 yardstick.

Test-only: the package never imports torch. The twin takes the oracle's parameter dict (names and
layout of docs/SPEC.md §2.4) and computes the loss and every parameter gradient by torch autograd, in
one of three recipes (:data:`RECIPES`):

* ``float64``: every tensor float64. It equals ``rwkvx.oracle.Oracle`` in float64 to rounding
  (tests/test_torch_twin.py), and is fast on a GPU where the oracle is slow.
* ``autocast_bf16``: what a PyTorch user of RWKV-LM gets on the same model: float32 master
  weights, the forward under ``torch.autocast(device, torch.bfloat16)`` (matmuls take bf16 operands
  and return bf16; LayerNorm, GroupNorm, softmax and the loss run in fp32; element-wise ops follow
  torch's type promotion), and the WKV7 recurrence as RWKV-LM's "clampw" kernel does it: r, the
  decay's logit w, k, v, a and b rounded to bf16, the decay exp(-e^-1/2 sigmoid(w)) computed inside
  in fp32, an fp32 state and fp32 accumulation, the output and the six input gradients rounded to
  bf16. The model code is written as RWKV-LM writes it, so the dtypes fall where they fall there.
* ``rwkvx_bf16``: an emulation of rwkvx's bf16 plan (rwkvx/arena.py, rwkvx/step.py) on any device:
  float64 arithmetic, rounded to bf16 (via fp32, to nearest even) exactly where rwkvx stores a buffer in
  bf16 -- a tensor's value in the forward, the gradient rwkvx stores in the backward -- and the GEMM
  operands rounded as the tensor cores take them. The roundings come in families (:data:`FAMILIES`);
  ``fp32_families`` leaves some unrounded, so that each family's share of the gradient error shows
  (scripts/bf16_error_budget.py). ``kernels`` adds the roundings inside the WKV7 and MoBA kernels
  (:data:`KERNELS`): the chunked WKV7 in fp32 with its tf32 tensor-core operands (the numpy model
  rwkvx/cu/wkv7/chunked_model.py, one TF32 pass or 3xTF32 for the chunk operators) and MoBA's mma
  kernels' bf16 probabilities and dS. Not emulated: fp32 rather than float64 arithmetic elsewhere, and the
  order of sums.

MoBA attention is written straightforwardly: dense [T, T] scores masked to the keys each query may
see (docs/SPEC.md §2.3 "Attn (MoBA)"); its block selection comes from the gate of the recipe or is
forced (``selection=``), as the oracle's is.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rwkvx.config import DECAY_SCALE, GN_EPS, L2_EPS, LN_EPS, Config
from rwkvx.cu.wkv7 import chunked_model
from rwkvx.cu.wkv7.ops import CHUNKED_HEAD_SIZES
from rwkvx.oracle import rel_err
from rwkvx.params import check_params
from rwkvx.runtime.dtypes import round_tf32
from rwkvx.validate import IGNORE_INDEX, check_targets, check_tokens

RECIPES = ("float64", "autocast_bf16", "rwkvx_bf16")
ORACLE_TOL = 1e-10       # the float64 recipe against the float64 oracle: only the order of the sums differs
MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
# The bf16 roundings of the rwkvx_bf16 recipe by family: what each rounds (rwkvx's buffer names).
FAMILIES = {
    "residual": "the residual stream emb_out, block_in.*, x1 and its gradient dx; dv_first",
    "layernorm": "the LayerNorm outputs h1, h2, lnout and their gradients",
    "shift": "the token-shift mixes xr .. xg, xk2 and their gradients",
    "lora": "the LoRA hiddens hw, ha, hv, hg (before and after tanh / sigmoid), outputs wl, al, vl, and "
            "their gradients",
    "r": "the receptance r's value (MoBA's q), which the WKV7 / MoBA and the bonus term read",
    "kv": "the key and value projections' values k, v (MoBA's k, v), which the time mix's prep (k', v', kk), block "
          "0's WKV7 and MoBA read",
    "drkv": "the projections' gradients dr, dk, dv (MoBA's dq, dk, dv) the GEMMs read, and the WKV7's dr before "
            "the bonus term's dr2 is added to it",
    "decay": "the WKV7 decay exp(-e^-1/2 sigmoid(w0 + wl)) the recurrence reads",
    "wkv_in": "the other WKV7 inputs k', v', wa, wb (their gradients are fp32 in rwkvx)",
    "y": "the WKV7 / MoBA output y and its gradient",
    "gn_gate": "the GroupNorm + gate output z, the gate g, their gradients and the bonus term's dr2, dk'2, dv'2",
    "ffn": "the channel mix's kf (before and after relu^2) and its gradient dkf (both)",
    "logits": "the logits and dlogits",
    "gemm_in": "every GEMM's activation and gradient operands, rounded as the tensor cores take them",
    "weights": "the weights as GEMM operands (rwkvx's bf16 copy params_x)",
}
# The kernel-internal roundings the rwkvx_bf16 recipe can add (``kernels=``); at most one wkv7_* and one
# moba_* of them.
KERNELS = {
    "wkv7_tf32": "the chunked WKV7 as the bf16 kernels compute it: fp32 arithmetic, every tensor-core "
                 "operand rounded to tf32 once (the chunk operators in one pass: SPLIT_OPERATORS['bf16'] False)",
    "wkv7_split": "the same with the chunk operators' products in 3xTF32 (SPLIT_OPERATORS['bf16'] True)",
    "wkv7_exact": "every product of the chunked WKV7 in 3xTF32, the state products included (chunked_exact's "
                  "products on bf16 inputs)",
    "moba_bf16": "MoBA's mma kernels: the probabilities P and dS rounded to bf16 as the second products' "
                 "operands, delta from the output before its bf16 rounding (o + olo)",
    "moba_bf16_delta": "the same with delta from the bf16 output alone (no residual olo kept)",
    "moba_split_ds": "the same with dS as a bf16 hi + lo pair for dq and dk (two mma per step), P still bf16",
    "ffn_kf_fp32": "the channel mix's relu^2 taken from kf in fp32 (the key GEMM's output, not kept) and "
                   "stored bf16; dkf and the rest of the family ffn as it is",
}


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (through fp32, to nearest even, as a kernel's fp32 result is stored), in x's dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


class _Round(torch.autograd.Function):
    """Identity, with the value (forward) and / or the incoming gradient (backward) rounded to bf16."""

    @staticmethod
    def forward(ctx, x, value: bool, grad: bool):
        ctx.grad = grad
        return bf16_round(x) if value else x.clone()

    @staticmethod
    def backward(ctx, g):
        return (bf16_round(g) if ctx.grad else g), None, None


class _Gemm(torch.autograd.Function):
    """x @ w^T with the operands rounded to bf16 where asked: x and the output's gradient (``acts``), w
    (``weights``); the backward's products take the same operands, as rwkvx's dgrad and wgrad GEMMs do."""

    @staticmethod
    def forward(ctx, x, w, acts: bool, weights: bool):
        x, w = (bf16_round(x) if acts else x), (bf16_round(w) if weights else w)
        ctx.save_for_backward(x, w)
        ctx.acts = acts
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = bf16_round(g) if ctx.acts else g
        return g @ w, g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1]), None, None


_ACTIVATIONS = {     # f(x), and f' from the output y: rwkvx's backward kernels read the stored output
    "tanh": (torch.tanh, lambda y: 1 - y * y),
    "sigmoid": (torch.sigmoid, lambda y: y * (1 - y)),
    "relu_sq": (lambda x: torch.relu(x) ** 2, lambda y: 2 * torch.sqrt(y)),
}


class _Activation(torch.autograd.Function):
    """An activation computed in place on a bf16 buffer: its output, and the gradient that arrives at it,
    rounded to bf16, and the derivative taken from the rounded output."""

    @staticmethod
    def forward(ctx, x, kind: str):
        y = bf16_round(_ACTIVATIONS[kind][0](x))
        ctx.save_for_backward(y)
        ctx.kind = kind
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return bf16_round(g) * _ACTIVATIONS[ctx.kind][1](y), None


class Rounding:
    """The bf16 roundings ``recipe`` makes: those of the families in ``rounded`` (:data:`FAMILIES`); with
    none, every method is the plain operation (the float64 and autocast recipes). ``decay_logit``: the
    family ``decay`` rounds the decay's logit instead of the decay; ``kernels``: the kernel-internal
    roundings of :data:`KERNELS` (see :func:`loss_and_grads`)."""

    def __init__(self, recipe: str, rounded: Iterable[str], decay_logit: bool = False, kernels: Iterable[str] = ()):
        self.recipe = recipe
        self.rounded = frozenset(rounded)
        self.decay_logit = decay_logit
        self.kernels = frozenset(kernels)

    def __call__(self, x: torch.Tensor, family: str, grad_family: str | None = None) -> torch.Tensor:
        """x as a stored buffer of ``family``: its value rounded, and its gradient as a stored buffer of
        ``grad_family`` (by default ``family`` too)."""
        value = family in self.rounded
        grad = (family if grad_family is None else grad_family) in self.rounded
        return _Round.apply(x, value, grad) if value or grad else x

    def value(self, x: torch.Tensor, family: str) -> torch.Tensor:
        """x with its value rounded (a buffer whose gradient rwkvx keeps in fp32, or never stores)."""
        return _Round.apply(x, True, False) if family in self.rounded else x

    def grad(self, x: torch.Tensor, family: str) -> torch.Tensor:
        """x with the gradient that arrives through this use rounded (one consumer's stored gradient)."""
        return _Round.apply(x, False, True) if family in self.rounded else x

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T as a GEMM, its operands rounded by the families gemm_in and weights."""
        acts, weights = "gemm_in" in self.rounded, "weights" in self.rounded
        return _Gemm.apply(x, w, acts, weights) if acts or weights else F.linear(x, w)

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w as a GEMM (a LoRA matrix w [in, out])."""
        return self.linear(x, w.T) if self.rounded else x @ w

    def activation(self, kind: str, x: torch.Tensor, family: str) -> torch.Tensor:
        """tanh, sigmoid or relu^2 of x, computed in place on a buffer of ``family``."""
        if family not in self.rounded:
            return _ACTIVATIONS[kind][0](x)
        return _Activation.apply(x, kind)


class WKV7(torch.autograd.Function):
    """The WKV7 recurrence of docs/SPEC.md §2.3 on [B, T, H, N] inputs of one dtype, with the decay given
    by its logit: decay = exp(-DECAY_SCALE * sigmoid(w)), as RWKV-LM's clampw kernel takes it. With
    ``round_decay`` the recurrence reads the decay rounded to bf16 while the gradient of w takes the
    derivative of the exact decay, as rwkvx's bf16 plan does (a bf16 decay buffer; the time mix's prep
    backward recomputes the decay in fp32).

    A plain sequential recurrence over t, vectorised over B and H. The state and every sum are float64
    for float64 inputs and float32 otherwise; the output and the input gradients come back in the
    inputs' dtype (for bf16 inputs: the kernel's bf16 y and bf16 gradients). The backward runs the
    adjoint recurrence in reverse over the states the forward kept."""

    @staticmethod
    def forward(ctx, r, w, k, v, a, b, round_decay: bool = False):
        dtype = r.dtype
        if any(t.dtype != dtype or t.shape != r.shape for t in (w, k, v, a, b)):
            raise ValueError("WKV7 inputs must share one dtype and one shape [B, T, H, N]")
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        with torch.autocast(r.device.type, enabled=False):
            r, w, k, v, a, b = (t.to(acc) for t in (r, w, k, v, a, b))
            exact = torch.exp(-DECAY_SCALE * torch.sigmoid(w))
            decay = bf16_round(exact) if round_decay else exact
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
        ctx.save_for_backward(r, w, k, v, a, b, decay, exact, sa, states)
        ctx.dtype = dtype
        return y.to(dtype)

    @staticmethod
    def backward(ctx, dy):
        r, w, k, v, a, b, decay, exact, sa, states = ctx.saved_tensors
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
            grads[1] = ddecay * exact * (-DECAY_SCALE) * s * (1 - s)
        return *(g.to(ctx.dtype) for g in grads), None


# the chunked model's roundings per wkv7_* kernel: (state products' operands, chunk operators' operands)
_WKV7_ROUNDINGS = {"wkv7_tf32": (round_tf32, round_tf32), "wkv7_split": (round_tf32, chunked_model.split3),
                   "wkv7_exact": (chunked_model.split3, chunked_model.split3)}


class ChunkedWKV7(torch.autograd.Function):
    """The WKV7 recurrence as rwkvx's chunked kernels compute it on their fp32 and bf16 inputs: the numpy
    model rwkvx/cu/wkv7/chunked_model.py per (sequence, head) in float32 with the tensor-core operands
    rounded as ``kernel`` (a wkv7_* key of :data:`KERNELS`) says. Inputs [B, T, H, N] float64 holding the
    values the kernels read (w: the decay's logit); ``round_decay`` and the gradient of w as
    :class:`WKV7`'s. The output and the gradients come back float64."""

    @staticmethod
    def forward(ctx, r, w, k, v, a, b, round_decay: bool, kernel: str):
        exact = torch.exp(-DECAY_SCALE * torch.sigmoid(w))
        decay = bf16_round(exact) if round_decay else exact
        ins = [t.detach().cpu().numpy().astype(np.float32) for t in (r, decay, k, v, a, b)]
        rnd, op = _WKV7_ROUNDINGS[kernel]
        B, T, H, N = r.shape
        y = np.empty((B, T, H, N), np.float32)
        for bb, h in np.ndindex(B, H):
            y[bb, :, h] = chunked_model.forward(*(x[bb, :, h] for x in ins), rnd=rnd, dt=np.float32, op=op)[0]
        ctx.save_for_backward(w, exact)
        ctx.ins, ctx.kernel = ins, kernel
        return torch.as_tensor(y, dtype=r.dtype, device=r.device)

    @staticmethod
    def backward(ctx, dy):
        w, exact = ctx.saved_tensors
        rnd, op = _WKV7_ROUNDINGS[ctx.kernel]
        g = np.empty((6,) + dy.shape, np.float32)
        dy_np = dy.detach().cpu().numpy().astype(np.float32)
        for bb, h in np.ndindex(dy.shape[0], dy.shape[2]):
            g[:, bb, :, h] = chunked_model.backward(*(x[bb, :, h] for x in ctx.ins), dy_np[bb, :, h], rnd=rnd,
                                                    dt=np.float32, op=op)
        grads = [torch.as_tensor(x, dtype=dy.dtype, device=dy.device) for x in g]
        s = torch.sigmoid(w)
        grads[1] = grads[1] * exact * (-DECAY_SCALE) * s * (1 - s)
        return *grads, None, None


def wkv7(r, w, k, v, a, b, head_size: int, recipe: str, round_decay: bool = False,
         kernel: str | None = None) -> torch.Tensor:
    """y [B, T, C] of the WKV7 recurrence on [B, T, C] inputs (w: the decay's logit); ``autocast_bf16``
    rounds the six inputs to bf16 first, as the clampw kernel's caller does; ``round_decay``: see :class:`WKV7`;
    ``kernel``: a wkv7_* key of :data:`KERNELS`, the chunked kernels' roundings (:class:`ChunkedWKV7`)."""
    B, T, C = r.shape
    ins = (r, w, k, v, a, b)
    if recipe == "autocast_bf16":
        ins = tuple(t.to(torch.bfloat16) for t in ins)
    ins = tuple(t.reshape(B, T, C // head_size, head_size) for t in ins)
    y = WKV7.apply(*ins, round_decay) if kernel is None else ChunkedWKV7.apply(*ins, round_decay, kernel)
    return y.reshape(B, T, C)


# ---------------------------------------------------------------- the model, written as RWKV-LM writes it
# (rd: the recipe's Rounding, named after rwkvx's buffers; the plain operation in float64 and autocast)

def _shift(x):
    """shift(x)_t = x_{t-1}, zero at t = 0 of every sequence ([B, T, C])."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def _layer_norm(P, name, x):
    return F.layer_norm(x, x.shape[-1:], P[name + ".weight"], P[name + ".bias"], LN_EPS)


def _lora(rd, x, P, first, second, activation=None):
    """(x @ first, activated) @ second with rwkvx's LoRA hidden and output buffers."""
    h = rd(rd.matmul(x, P[first]), "lora")
    if activation:
        h = rd.activation(activation, h, "lora")
    return rd.matmul(h, P[second])


def _time_mix(P, pre, layer, x, v_first, N, rd):
    a = pre + "att."
    B, T, C = x.shape
    H = C // N
    xx = _shift(x) - x
    xr, xw, xk, xv, xa, xg = (rd(x + xx * P[a + m], "shift") for m in MIXES)
    r = rd(rd.linear(xr, P[a + "receptance.weight"]), "r", "drkv")
    w = P[a + "w0"] + rd(_lora(rd, xw, P, a + "w1", a + "w2", "tanh"), "lora")     # the decay's logit
    if rd.decay_logit:
        w = rd.value(w, "decay")
    k = rd(rd.linear(xk, P[a + "key.weight"]), "kv", "drkv")
    v = rd(rd.linear(xv, P[a + "value.weight"]), "kv", "drkv")
    rate = torch.sigmoid(P[a + "a0"] + rd(_lora(rd, xa, P, a + "a1", a + "a2"), "lora"))
    g = rd(_lora(rd, xg, P, a + "g1", a + "g2", "sigmoid"), "gn_gate")
    kk = F.normalize((k * P[a + "k_k"]).view(B, T, H, N), dim=-1, p=2.0, eps=L2_EPS).view(B, T, C)
    k = rd.value(k * (1 + (rate - 1) * P[a + "k_a"]), "wkv_in")
    if layer == 0:
        v_first = v
    else:
        v_first = rd.grad(v_first, "residual")         # rwkvx accumulates dv_first over the blocks in bf16
        v = v + (v_first - v) * torch.sigmoid(P[a + "v0"] + rd(_lora(rd, xv, P, a + "v1", a + "v2"), "lora"))
        v = rd.value(v, "wkv_in")
    wa, wb = (rd.value(t, "wkv_in") for t in (-kk, kk * rate))
    round_decay = "decay" in rd.rounded and not rd.decay_logit
    kernel = next((name for name in rd.kernels if name.startswith("wkv7_")), None)
    y = rd(wkv7(rd.grad(r, "drkv"), w, k, v, wa, wb, N, rd.recipe, round_decay, kernel), "y")
    y = F.group_norm(y.view(B * T, C), H, P[a + "ln_x.weight"], P[a + "ln_x.bias"], GN_EPS).view(B, T, C)
    r, k, v = (rd.grad(t, "gn_gate").view(B, T, H, N) for t in (r, k, v))      # the bonus term's gradients
    bonus = (r * k * P[a + "r_k"]).sum(dim=-1, keepdim=True)
    y = y + (bonus * v).view(B, T, C)
    return rd.linear(rd(y * g, "gn_gate"), P[a + "output.weight"]), v_first


def _channel_mix(P, pre, x, rd):
    f = pre + "ffn."
    k = rd(x + (_shift(x) - x) * P[f + "x_k"], "shift")
    k = rd.linear(k, P[f + "key.weight"])
    k = rd.grad(k, "ffn") if "ffn_kf_fp32" in rd.kernels else rd(k, "ffn")
    k = rd.activation("relu_sq", k, "ffn")
    return rd.linear(k, P[f + "value.weight"])


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


class MobaBf16(torch.autograd.Function):
    """MoBA attention as its mma kernels round it (rwkvx/cu/moba/mma_model.py): the un-normalised
    probabilities exp(s - max) rounded to bf16 as the operand of P V (the sum that normalises them
    unrounded); in the backward P = exp(s - lse) and dS = P (dP - delta) rounded to bf16 as the operands
    of dv = P^T dO, dq = dS K and dk = dS^T Q (``split_ds``: dS as a bf16 hi + lo pair), delta from the
    output as the kernels keep it: with ``store`` (o stored in bf16) the bf16 output plus its residual
    olo rounded to bf16, with ``rounded_delta`` the bf16 output alone. q, k, v [B, H, T, N] (the kernels'
    bf16 operands), ``visible`` [B, H, T, T]; float64 arithmetic."""

    @staticmethod
    def forward(ctx, q, k, v, visible, store: bool, split_ds: bool = False, rounded_delta: bool = False):
        scale = q.shape[-1] ** -0.5
        s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~visible, -torch.inf)
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        o = (bf16_round(p) @ v) / l
        hi = bf16_round(o)
        kept = o if not store else hi if rounded_delta else hi + bf16_round(o - hi)
        ctx.save_for_backward(q, k, v, visible, m + torch.log(l), kept)
        ctx.split_ds = split_ds
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, visible, lse, o = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~visible, -torch.inf)
        p = torch.exp(s - lse)
        ds = p * (do @ v.transpose(-1, -2) - (o * do).sum(-1, keepdim=True))
        hi = bf16_round(ds)
        ds = hi + bf16_round(ds - hi) if ctx.split_ds else hi
        return ((ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, bf16_round(p).transpose(-1, -2) @ do,
                None, None, None, None)


def _moba_attention(q, k, v, chunk: int, selection: torch.Tensor, kernel: str | None = None,
                    store: bool = False) -> torch.Tensor:
    """o [B, T, H, N]: softmax attention of each query over its visible keys (the selected blocks and
    its own block up to itself), scores scaled by 1/sqrt(N); ``kernel``: a moba_* key of :data:`KERNELS`,
    the roundings of the mma kernels (:class:`MobaBf16`, ``store``: o stored in bf16)."""
    B, T, H, N = q.shape
    nblk = -(-T // chunk)
    pos = torch.arange(T, device=q.device)
    blk = pos // chunk
    chosen = torch.zeros((B, H, T, nblk + 1), dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, selection.masked_fill(selection < 0, nblk), True)
    visible = chosen[..., blk] | ((blk[:, None] == blk[None, :]) & (pos[None, :] <= pos[:, None]))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if kernel is not None:
        return MobaBf16.apply(qh, kh, vh, visible, store, kernel == "moba_split_ds",
                              kernel == "moba_bf16_delta").transpose(1, 2)
    scores = (qh @ kh.transpose(-1, -2)) * N ** -0.5
    p = torch.softmax(scores.masked_fill(~visible, -torch.inf), dim=-1)
    return (p @ vh).transpose(1, 2)


def _attention(P, pre, x, cfg, forced, rd):
    a = pre + "att."
    B, T, C = x.shape
    N = cfg.head_size
    q, k, v = (rd(rd.linear(x, P[a + n + ".weight"]), family, "drkv").view(B, T, C // N, N)
               for n, family in (("receptance", "r"), ("key", "kv"), ("value", "kv")))
    own, gaps = moba_select(q, k, cfg.moba_chunk_size, cfg.moba_top_k)
    selection = own if forced is None else forced
    kernel = next((name for name in rd.kernels if name.startswith("moba_")), None)
    o = _moba_attention(q, k, v, cfg.moba_chunk_size, selection, kernel, "y" in rd.rounded)
    o = rd(o.reshape(B, T, C), "y")
    return rd.linear(o, P[a + "output.weight"]), own, gaps


def _loss(cfg, P, tokens, targets, ignore_index, rd, forced):
    """(loss, own selections, gate margins) of the forward; the graph is kept for the backward."""
    x = rd(F.embedding(tokens, P["rwkv.emb.weight"]), "residual")
    if cfg.ln0:
        x = rd(_layer_norm(P, "rwkv.blocks.0.ln0", x), "residual")
    v_first = None
    selections, gaps = [], []
    for kind, idx in cfg.block_order():
        pre = f"rwkv.blocks.{idx}." if kind == "rwkv" else f"moba.{idx}."
        h1 = rd(_layer_norm(P, pre + "ln1", x), "layernorm")
        if kind == "rwkv":
            out, v_first = _time_mix(P, pre, idx, h1, v_first, cfg.head_size, rd)
        else:
            out, own, gap = _attention(P, pre, h1, cfg, None if forced is None else forced[idx], rd)
            selections.append(own)
            gaps.append(gap)
        x = rd(x + out, "residual")
        x = rd(x + _channel_mix(P, pre, rd(_layer_norm(P, pre + "ln2", x), "layernorm"), rd), "residual")
    logits = rd(rd.linear(rd(_layer_norm(P, "rwkv.ln_out", x), "layernorm"), P["rwkv.head.weight"]), "logits")
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
                   ignore_index: int = IGNORE_INDEX, selection: list | None = None,
                   fp32_families: Iterable[str] = (), decay_logit: bool = False,
                   kernels: Iterable[str] = ()) -> TwinResult:
    """The mean cross-entropy over the targets that are not ``ignore_index`` and its gradient for every
    parameter, computed by ``recipe`` (one of :data:`RECIPES`) on ``device``. ``params``: the oracle's
    dict (numpy, any float dtype; held as float64 in ``float64`` and ``rwkvx_bf16``, as float32 master
    weights in ``autocast_bf16``). ``selection``: per attention block the MoBA blocks to use (int [B, H,
    T, top_k-1], the oracle's format), None to use the recipe's own gate. ``fp32_families``: the
    :data:`FAMILIES` that ``rwkvx_bf16`` leaves unrounded (all of them: the float64 recipe).
    ``decay_logit``: an alternative to rwkvx's bf16 decay buffer for ``rwkvx_bf16``: the family ``decay``
    rounds the decay's logit w0 + wl to bf16 and the recurrence takes the exact decay of that, as
    RWKV-LM's clampw kernel does. ``kernels``: the kernel-internal roundings of :data:`KERNELS` that
    ``rwkvx_bf16`` adds (at most one wkv7_* and one moba_* of them; wkv7_* need a head size of the
    chunked kernels)."""
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg must be an rwkvx.Config, got {type(cfg).__name__}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    fp32_families = frozenset(fp32_families)
    if fp32_families - FAMILIES.keys():
        raise ValueError(f"fp32_families: unknown families {sorted(fp32_families - FAMILIES.keys())}; "
                         f"the families are {tuple(FAMILIES)}")
    kernels = frozenset(kernels)
    if kernels - KERNELS.keys():
        raise ValueError(f"kernels: unknown {sorted(kernels - KERNELS.keys())}; the kernels are {tuple(KERNELS)}")
    if any(len([name for name in kernels if name.startswith(kind)]) > 1 for kind in ("wkv7_", "moba_")):
        raise ValueError(f"kernels: at most one of the wkv7_* and one of the moba_* roundings, got {sorted(kernels)}")
    if any(name.startswith("wkv7_") for name in kernels) and cfg.head_size not in CHUNKED_HEAD_SIZES:
        raise ValueError(f"kernels: the chunked WKV7 takes head sizes {CHUNKED_HEAD_SIZES}, not {cfg.head_size}")
    if (fp32_families or decay_logit or kernels) and recipe != "rwkvx_bf16":
        raise ValueError(f"fp32_families, decay_logit and kernels apply to the rwkvx_bf16 recipe only, not {recipe!r}")
    check_params(cfg, params)
    tokens = check_tokens(tokens, cfg.vocab_size)
    targets = check_targets(targets, tokens.shape, cfg.vocab_size, ignore_index)
    device = torch.device(device)
    if selection is not None:
        shape = (tokens.shape[0], cfg.n_head, tokens.shape[1], cfg.moba_top_k - 1)
        if len(selection) != cfg.n_attn_layer or any(np.shape(s) != shape for s in selection):
            raise ValueError(f"selection must hold {cfg.n_attn_layer} arrays of shape {shape}")
        selection = [torch.as_tensor(np.asarray(s, dtype=np.int64), device=device) for s in selection]
    dtype = torch.float32 if recipe == "autocast_bf16" else torch.float64
    rd = Rounding(recipe, FAMILIES.keys() - fp32_families if recipe == "rwkvx_bf16" else frozenset(), decay_logit,
                  kernels)
    P = {n: torch.tensor(np.asarray(p), dtype=dtype, device=device, requires_grad=True) for n, p in params.items()}
    tok, tgt = (torch.as_tensor(t, device=device) for t in (tokens, targets))
    context = (torch.autocast(device.type, dtype=torch.bfloat16) if recipe == "autocast_bf16"
               else contextlib.nullcontext())
    with context:
        loss, own, gaps = _loss(cfg, P, tok, tgt, int(ignore_index), rd, selection)
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
