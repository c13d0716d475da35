"""The GPU model: resident weights, one scratch arena, and the training step as a list of ops.

Reading order: :class:`Layout` (every device buffer, sized from (config, B, T)), then
:class:`StepBuilder` (forward, loss, backward, op by op, the seed's structure: each block's forward
is recomputed from its saved input during the backward), then :class:`Model` (the public API).

Building the op lists needs no GPU (pointers are base + offset), so plan construction is tested on
CPU CI; :class:`Model` allocates the arena once and runs the ops through :class:`rwkvx.runtime.Plan`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import validate
from .config import Config
from .optim import Schedule
from .ops import adamw, channelmix, embedding, layernorm, loss, moba, timemix, wkv7
from .params import ParamDict, check_params, param_shapes
from .runtime import gemm
from .runtime.ops import Copy, CopyDtoH, CopyHtoD, Memset

PRECISIONS = ("fp32", "tf32")
_ALIGN = 256  # bytes; every buffer starts 256-byte aligned (float4 kernels, cuBLAS)


def _round_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


class Layout:
    """Every device buffer of a (config, B, T) model: name -> (offset, bytes) in one arena.

    Regions: ``params``/``grads``/``adam_m``/``adam_v`` (flat, same offsets per tensor), the per-step
    inputs, one saved input per block, and one block's worth of transients shared by all blocks.
    """

    def __init__(self, cfg: Config, B: int, T: int):
        self.cfg, self.B, self.T = cfg, B, T
        self.offsets: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.total = 0
        C, F, V, H, N = cfg.n_embd, cfg.ffn_dim, cfg.vocab_size, cfg.n_head, cfg.head_size
        R = B * T
        shapes = param_shapes(cfg)
        self.param_segments, n_flat = adamw.flat_layout(shapes)
        # name -> (offset, size) in floats; the same offsets in params, grads, adam_m and adam_v
        self.param_offsets = {seg[0]: (seg[1], seg[2]) for seg in self.param_segments}
        self.param_shapes = shapes
        for region in ("params", "grads", "adam_m", "adam_v"):
            self._add(region, 4 * n_flat)
        self.adam_table, self.adam_lrmul = adamw.build_table(self.param_segments)
        self.adam_chunks = len(self.adam_lrmul)
        self._add("adam_table", self.adam_table.nbytes)
        self._add("adam_lrmul", self.adam_lrmul.nbytes)
        self._add("adam_state", 8 * adamw.STATE_DOUBLES)
        self._add("adam_partials", adamw.scratch_bytes(self.adam_chunks))
        # per-step inputs (written from pinned host memory inside the step)
        for name in ("tokens", "targets", "emb_order"):
            self._add(name, 4 * R)
        self._add("emb_seg_start", 4 * (R + 1))
        self._add("emb_n_seg", 4)
        self._add("inv_count", 8)
        self._add("loss_t", 8 * R)
        # saved activations: each block's input and the final residual stream
        self._add("emb_out", 4 * R * C)
        for i in range(cfg.n_blocks + 1):
            self._add(f"block_in.{i}", 4 * R * C)
        self._add("v_first", 4 * R * C)
        self._add("dv_first", 4 * R * C)
        self._add("lnout", 4 * R * C)
        self._add("lnout_mean", 4 * R)
        self._add("lnout_rstd", 4 * R)
        self._add("logits", 4 * R * V)
        self._add("dx", 4 * R * C)
        self._add("dlnout", 4 * R * C)
        if cfg.n_attn_layer:
            moba_sizes = moba.scratch_sizes(B, T, H, N, cfg.moba_chunk_size, cfg.moba_top_k)
            for j in range(cfg.n_attn_layer):  # kept per block: the selection is read back after a step
                self._add(f"moba_sel.{j}", moba_sizes["sel"])
        # one block's transients, shared by every block (blocks run one after another)
        rc = ("h1", "xr", "xw", "xk", "xv", "xa", "xg", "r", "k", "v", "wl", "al", "vl", "g", "decay",
              "kp", "vp", "wa", "wb", "y", "z", "x1", "h2", "xk2",
              "dz", "dy", "dg", "dr2", "dkp2", "dvp2", "dr", "ddecay", "dkp", "dvp", "dwa", "dwb",
              "dk", "dv", "dwl", "dal", "dvl", "dxr", "dxw", "dxk", "dxv", "dxa", "dxg", "dh1",
              "dh2", "dxk2")
        for name in rc:
            self._add(name, 4 * R * C)
        for name, d in (("hw", cfg.dim_w), ("ha", cfg.dim_a), ("hv", cfg.dim_v), ("hg", cfg.dim_g)):
            self._add(name, 4 * R * d)
            self._add("d" + name, 4 * R * d)
        self._add("kf", 4 * R * F)
        self._add("dkf", 4 * R * F)
        for name in ("ln1_mean", "ln1_rstd", "ln2_mean", "ln2_rstd", "ln0_mean", "ln0_rstd"):
            self._add(name, 4 * R)
        wk = wkv7.scratch_bytes(B, T, H, N)
        for name, nbytes in wk.items():
            self._add("wkv_" + name, nbytes)
        if cfg.n_attn_layer:
            for name, nbytes in moba_sizes.items():
                if name != "sel":
                    self._add("moba_" + name, nbytes)
        self._add("partials", max(layernorm.scratch_bytes(R, C), channelmix.scratch_bytes(R, C),
                                  timemix.scratch_bytes(R, C, N)))

    def _add(self, name: str, nbytes: int) -> None:
        self.offsets[name] = self.total
        self.sizes[name] = nbytes
        self.total += _round_up(max(nbytes, 1))

    def bytes_per_token(self) -> float:
        """Arena bytes divided by B*T (the parameter regions included)."""
        return self.total / (self.B * self.T)


@dataclass
class StepOps:
    """The op lists of one step; ``forward`` ends with logits, ``loss`` fills dlogits in place."""
    stage_tokens: list
    stage_targets: list
    forward: list
    loss: list
    backward: list

    @property
    def step(self) -> list:
        """The whole step without the optimizer: inputs staged, forward, loss, backward."""
        return self.stage_tokens + self.stage_targets + self.forward + self.loss + self.backward


class StepBuilder:
    """Composes the step from the op builders of :mod:`rwkvx.ops` and cuBLAS GEMMs."""

    def __init__(self, layout: Layout, base: int, host: dict[str, int]):
        self.L = layout
        self.cfg = layout.cfg
        self.B, self.T = layout.B, layout.T
        self.R = self.B * self.T
        self.base = base
        self.host = host  # pinned host pointers: tokens, targets, emb_order, ...

    # -- addresses ----------------------------------------------------------------------------
    def buf(self, name: str) -> int:
        return self.base + self.L.offsets[name]

    def _param_offset(self, region: str, name: str) -> int:
        return self.buf(region) + 4 * self.L.param_offsets[name][0]

    def p(self, name: str) -> int:
        """Device address of parameter ``name``."""
        return self._param_offset("params", name)

    def gp(self, name: str) -> int:
        """Device address of the gradient of parameter ``name``."""
        return self._param_offset("grads", name)

    # -- the step -----------------------------------------------------------------------------
    def build(self) -> StepOps:
        R = self.R
        stage_tokens = [CopyHtoD(self.buf("tokens"), self.host["tokens"], 4 * R)]
        stage_targets = [CopyHtoD(self.buf(n), self.host[n], self.L.sizes[n])
                         for n in ("targets", "emb_order", "emb_seg_start", "emb_n_seg", "inv_count")]
        return StepOps(stage_tokens, stage_targets, self.forward(), self.loss(), self.backward())

    def forward(self) -> list:
        cfg, R, C, V = self.cfg, self.R, self.cfg.n_embd, self.cfg.vocab_size
        ops = []
        x0 = self.buf("block_in.0")
        if cfg.ln0:
            ops += embedding.forward(self.buf("tokens"), self.p("rwkv.emb.weight"),
                                     self.buf("emb_out"), R, C, V)
            ops += layernorm.forward(self.buf("emb_out"), self.p("rwkv.blocks.0.ln0.weight"),
                                     self.p("rwkv.blocks.0.ln0.bias"), x0,
                                     self.buf("ln0_mean"), self.buf("ln0_rstd"), R, C)
        else:
            ops += embedding.forward(self.buf("tokens"), self.p("rwkv.emb.weight"), x0, R, C, V)
        for pos, (kind, idx) in enumerate(cfg.block_order()):
            xin, xout = self.buf(f"block_in.{pos}"), self.buf(f"block_in.{pos + 1}")
            if kind == "rwkv":
                ops += self.rwkv_forward(idx, xin)
            else:
                ops += self.attn_forward(idx, xin)
            ops += self.channel_mix_forward(self._prefix(kind, idx), xout)
        final = self.buf(f"block_in.{cfg.n_blocks}")
        ops += layernorm.forward(final, self.p("rwkv.ln_out.weight"), self.p("rwkv.ln_out.bias"),
                                 self.buf("lnout"), self.buf("lnout_mean"), self.buf("lnout_rstd"), R, C)
        ops.append(gemm.linear(self.buf("lnout"), self.p("rwkv.head.weight"), self.buf("logits"), R, C, V))
        return ops

    def loss(self) -> list:
        R, V = self.R, self.cfg.vocab_size
        ops = loss.cross_entropy(self.buf("logits"), self.buf("targets"), self.buf("loss_t"),
                                 self.buf("logits"), self.buf("inv_count"), R, V, ignore_index=-1)
        ops.append(CopyDtoH(self.host["loss_t"], self.buf("loss_t"), 8 * R))
        return ops

    def backward(self) -> list:
        cfg, R, C, V = self.cfg, self.R, self.cfg.n_embd, self.cfg.vocab_size
        dlogits, dx = self.buf("logits"), self.buf("dx")
        ops = [gemm.linear_dw(self.buf("lnout"), dlogits, self.gp("rwkv.head.weight"), R, C, V),
               gemm.linear_dx(dlogits, self.p("rwkv.head.weight"), self.buf("dlnout"), R, C, V)]
        final = self.buf(f"block_in.{cfg.n_blocks}")
        ops += layernorm.backward(final, self.p("rwkv.ln_out.weight"), self.buf("dlnout"), dx,
                                  self.gp("rwkv.ln_out.weight"), self.gp("rwkv.ln_out.bias"),
                                  self.buf("lnout_mean"), self.buf("lnout_rstd"), self.buf("partials"),
                                  R, C)
        ops.append(Memset(self.buf("dv_first"), 4 * R * C))
        for pos, (kind, idx) in reversed(list(enumerate(cfg.block_order()))):
            xin = self.buf(f"block_in.{pos}")
            prefix = self._prefix(kind, idx)
            # recompute the block's forward from its saved input, then go back through it
            ops += self.rwkv_forward(idx, xin) if kind == "rwkv" else self.attn_forward(idx, xin)
            ops += self.channel_mix_forward(prefix, None)
            ops += self.channel_mix_backward(prefix)
            ops += self.rwkv_backward(idx, xin) if kind == "rwkv" else self.attn_backward(idx, xin)
        demb_in = dx
        if cfg.ln0:
            demb_in = self.buf("dh1")
            ops += layernorm.backward(self.buf("emb_out"), self.p("rwkv.blocks.0.ln0.weight"), dx,
                                      demb_in, self.gp("rwkv.blocks.0.ln0.weight"),
                                      self.gp("rwkv.blocks.0.ln0.bias"), self.buf("ln0_mean"),
                                      self.buf("ln0_rstd"), self.buf("partials"), R, C)
        ops += embedding.backward(demb_in, self.buf("tokens"), self.buf("emb_order"),
                                  self.buf("emb_seg_start"), self.buf("emb_n_seg"),
                                  self.gp("rwkv.emb.weight"), R, C, V)
        return ops

    def optimizer(self, weight_decay: float, clip: bool) -> list:
        """One fused AdamW update of every parameter (rwkvx/optim.py's formulas; state on device)."""
        b = self.buf
        return adamw.step(b("params"), b("grads"), b("adam_m"), b("adam_v"), b("adam_table"),
                          b("adam_lrmul"), b("adam_state"), self.L.adam_chunks, b("adam_partials"),
                          weight_decay=weight_decay, clip=clip)

    @staticmethod
    def _prefix(kind: str, idx: int) -> str:
        return f"rwkv.blocks.{idx}." if kind == "rwkv" else f"moba.{idx}."

    # -- shared block parts ---------------------------------------------------------------------
    def _residual_out(self, x_res: int, act: int, weight: int, out: int, n_in: int) -> list:
        """out = x_res + act @ weight^T (copy, then a GEMM accumulating with beta = 1)."""
        R, C = self.R, self.cfg.n_embd
        return [Copy(out, x_res, 4 * R * C), gemm.linear(act, weight, out, R, n_in, C, beta=1.0)]

    def channel_mix_forward(self, prefix: str, xout: int | None) -> list:
        """h2 = LN2(x1); kf = relu(xk2 @ key^T)^2; xout = x1 + kf @ value^T (skipped when None)."""
        R, C, F, T = self.R, self.cfg.n_embd, self.cfg.ffn_dim, self.T
        b = self.buf
        ops = layernorm.forward(b("x1"), self.p(prefix + "ln2.weight"), self.p(prefix + "ln2.bias"),
                                b("h2"), b("ln2_mean"), b("ln2_rstd"), R, C)
        ops += channelmix.shift_mix(b("h2"), self.p(prefix + "ffn.x_k"), b("xk2"), R, T, C)
        ops.append(gemm.linear(b("xk2"), self.p(prefix + "ffn.key.weight"), b("kf"), R, C, F))
        ops += channelmix.relu_sq(b("kf"), b("kf"), R * F)
        if xout is not None:
            ops += self._residual_out(b("x1"), b("kf"), self.p(prefix + "ffn.value.weight"), xout, F)
        return ops

    def channel_mix_backward(self, prefix: str) -> list:
        """From dx (= d block output) to dx = d x1 (in place), with the FFN and ln2 gradients."""
        R, C, F, T = self.R, self.cfg.n_embd, self.cfg.ffn_dim, self.T
        b, dx = self.buf, self.buf("dx")
        ops = [gemm.linear_dw(b("kf"), dx, self.gp(prefix + "ffn.value.weight"), R, F, C),
               gemm.linear_dx(dx, self.p(prefix + "ffn.value.weight"), b("dkf"), R, F, C)]
        ops += channelmix.relu_sq_backward(b("dkf"), b("kf"), b("dkf"), R * F, src_is_k=True)
        ops += [gemm.linear_dw(b("xk2"), b("dkf"), self.gp(prefix + "ffn.key.weight"), R, C, F),
                gemm.linear_dx(b("dkf"), self.p(prefix + "ffn.key.weight"), b("dxk2"), R, C, F)]
        ops += channelmix.mix_backward(b("dxk2"), b("h2"), self.p(prefix + "ffn.x_k"), b("dh2"),
                                       self.gp(prefix + "ffn.x_k"), b("partials"), R, T, C)
        ops += layernorm.backward(b("x1"), self.p(prefix + "ln2.weight"), b("dh2"), dx,
                                  self.gp(prefix + "ln2.weight"), self.gp(prefix + "ln2.bias"),
                                  b("ln2_mean"), b("ln2_rstd"), b("partials"), R, C, accumulate_dx=True)
        return ops

    def _ln1_forward(self, prefix: str, xin: int) -> list:
        R, C, b = self.R, self.cfg.n_embd, self.buf
        return layernorm.forward(xin, self.p(prefix + "ln1.weight"), self.p(prefix + "ln1.bias"),
                                 b("h1"), b("ln1_mean"), b("ln1_rstd"), R, C)

    def _ln1_backward(self, prefix: str, xin: int) -> list:
        R, C, b = self.R, self.cfg.n_embd, self.buf
        return layernorm.backward(xin, self.p(prefix + "ln1.weight"), b("dh1"), b("dx"),
                                  self.gp(prefix + "ln1.weight"), self.gp(prefix + "ln1.bias"),
                                  b("ln1_mean"), b("ln1_rstd"), b("partials"), R, C, accumulate_dx=True)

    # -- RWKV-7 time mix ------------------------------------------------------------------------
    def _lora(self, i: int) -> list[tuple[str, str, str, str, int]]:
        """(input, hidden, output, letter, rank) of the LoRA paths of RWKV block i."""
        cfg = self.cfg
        paths = [("xw", "hw", "wl", "w", cfg.dim_w), ("xa", "ha", "al", "a", cfg.dim_a)]
        if i > 0:
            paths.append(("xv", "hv", "vl", "v", cfg.dim_v))
        paths.append(("xg", "hg", "g", "g", cfg.dim_g))
        return paths

    def rwkv_forward(self, i: int, xin: int) -> list:
        """x1 = xin + TimeMix(LN1(xin)) (SPEC §2.3), leaving every transient the backward needs."""
        R, C, T, N, H = self.R, self.cfg.n_embd, self.T, self.cfg.head_size, self.cfg.n_head
        pre, b, p = f"rwkv.blocks.{i}.", self.buf, self.p
        att = pre + "att."
        ops = self._ln1_forward(pre, xin)
        mixes = tuple(p(att + m) for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
        ops += timemix.shift_forward(b("h1"), mixes, tuple(b(n) for n in ("xr", "xw", "xk", "xv", "xa", "xg")),
                                     R, C, T)
        for src, dst, name in (("xr", "r", "receptance"), ("xk", "k", "key"), ("xv", "v", "value")):
            ops.append(gemm.linear(b(src), p(f"{att}{name}.weight"), b(dst), R, C, C))
        for src, hid, out, letter, rank in self._lora(i):
            ops.append(gemm.matmul(b(src), p(f"{att}{letter}1"), b(hid), R, C, rank))
            if letter == "w":
                ops += timemix.tanh_forward(b(hid), b(hid), R * rank)
            elif letter == "g":
                ops += timemix.sigmoid_forward(b(hid), b(hid), R * rank)
            ops.append(gemm.matmul(b(hid), p(f"{att}{letter}2"), b(out), R, rank, C))
        ops += timemix.prep_forward(b("k"), b("v"), b("wl"), b("al"), b("vl"), b("v_first"),
                                    p(att + "w0"), p(att + "a0"), p(att + "v0") if i else 0,
                                    p(att + "k_k"), p(att + "k_a"),
                                    b("decay"), b("kp"), b("vp"), b("wa"), b("wb"), R, C, N, i)
        v_used = b("vp") if i else b("v")
        ops += wkv7.forward(b("r"), b("decay"), b("kp"), v_used, b("wa"), b("wb"), b("y"), b("wkv_ckpt"),
                            self.B, T, H, N)
        ops += timemix.gn_forward(b("y"), b("r"), b("kp"), v_used, b("g"), p(att + "ln_x.weight"),
                                  p(att + "ln_x.bias"), p(att + "r_k"), b("z"), R, C, N)
        ops += self._residual_out(xin, b("z"), p(att + "output.weight"), b("x1"), C)
        return ops

    def rwkv_backward(self, i: int, xin: int) -> list:
        """From dx = d x1 to dx = d xin (in place), with every TimeMix and ln1 gradient of block i."""
        R, C, T, N, H = self.R, self.cfg.n_embd, self.T, self.cfg.head_size, self.cfg.n_head
        pre, b, p, gp = f"rwkv.blocks.{i}.", self.buf, self.p, self.gp
        att = pre + "att."
        dx = b("dx")
        v_used = b("vp") if i else b("v")
        ops = [gemm.linear_dw(b("z"), dx, gp(att + "output.weight"), R, C, C),
               gemm.linear_dx(dx, p(att + "output.weight"), b("dz"), R, C, C)]
        ops += timemix.gn_backward(b("y"), b("r"), b("kp"), v_used, b("g"), b("dz"), p(att + "ln_x.weight"),
                                   p(att + "ln_x.bias"), p(att + "r_k"), b("dy"), b("dg"), b("dr2"),
                                   b("dkp2"), b("dvp2"), b("partials"),
                                   (gp(att + "ln_x.weight"), gp(att + "ln_x.bias"), gp(att + "r_k")),
                                   R, C, N)
        ops += wkv7.backward(b("r"), b("decay"), b("kp"), v_used, b("wa"), b("wb"), b("dy"), b("wkv_ckpt"),
                             b("wkv_slab"), b("dr"), b("ddecay"), b("dkp"), b("dvp"), b("dwa"), b("dwb"),
                             self.B, T, H, N, partials=b("wkv_partials") or None)
        dparams = [gp(att + n) for n in ("w0", "a0", "k_k", "k_a")] + ([gp(att + "v0")] if i else [])
        ops += timemix.prep_backward(b("k"), b("v"), b("wl"), b("al"), b("vl"), b("v_first"),
                                     p(att + "w0"), p(att + "a0"), p(att + "v0") if i else 0,
                                     p(att + "k_k"), p(att + "k_a"),
                                     b("ddecay"), b("dkp"), b("dvp"), b("dwa"), b("dwb"), b("dkp2"), b("dvp2"),
                                     b("dr"), b("dr2"), b("dr"), b("dk"), b("dv"), b("dwl"), b("dal"),
                                     b("dvl"), b("dv_first"), b("partials"), dparams, R, C, N, i)
        # projections r, k, v: dx* = d(out) @ W, dW = d(out)^T x*
        for src, dsrc, dout, name in (("xr", "dxr", "dr", "receptance"), ("xk", "dxk", "dk", "key"),
                                      ("xv", "dxv", "dv", "value")):
            ops += [gemm.linear_dw(b(src), b(dout), gp(f"{att}{name}.weight"), R, C, C),
                    gemm.linear_dx(b(dout), p(f"{att}{name}.weight"), b(dsrc), R, C, C)]
        # LoRA paths: out = act(src @ W1) @ W2
        grads_of = {"wl": "dwl", "al": "dal", "vl": "dvl", "g": "dg"}
        for src, hid, out, letter, rank in self._lora(i):
            dout, dhid = b(grads_of[out]), b("d" + hid)
            ops += [gemm.matmul_dw(b(hid), dout, gp(f"{att}{letter}2"), R, rank, C),
                    gemm.matmul_dx(dout, p(f"{att}{letter}2"), dhid, R, rank, C)]
            if letter == "w":
                ops += timemix.tanh_backward(b(hid), dhid, dhid, R * rank)
            elif letter == "g":
                ops += timemix.sigmoid_backward(b(hid), dhid, dhid, R * rank)
            ops.append(gemm.matmul_dw(b(src), dhid, gp(f"{att}{letter}1"), R, C, rank))
            # xv feeds both the value projection and the v LoRA: accumulate its gradient
            beta = 1.0 if letter == "v" else 0.0
            ops.append(gemm.matmul_dx(dhid, p(f"{att}{letter}1"), b("d" + src), R, C, rank, beta=beta))
        dmix = tuple(gp(att + m) for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
        ops += timemix.shift_backward(b("h1"), tuple(p(att + m) for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")),
                                      tuple(b(n) for n in ("dxr", "dxw", "dxk", "dxv", "dxa", "dxg")),
                                      b("dh1"), dmix, b("partials"), R, C, T)
        ops += self._ln1_backward(pre, xin)
        return ops

    # -- MoBA attention -------------------------------------------------------------------------
    def _moba_args(self, j: int) -> dict:
        cfg = self.cfg
        scratch = {name: (self.buf(f"moba_sel.{j}") if name == "sel" else self.buf("moba_" + name))
                   for name in moba.SCRATCH_NAMES}
        return dict(scratch=scratch, B=self.B, T=self.T, H=cfg.n_head, N=cfg.head_size,
                    chunk=cfg.moba_chunk_size, top_k=cfg.moba_top_k)

    def attn_forward(self, j: int, xin: int) -> list:
        """x1 = xin + Attn_j(LN1(xin)) (SPEC §2.3, MoBA)."""
        R, C, b, p = self.R, self.cfg.n_embd, self.buf, self.p
        pre = f"moba.{j}."
        ops = self._ln1_forward(pre, xin)
        for dst, name in (("r", "receptance"), ("k", "key"), ("v", "value")):
            ops.append(gemm.linear(b("h1"), p(f"{pre}att.{name}.weight"), b(dst), R, C, C))
        ops += moba.forward(b("r"), b("k"), b("v"), b("y"), **self._moba_args(j))
        ops += self._residual_out(xin, b("y"), p(pre + "att.output.weight"), b("x1"), C)
        return ops

    def attn_backward(self, j: int, xin: int) -> list:
        """From dx = d x1 to dx = d xin (in place), with the attention and ln1 gradients."""
        R, C, b, p, gp = self.R, self.cfg.n_embd, self.buf, self.p, self.gp
        pre = f"moba.{j}."
        dx = b("dx")
        ops = [gemm.linear_dw(b("y"), dx, gp(pre + "att.output.weight"), R, C, C),
               gemm.linear_dx(dx, p(pre + "att.output.weight"), b("dz"), R, C, C)]
        ops += moba.backward(b("r"), b("k"), b("v"), b("y"), b("dz"), b("dr"), b("dk"), b("dv"),
                             **self._moba_args(j))
        for n, (dsrc, name) in enumerate((("dr", "receptance"), ("dk", "key"), ("dv", "value"))):
            ops += [gemm.linear_dw(b("h1"), b(dsrc), gp(f"{pre}att.{name}.weight"), R, C, C),
                    gemm.linear_dx(b(dsrc), p(f"{pre}att.{name}.weight"), b("dh1"), R, C, C,
                                   beta=1.0 if n else 0.0)]
        ops += self._ln1_backward(pre, xin)
        return ops


class Model:
    """An RWKV-X model resident on the GPU, for a fixed batch size and sequence length.

    Same contract as :class:`rwkvx.oracle.Oracle`: ``forward(tokens)`` -> logits,
    ``loss_and_grads(tokens, targets, ignore_index)`` -> (loss, grads). Weights, gradients, optimizer
    moments and every activation live in one device arena sized at construction; a step allocates
    nothing and synchronises only to read the per-token losses.
    """

    def __init__(self, cfg: Config, params: ParamDict, batch_size: int, seq_len: int,
                 precision: str = "fp32"):
        if not isinstance(cfg, Config):
            raise TypeError("Model expects an rwkvx.Config")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}"
                             + (" (bf16 is not implemented yet)" if precision == "bf16" else ""))
        check_params(cfg, params)
        from .runtime import Device, Plan  # raises RuntimeError without a GPU
        self.cfg, self.B, self.T, self.precision = cfg, batch_size, seq_len, precision
        self.dev = Device.get()
        self.layout = Layout(cfg, batch_size, seq_len)
        self.arena = self.dev.alloc(self.layout.total)
        R = batch_size * seq_len
        self._pinned = {
            "tokens": self.dev.alloc_pinned(4 * R), "targets": self.dev.alloc_pinned(4 * R),
            "emb_order": self.dev.alloc_pinned(4 * R), "emb_seg_start": self.dev.alloc_pinned(4 * (R + 1)),
            "emb_n_seg": self.dev.alloc_pinned(4), "inv_count": self.dev.alloc_pinned(8),
            "loss_t": self.dev.alloc_pinned(8 * R)}
        self.builder = StepBuilder(self.layout, self.arena.ptr, {k: v.ptr for k, v in self._pinned.items()})
        self.ops = self.builder.build()
        self._forward_plan = Plan(self.dev, self.ops.stage_tokens + self.ops.forward, precision=precision)
        self._step_plan = Plan(self.dev, self.ops.step, precision=precision)
        self.load_params(params)

    # -- parameters ------------------------------------------------------------------------------
    def _region(self, region: str) -> dict[str, np.ndarray]:
        flat = self.dev.download(self.builder.buf(region), (self.layout.sizes[region] // 4,), np.float32)
        return {n: flat[off:off + size].reshape(self.layout.param_shapes[n]).copy()
                for n, (off, size) in self.layout.param_offsets.items()}

    def _upload_region(self, region: str, tensors: dict[str, np.ndarray]) -> None:
        """Inverse of :meth:`_region`: one name-keyed tensor per parameter, packed and uploaded."""
        flat = np.zeros(self.layout.sizes[region] // 4, np.float32)
        for n, (off, size) in self.layout.param_offsets.items():
            flat[off:off + size] = np.asarray(tensors[n], np.float32).ravel()
        self.dev.upload(self.builder.buf(region), flat)

    def load_params(self, params: ParamDict) -> None:
        """Upload ``params`` (names and shapes of ``param_shapes(cfg)``) to the device."""
        check_params(self.cfg, params)
        self._upload_region("params", params)

    def params(self) -> ParamDict:
        """The current parameters, downloaded, name-keyed."""
        return self._region("params")

    def grads(self) -> ParamDict:
        """The gradients of the last :meth:`loss_and_grads`, downloaded, name-keyed."""
        return self._region("grads")

    # -- steps ---------------------------------------------------------------------------------
    def _stage_tokens(self, tokens) -> np.ndarray:
        tokens = validate.check_tokens(tokens, self.cfg.vocab_size)
        if tokens.shape != (self.B, self.T):
            raise ValueError(f"tokens have shape {tokens.shape}, this Model was built for "
                             f"(batch_size, seq_len) = {(self.B, self.T)}")
        self._pinned["tokens"].array(np.int32, (self.B * self.T,))[:] = tokens.ravel()
        return tokens

    def forward(self, tokens) -> np.ndarray:
        """Logits ``[B, T, V]`` (float32) for int tokens ``[B, T]``."""
        self._stage_tokens(tokens)
        self._forward_plan.run()
        self.dev.synchronize()
        return self.dev.download(self.builder.buf("logits"), (self.B, self.T, self.cfg.vocab_size))

    def stage_batch(self, tokens, targets, ignore_index: int = -100) -> None:
        """Validate a batch and write it into the pinned buffers the step reads."""
        tokens = self._stage_tokens(tokens)
        targets = validate.check_targets(targets, tokens.shape, self.cfg.vocab_size, ignore_index)
        flat = np.where(targets == ignore_index, -1, targets).astype(np.int32).ravel()
        order, seg_start, n_seg = embedding.sort_tokens(tokens)
        pin = self._pinned
        pin["targets"].array(np.int32, flat.shape)[:] = flat
        pin["emb_order"].array(np.int32, order.shape)[:] = order
        pin["emb_seg_start"].array(np.int32, seg_start.shape)[:] = seg_start
        pin["emb_n_seg"].array(np.int32, (1,))[:] = n_seg
        pin["inv_count"].array(np.float64, (1,))[:] = loss.inv_count(flat, -1)

    def mean_loss(self) -> float:
        """The mean loss of the last step, from the pinned per-token losses, reduced in double."""
        from .runtime import sum_float64
        inv = float(self._pinned["inv_count"].array(np.float64, (1,))[0])
        return sum_float64(self._pinned["loss_t"].array(np.float64, (self.B * self.T,))) * inv

    def run_step(self) -> None:
        """Enqueue one forward + loss + backward on the staged batch (no synchronisation)."""
        self._step_plan.run()

    def loss_and_grads(self, tokens, targets, ignore_index: int = -100) -> tuple[float, ParamDict]:
        """Mean cross-entropy over targets != ignore_index, and the gradient of every parameter."""
        self.stage_batch(tokens, targets, ignore_index)
        self.run_step()
        self.dev.synchronize()
        return self.mean_loss(), self.grads()

    # -- training: the whole step, AdamW included, as one CUDA graph -----------------------------
    def configure_optimizer(self, schedule: Schedule, weight_decay: float = 0.0,
                            grad_clip: float | None = None) -> None:
        """Set up AdamW (moments zeroed, step 0) and the training plan ``train_step`` replays."""
        from .runtime import Plan
        b = self.builder.buf
        self.dev.upload(b("adam_table"), self.layout.adam_table)
        self.dev.upload(b("adam_lrmul"), self.layout.adam_lrmul)
        self.dev.upload(b("adam_state"), adamw.state_from_schedule(schedule, grad_clip))
        zeros = np.zeros(self.layout.sizes["adam_m"] // 4, np.float32)
        self.dev.upload(b("adam_m"), zeros)
        self.dev.upload(b("adam_v"), zeros)
        self.schedule, self.weight_decay, self.grad_clip = schedule, weight_decay, grad_clip
        self._train_plan = Plan(self.dev, self.ops.step + self.builder.optimizer(weight_decay, bool(grad_clip)),
                                precision=self.precision)
        self._train_graph = None

    def train_step(self, tokens, targets, ignore_index: int = -100, graph: bool = True) -> float:
        """Forward, loss, backward and AdamW update on one batch; returns the mean loss.

        With ``graph`` (default) the step is captured once as a CUDA graph and replayed; otherwise
        the same plan is enqueued op by op. Both give bit-identical results.
        """
        if getattr(self, "_train_plan", None) is None:
            raise RuntimeError("call configure_optimizer() before train_step()")
        self.stage_batch(tokens, targets, ignore_index)
        if not graph:
            self._train_plan.run()
        else:
            if self._train_graph is None:
                from .runtime import Graph
                self._step_plan.run()   # warm-up without an update: modules and cuBLAS ready
                self.dev.synchronize()
                self._train_graph = Graph.capture(self.dev, self._train_plan.run)
            self._train_graph.launch()
        self.dev.synchronize()
        return self.mean_loss()

    def evaluate(self, tokens, targets, ignore_index: int = -100) -> float:
        """Mean loss on one batch: forward and loss only, the parameters untouched."""
        from .runtime import Plan
        if getattr(self, "_eval_plan", None) is None:
            ops = self.ops
            self._eval_plan = Plan(self.dev, ops.stage_tokens + ops.stage_targets + ops.forward + ops.loss,
                                   precision=self.precision)
        self.stage_batch(tokens, targets, ignore_index)
        self._eval_plan.run()
        self.dev.synchronize()
        return self.mean_loss()

    def optimizer_stats(self) -> dict[str, float]:
        """``{"step", "lr", "grad_norm", "clip"}`` of the last update, read from the device state."""
        st = self.dev.download(self.builder.buf("adam_state"), (adamw.STATE_DOUBLES,), np.float64)
        return {"step": int(st[adamw.ST_STEP]), "lr": float(st[adamw.ST_LR]),
                "grad_norm": float(st[adamw.ST_NORM]), "clip": float(st[adamw.ST_SCALE])}

    def optimizer_state(self) -> dict:
        """AdamW moments and step, in :meth:`rwkvx.optim.AdamW.state_dict`'s format."""
        tensors = {}
        for key, region in (("m", "adam_m"), ("v", "adam_v")):
            for name, value in self._region(region).items():
                tensors[f"optim.{key}.{name}"] = value
        return {"tensors": tensors, "meta": {"optim_step": self.optimizer_stats()["step"]}}

    def load_optimizer_state(self, state: dict) -> None:
        """Restore moments and step saved by :meth:`optimizer_state` (or the CPU AdamW)."""
        tensors, meta = state.get("tensors") or {}, state.get("meta") or {}
        step = meta.get("optim_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"optimizer state needs an int step count 'optim_step' >= 0, got {step!r}")
        for key, region in (("m", "adam_m"), ("v", "adam_v")):
            moments = {}
            for name, shape in self.layout.param_shapes.items():
                full = f"optim.{key}.{name}"
                if full not in tensors:
                    raise ValueError(f"optimizer state is missing {full}")
                moments[name] = np.asarray(tensors[full], np.float32)
                if moments[name].shape != shape:
                    raise ValueError(f"optimizer state {full} has shape {moments[name].shape}")
            self._upload_region(region, moments)
        self.dev.upload(self.builder.buf("adam_state"),
                        adamw.state_from_schedule(self.schedule, self.grad_clip, step=step))

    def moba_selection(self) -> list[np.ndarray]:
        """Each attention block's selection of the last forward: int32 ``[B, H, T, top_k-1]``."""
        cfg = self.cfg
        shape = (self.B, cfg.n_head, self.T, cfg.moba_top_k - 1)
        n = int(np.prod(shape))
        return [self.dev.download(self.builder.buf(f"moba_sel.{j}"), (max(n, 1),), np.int32)[:n].reshape(shape)
                for j in range(cfg.n_attn_layer)]

    def poison(self) -> None:
        """Fill gradients and every activation with NaN (tests: whatever a step leaves unwritten shows)."""
        start = self.layout.offsets["grads"]
        end = self.layout.offsets["adam_m"]
        self.dev.upload(self.arena.ptr + start, np.full((end - start) // 4, np.nan, np.float32))
        start = self.layout.offsets["tokens"]
        self.dev.upload(self.arena.ptr + start, np.full((self.layout.total - start) // 4, np.nan, np.float32))

    def memory_bytes(self) -> int:
        """Bytes of the device arena (weights, gradients, optimizer state, activations, scratch)."""
        return self.layout.total
