"""The GPU model's memory: :class:`Layout` places every device buffer of a (config, B, T, precision,
recompute) model in one arena, as offsets from its base.

The buffer sets named here say which transients a block keeps for its backward and which buffers share
memory; :mod:`rwkvx.step` addresses the buffers by name, :mod:`rwkvx.model` allocates the arena once.
Computing a layout needs no GPU (the device's properties come as a
:class:`~rwkvx.runtime.device.DeviceInfo`).
"""
from __future__ import annotations

import numpy as np

from .config import Config
from .cu import adamw, channelmix, layernorm, moba, timemix, wkv7
from .lora import LoraSettings, lora_shapes
from .oracle.adamw import MOMENT_TYPES
from .params import gemm_weights, param_shapes
from .precision import Precision, resolve_precision
from .runtime.device import DeviceInfo
from .runtime.dtypes import ELEM_BYTES, poison_bits
from .state_tuning import state_shapes

HEAD_CHUNK_BYTES = 512 << 20  # the logits of one row chunk of the head: [rows, V] activations

_ALIGN = 256  # bytes; every buffer starts 256-byte aligned (vector kernels, cuBLAS)


def _round_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


# Transients the backward reads from its own block's forward: with recompute=False each block keeps its
# own copies (block 0 uses the shared ones); with recompute=True the backward recomputes them.
FORWARD_STATE = {
    "rwkv": ("xr", "xw", "xk", "xv", "xa", "xg", "r", "k", "v", "wl", "al", "vl", "g", "hw", "ha", "hv",
             "hg", "decay", "kp", "vp", "wa", "wb", "y", "z", "ln1_mean", "ln1_rstd", "wkv_sa", "wkv_ckpt"),
    "attn": ("h1_x", "r", "k", "v", "y", "ln1_mean", "ln1_rstd", "moba_lse", "moba_idx", "moba_qlist", "moba_olo"),
}
# Buffers stored in fp32 in every precision (docs/SPEC.md §4): the residual stream and its gradient, the
# LayerNorm outputs where they are stored (LN_OUTPUTS; the decoder's token shifts read them) and the gradient
# of the LayerNorm outputs still in memory (dh1: the attention blocks' and ln0's), v_first's gradient
# (summed over the blocks) and the WKV7 decay. In bf16 these roundings cost the most accuracy per byte
# (docs/PERFORMANCE.md, "bf16 accuracy"); the rest of the activations are the GEMMs' bf16 operands.
FP32_ALWAYS = ("emb_out", "block_in", "x1", "dx", "dv_first", "h1", "h2", "dh1", "dlnout", "decay")
# The bf16 GEMM operands of fp32 buffers, name -> its copy in the activation type: the attention blocks'
# LN1 output (only GEMMs read it) and the residual gradient (written by the LayerNorm backward with it).
# In fp32 and tf32 a copy is the buffer itself (same offset).
GEMM_COPIES = {"h1": "h1_x", "dx": "dx_x"}
# The buffers of GEMM_COPIES that only attention blocks read as GEMM operands: a model without attention
# blocks has no copy of them (and, unless a layout stores the LayerNorm outputs, no h1).
ATTENTION_OPERANDS = ("h1",)
# One block's full LayerNorm outputs, LN1's and LN2's [B*T, C]: only the decoder stores them (its prefill keeps
# their last rows as the token shifts' state, its step shifts them), so only its layout has them
# (Layout's ln_outputs). The training step never does: the fused LayerNorm + token shift kernels write the
# mixes alone and their backward recomputes the output from the LayerNorm's input and statistics; h1 is
# there only as the attention blocks' LN1 output where that GEMM operand is h1 itself (fp32, tf32).
LN_OUTPUTS = ("h1", "h2")
# The FFN key projection's output before relu², fp32 in every precision: relu² squares its rounding, so
# the kernel squares the fp32 product and rounds once, into kf (docs/PERFORMANCE.md, "bf16 accuracy").
# A transient of the channel mix's forward, in the channel mix's shared set; in fp32 and tf32 there is none
# (relu² runs in place on the fp32 kf).
KF_PRE = "kf_pre"
# What an attention block keeps for its backward even with recompute=True: the recompute skips the MoBA
# forward, the one part of a block whose cost grows with the attended keys (T * chunk * top_k), for
# B*T*(C + H) activations (in bf16 B*T*(2C + H): the output's residual olo too) and the query lists per
# attention block.
ATTENTION_KEPT = ("y", "moba_lse", "moba_idx", "moba_qlist", "moba_olo")
CHANNEL_MIX_STATE = ("x1", "xk2", "kf", "ln2_mean", "ln2_rstd")
# The WKV7 gradients that only feed the time mix's prep backward: f32 in every precision (its parameter
# gradients sum them over the tokens after near-cancelling projections, where bf16 rounding would show).
WKV_F32_GRADS = ("ddecay", "dkp", "dvp", "dwa", "dwb")
# Gradients written and read only after their block's WKV7 or MoBA backward has run (the time mix's LoRA and
# projection inputs' gradients, d LN1 output): they share the region of the WKV7 / MoBA scratch.
AFTER_WKV_GRADS = ("dwl", "dal", "dvl", "dxr", "dxw", "dxk", "dxv", "dxa", "dxg", "dh1")
# MoBA scratch that lives inside one attention block's forward or backward (shares the logits' region)
SHARED_MOBA_SCRATCH = ("part", "lpart")
# What AdamW updates (Layout.trains -> its values, gradients and two moments, flat regions with the same
# offsets): every parameter, or under state tuning the RWKV blocks' initial WKV states alone, or under LoRA
# the adapters' factors alone (the parameters frozen in both)
TRAINED = {"params": ("params", "grads", "adam_m", "adam_v"),
           "states": ("states", "state_grads", "state_m", "state_v"),
           "lora": ("lora", "lora_grads", "lora_m", "lora_v")}
