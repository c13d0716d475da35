"""The GPU model: resident weights, one scratch arena, and the training step as a list of ops.

Reading order: :class:`Layout` (every device buffer, sized from (config, B, T)), then
:class:`StepBuilder` (forward, loss, backward, op by op, the seed's structure: each block's forward
is recomputed from its saved input during the backward), then :class:`Model` (the public API).

Building the op lists needs no GPU (pointers are base + offset, typed by the element type of their
buffer), so plan construction is tested on CPU CI; :class:`Model` allocates the arena once and runs
the ops through :class:`rwkvx.runtime.Plan`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import validate
from .config import Config
from .optim import Schedule
from .cu import adamw, channelmix, embedding, layernorm, loss, moba, timemix, wkv7
from .params import ParamDict, check_params, param_shapes
from .precision import Precision, resolve_precision
from .runtime import gemm
from .runtime.device import DeviceInfo
from .runtime.dtypes import ELEM_BYTES, from_storage, poison_bits, storage_dtype, to_storage
from .runtime.ops import CopyDtoH, CopyHtoD, DevPtr, Gemm, Memset, flatten_ops

HEAD_CHUNK_BYTES = 512 << 20  # the logits of one row chunk of the head: [rows, V] activations
DEFAULT_RECOMPUTE = True      # the backward recomputes each block's forward (least memory)

_ALIGN = 256  # bytes; every buffer starts 256-byte aligned (vector kernels, cuBLAS)


def _round_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


# Transients the backward reads from its own block's forward: with recompute=False each block keeps its
# own copies (block 0 uses the shared ones); with recompute=True the backward recomputes them.
FORWARD_STATE = {
    "rwkv": ("h1", "xr", "xw", "xk", "xv", "xa", "xg", "r", "k", "v", "wl", "al", "vl", "g", "hw", "ha", "hv",
             "hg", "decay", "kp", "vp", "wa", "wb", "y", "z", "ln1_mean", "ln1_rstd", "wkv_sa", "wkv_ckpt"),
    "attn": ("h1", "r", "k", "v", "y", "ln1_mean", "ln1_rstd", "moba_lse", "moba_idx", "moba_qlist"),
}
# What an attention block keeps for its backward even with recompute=True: the recompute skips the MoBA
# forward, the one part of a block whose cost grows with the attended keys (T * chunk * top_k), for
# B*T*(C + H) activations and the query lists per attention block.
ATTENTION_KEPT = ("y", "moba_lse", "moba_idx", "moba_qlist")
CHANNEL_MIX_STATE = ("x1", "h2", "xk2", "kf", "ln2_mean", "ln2_rstd")
# The WKV7 gradients that only feed the time mix's prep backward: f32 in every precision (its parameter
# gradients sum them over the tokens after near-cancelling projections, where bf16 rounding would show).
WKV_F32_GRADS = ("ddecay", "dkp", "dvp", "dwa", "dwb")
# MoBA scratch that lives inside one attention block's forward or backward (shares the logits' region)
SHARED_MOBA_SCRATCH = ("part", "lpart")


def head_chunk_rows(R: int, V: int, xtype: str) -> int:
    """Rows of one head / cross-entropy chunk: as many as fit HEAD_CHUNK_BYTES of logits, a multiple
    of 64 rows (at least 64), at most R."""
    rows = max(64, HEAD_CHUNK_BYTES // (V * ELEM_BYTES[xtype]) // 64 * 64)
    return min(R, rows)


class Layout:
    """Every device buffer of a (config, B, T) model: name -> (offset, element type, count) in one arena.

    Regions: ``params``/``grads``/``adam_m``/``adam_v`` (flat f32, same offsets per tensor), the per-step
    inputs, one saved input per block, and one block's worth of transients shared by all blocks (with
    ``recompute=False``, also every other block's :data:`FORWARD_STATE`, as ``name@position``).
    Activations have the precision's element type ``xtype``; ``methods`` are its kernel methods
    (:meth:`rwkvx.precision.Precision.kernel_methods`), overridden by ``methods`` where given.
    """

    def __init__(self, cfg: Config, B: int, T: int, dev: DeviceInfo, precision: str | Precision = "fp32",
                 recompute: bool = DEFAULT_RECOMPUTE, methods: dict[str, str] | None = None):
        precision = resolve_precision(precision)
        xtype = precision.xtype
        self.cfg, self.B, self.T, self.dev, self.xtype = cfg, B, T, dev, xtype
        self.precision, self.recompute = precision, recompute
        self.methods = precision.kernel_methods(cfg)
        if methods is not None:
            if set(methods) - set(self.methods):
                raise ValueError(f"methods: unknown kernel families {sorted(set(methods) - set(self.methods))}")
            self.methods.update(methods)
        self.offsets: dict[str, int] = {}
        self.elems: dict[str, str] = {}
        self.counts: dict[str, int] = {}
        self.total = 0
        C, F, V, H, N = cfg.n_embd, cfg.ffn_dim, cfg.vocab_size, cfg.n_head, cfg.head_size
        R = B * T
        X = xtype
        shapes = param_shapes(cfg)
        self.param_segments, n_flat = adamw.flat_layout(shapes)
        # name -> (offset, size) in floats; the same offsets in params, grads, adam_m and adam_v
        self.param_offsets = {seg[0]: (seg[1], seg[2]) for seg in self.param_segments}
        self.param_shapes = shapes
        for region in ("params", "grads", "adam_m", "adam_v"):
            self._add(region, n_flat, "f32")
        # the weights as the GEMMs read them (bf16 only; refreshed by AdamW)
        self._add("params_x", n_flat if xtype == "bf16" else 0, xtype)
        self.adam_table, self.adam_lrmul = adamw.build_table(self.param_segments)
        self.adam_chunks = len(self.adam_lrmul)
        self._add("adam_table", self.adam_table.size, "i32")
        self._add("adam_lrmul", self.adam_lrmul.size, "f32")
        self._add("adam_state", adamw.STATE_DOUBLES, "f64")
        self._add("adam_partials", adamw.scratch_elems(self.adam_chunks), "f64")
        # per-step inputs (written from pinned host memory inside the step)
        for name, count in self.host_inputs(R).items():
            self._add(name, count, "f64" if name == "inv_count" else "i32")
        self._add("loss_t", R, "f64")
        # saved activations: each block's input and the final residual stream
        self._add("emb_out", R * C, X)
        for i in range(cfg.n_blocks + 1):
            self._add(f"block_in.{i}", R * C, X)
        for name in ("v_first", "dv_first", "lnout"):
            self._add(name, R * C, X)
        self._add("lnout_mean", R, "f32")
        self._add("lnout_rstd", R, "f32")
        self.head_rows = head_chunk_rows(R, V, X)
        # buffers never live at once share one region (_add_shared), one set at a time: the head's row
        # chunk of logits (then dlogits), the WKV7 work buffer, MoBA's partial outputs, the channel mix's
        # backward gradients (each set lives inside the head or inside one part of one block's pass)
        shared: dict[str, dict[str, tuple[int, str]]] = {
            "head": {"logits": (self.head_rows * V, X)}, "wkv": {}, "moba": {},
            "ffn": {"dkf": (R * F, X), "dxk2": (R * C, X), "dh2": (R * C, X)}}
        self._add("dx", R * C, X)
        self._add("dlnout", R * C, X)
        if cfg.n_attn_layer:
            moba_sizes = moba.scratch_sizes(B, T, H, N, cfg.moba_chunk_size, cfg.moba_top_k)
            for j in range(cfg.n_attn_layer):  # kept per block: the selection is read back after a step
                self._add(f"moba_sel.{j}", *moba_sizes["sel"])
        # one block's transients, shared by every block (blocks run one after another)
        rc = ("h1", "xr", "xw", "xk", "xv", "xa", "xg", "r", "k", "v", "wl", "al", "vl", "g", "decay",
              "kp", "vp", "wa", "wb", "y", "z", "x1", "h2", "xk2",
              "dz", "dy", "dg", "dr2", "dkp2", "dvp2", "dr", "ddecay", "dkp", "dvp", "dwa", "dwb",
              "dk", "dv", "dwl", "dal", "dvl", "dxr", "dxw", "dxk", "dxv", "dxa", "dxg", "dh1")
        for name in rc:
            self._add(name, R * C, "f32" if name in WKV_F32_GRADS else X)
        for name, d in (("hw", cfg.dim_w), ("ha", cfg.dim_a), ("hv", cfg.dim_v), ("hg", cfg.dim_g)):
            self._add(name, R * d, X)
            self._add("d" + name, R * d, X)
        self._add("kf", R * F, X)
        for name in ("ln1_mean", "ln1_rstd", "ln2_mean", "ln2_rstd", "ln0_mean", "ln0_rstd"):
            self._add(name, R, "f32")
        # with recompute the chunked WKV7's recomputed forward also writes the backward's chunk records
        # (one pass for both, rwkvx.cu.wkv7.forward), kept through the channel mix until the block's
        # WKV7 backward: they lead the WKV7 work buffer's set and the channel mix's
        keep = recompute and self.methods["wkv7"] in wkv7.CHUNKED_METHODS
        for name, count in wkv7.scratch_elems(B, T, H, N, dev, method=self.methods["wkv7"],
                                              kept_records=keep).items():
            if name == "partials":
                shared["wkv"]["wkv_partials"] = (count, "f32")
            elif name == "records":
                for kept_by in ("wkv", "ffn"):
                    shared[kept_by] = {"wkv_records": (count, "f32"), **shared[kept_by]}
            else:
                self._add("wkv_" + name, count, "f32")
        if cfg.n_attn_layer:
            for name, (count, elem) in moba_sizes.items():
                if name in SHARED_MOBA_SCRATCH:
                    shared["moba"]["moba_" + name] = (count, elem)
                elif name != "sel":
                    self._add("moba_" + name, count, elem)
        self._add_shared(shared)
        self._add("partials", max(layernorm.scratch_elems(R, C, dev), channelmix.scratch_elems(R, C, dev),
                                  timemix.scratch_elems(R, C, N, dev)), "f32")
        for pos, (kind, _) in enumerate(cfg.block_order()):
            if not recompute:
                kept = FORWARD_STATE[kind] + CHANNEL_MIX_STATE if pos else ()
            else:
                kept = ATTENTION_KEPT if kind == "attn" else ()
            for name in kept:
                if name in self.counts:
                    self._add(f"{name}@{pos}", self.counts[name], self.elems[name])

    @staticmethod
    def host_inputs(R: int) -> dict[str, int]:
        """Elements of each per-step input staged from pinned host memory (int32; inv_count f64)."""
        return {"tokens": R, "targets": R, "emb_order": R, "emb_seg_start": R + 1, "emb_n_seg": 1,
                "inv_count": 1}

    def _add(self, name: str, count: int, elem: str) -> None:
        self.offsets[name] = self.total
        self.elems[name] = elem
        self.counts[name] = count
        self.total += _round_up(max(count * ELEM_BYTES[elem], 1))

    def _add_shared(self, sets: dict[str, dict[str, tuple[int, str]]]) -> None:
        """Sets of buffers of which only one is ever live (each is written and read inside the head, or
        inside one block's forward or backward): every set laid out from the same offset, in a region as
        large as the largest set. A buffer named in several sets (live while either is) leads each."""
        start, end = self.total, self.total
        for buffers in sets.values():
            self.total = start
            for name, (count, elem) in buffers.items():
                if name in self.offsets:
                    if self.offsets[name] != self.total:
                        raise ValueError(f"Layout: shared buffer {name} must lead every set that names it")
                    self.total += _round_up(max(count * ELEM_BYTES[elem], 1))
                else:
                    self._add(name, count, elem)
            end = max(end, self.total)
        self.total = end

    def poison_image(self) -> np.ndarray:
        """The arena's bytes from the per-step inputs on, every buffer NaN (floats) or -0x5eadbeef (i32)."""
        start = self.offsets["tokens"]
        image = np.zeros(self.total - start, np.uint8)
        names = list(self.offsets)[list(self.offsets).index("tokens"):]
        # narrowest element type last: where the shared region's buffers overlap, bf16 NaN pairs
        # (0x7FC0 7FC0) still read as NaN in an f32 buffer, while f32 NaN bits would leave every other
        # bf16 element +0
        for name in sorted(names, key=lambda n: -ELEM_BYTES[self.elems[n]]):
            bits = poison_bits(self.elems[name], self.counts[name]).view(np.uint8)
            image[self.offsets[name] - start:self.offsets[name] - start + bits.size] = bits
        return image

    def nbytes(self, name: str) -> int:
        """Bytes of buffer ``name``."""
        return self.counts[name] * ELEM_BYTES[self.elems[name]]

    def bytes_per_token(self) -> float:
        """Arena bytes divided by B*T (the parameter regions included)."""
        return self.total / (self.B * self.T)


@dataclass
class StepOps:
    """The op lists of one step. ``forward`` ends with the final LayerNorm's output; ``loss`` runs the
    head and cross-entropy chunk by chunk of rows (logits, loss, dlogits in place, the head's gradients);
    ``evaluate`` is ``loss`` without gradients; ``head[c]`` computes the logits of chunk c alone.

    ``grad_ready``: ``(k, names)`` pairs in backward order: after ``backward[:k]`` the gradients of
    ``names`` are final (no later op of the step touches them) — where a data-parallel step starts
    reducing them (:mod:`rwkvx.dist.step`). Every parameter is named exactly once."""
    stage_tokens: list
    stage_targets: list
    forward: list
    loss: list
    backward: list
    evaluate: list
    head: list
    grad_ready: list = field(default_factory=list)

    @property
    def step(self) -> list:
        """The whole step without the optimizer: inputs staged, forward, loss, backward."""
        return self.stage_tokens + self.stage_targets + self.forward + self.loss + self.backward


class StepBuilder:
    """Composes the step from the op builders of :mod:`rwkvx.cu` and cuBLAS GEMMs of ``precision``."""

    def __init__(self, layout: Layout, base: int, host: dict[str, int]):
        self.L = layout
        self.cfg = layout.cfg
        self.dev = layout.dev
        self.B, self.T = layout.B, layout.T
        self.R = self.B * self.T
        self.base = base
        self.host = host  # pinned host pointers: tokens, targets, emb_order, ...
        self.mm = layout.precision.gemm     # every GEMM's mode
        self.methods = layout.methods       # the WKV7 and MoBA kernel methods
        self.block_pos: int | None = None   # the block being built: selects its own forward state

    # -- addresses ----------------------------------------------------------------------------
    def buf(self, name: str) -> DevPtr | None:
        """Typed device pointer of buffer ``name``; None for an empty buffer."""
        own = f"{name}@{self.block_pos}"
        if own in self.L.offsets:
            name = own
        if not self.L.counts[name]:
            return None
        return DevPtr(self.base + self.L.offsets[name], self.L.elems[name])

    def p(self, name: str) -> DevPtr:
        """Device address of parameter ``name``."""
        return self.buf("params").offset(self.L.param_offsets[name][0])

    def w(self, name: str) -> DevPtr:
        """Parameter ``name`` as a GEMM operand: the bf16 copy in bf16 mode, else the fp32 weight."""
        if self.L.counts["params_x"]:
            return self.buf("params_x").offset(self.L.param_offsets[name][0])
        return self.p(name)

    def gp(self, name: str) -> DevPtr:
        """Device address of the gradient of parameter ``name``."""
        return self.buf("grads").offset(self.L.param_offsets[name][0])

    # -- the step -----------------------------------------------------------------------------
    def build(self) -> StepOps:
        stage = {n: CopyHtoD(self.buf(n), self.host[n], self.L.nbytes(n)) for n in self.L.host_inputs(self.R)}
        stage_tokens = [stage.pop("tokens")]
        forward, loss_ops, backward = self.forward(), self.loss(), self.backward()
        return StepOps(stage_tokens, list(stage.values()), forward, loss_ops, backward,
                       self.loss(with_grad=False), [self.head_logits(r0) for r0 in self.head_chunks()],
                       self.grad_ready)

    def forward(self) -> list:
        cfg, R, C, V, dev = self.cfg, self.R, self.cfg.n_embd, self.cfg.vocab_size, self.dev
        ops = []
        x0 = self.buf("block_in.0")
        if cfg.ln0:
            ops += embedding.forward(self.buf("tokens"), self.p("rwkv.emb.weight"),
                                     self.buf("emb_out"), R, C, V, dev)
            ops += layernorm.forward(self.buf("emb_out"), self.p("rwkv.blocks.0.ln0.weight"),
                                     self.p("rwkv.blocks.0.ln0.bias"), x0,
                                     self.buf("ln0_mean"), self.buf("ln0_rstd"), R, C)
        else:
            ops += embedding.forward(self.buf("tokens"), self.p("rwkv.emb.weight"), x0, R, C, V, dev)
        for pos, (kind, idx) in enumerate(cfg.block_order()):
            self.block_pos = pos
            xin, xout = self.buf(f"block_in.{pos}"), self.buf(f"block_in.{pos + 1}")
            if kind == "rwkv":
                ops += self.rwkv_forward(idx, xin, for_backward=not self.L.recompute)
            else:
                ops += self.attn_forward(idx, xin)
            ops += self.channel_mix_forward(self._prefix(kind, idx), xout)
        self.block_pos = None
        final = self.buf(f"block_in.{cfg.n_blocks}")
        ops += layernorm.forward(final, self.p("rwkv.ln_out.weight"), self.p("rwkv.ln_out.bias"),
                                 self.buf("lnout"), self.buf("lnout_mean"), self.buf("lnout_rstd"), R, C)
        return ops

    def head_chunks(self) -> range:
        """First row of each head / cross-entropy chunk."""
        return range(0, self.R, self.L.head_rows)

    def head_logits(self, r0: int) -> list:
        """Logits of rows [r0, r0 + rows) into the chunk buffer ``logits``."""
        rows, C, V = min(self.L.head_rows, self.R - r0), self.cfg.n_embd, self.cfg.vocab_size
        return [gemm.linear(self.buf("lnout").offset(r0 * C), self.w("rwkv.head.weight"), self.buf("logits"),
                            rows, C, V, precision=self.mm)]

    def loss(self, with_grad: bool = True) -> list:
        """Head and cross-entropy per row chunk: float64 per-token losses, and ``with_grad`` dlogits in
        place, the head's weight gradient accumulated over the chunks in order, and dlnout."""
        C, V, mm = self.cfg.n_embd, self.cfg.vocab_size, self.mm
        lnout, dlogits = self.buf("lnout"), self.buf("logits")
        ops = []
        for r0 in self.head_chunks():
            rows = min(self.L.head_rows, self.R - r0)
            ops += self.head_logits(r0)
            ops += loss.cross_entropy(self.buf("logits"), self.buf("targets").offset(r0),
                                      self.buf("loss_t").offset(r0), dlogits if with_grad else None,
                                      self.buf("inv_count"), rows, V)
            if with_grad:
                ops += [gemm.linear_dw(lnout.offset(r0 * C), dlogits, self.gp("rwkv.head.weight"), rows, C, V,
                                       beta=1.0 if r0 else 0.0, precision=mm),
                        gemm.linear_dx(dlogits, self.w("rwkv.head.weight"), self.buf("dlnout").offset(r0 * C),
                                       rows, C, V, precision=mm)]
        ops.append(CopyDtoH(self.host["loss_t"], self.buf("loss_t"), self.L.nbytes("loss_t")))
        return ops

    def backward(self) -> list:
        """From dlnout (the loss's output) back to the embedding, with every gradient but the head's."""
        cfg, R, C, V, dev = self.cfg, self.R, self.cfg.n_embd, self.cfg.vocab_size, self.dev
        dx = self.buf("dx")
        final = self.buf(f"block_in.{cfg.n_blocks}")
        ops = layernorm.backward(final, self.p("rwkv.ln_out.weight"), self.buf("dlnout"), dx,
                                  self.gp("rwkv.ln_out.weight"), self.gp("rwkv.ln_out.bias"),
                                  self.buf("lnout_mean"), self.buf("lnout_rstd"), self.buf("partials"),
                                  R, C, dev)
        self.grad_ready = []
        self._grads_ready(ops, "rwkv.head.", "rwkv.ln_out.")
        ln0 = ("rwkv.blocks.0.ln0.weight", "rwkv.blocks.0.ln0.bias") if cfg.ln0 else ()
        ops.append(Memset(self.buf("dv_first"), self.L.nbytes("dv_first")))
        for pos, (kind, idx) in reversed(list(enumerate(cfg.block_order()))):
            self.block_pos = pos
            xin = self.buf(f"block_in.{pos}")
            prefix = self._prefix(kind, idx)
            if self.L.recompute:    # the block's forward again from its saved input, then back through it
                if kind == "rwkv":
                    ops += self.rwkv_forward(idx, xin, for_backward=True)
                else:
                    ops += self.attn_forward(idx, xin, attend=False)
                ops += self.channel_mix_forward(prefix, None)
            ops += self.channel_mix_backward(prefix)
            ops += self.rwkv_backward(idx, xin) if kind == "rwkv" else self.attn_backward(idx, xin)
            self._grads_ready(ops, prefix, exclude=ln0)   # block 0's ln0 comes after the last block
        self.block_pos = None
        demb_in = dx
        if cfg.ln0:
            demb_in = self.buf("dh1")
            ops += layernorm.backward(self.buf("emb_out"), self.p("rwkv.blocks.0.ln0.weight"), dx,
                                      demb_in, self.gp("rwkv.blocks.0.ln0.weight"),
                                      self.gp("rwkv.blocks.0.ln0.bias"), self.buf("ln0_mean"),
                                      self.buf("ln0_rstd"), self.buf("partials"), R, C, dev)
        ops += embedding.backward(demb_in, self.buf("tokens"), self.buf("emb_order"),
                                  self.buf("emb_seg_start"), self.buf("emb_n_seg"),
                                  self.gp("rwkv.emb.weight"), R, C, V)
        self._grads_ready(ops, "rwkv.emb.", *ln0)
        return ops

    def _grads_ready(self, ops: list, *prefixes: str, exclude: tuple = ()) -> None:
        """Mark the gradients of the parameters named by ``prefixes`` final after ``ops`` so far."""
        names = tuple(n for n in self.L.param_offsets if n.startswith(prefixes) and n not in exclude)
        self.grad_ready.append((len(ops), names))

    def optimizer(self, weight_decay: float, clip: bool) -> list:
        """One fused AdamW update of every parameter (rwkvx/optim.py's formulas; state on device)."""
        b = self.buf
        return adamw.step(b("params"), b("grads"), b("adam_m"), b("adam_v"), b("adam_table"),
                          b("adam_lrmul"), b("adam_state"), self.L.adam_chunks, b("adam_partials"),
                          weight_decay=weight_decay, clip=clip, params_x=self.buf("params_x"))

    @staticmethod
    def _prefix(kind: str, idx: int) -> str:
        return f"rwkv.blocks.{idx}." if kind == "rwkv" else f"moba.{idx}."

    # -- shared block parts ---------------------------------------------------------------------
    def _residual_add(self, act, weight, out, n_in: int) -> list:
        """out += act @ weight^T: ``out`` holds the residual, copied there by the LayerNorm that read it."""
        return [gemm.linear(act, weight, out, self.R, n_in, self.cfg.n_embd, beta=1.0, precision=self.mm)]

    # The token shifts, the WKV recurrence and the MoBA attention are the parts of a block that look
    # at other tokens; each is one method, so that rwkvx.decoder's stateful builders can replace them.
    def channel_shift(self, prefix: str) -> list:
        """xk2 = h2 + (shift(h2) - h2) * ffn.x_k of block ``prefix``."""
        return channelmix.shift_mix(self.buf("h2"), self.p(prefix + "ffn.x_k"), self.buf("xk2"), self.R,
                                    self.T, self.cfg.n_embd, self.dev)

    def time_shift(self, i: int) -> list:
        """The six token-shift mixes xr .. xg of h1 in RWKV block i."""
        att, b = f"rwkv.blocks.{i}.att.", self.buf
        mixes = tuple(self.p(att + m) for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
        return timemix.shift_forward(b("h1"), mixes, tuple(b(n) for n in ("xr", "xw", "xk", "xv", "xa", "xg")),
                                     self.R, self.cfg.n_embd, self.T, self.dev)

    def wkv(self, i: int, for_backward: bool) -> list:
        """y = WKV7(r, decay, kp, v', wa, wb) of RWKV block i (v' = vp, or v in block 0); with
        ``for_backward`` it also saves what wkv7's backward reads (sa and the state checkpoints)."""
        b, cfg = self.buf, self.cfg
        saved = dict(sa=b("wkv_sa"), ckpt=b("wkv_ckpt"), records=self._wkv_records()) if for_backward else {}
        return wkv7.forward(b("r"), b("decay"), b("kp"), self._value(i), b("wa"), b("wb"), b("y"),
                            self.B, self.T, cfg.n_head, cfg.head_size, self.dev, **saved,
                            method=self.methods["wkv7"], partials=b("wkv_partials"))

    def _wkv_records(self) -> DevPtr | None:
        """The WKV7 backward's chunk records as the recomputed forward keeps them (recompute, chunked), else None."""
        return self.buf("wkv_records") if "wkv_records" in self.L.offsets else None

    def attention(self, j: int) -> list:
        """y = MoBA attention of (q, k, v) = (r, k, v) in attention block j."""
        b = self.buf
        return moba.forward(b("r"), b("k"), b("v"), b("y"), **self._moba_args(j))

    def channel_mix_forward(self, prefix: str, xout) -> list:
        """h2 = LN2(x1); kf = relu(xk2 @ key^T)^2; xout = x1 + kf @ value^T (skipped when None)."""
        R, C, F, dev = self.R, self.cfg.n_embd, self.cfg.ffn_dim, self.dev
        b = self.buf
        ops = layernorm.forward(b("x1"), self.p(prefix + "ln2.weight"), self.p(prefix + "ln2.bias"),
                                b("h2"), b("ln2_mean"), b("ln2_rstd"), R, C, x_copy=xout)
        ops += self.channel_shift(prefix)
        ops.append(gemm.linear(b("xk2"), self.w(prefix + "ffn.key.weight"), b("kf"), R, C, F, precision=self.mm))
        ops += channelmix.relu_sq(b("kf"), b("kf"), R * F, dev)
        if xout is not None:
            ops += self._residual_add(b("kf"), self.w(prefix + "ffn.value.weight"), xout, F)
        return ops

    def channel_mix_backward(self, prefix: str) -> list:
        """From dx (= d block output) to dx = d x1 (in place), with the FFN and ln2 gradients."""
        R, C, F, T, dev, mm = self.R, self.cfg.n_embd, self.cfg.ffn_dim, self.T, self.dev, self.mm
        b, dx = self.buf, self.buf("dx")
        ops = [gemm.linear_dw(b("kf"), dx, self.gp(prefix + "ffn.value.weight"), R, F, C, precision=mm),
               gemm.linear_dx(dx, self.w(prefix + "ffn.value.weight"), b("dkf"), R, F, C, precision=mm)]
        ops += channelmix.relu_sq_backward(b("dkf"), b("kf"), b("dkf"), R * F, dev, src_is_k=True)
        ops += [gemm.linear_dw(b("xk2"), b("dkf"), self.gp(prefix + "ffn.key.weight"), R, C, F, precision=mm),
                gemm.linear_dx(b("dkf"), self.w(prefix + "ffn.key.weight"), b("dxk2"), R, C, F, precision=mm)]
        ops += channelmix.mix_backward(b("dxk2"), b("h2"), self.p(prefix + "ffn.x_k"), b("dh2"),
                                       self.gp(prefix + "ffn.x_k"), b("partials"), R, T, C, dev)
        ops += layernorm.backward(b("x1"), self.p(prefix + "ln2.weight"), b("dh2"), dx,
                                  self.gp(prefix + "ln2.weight"), self.gp(prefix + "ln2.bias"),
                                  b("ln2_mean"), b("ln2_rstd"), b("partials"), R, C, dev, accumulate_dx=True)
        return ops

    def _ln1_forward(self, prefix: str, xin) -> list:
        R, C, b = self.R, self.cfg.n_embd, self.buf
        return layernorm.forward(xin, self.p(prefix + "ln1.weight"), self.p(prefix + "ln1.bias"),
                                 b("h1"), b("ln1_mean"), b("ln1_rstd"), R, C, x_copy=b("x1"))

    def _ln1_backward(self, prefix: str, xin) -> list:
        R, C, b = self.R, self.cfg.n_embd, self.buf
        return layernorm.backward(xin, self.p(prefix + "ln1.weight"), b("dh1"), b("dx"),
                                  self.gp(prefix + "ln1.weight"), self.gp(prefix + "ln1.bias"),
                                  b("ln1_mean"), b("ln1_rstd"), b("partials"), R, C, self.dev, accumulate_dx=True)

    # -- RWKV-7 time mix ------------------------------------------------------------------------
    def _lora(self, i: int) -> list[tuple[str, str, str, str, int]]:
        """(input, hidden, output, letter, rank) of the LoRA paths of RWKV block i."""
        cfg = self.cfg
        paths = [("xw", "hw", "wl", "w", cfg.dim_w), ("xa", "ha", "al", "a", cfg.dim_a)]
        if i > 0:
            paths.append(("xv", "hv", "vl", "v", cfg.dim_v))
        paths.append(("xg", "hg", "g", "g", cfg.dim_g))
        return paths

    def _prep_inputs(self, i: int) -> dict:
        """The arguments prep_forward and prep_backward share for RWKV block i."""
        b, p, att = self.buf, self.p, f"rwkv.blocks.{i}.att."
        return dict(k=b("k"), v=b("v"), wl=b("wl"), al=b("al"), vl=b("vl"), v_first=b("v_first"),
                    w0=p(att + "w0"), a0=p(att + "a0"), v0=p(att + "v0") if i else None,
                    k_k=p(att + "k_k"), k_a=p(att + "k_a"), R=self.R, C=self.cfg.n_embd,
                    N=self.cfg.head_size, layer=i, dev=self.dev)

    def _value(self, i: int) -> DevPtr:
        """v' of RWKV block i, the WKV's value: vp after the value residual, or v itself in block 0."""
        return self.buf("vp") if i else self.buf("v")

    def _gn_inputs(self, i: int) -> dict:
        """The arguments gn_forward and gn_backward share for RWKV block i."""
        b, p, att = self.buf, self.p, f"rwkv.blocks.{i}.att."
        return dict(y=b("y"), r=b("r"), kp=b("kp"), vp=self._value(i), g=b("g"),
                    ln_w=p(att + "ln_x.weight"), ln_b=p(att + "ln_x.bias"), r_k=p(att + "r_k"),
                    R=self.R, C=self.cfg.n_embd, N=self.cfg.head_size, dev=self.dev)

    def rwkv_forward(self, i: int, xin, for_backward: bool = False) -> list:
        """x1 = xin + TimeMix(LN1(xin)) (docs/SPEC.md §2.3), leaving every transient the backward needs; only
        ``for_backward`` (the forward the backward reads: the recompute, or the forward itself without
        recompute) saves the WKV state for it."""
        R, C, dev, mm = self.R, self.cfg.n_embd, self.dev, self.mm
        pre, b = f"rwkv.blocks.{i}.", self.buf
        att = pre + "att."
        ops = self._ln1_forward(pre, xin)
        ops += self.time_shift(i)
        for src, dst, name in (("xr", "r", "receptance"), ("xk", "k", "key"), ("xv", "v", "value")):
            ops.append(gemm.linear(b(src), self.w(f"{att}{name}.weight"), b(dst), R, C, C, precision=mm))
        for src, hid, out, letter, rank in self._lora(i):
            ops.append(gemm.matmul(b(src), self.w(f"{att}{letter}1"), b(hid), R, C, rank, precision=mm))
            if letter == "w":
                ops += timemix.tanh_forward(b(hid), b(hid), R * rank, dev)
            elif letter == "g":
                ops += timemix.sigmoid_forward(b(hid), b(hid), R * rank, dev)
            ops.append(gemm.matmul(b(hid), self.w(f"{att}{letter}2"), b(out), R, rank, C, precision=mm))
        ops += timemix.prep_forward(**self._prep_inputs(i), decay=b("decay"), kp=b("kp"), vp=b("vp"),
                                    wa=b("wa"), wb=b("wb"))
        ops += self.wkv(i, for_backward)
        ops += timemix.gn_forward(**self._gn_inputs(i), z=b("z"))
        ops += self._residual_add(b("z"), self.w(att + "output.weight"), b("x1"), C)
        return ops

    def rwkv_backward(self, i: int, xin) -> list:
        """From dx = d x1 to dx = d xin (in place), with every TimeMix and ln1 gradient of block i."""
        R, C, T, N, H, dev, mm = (self.R, self.cfg.n_embd, self.T, self.cfg.head_size, self.cfg.n_head,
                                  self.dev, self.mm)
        pre, b, p, gp = f"rwkv.blocks.{i}.", self.buf, self.p, self.gp
        att = pre + "att."
        dx = b("dx")
        gn = self._gn_inputs(i)
        ops = [gemm.linear_dw(b("z"), dx, gp(att + "output.weight"), R, C, C, precision=mm),
               gemm.linear_dx(dx, self.w(att + "output.weight"), b("dz"), R, C, C, precision=mm)]
        ops += timemix.gn_backward(**gn, dz=b("dz"), dy=b("dy"), dg=b("dg"), dr2=b("dr2"), dkp2=b("dkp2"),
                                   dvp2=b("dvp2"), partials=b("partials"),
                                   dparams=(gp(att + "ln_x.weight"), gp(att + "ln_x.bias"), gp(att + "r_k")))
        ops += wkv7.backward(b("r"), b("decay"), b("kp"), gn["vp"], b("wa"), b("wb"), b("dy"), b("wkv_sa"),
                             b("wkv_ckpt"), b("dr"), b("ddecay"), b("dkp"), b("dvp"), b("dwa"), b("dwb"),
                             self.B, T, H, N, dev, partials=b("wkv_partials"), method=self.methods["wkv7"],
                             records=self._wkv_records())
        dparams = [gp(att + n) for n in ("w0", "a0", "k_k", "k_a")] + ([gp(att + "v0")] if i else [])
        ops += timemix.prep_backward(**self._prep_inputs(i),
                                     d_decay=b("ddecay"), dkp=b("dkp"), dvp=b("dvp"), dwa=b("dwa"), dwb=b("dwb"),
                                     dkp2=b("dkp2"), dvp2=b("dvp2"), dr=b("dr"), dr2=b("dr2"), dr_out=b("dr"),
                                     dk=b("dk"), dv=b("dv"), dwl=b("dwl"), dal=b("dal"), dvl=b("dvl"),
                                     dv_first=b("dv_first"), partials=b("partials"), dparams=dparams)
        # projections r, k, v: dx* = d(out) @ W, dW = d(out)^T x*
        for src, dsrc, dout, name in (("xr", "dxr", "dr", "receptance"), ("xk", "dxk", "dk", "key"),
                                      ("xv", "dxv", "dv", "value")):
            ops += [gemm.linear_dw(b(src), b(dout), gp(f"{att}{name}.weight"), R, C, C, precision=mm),
                    gemm.linear_dx(b(dout), self.w(f"{att}{name}.weight"), b(dsrc), R, C, C, precision=mm)]
        # LoRA paths: out = act(src @ W1) @ W2
        grads_of = {"wl": "dwl", "al": "dal", "vl": "dvl", "g": "dg"}
        for src, hid, out, letter, rank in self._lora(i):
            dout, dhid = b(grads_of[out]), b("d" + hid)
            ops += [gemm.matmul_dw(b(hid), dout, gp(f"{att}{letter}2"), R, rank, C, precision=mm),
                    gemm.matmul_dx(dout, self.w(f"{att}{letter}2"), dhid, R, rank, C, precision=mm)]
            if letter == "w":
                ops += timemix.tanh_backward(b(hid), dhid, dhid, R * rank, dev)
            elif letter == "g":
                ops += timemix.sigmoid_backward(b(hid), dhid, dhid, R * rank, dev)
            ops.append(gemm.matmul_dw(b(src), dhid, gp(f"{att}{letter}1"), R, C, rank, precision=mm))
            # xv feeds both the value projection and the v LoRA: accumulate its gradient
            beta = 1.0 if letter == "v" else 0.0
            ops.append(gemm.matmul_dx(dhid, self.w(f"{att}{letter}1"), b("d" + src), R, C, rank, beta=beta,
                                      precision=mm))
        dmix = tuple(gp(att + m) for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
        ops += timemix.shift_backward(b("h1"), tuple(p(att + m) for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")),
                                      tuple(b(n) for n in ("dxr", "dxw", "dxk", "dxv", "dxa", "dxg")),
                                      b("dh1"), dmix, b("partials"), R, C, T, dev)
        ops += self._ln1_backward(pre, xin)
        return ops

    # -- MoBA attention -------------------------------------------------------------------------
    def _moba_args(self, j: int) -> dict:
        cfg = self.cfg
        scratch = {name: (self.buf(f"moba_sel.{j}") if name == "sel" else self.buf("moba_" + name))
                   for name in moba.SCRATCH_NAMES}
        return dict(scratch=scratch, B=self.B, T=self.T, H=cfg.n_head, N=cfg.head_size,
                    chunk=cfg.moba_chunk_size, top_k=cfg.moba_top_k, dev=self.dev, method=self.methods["moba"])

    def attn_forward(self, j: int, xin, attend: bool = True) -> list:
        """x1 = xin + Attn_j(LN1(xin)) (docs/SPEC.md §2.3, MoBA). Without ``attend`` (the recompute) the block's
        kept MoBA output and selection (:data:`ATTENTION_KEPT`) stand for the attention."""
        R, C, b = self.R, self.cfg.n_embd, self.buf
        pre = f"moba.{j}."
        ops = self._ln1_forward(pre, xin)
        for dst, name in (("r", "receptance"), ("k", "key"), ("v", "value")):
            ops.append(gemm.linear(b("h1"), self.w(f"{pre}att.{name}.weight"), b(dst), R, C, C, precision=self.mm))
        if attend:
            ops += self.attention(j)
        ops += self._residual_add(b("y"), self.w(pre + "att.output.weight"), b("x1"), C)
        return ops

    def attn_backward(self, j: int, xin) -> list:
        """From dx = d x1 to dx = d xin (in place), with the attention and ln1 gradients."""
        R, C, b, gp, mm = self.R, self.cfg.n_embd, self.buf, self.gp, self.mm
        pre = f"moba.{j}."
        dx = b("dx")
        ops = [gemm.linear_dw(b("y"), dx, gp(pre + "att.output.weight"), R, C, C, precision=mm),
               gemm.linear_dx(dx, self.w(pre + "att.output.weight"), b("dz"), R, C, C, precision=mm)]
        ops += moba.backward(b("r"), b("k"), b("v"), b("y"), b("dz"), b("dr"), b("dk"), b("dv"),
                             **self._moba_args(j))
        for n, (dsrc, name) in enumerate((("dr", "receptance"), ("dk", "key"), ("dv", "value"))):
            ops += [gemm.linear_dw(b("h1"), b(dsrc), gp(f"{pre}att.{name}.weight"), R, C, C, precision=mm),
                    gemm.linear_dx(b(dsrc), self.w(f"{pre}att.{name}.weight"), b("dh1"), R, C, C,
                                   beta=1.0 if n else 0.0, precision=mm)]
        ops += self._ln1_backward(pre, xin)
        return ops


class Model:
    """An RWKV-X model resident on the GPU, for a fixed batch size and sequence length.

    Same contract as :class:`rwkvx.oracle.Oracle`: ``forward(tokens)`` -> logits,
    ``loss_and_grads(tokens, targets, ignore_index)`` -> (loss, grads). Weights, gradients, optimizer
    moments and every activation live in one device arena sized at construction; a step allocates
    nothing and synchronises only to read the per-token losses.

    ``precision`` (docs/SPEC.md §4): "fp32" (exact), "tf32" (tensor-core GEMMs), "bf16" (bf16 GEMM operands and
    activations; fp32 master weights, gradients, optimizer state, WKV state and statistics).
    ``recompute`` (default :data:`DEFAULT_RECOMPUTE`, True): the backward recomputes each block's forward from its saved input;
    False keeps every block's transients instead (more memory, no second forward). ``methods``
    overrides the precision's kernel methods (e.g. ``{"wkv7": "sequential"}``).
    """

    def __init__(self, cfg: Config, params: ParamDict, batch_size: int, seq_len: int,
                 precision: str | Precision = "fp32", recompute: bool = DEFAULT_RECOMPUTE, methods: dict[str, str] | None = None):
        if not isinstance(cfg, Config):
            raise TypeError("Model expects an rwkvx.Config")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        precision = resolve_precision(precision)
        if not isinstance(recompute, bool):
            raise TypeError(f"recompute must be a bool, got {type(recompute).__name__}")
        check_params(cfg, params)
        from ._core import Plan
        from .runtime import Device  # raises RuntimeError without a GPU
        self.cfg, self.B, self.T, self.precision, self.recompute = cfg, batch_size, seq_len, precision, recompute
        self.dev = Device.get()
        self.layout = Layout(cfg, batch_size, seq_len, self.dev.info, precision, recompute, methods)
        self.arena = self.dev.alloc(self.layout.total)
        R = batch_size * seq_len
        self._pinned = {name: self.dev.alloc_pinned(self.layout.nbytes(name))
                        for name in [*Layout.host_inputs(R), "loss_t"]}
        self.builder = StepBuilder(self.layout, self.arena.ptr, {k: v.ptr for k, v in self._pinned.items()})
        self.ops = self.builder.build()
        # every GEMM's algorithm, chosen before anything in the arena past the per-step inputs is live:
        # new shapes are timed with their outputs written there, so the plans allocate nothing for it
        ops = self.ops
        gemms = [op for op in flatten_ops([ops.step, ops.evaluate, ops.head]) if isinstance(op, Gemm)]
        free = self.layout.offsets["tokens"]
        self.dev.cublas.prepare(gemms, scratch=(self.arena.ptr + free, self.layout.total - free))
        self._forward_plan = Plan(self.dev, self.ops.stage_tokens + self.ops.forward)
        self._step_plan = Plan(self.dev, self.ops.step)
        self.load_params(params)

    # -- parameters ------------------------------------------------------------------------------
    def _region(self, region: str) -> dict[str, np.ndarray]:
        flat = self.dev.download(self.builder.buf(region), (self.layout.counts[region],), np.float32)
        return {n: flat[off:off + size].reshape(self.layout.param_shapes[n]).copy()
                for n, (off, size) in self.layout.param_offsets.items()}

    def _upload_region(self, region: str, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """Inverse of :meth:`_region`: one name-keyed tensor per parameter, packed and uploaded."""
        flat = np.zeros(self.layout.counts[region], np.float32)
        for n, (off, size) in self.layout.param_offsets.items():
            flat[off:off + size] = np.asarray(tensors[n], np.float32).ravel()
        self.dev.upload(self.builder.buf(region), flat)
        return flat

    def load_params(self, params: ParamDict) -> None:
        """Upload ``params`` (names and shapes of ``param_shapes(cfg)``) to the device (and their bf16
        copy, the GEMMs' operands, in bf16 mode)."""
        check_params(self.cfg, params)
        flat = self._upload_region("params", params)
        if self.layout.counts["params_x"]:
            self.dev.upload(self.builder.buf("params_x"), to_storage("bf16", flat))

    def params(self) -> ParamDict:
        """The current parameters, downloaded, name-keyed."""
        return self._region("params")

    def grads(self) -> ParamDict:
        """The gradients of the last :meth:`loss_and_grads`, downloaded, name-keyed."""
        return self._region("grads")

    # -- steps ---------------------------------------------------------------------------------
    def stage_tokens(self, tokens) -> np.ndarray:
        """Validate ``tokens`` [B, T] and write them into the pinned buffer the forward reads."""
        tokens = validate.check_tokens(tokens, self.cfg.vocab_size)
        if tokens.shape != (self.B, self.T):
            raise ValueError(f"tokens have shape {tokens.shape}, this Model was built for "
                             f"(batch_size, seq_len) = {(self.B, self.T)}")
        self._pinned["tokens"].array(np.int32, (self.B * self.T,))[:] = tokens.ravel()
        return tokens

    def forward(self, tokens) -> np.ndarray:
        """Logits ``[B, T, V]`` (float32) for int tokens ``[B, T]``."""
        self.stage_tokens(tokens)
        self._forward_plan.run()
        return self.logits().reshape(self.B, self.T, self.cfg.vocab_size)

    def logits(self) -> np.ndarray:
        """Logits ``[B*T, V]`` (float32) of the last forward (its final LayerNorm's output), through the
        head chunk by chunk of rows."""
        from ._core import Plan
        if getattr(self, "_head_plans", None) is None:
            self._head_plans = [Plan(self.dev, ops) for ops in self.ops.head]
        V, rows, buf = self.cfg.vocab_size, self.layout.head_rows, self.builder.buf("logits")
        out = np.empty((self.B * self.T, V), np.float32)
        for plan, r0 in zip(self._head_plans, self.builder.head_chunks()):
            plan.run()
            n = min(rows, self.B * self.T - r0)
            out[r0:r0 + n] = from_storage(buf.elem, self.dev.download(buf, (n, V), storage_dtype(buf.elem)))
        return out

    def stage_batch(self, tokens, targets, ignore_index: int = validate.IGNORE_INDEX) -> None:
        """Validate a batch and write it into the pinned buffers the step reads (ignored targets are
        stored as validate.IGNORE_INDEX, the value the loss kernel was built with)."""
        tokens = self.stage_tokens(tokens)
        targets = validate.check_targets(targets, tokens.shape, self.cfg.vocab_size, ignore_index)
        flat = np.where(targets == ignore_index, validate.IGNORE_INDEX, targets).astype(np.int32).ravel()
        order, seg_start, n_seg = embedding.sort_tokens(tokens)
        pin = self._pinned
        pin["targets"].array(np.int32, flat.shape)[:] = flat
        pin["emb_order"].array(np.int32, order.shape)[:] = order
        pin["emb_seg_start"].array(np.int32, seg_start.shape)[:] = seg_start
        pin["emb_n_seg"].array(np.int32, (1,))[:] = n_seg
        pin["inv_count"].array(np.float64, (1,))[:] = loss.inv_count(flat)

    def inv_count(self) -> float:
        """1 / the number of targets != ignore_index in the staged batch (float64, as the loss uses it)."""
        return float(self._pinned["inv_count"].array(np.float64, (1,))[0])

    def mean_loss(self) -> float:
        """The mean loss of the last step, from the pinned per-token losses, reduced in double."""
        from ._core import sum_float64
        return sum_float64(self._pinned["loss_t"].array(np.float64, (self.B * self.T,))) * self.inv_count()

    def run_step(self) -> None:
        """Enqueue one forward + loss + backward on the staged batch (no synchronisation)."""
        self._step_plan.run()

    def loss_and_grads(self, tokens, targets, ignore_index: int = validate.IGNORE_INDEX) -> tuple[float, ParamDict]:
        """Mean cross-entropy over targets != ignore_index, and the gradient of every parameter."""
        self.stage_batch(tokens, targets, ignore_index)
        self.run_step()
        self.dev.synchronize()
        return self.mean_loss(), self.grads()

    # -- training: the whole step, AdamW included, as one CUDA graph -----------------------------
    def configure_optimizer(self, schedule: Schedule, weight_decay: float = 0.0,
                            grad_clip: float | None = None) -> None:
        """Set up AdamW (moments zeroed, step 0) and the training plan ``train_step`` replays."""
        from ._core import Plan
        b = self.builder.buf
        self.dev.upload(b("adam_table"), self.layout.adam_table)
        self.dev.upload(b("adam_lrmul"), self.layout.adam_lrmul)
        self.dev.upload(b("adam_state"), adamw.state_from_schedule(schedule, grad_clip))
        zeros = np.zeros(self.layout.counts["adam_m"], np.float32)
        self.dev.upload(b("adam_m"), zeros)
        self.dev.upload(b("adam_v"), zeros)
        self.schedule, self.weight_decay, self.grad_clip = schedule, weight_decay, grad_clip
        self._train_plan = Plan(self.dev, self.ops.step + self.builder.optimizer(weight_decay, bool(grad_clip)))
        self._train_graph = None

    def train_step(self, tokens, targets, ignore_index: int = validate.IGNORE_INDEX, graph: bool = True) -> float:
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

    def evaluate(self, tokens, targets, ignore_index: int = validate.IGNORE_INDEX) -> float:
        """Mean loss on one batch: forward and loss only, the parameters untouched."""
        from ._core import Plan
        if getattr(self, "_eval_plan", None) is None:
            ops = self.ops
            self._eval_plan = Plan(self.dev, ops.stage_tokens + ops.stage_targets + ops.forward + ops.evaluate)
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
        if n == 0:                          # top_k == 1: nothing is selected, no buffer exists
            return [np.zeros(shape, np.int32) for _ in range(cfg.n_attn_layer)]
        return [self.dev.download(self.builder.buf(f"moba_sel.{j}"), shape, np.int32)
                for j in range(cfg.n_attn_layer)]

    def poison(self) -> None:
        """Fill gradients and every activation with NaN (tests: whatever a step leaves unwritten shows)."""
        L = self.layout
        self.dev.upload(self.arena.ptr + L.offsets["tokens"], L.poison_image())
        self.dev.upload(self.builder.buf("grads"), poison_bits("f32", L.counts["grads"]))

    def memory_bytes(self) -> int:
        """Bytes of the device arena (weights, gradients, optimizer state, activations, scratch)."""
        return self.layout.total