MOMENT_REGIONS = {name for regions in TRAINED.values() for name in regions[2:]}   # of the Layout's moments type


# The parameters' regions besides AdamW's moments: the float32 values, their gradients, and the bf16 copy
# the GEMMs read (empty where they read the float32 values)
PARAMETER_REGIONS = ("params", "grads", "params_x")


def _flat_size(offsets: dict[str, tuple[int, int]]) -> int:
    """Floats a flat region of tensors at ``offsets`` spans."""
    return max((off + size for off, size in offsets.values()), default=0)


def head_chunk_rows(R: int, V: int, xtype: str, chunk_bytes: int) -> int:
    """Rows of one head / cross-entropy chunk: as many as fit ``chunk_bytes`` of logits, a multiple
    of 64 rows (at least 64), at most R."""
    rows = max(64, chunk_bytes // (V * ELEM_BYTES[xtype]) // 64 * 64)
    return min(R, rows)


class Layout:
    """Every device buffer of a (config, B, T, precision, recompute) model: name -> (offset, element type,
    count) in one arena.

    Regions: ``params``/``grads``/``adam_m``/``adam_v`` (flat, same offsets per tensor; f32, the moments
    of type ``moments``: "f32" or "bf16", the lean moments of :mod:`rwkvx.oracle.adamw`; with the
    parameters frozen, packed as :meth:`_parameter_regions` says, at :attr:`region_offsets`), the per-step
    inputs, one saved input per block, and one block's worth of transients shared by all blocks (with
    ``recompute=False``, also every other block's :data:`FORWARD_STATE`, as ``name@position``).
    Activations have the element type ``xtype`` of ``precision`` (a :class:`~rwkvx.precision.Precision`
    or its name); ``methods`` are its kernel methods (:meth:`rwkvx.precision.Precision.kernel_methods`),
    overridden by ``methods`` where given. ``recompute``: the backward recomputes each block's forward
    (see :class:`rwkvx.model.Model`). ``head_chunk_bytes``: the most bytes of logits the head computes at
    once; the head and the cross entropy run over the rows in chunks of :attr:`head_rows`
    (:func:`head_chunk_rows`). ``tune_states``: the RWKV blocks start their WKV recurrence from initial
    states (``states``, flat f32 at :attr:`state_offsets`, :mod:`rwkvx.state_tuning`) and AdamW trains those
    alone (:data:`TRAINED`: ``state_grads``, ``state_m``, ``state_v``; the parameters get no moments).
    ``lora`` (:class:`rwkvx.lora.LoraSettings`): every adapted projection adds s·(x·A)·B; the factors
    (``lora``, flat f32 at :attr:`lora_offsets`, with their bf16 copy ``lora_x`` where the GEMMs read bf16
    operands) are what AdamW trains (``lora_grads``, ``lora_m``, ``lora_v``; the parameters get no
    moments); ``lora_h`` [B*T, r] holds one projection's hidden x·A (then, in the backward, its gradient).
    ``ln_outputs``: allocate the full LayerNorm outputs h1 and h2 (:data:`LN_OUTPUTS`), as the decoder's
    builders and step variants with separate LayerNorm and shift kernels need; without it h2 is absent and
    h1 exists only where the attention blocks' GEMM operand ``h1_x`` is h1 itself (fp32, tf32). A model
    without attention blocks has no ``h1_x`` (:data:`ATTENTION_OPERANDS`).
    """

    def __init__(self, cfg: Config, B: int, T: int, dev: DeviceInfo, precision: Precision | str,
                 recompute: bool, methods: dict[str, str] | None = None, *,
                 head_chunk_bytes: int = HEAD_CHUNK_BYTES, tune_states: bool = False,
                 moments: str = "f32", lora: LoraSettings | None = None, ln_outputs: bool = False):
        if isinstance(head_chunk_bytes, bool) or not isinstance(head_chunk_bytes, int) or head_chunk_bytes < 1:
            raise ValueError(f"head_chunk_bytes must be a positive int, got {head_chunk_bytes!r}")
        precision = resolve_precision(precision)
        xtype = precision.xtype
        self.cfg, self.B, self.T, self.dev, self.xtype = cfg, B, T, dev, xtype
        if tune_states and lora is not None:
            raise ValueError("Layout: state tuning and LoRA train different tensors; choose one")
        if lora is not None and not isinstance(lora, LoraSettings):
            raise TypeError(f"Layout: lora must be an rwkvx.lora.LoraSettings, got {type(lora).__name__}")
        self.precision, self.recompute, self.tune_states, self.lora = precision, recompute, tune_states, lora
        self.ln_outputs = ln_outputs
        # the GEMM-operand copies this model's step reads
        self.gemm_copies = {name: copy for name, copy in GEMM_COPIES.items()
                            if cfg.n_attn_layer or name not in ATTENTION_OPERANDS}
        # the regions AdamW updates (TRAINED's key)
        self.trains = "states" if tune_states else "lora" if lora is not None else "params"
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
        if moments not in MOMENT_TYPES:
            raise ValueError(f"moments must be one of {', '.join(MOMENT_TYPES)}, got {moments!r}")
        self.region_offsets = self._parameter_regions(cfg, precision.gemm.bf16_operands)
        for region in TRAINED["params"]:          # frozen parameters (state tuning, LoRA) have no moments
            if region in MOMENT_REGIONS:
                self._add(region, n_flat if self.trains == "params" else 0, moments)
            else:
                self._add(region, _flat_size(self.region_offsets[region]), "f32")
        self._add("params_x", _flat_size(self.region_offsets["params_x"]), xtype)
        self.state_offsets: dict[str, tuple[int, int]] = {}
        self.lora_offsets: dict[str, tuple[int, int]] = {}
        trained_segments = self.param_segments
        if self.trains != "params":
            shapes = state_shapes(cfg) if tune_states else lora_shapes(cfg, lora)
            trained_segments, n_trained = adamw.flat_layout(shapes)
            offsets = {seg[0]: (seg[1], seg[2]) for seg in trained_segments}
            if tune_states:
                self.state_offsets = offsets
            else:
                self.lora_offsets = offsets
            for region in TRAINED[self.trains]:
                self._add(region, n_trained, moments if region in MOMENT_REGIONS else "f32")
            if lora is not None:
                self._add("lora_x", n_trained if precision.gemm.bf16_operands else 0, xtype)
        self.adam_table, self.adam_lrmul = adamw.build_table(trained_segments)
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
        self._add("emb_out", R * C, self.elem_of("emb_out"))
        for i in range(cfg.n_blocks + 1):
            self._add(f"block_in.{i}", R * C, self.elem_of("block_in"))
        for name in ("v_first", "dv_first", "lnout"):
            self._add(name, R * C, self.elem_of(name))
        self._add("lnout_mean", R, "f32")
        self._add("lnout_rstd", R, "f32")
        self.head_rows = head_chunk_rows(R, V, X, head_chunk_bytes)
        # buffers never live at once share one region (_add_shared), one set at a time: the head's row
        # chunk of logits (then dlogits), the WKV7 work buffer, MoBA's partial outputs, the channel mix's
        # backward gradients, its forward's fp32 key product (bf16), the gradients a block's backward
        # computes after its WKV7 / MoBA backward
        # (each set lives inside the head or inside one part of one block's pass)
        shared: dict[str, dict[str, tuple[int, str]]] = {
            "head": {"logits": (self.head_rows * V, X)}, "wkv": {}, "moba": {},
            "ffn": {"dkf": (R * F, X), "dxk2": (R * C, X)},
            "ffn_forward": {KF_PRE: (R * F, "f32")} if X != "f32" else {},
            "tail": {name: (R * C, self.elem_of(name)) for name in AFTER_WKV_GRADS}}
        self._add("dx", R * C, self.elem_of("dx"))
        self._add("dlnout", R * C, self.elem_of("dlnout"))
        if cfg.n_attn_layer:
            moba_sizes = moba.scratch_sizes(B, T, H, N, cfg.moba_chunk_size, cfg.moba_top_k, X)
            for j in range(cfg.n_attn_layer):  # kept per block: the selection is read back after a step
                self._add(f"moba_sel.{j}", *moba_sizes["sel"])
        # one block's transients, shared by every block (blocks run one after another); a LayerNorm output
        # only where something stores it (LN_OUTPUTS)
        rc = ("h1", "xr", "xw", "xk", "xv", "xa", "xg", "r", "k", "v", "wl", "al", "vl", "g", "decay",
              "kp", "vp", "wa", "wb", "y", "z", "x1", "h2", "xk2",
              "dz", "dy", "dg", "dr2", "dkp2", "dvp2", "dr", "ddecay", "dkp", "dvp", "dwa", "dwb",
              "dk", "dv", "dwl", "dal", "dvl", "dxr", "dxw", "dxk", "dxv", "dxa", "dxg", "dh1")
        for name in rc:
            stored = name not in LN_OUTPUTS or ln_outputs or self._is_own_copy(name)
            if name not in AFTER_WKV_GRADS and stored:
                self._add(name, R * C, self.elem_of(name))
        for name, copy in self.gemm_copies.items():
            if self._is_own_copy(name):
                self._alias(copy, name)
            else:
                self._add(copy, R * C, X)
        for name, d in (("hw", cfg.dim_w), ("ha", cfg.dim_a), ("hv", cfg.dim_v), ("hg", cfg.dim_g)):
            self._add(name, R * d, X)
            self._add("d" + name, R * d, X)
        self._add("kf", R * F, X)
        if lora is not None:
            self._add("lora_h", R * lora.rank, X)
        for name in ("ln1_mean", "ln1_rstd", "ln2_mean", "ln2_rstd", "ln0_mean", "ln0_rstd"):
            self._add(name, R, "f32")
        # with recompute the chunked WKV7's recomputed forward also writes the backward's chunk records
        # (one pass for both, rwkvx.cu.wkv7.forward), kept through the channel mix until the block's
        # WKV7 backward: they lead the WKV7 work buffer's set and the channel mix's two
        keep = recompute and self.methods["wkv7"] in wkv7.CHUNKED_METHODS
        for name, count in wkv7.scratch_elems(B, T, H, N, dev, method=self.methods["wkv7"],
                                              kept_records=keep, ds0=tune_states).items():
            if name == "partials":
                shared["wkv"]["wkv_partials"] = (count, "f32")
            elif name == "records":
                for kept_by in ("wkv", "ffn", "ffn_forward"):
                    shared[kept_by] = {"wkv_records": (count, "f32"), **shared[kept_by]}
            else:
                self._add("wkv_" + name, count, "f32")
        per_block = {}          # what every attention block keeps as its own copy (attention is never block 0)
        if cfg.n_attn_layer:
            for name, (count, elem) in moba_sizes.items():
                if name in SHARED_MOBA_SCRATCH:
                    shared["moba"]["moba_" + name] = (count, elem)
                elif "moba_" + name in ATTENTION_KEPT:
                    per_block["moba_" + name] = (count, elem)
                elif name != "sel":
                    self._add("moba_" + name, count, elem)
        self._add_shared(shared)
        self._add("partials", max(layernorm.scratch_elems(R, C, dev), layernorm.shift_backward_scratch_elems(R, C, dev),
                                  channelmix.scratch_elems(R, C, dev), timemix.scratch_elems(R, C, N, dev)), "f32")
        for pos, (kind, _) in enumerate(cfg.block_order()):
            if not recompute:
                kept = FORWARD_STATE[kind] + CHANNEL_MIX_STATE if pos else ()
            else:
                kept = ATTENTION_KEPT if kind == "attn" else ()
            for name in kept:
                if name in per_block:
                    self._add(f"{name}@{pos}", *per_block[name])
                elif name in self.counts:
                    self._add(f"{name}@{pos}", self.counts[name], self.elems[name])

    def _parameter_regions(self, cfg: Config, bf16_operands: bool) -> dict[str, dict[str, tuple[int, int]]]:
        """Name -> (offset, size) of the parameters each of :data:`PARAMETER_REGIONS` holds.

        Trained parameters: every one in ``params`` and ``grads``, and in ``params_x`` where the GEMMs read
        bf16 operands, at :attr:`param_offsets` (AdamW updates the values and refreshes the copy at the
        same offsets). Frozen parameters (state tuning, LoRA) are laid out compactly: ``params_x`` holds
        the bf16 copy of :func:`~rwkvx.params.gemm_weights` alone and ``params`` the float32 values of the
        rest (every parameter where the GEMMs read float32); ``grads`` is empty (the step forms no
        parameter gradient: nothing would read it)."""
        every = self.param_offsets
        if self.trains == "params":
            return {"params": every, "grads": every, "params_x": every if bf16_operands else {}}
        gemm = set(gemm_weights(cfg))

        def compact(keep) -> dict[str, tuple[int, int]]:
            shapes = {n: s for n, s in self.param_shapes.items() if keep(n)}
            return {seg[0]: (seg[1], seg[2]) for seg in adamw.flat_layout(shapes)[0]}

        return {"params": compact(lambda n: n not in gemm) if bf16_operands else every, "grads": {},
                "params_x": compact(lambda n: n in gemm) if bf16_operands else {}}

    def _is_own_copy(self, name: str) -> bool:
        """Whether fp32 buffer ``name`` has a GEMM-operand copy in this model (:attr:`gemm_copies`) and is that
        copy itself (the activations are fp32)."""
        return name in self.gemm_copies and self.elem_of(name) == self.xtype

    def elem_of(self, name: str) -> str:
        """The element type of activation buffer ``name`` (``block_in`` for every ``block_in.i``):
        f32 for :data:`FP32_ALWAYS` and :data:`WKV_F32_GRADS`, else the precision's activation type."""
        return "f32" if name in FP32_ALWAYS or name in WKV_F32_GRADS else self.xtype

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

    def _alias(self, name: str, of: str) -> None:
        """Buffer ``name`` is buffer ``of`` (same offset, type and size)."""
        self.offsets[name], self.elems[name], self.counts[name] = self.offsets[of], self.elems[of], self.counts[of]

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
