"""Stateful generation on the GPU: :class:`Decoder`, the GPU :class:`rwkvx.generation.Session`.

A Decoder serves one (model, batch size) pair for any prompt up to its capacities; it reads the weights
from the model's own resident parameters (``params``, and ``params_x`` in bf16; a state-tuned model's
initial WKV states ``states`` too, every sequence starting from them; a LoRA model's factors ``lora``
(``lora_x``), applied by the adapted projections as in the forward), so an optimizer step or
:meth:`rwkvx.model.Model.load_params` is seen by the next token without a copy, and holds the model's
arena, so the weights stay allocated while the decoder lives even if nobody keeps the model. Everything
else (activations, the carried state, the step's CUDA graph) is the decoder's own, allocated once;
:func:`decoder_for` keeps one Decoder per batch size on the model, so a second ``generate`` builds
nothing.

**Prefill** (once per batch of prompts, each of its own length P_b): each prompt's first ``prefix_b``
tokens run through the model's forward kernels in parallel (the chunked WKV7 where the precision uses
it), over a window of ``prompt_cap`` tokens (the rest padded with token 0: the forward is causal, so
the padding never reaches them). ``prefix_b`` is the largest multiple of the WKV7 kernel's checkpoint
interval below P_b (0 for a short prompt), because its checkpoints are where the forward leaves the
WKV state (:func:`prefix_len`). After each block, copies leave what decoding needs in the decoder's
state arena: row prefix_b - 1 of LN1 and LN2 (the token shifts), the WKV state, MoBA's keys, values
and the means of the complete key blocks. The remaining 1 to interval tokens of each prompt are fed
one by one through the step.

**Step** (one token per sequence, each at its own position): the same :class:`rwkvx.step.StepBuilder`
forward on B rows of the decoder's arena, with the parts that look at earlier tokens (token shifts,
WKV, MoBA) replaced by rwkvx/cu/decode/decode.cu's single-token kernels reading and updating the state
arena, then the head and rwkvx/cu/decode/sample.cu's ``dec_sample``, which chooses each sequence's next
token from its logits by :mod:`rwkvx.sampling`'s contract. :func:`fuse_step` then fuses that op list
into fewer launches: each LayerNorm with the token shift it feeds, and up to GEMV_ROWS = 8 sequences
the GEMMs (with their activations and residual adds) into multi-product GEMV launches and each time
mix's middle (LoRA second layers, prep, WKV7, GroupNorm) into one kernel (rwkvx/cu/decode/README.md). The token ids, their positions (device ints
MoBA reads), one uniform draw per sequence and the sampling options come from pinned memory, only the B
chosen token ids go back, and the whole step is one CUDA graph, replayed per token.

State arena (elements; X = the model's activation type): per RWKV block i ``tm_prev.i`` fp32 [B, C] and
``wkv.i`` fp32 [B, H, N, N]; per block ``cm_prev.<prefix>`` fp32 [B, C] (the LayerNorm outputs the token
shifts read are fp32 in every precision; ``wkv.i`` starts from zeros, or from a state-tuned model's
initial state of block i); per attention block j the caches
``kc.j``, ``vc.j`` X [B, Tmax, H, N] and (top_k > 1) ``kmean.j`` fp32 [B, H, Tmax // chunk, N] and
``sel.j`` int32 [B, H, top_k-1] (the last step's selection); ``pos`` int32 [B]; the sampler's ``u`` f64 [B],
``opts`` f64 [3] (:data:`rwkvx.cu.decode.SAMPLE_OPTS`) and ``next`` int32 [B].
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .arena import Layout
from .cu import decode, wkv7
from .cu._common import carve, carved_bytes
from .model import Model
from .runtime.dtypes import ELEM_BYTES, from_storage, storage_dtype
from .runtime.kernel import XTYPE_DEFINE, KernelFile
from .runtime.ops import Copy, CopyDtoH, CopyHtoD, DevPtr, Gemm, Launch, Memset, flatten_ops
from .sampling import Sampling
from .state_tuning import state_name
from .step import TIME_MIX_OUTPUTS, TIME_MIXES, StepBuilder
from .validate import check_tokens

# read from the model's arena, never copied: the weights, a state-tuned model's initial WKV states, a LoRA
# model's factors (and their bf16 copy); what only training touches is never allocated
WEIGHT_REGIONS = ("params", "params_x", "states", "lora", "lora_x")
TRAINING_REGIONS = ("grads", "adam_m", "adam_v", "state_grads", "state_m", "state_v", "lora_grads", "lora_m",
                    "lora_v")
MIN_PROMPT_CAP = 64        # the smallest prompt window a cached decoder is built for (tokens)
MIN_MAX_LEN = 256          # the smallest cache a cached decoder is built for (tokens)


def checkpoint_interval(method: str) -> int:
    """Tokens between the WKV7 forward's saved states for kernel ``method``."""
    return wkv7.CHUNKED_L if method in wkv7.CHUNKED_METHODS else wkv7.CHUNK


def prefix_len(prompt_len: int, method: str) -> int:
    """Tokens of a prompt of ``prompt_len`` that the prefill runs through the forward: the largest
    multiple of the checkpoint interval below ``prompt_len`` (at least one token is left for the step,
    which chooses the first new token from the prompt's last position)."""
    g = checkpoint_interval(method)
    return (prompt_len - 1) // g * g


def state_slot(method: str, prefix: int) -> int:
    """The WKV7 checkpoint slot holding the state after ``prefix`` tokens (> 0, a multiple of the
    interval): the sequential kernel saves the state after each chunk, the chunked ones the state
    entering each chunk (so the window must be longer than ``prefix``)."""
    g = checkpoint_interval(method)
    return prefix // g if method in wkv7.CHUNKED_METHODS else prefix // g - 1


def weight_pointers(model_builder: StepBuilder) -> dict[str, DevPtr | None]:
    """The regions of :data:`WEIGHT_REGIONS` a model has, at their addresses in the model's arena
    (``model_builder``: the model's StepBuilder)."""
    return {n: model_builder.buf(n) for n in WEIGHT_REGIONS if n in model_builder.L.offsets}


def own_span(layout: Layout) -> tuple[int, int]:
    """(start, end): the bytes of ``layout``'s arena a decoder allocates, from its first buffer that is
    not a weight or training region (which the layout places first) to its end. ``start`` is a buffer's
    offset, aligned as every offset is, so the decoder's buffers keep the layout's alignment (the end of
    the last skipped region need not be: a bf16 copy of 4 mod 8 values ends 8 bytes off 16)."""
    skipped = {n for n in WEIGHT_REGIONS + TRAINING_REGIONS if n in layout.offsets}
    start = min(off for n, off in layout.offsets.items() if n not in skipped)
    if any(layout.offsets[n] + layout.nbytes(n) > start for n in skipped):
        raise ValueError("decoder: the layout must place the weight and training regions first")
    return start, layout.total


def state_sizes(layout: Layout, max_len: int) -> dict[str, tuple[int, str]]:
    """(elements, element type) of every buffer of the state arena of a model of ``layout``."""
    cfg, B, X = layout.cfg, layout.B, layout.xtype
    C, H, N, K1 = cfg.n_embd, cfg.n_head, cfg.head_size, cfg.moba_top_k - 1
    sizes: dict[str, tuple[int, str]] = {"pos": (B, "i32"), "u": (B, "f64"),
                                         "opts": (len(decode.SAMPLE_OPTS), "f64"), "next": (B, "i32")}
    for kind, idx in cfg.block_order():
        if kind == "rwkv":
            sizes[f"tm_prev.{idx}"] = (B * C, "f32")
            sizes[f"wkv.{idx}"] = (B * H * N * N, "f32")
        else:
            sizes[f"kc.{idx}"] = sizes[f"vc.{idx}"] = (B * max_len * C, X)
            sizes[f"kmean.{idx}"] = (B * H * (max_len // cfg.moba_chunk_size) * N if K1 else 0, "f32")
            sizes[f"sel.{idx}"] = (B * H * K1, "i32")
        sizes["cm_prev." + StepBuilder._prefix(kind, idx)] = (B * C, "f32")
    return sizes


class _DecoderBuilder(StepBuilder):
    """A StepBuilder on the decoder's arena at ``base`` whose weights are ``weights`` (the model's
    ``params`` and ``params_x`` pointers), with the state arena ``state`` (caches of ``max_len`` tokens).
    Its token shifts store and read the LayerNorm outputs h1 and h2: ``layout`` must have them (``ln_outputs``)."""

    def __init__(self, layout: Layout, base: int, weights: dict[str, DevPtr | None],
                 state: dict[str, DevPtr | None], max_len: int):
        if not layout.ln_outputs:
            raise ValueError("decoder: the layout must have the LayerNorm outputs h1 and h2 "
                             "(Layout(..., ln_outputs=True))")
        super().__init__(layout, base, {})
        self.weights, self.state, self.max_len = weights, state, max_len

    def buf(self, name: str) -> DevPtr | None:
        if name in self.weights:
            return self.weights[name]
        return super().buf(name)


class PrefillBuilder(_DecoderBuilder):
    """The forward over the prompt window (B x T tokens) that also leaves in the state arena what
    decoding needs after each sequence's first ``prefixes[b]`` tokens (each a multiple of the WKV7
    checkpoint interval in [0, T), not all 0; a sequence with none keeps the state it starts from: zeros,
    or a state-tuned model's initial states)."""

    def __init__(self, layout: Layout, base: int, weights: dict[str, DevPtr | None],
                 state: dict[str, DevPtr | None], max_len: int, prefixes: tuple[int, ...]):
        super().__init__(layout, base, weights, state, max_len)
        g = checkpoint_interval(self.methods["wkv7"])
        if (len(prefixes) != self.B or not any(prefixes)
                or any(not 0 <= n < self.T or n % g for n in prefixes)):
            raise ValueError(f"prefixes {prefixes}: {self.B} multiples of {g} in [0, {self.T}), not all 0")
        self.prefixes = prefixes

    def _rows(self) -> list[tuple[int, int]]:
        """(sequence, its prefix) of the sequences with a prefix."""
        return [(b, n) for b, n in enumerate(self.prefixes) if n]

    def _last_rows(self, src: DevPtr, dst: DevPtr) -> list:
        """dst [B, C] = row prefix-1 of each sequence of src [B*T, C]."""
        C, T = self.cfg.n_embd, self.T
        return [Copy(dst.offset(b * C), src.offset((b * T + n - 1) * C), C * ELEM_BYTES[src.elem])
                for b, n in self._rows()]

    # h1 and h2 always stored (``h`` aside; the layout has them): their rows at each prefix's end are the
    # shifts' decoding state
    def time_shift(self, i: int, xin, h: DevPtr | None = None) -> list:
        return super().time_shift(i, xin, self.buf("h1")) + self._last_rows(self.buf("h1"), self.state[f"tm_prev.{i}"])

    def channel_shift(self, prefix: str, xin, h: DevPtr | None = None) -> list:
        return (super().channel_shift(prefix, xin, self.buf("h2"))
                + self._last_rows(self.buf("h2"), self.state["cm_prev." + prefix]))

    def wkv(self, i: int, for_backward: bool) -> list:
        H, N, method = self.cfg.n_head, self.cfg.head_size, self.methods["wkv7"]
        nC = wkv7.n_chunks(self.T, method)
        ckpt, dst = self.buf("wkv_ckpt"), self.state[f"wkv.{i}"]
        return super().wkv(i, for_backward=True) + [
            Copy(dst.offset(bh * N * N), ckpt.offset((bh * nC + state_slot(method, n)) * N * N), N * N * 4)
            for b, n in self._rows() for bh in range(b * H, (b + 1) * H)]

    def attention(self, j: int) -> list:
        cfg, T = self.cfg, self.T
        C, H, N, chunk = cfg.n_embd, cfg.n_head, cfg.head_size, cfg.moba_chunk_size
        ops = super().attention(j)
        for name, cache in (("k", f"kc.{j}"), ("v", f"vc.{j}")):
            src, dst = self.buf(name), self.state[cache]
            ops += [Copy(dst.offset(b * self.max_len * C), src.offset(b * T * C), n * C * ELEM_BYTES[src.elem])
                    for b, n in self._rows()]
        if cfg.moba_top_k > 1:            # the forward's means of the blocks complete within each prefix
            src, dst = self.buf("moba_kmean"), self.state[f"kmean.{j}"]
            nblk, maxblk = -(-T // chunk), self.max_len // chunk
            ops += [Copy(dst.offset(bh * maxblk * N), src.offset(bh * nblk * N), n // chunk * N * 4)
                    for b, n in self._rows() if n >= chunk for bh in range(b * H, (b + 1) * H)]
        return ops


class DecodeStepBuilder(_DecoderBuilder):
    """One token per sequence: the forward on B rows of the decoder's arena, with decode.cu where it
    looks at earlier tokens."""

    def __init__(self, layout: Layout, base: int, weights: dict[str, DevPtr | None],
                 state: dict[str, DevPtr | None], max_len: int):
        super().__init__(layout, base, weights, state, max_len)
        self.T, self.R = 1, self.B

    # The LayerNorm and decode.shift stay two launches here: fuse_step joins them into dec_ln_shift.
    def time_shift(self, i: int, xin, h: DevPtr | None = None) -> list:
        att, b = f"rwkv.blocks.{i}.att.", self.buf
        return self._ln1_forward(f"rwkv.blocks.{i}.", xin, b("h1")) + decode.shift(
            b("h1"), self.state[f"tm_prev.{i}"], [self.p(att + m) for m in TIME_MIXES],
            [b(n) for n in TIME_MIX_OUTPUTS], self.B, self.cfg.n_embd, self.dev)

    def channel_shift(self, prefix: str, xin, h: DevPtr | None = None) -> list:
        b = self.buf
        return self._ln2_forward(prefix, xin) + decode.shift(
            b("h2"), self.state["cm_prev." + prefix], [self.p(prefix + "ffn.x_k")], [b("xk2")], self.B,
            self.cfg.n_embd, self.dev)

    def wkv(self, i: int, for_backward: bool) -> list:
        b, cfg = self.buf, self.cfg
        return decode.wkv7_step(b("r"), b("decay"), b("kp"), self._value(i), b("wa"), b("wb"),
                                self.state[f"wkv.{i}"], b("y"), self.B, cfg.n_head, cfg.head_size)

    def attention(self, j: int) -> list:
        b, cfg, s = self.buf, self.cfg, self.state
        return decode.moba_step(b("r"), b("k"), b("v"), s[f"kc.{j}"], s[f"vc.{j}"], s[f"kmean.{j}"], s["pos"],
                                b("y"), self.B, cfg.n_head, cfg.head_size, self.max_len, cfg.moba_chunk_size,
                                cfg.moba_top_k, self.dev, sel=s[f"sel.{j}"])


def prefill_ops(layout: Layout, base: int, weights: dict[str, DevPtr | None], state: dict[str, DevPtr | None],
                state_bytes: int, max_len: int, prefixes: tuple[int, ...], host_prompt: int) -> list:
    """The prefill of prompts whose first ``prefixes[b]`` tokens go through the forward (needs no GPU):
    the state arena (``state_bytes`` from ``state["pos"]``) zeroed — under state tuning every sequence's
    WKV states then set to the model's initial states (``weights["states"]``) — then, when a prefix is not
    0, the window's tokens staged from pinned ``host_prompt`` int32 [B, T] and the forward (from the
    initial states) with its state copies."""
    ops = [Memset(state["pos"], state_bytes)]
    if layout.tune_states:
        for i in range(layout.cfg.n_rwkv_layer):
            off, size = layout.state_offsets[state_name(i)]
            ops += [Copy(state[f"wkv.{i}"].offset(b * size), weights["states"].offset(off), 4 * size)
                    for b in range(layout.B)]
    if any(prefixes):
        built = PrefillBuilder(layout, base, weights, state, max_len, prefixes)
        ops += [CopyHtoD(built.buf("tokens"), host_prompt, 4 * layout.B * layout.T), *built.forward()]
    return ops


# the forward's activation kernels that a GEMM's output may go through in place, as dec_gemv's
# epilogues: kernel -> (epilogue, input parameter, output parameter)
ACTIVATIONS = {"tm_tanh_fwd": ("tanh", "a", "out"), "tm_sigmoid_fwd": ("sigmoid", "a", "out"),
               "cm_relu_sq_forward": ("relu_sq", "h", "k")}


def _args(op: Launch) -> dict[str, Any]:
    """A launch's arguments by name, pointers typed as declared (floatX: the launch's element type)."""
    xtype = "bf16" if dict(op.defines)[XTYPE_DEFINE] == "1" else "f32"
    out: dict[str, Any] = {}
    for (name, arg), (_, value) in zip(KernelFile.registry[op.module].kernels[op.name].params, op.args):
        if arg.kind == "ptr":
            value = DevPtr(value, xtype if arg.elem == "x" else arg.elem) if value else None
        out[name] = value
    return out


def _ln_shift(ln: Any, shift: Any) -> list:
    """dec_ln_shift for a LayerNorm launch ``ln`` whose output is the row the dec_shift launch ``shift``
    reads, else []."""
    if not (isinstance(ln, Launch) and isinstance(shift, Launch) and ln.name == "ln_forward"
            and shift.name == "dec_shift"):
        return []
    a, s = _args(ln), _args(shift)
    if a["y"] is None or a["y"] != s["x"] or a["y"].elem != "f32" or (a["R"], a["C"]) != (s["B"], s["C"]):
        return []
    written = [s["prev"]] + [s[f"o{j}"] for j in range(s["nmix"])]
    if a["x"] == a["y"] or any(p in (a["x"], a["y"]) for p in written):   # dec_ln_shift: nothing aliases
        return []
    n = s["nmix"]
    return decode.ln_shift(a["x"], a["w"], a["b"], a["y"], a["mean_out"], a["rstd_out"], s["prev"],
                           [s[f"m{j}"] for j in range(n)], [s[f"o{j}"] for j in range(n)], s["B"], s["C"], a["eps"])


def _gemv_jobs(op: Launch) -> list[decode.GemvJob]:
    """The jobs of a dec_gemv launch."""
    a = _args(op)
    return [decode.GemvJob(a[f"x{j}"], a[f"w{j}"], a[f"y{j}"] or a[f"r{j}"], a[f"n{j}"], a[f"k{j}"],
                           bool(a[f"mode{j}"] & decode.GEMV_KN),
                           {c: e for e, c in decode.GEMV_EPILOGUES.items()}[a[f"mode{j}"] & (decode.GEMV_KN - 1)],
                           a[f"r{j}"] is not None, a[f"a{j}"], dict(op.defines).get("GEMV_TF32") == "1")
            for j in range(decode.GEMV_JOBS) if a[f"n{j}"]]


def _time_mix(ops: list, B: int) -> list:
    """dec_tmix for ``ops`` = [dec_gemv of an RWKV block's LoRA second layers, tm_prep_fwd, dec_wkv7,
    tm_gn_fwd] of B rows, each reading what the one before wrote, else []."""
    names = [op.name if isinstance(op, Launch) else None for op in ops]
    if names != ["dec_gemv", "tm_prep_fwd", "dec_wkv7", "tm_gn_fwd"]:
        return []
    jobs = {int(job.out): job for job in _gemv_jobs(ops[0])}
    p, w, g = (_args(op) for op in ops[1:])
    value = p["vp"] if p["layer"] else p["v"]
    outs = {"w": p["wl"], "a": p["al"], "v": p["vl"], "g": g["g"]}
    lora = {q: jobs.get(int(ptr)) for q, ptr in outs.items() if ptr is not None}
    C = w["H"] * int(dict(ops[2].defines)["HEAD_SIZE"])
    if (len(jobs) != len(lora) or None in lora.values() or p["R"] != B
            or any(not job.kn or job.residual or job.epilogue != "none" or job.n != C for job in lora.values())
            or (w["w"], w["k"], w["v"], w["a"], w["b"]) != (p["decay"], p["kp"], value, p["wa"], p["wb"])
            or (g["y"], g["r"], g["kp"], g["vp"]) != (w["y"], w["r"], p["kp"], value)):
        return []
    return decode.tmix_step({q: j.x for q, j in lora.items()}, {q: j.w for q, j in lora.items()},
                            {q: j.k for q, j in lora.items()}, w["r"], p["k"], p["v"], p["vf"], p["w0"], p["a0"],
                            p["v0"], p["k_k"], p["k_a"], w["state"], g["lnw"], g["lnb"], g["rk"], g["z"], B,
                            w["H"], C // w["H"])


def _as_job(g: Gemm, B: int) -> decode.GemvJob | None:
    """The dec_gemv job of GEMM ``g`` on B rows (rwkvx.runtime.gemm's linear or matmul on dense operands:
    the weight is A, the activations B), or None if it is not of that form (:func:`rwkvx.cu.decode.
    gemv_supports` says whether dec_gemv computes it)."""
    p = g.precision
    kn = not g.transa                       # linear: A = W [n, k] transposed; matmul: A = W [k, n]
    if g.n != B or g.transb or g.alpha != 1.0 or g.beta not in (0.0, 1.0) or g.ldb != g.k or g.ldc != g.m \
            or g.lda != (g.m if kn else g.k):
        return None
    residual = g.beta == 1.0                # D = C + product (C: the residual stream)
    return decode.GemvJob(DevPtr(g.B, p.b), DevPtr(g.A, p.a), DevPtr(g.D, p.c), g.m, g.k, kn, residual=residual,
                          addend=DevPtr(g.C, p.c) if residual else None, tf32=p.compute == "tf32")


def _with_activation(op: Any, job: decode.GemvJob, B: int, later: list) -> decode.GemvJob | None:
    """``job`` with ``op``'s activation as its epilogue, when ``op`` is one of :data:`ACTIVATIONS` over
    exactly ``job``'s output: in place, or into another buffer (then the job writes that one and its own
    output is never formed: relu² from the fp32 key product, a transient the ``later`` ops overwrite
    before they read it); else None."""
    if not isinstance(op, Launch) or op.name not in ACTIVATIONS or job.residual:
        return None
    epilogue, src, dst = ACTIVATIONS[op.name]
    a = _args(op)
    if a["n"] != B * job.n or a[src] != int(job.out) or a.get("b"):
        return None
    if a[dst] != a[src] and not _rewritten_first(int(job.out), later):
        return None
    return dataclasses.replace(job, out=a[dst], epilogue=epilogue)


def _rewritten_first(ptr: int, ops: list) -> bool:
    """Whether the first of ``ops`` that names address ``ptr`` is a GEMM overwriting it (D = ptr, beta 0),
    or none names it: what ``ptr`` holds now is never read."""
    for op in ops:
        if isinstance(op, Gemm):
            if op.D == ptr and op.beta == 0.0 and ptr not in (op.A, op.B):
                return True
            if ptr in (op.A, op.B, op.C, op.D):
                return False
        elif isinstance(op, Launch):
            if ptr in {int(v) for kind, v in op.args if kind == "p" and v}:
                return False
        elif ptr in {int(getattr(op, f)) for f in ("src", "dst") if hasattr(op, f)}:
            return False
    return True


def _schedule(jobs: list[decode.GemvJob], B: int) -> list:
    """dec_gemv launches of a run of ``jobs`` in program order: each job at the first level after every
    earlier job it depends on (reads what it writes, or writes what it reads or writes), each level in
    launches of up to GEMV_JOBS jobs."""
    def overlap(u, v):
        return u[0] < v[1] and v[0] < u[1]
    spans = [job.spans(B) for job in jobs]
    levels: list[int] = []
    for i, (reads, wr) in enumerate(spans):
        deps = [levels[j] for j, (reads2, wr2) in enumerate(spans[:i])
                if any(overlap(rd, wr2) for rd in reads) or any(overlap(wr, rd2) for rd2 in reads2)
                or overlap(wr, wr2)]
        levels.append(1 + max(deps, default=-1))
    ops = []
    for level in range(max(levels, default=-1) + 1):
        group = [job for job, lv in zip(jobs, levels) if lv == level]
        for i in range(0, len(group), decode.GEMV_JOBS):
            ops += decode.gemv(group[i:i + decode.GEMV_JOBS], B)
    return ops


def fuse_step(ops: list, B: int, xtype: str) -> list:
    """``ops`` (a step on B rows of element type ``xtype``) with each LayerNorm that feeds a token shift
    fused with it (dec_ln_shift), and, for B <= GEMV_ROWS, each run of GEMMs (and the activations
    applied to their whole outputs, :func:`_with_activation`) between other ops replaced by dec_gemv
    launches (the independent products of a run share a launch, each activation becomes its product's
    epilogue, applied to the fp32 product before the one rounding),
    then each RWKV block's LoRA second layers, prep, WKV7 token and GroupNorm by dec_tmix."""
    flat, out, run = flatten_ops(ops), [], []
    gemv = B <= decode.GEMV_ROWS
    i = 0
    while i < len(flat):
        job = _as_job(flat[i], B) if gemv and isinstance(flat[i], Gemm) else None
        activated = _with_activation(flat[i + 1], job, B, flat[i + 2:]) if job and i + 1 < len(flat) else None
        if activated is not None and decode.gemv_supports(activated, B, xtype):
            run.append(activated)
            i += 2
            continue
        if job is None or not decode.gemv_supports(job, B, xtype):
            fused = _ln_shift(flat[i], flat[i + 1]) if i + 1 < len(flat) else []
            out += _schedule(run, B) + (fused or [flat[i]])
            run = []
            i += 2 if fused else 1
            continue
        run.append(job)
        i += 1
    out += _schedule(run, B)
    fused, i = [], 0
    while i < len(out):
        tmix = _time_mix(out[i:i + 4], B) if gemv else []
        fused += tmix or [out[i]]
        i += 4 if tmix else 1
    return fused


def step_ops(layout: Layout, base: int, weights: dict[str, DevPtr | None], state: dict[str, DevPtr | None],
             max_len: int, host_inputs: int, host_draws: int, host_next: int) -> list:
    """One step (needs no GPU): pinned ``host_inputs`` int32 [2B] (the tokens, then their positions) and
    ``host_draws`` f64 [B + 3] (each sequence's u, then the sampling options) in, the chosen tokens
    int32 [B] out to pinned ``host_next``."""
    step = DecodeStepBuilder(layout, base, weights, state, max_len)
    B, V = layout.B, layout.cfg.vocab_size
    model = fuse_step(step.forward() + step.head_logits(0), B, layout.xtype)
    return [CopyHtoD(step.buf("tokens"), host_inputs, 4 * B),
            CopyHtoD(state["pos"], host_inputs + 4 * B, 4 * B),
            CopyHtoD(state["u"], host_draws, 8 * B),
            CopyHtoD(state["opts"], host_draws + 8 * B, 8 * len(decode.SAMPLE_OPTS)),
            *model,
            *decode.sample(step.buf("logits"), state["u"], state["opts"], state["next"], B, V),
            CopyDtoH(host_next, state["next"], 4 * B)]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class Decoder:
    """Stateful generation of ``batch`` sequences on the GPU with ``model``'s weights (see the module
    docstring): prompts of up to ``prompt_cap`` tokens, sequences of up to ``max_len`` tokens fed to
    the model, prompt included (the length of the MoBA caches); each sequence has its own length.
    :meth:`prefill` takes the prompts (it runs the prefix of each that the forward can take), then each
    :meth:`step` feeds one token to every active sequence and returns the next token of each, chosen on
    the device; :meth:`logits` reads the logits it was chosen from. A new :meth:`prefill` starts over;
    :meth:`free` releases the decoder.
    """

    def __init__(self, model: Model, batch: int, prompt_cap: int, max_len: int) -> None:
        from ._core import Plan
        from .runtime import Graph
        if not isinstance(model, Model):
            raise TypeError(f"Decoder expects an rwkvx.Model, got {type(model).__name__}")
        self.B, self.prompt_cap = _positive_int("batch", batch), _positive_int("prompt_cap", prompt_cap)
        self.max_len = _positive_int("max_len", max_len)
        # no reference back to the model, which keeps this decoder (decoder_for): dropping the model frees
        # both at once; a running generation holds the model itself. The model's arena, which the weights
        # are read from, is held: a decoder whose model nobody keeps (Decoder(Model(...), ...)) would
        # otherwise read freed memory from its first prefill on
        self.dev, self.cfg = model.dev, model.cfg
        self._weight_arena = model.arena
        self.in_use = False     # between decoder_for handing it to a generation and that generation's close
        self.private = False    # built for one generation while the kept one was in use: freed at close
        # the model's kind of layout (state tuning, LoRA): its weights packed as the model's, its states
        # or factors read from the model
        self.layout = Layout(self.cfg, self.B, self.prompt_cap, self.dev.info, model.precision, recompute=True,
                             methods=model.layout.methods, tune_states=model.layout.tune_states,
                             lora=model.layout.lora, ln_outputs=True)
        self.lengths: np.ndarray | None = None          # tokens fed so far per sequence (None: no prompt yet)
        B = self.B
        if B > self.layout.head_rows:
            raise ValueError(f"batch {B}: the head computes the logits of at most {self.layout.head_rows} "
                             f"rows at once for vocab_size {self.cfg.vocab_size}")
        start, end = own_span(self.layout)
        self.arena = self.dev.alloc(end - start)
        self.base = self.arena.ptr - start               # the layout's offsets below start are never used
        self.weights = weight_pointers(model.builder)
        sizes = state_sizes(self.layout, self.max_len)
        self.state_bytes = carved_bytes(sizes)
        self.state_arena = self.dev.alloc(self.state_bytes)
        self.state = carve(self.state_arena.ptr, sizes)
        self._pinned_prompt = self.dev.alloc_pinned(4 * B * self.prompt_cap)
        self._pinned_in = self.dev.alloc_pinned(8 * B)                       # tokens, then their positions
        self._pinned_draws = self.dev.alloc_pinned(8 * (B + len(decode.SAMPLE_OPTS)))   # u, then the options
        self._pinned_next = self.dev.alloc_pinned(4 * B)
        self._prefills: dict[tuple[int, ...], Any] = {}      # prefixes -> their Plan
        self._step_plan = Plan(self.dev, step_ops(self.layout, self.base, self.weights, self.state, self.max_len,
                                                  self._pinned_in.ptr, self._pinned_draws.ptr, self._pinned_next.ptr))
        # one eager step (modules, cuBLAS) before the capture; every prefill starts by zeroing the state
        self._pinned_in.array(np.int32, (2 * B,))[:] = 0
        self._set_draws(np.zeros(B), Sampling(temperature=0.0))
        self._step_plan.run()
        self.dev.synchronize()
        self._graph = Graph.capture(self.dev, self._step_plan.run)

    def _set_draws(self, u: np.ndarray, sampling: Sampling | None = None) -> None:
        pin = self._pinned_draws.array(np.float64, (self.B + len(decode.SAMPLE_OPTS),))
        u = np.asarray(u, np.float64)
        if u.shape != (self.B,) or not ((0 <= u) & (u < 1)).all():
            raise ValueError(f"u must be {self.B} draws in [0, 1), got shape {u.shape}")
        pin[:self.B] = u
        if sampling is not None:
            pin[self.B:] = [float(getattr(sampling, name)) for name in decode.SAMPLE_OPTS]

    def _prefill_plan(self, prefixes: tuple[int, ...]):
        from ._core import Plan
        if prefixes not in self._prefills:
            self._prefills[prefixes] = Plan(self.dev, prefill_ops(
                self.layout, self.base, self.weights, self.state, self.state_bytes, self.max_len, prefixes,
                self._pinned_prompt.ptr))
        return self._prefills[prefixes]

    def prefill(self, prompts: Any, sampling: Sampling) -> np.ndarray:
        """Start over with ``prompts`` (B token sequences, each of 1 to min(prompt_cap, max_len) tokens:
        a list of 1-D arrays or an array [B, P]) and ``sampling`` for every later step. Runs the prefix
        of each prompt that the forward can take (:func:`prefix_len`); returns those lengths, int64 [B]:
        the caller feeds each prompt's remaining tokens through :meth:`step`."""
        if len(prompts) != self.B:
            raise ValueError(f"{len(prompts)} prompts: this decoder takes {self.B}")
        rows = [check_tokens(np.asarray(p).reshape(1, -1), self.cfg.vocab_size, f"prompts[{b}]")[0]
                for b, p in enumerate(prompts)]
        cap = min(self.prompt_cap, self.max_len)
        for b, row in enumerate(rows):
            if not 1 <= len(row) <= cap:
                raise ValueError(f"prompts[{b}] has {len(row)} tokens: this decoder takes 1 to {cap}")
        self._set_draws(np.zeros(self.B), sampling)
        prefixes = tuple(prefix_len(len(row), self.layout.methods["wkv7"]) for row in rows)
        pin = self._pinned_prompt.array(np.int32, (self.B, self.prompt_cap))
        pin[:] = 0
        for b, (row, n) in enumerate(zip(rows, prefixes)):
            pin[b, :n] = row[:n]
        self._prefill_plan(prefixes).run()
        self.dev.synchronize()          # the pinned prompt may be rewritten by the next prefill
        self.lengths = np.array(prefixes, np.int64)
        return self.lengths.copy()

    def step(self, tokens: np.ndarray, u: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """Feed one token to each active sequence (``tokens`` int [B]; ``active`` bool [B], default all)
        and choose the next of every sequence with its draw ``u`` [B] in [0, 1) (graph replay): int64
        [B], meaningful for the active sequences. An inactive sequence stays where it is (its state
        past its end is not kept)."""
        if self.lengths is None:
            raise RuntimeError("Decoder.step before prefill")
        active = np.ones(self.B, bool) if active is None else np.asarray(active, bool).reshape(self.B)
        if (self.lengths[active] >= self.max_len).any():
            raise ValueError(f"the decoder holds at most max_len={self.max_len} tokens per sequence")
        tokens = np.where(active, np.asarray(tokens).reshape(self.B), 0)     # an inactive one's is unused
        tokens = check_tokens(tokens.reshape(self.B, 1), self.cfg.vocab_size)[:, 0]
        self._set_draws(u)
        pin = self._pinned_in.array(np.int32, (2 * self.B,))
        pin[:self.B] = tokens
        pin[self.B:] = np.where(active, self.lengths, np.maximum(self.lengths - 1, 0))
        self._graph.launch()
        self.dev.synchronize()
        self.lengths += active
        return self._pinned_next.array(np.int32, (self.B,)).astype(np.int64)

    def logits(self) -> np.ndarray:
        """The logits float32 [B, V] the last token was chosen from (downloaded)."""
        buf = DevPtr(self.base + self.layout.offsets["logits"], self.layout.elems["logits"])
        raw = self.dev.download(buf, (self.B, self.cfg.vocab_size), storage_dtype(buf.elem))
        return from_storage(buf.elem, raw)

    @property
    def graph(self):
        """The step's CUDA graph: replaying it alone repeats the last step's positions, for timing the
        device work of a step."""
        return self._graph

    def selection(self) -> list[np.ndarray]:
        """Per attention block, the last step's MoBA selection: int32 [B, H, top_k - 1]."""
        cfg = self.cfg
        shape = (self.B, cfg.n_head, cfg.moba_top_k - 1)
        return [self.dev.download(self.state[f"sel.{j}"], shape, np.int32) if cfg.moba_top_k > 1
                else np.zeros(shape, np.int32) for j in range(cfg.n_attn_layer)]

    def close(self) -> None:
        """End the current sequences: the buffers and graphs stay for the next :meth:`prefill`, or are
        freed if this decoder was built for one generation alone (:func:`decoder_for`)."""
        self.lengths = None
        self.in_use = False
        if self.private:
            self.free()

    def free(self) -> None:
        """Free the graph, the arenas and the pinned buffers (the model stays)."""
        self._graph.close()
        self._prefills.clear()
        for buf in (self.arena, self.state_arena, self._pinned_prompt, self._pinned_in, self._pinned_draws,
                    self._pinned_next):
            buf.close()
        self._weight_arena = None           # the model's: freed with the model (or now, if nobody keeps it)
        self.lengths = None


def _capacity(need: int, floor: int) -> int:
    """The smallest power of two >= need and >= floor."""
    return 1 << (max(need, floor) - 1).bit_length()


def decoder_for(model: Any, batch: int, prompt_len: int, max_len: int) -> Decoder:
    """The Decoder of ``model`` for one generation of ``batch`` sequences, marked in use until its
    :meth:`Decoder.close`: the one kept on the model (one per batch size and precision), built on first
    use, or again when a prompt or a sequence outgrows it (the capacities grow to the next power of two,
    at least :data:`MIN_PROMPT_CAP` / :data:`MIN_MAX_LEN`). While the kept one is in use (another live
    generation, e.g. an unfinished :func:`rwkvx.stream`), a decoder of its own is built for this
    generation and freed when it closes."""
    cache: dict = model.__dict__.setdefault("_decoders", {})
    key = (int(batch), model.precision.name)
    decoder = cache.get(key)
    if decoder is not None and not decoder.in_use and decoder.prompt_cap >= prompt_len \
            and decoder.max_len >= max_len:
        decoder.in_use = True
        return decoder
    caps = (MIN_PROMPT_CAP, MIN_MAX_LEN) if decoder is None else (decoder.prompt_cap, decoder.max_len)
    fresh = Decoder(model, batch, _capacity(prompt_len, caps[0]), _capacity(max_len, caps[1]))
    if decoder is not None and decoder.in_use:
        fresh.private = True
    else:
        if decoder is not None:
            decoder.free()
        cache[key] = fresh
    fresh.in_use = True
    return fresh


def free_decoders(model: Any) -> None:
    """Free the decoders :func:`decoder_for` keeps on ``model``."""
    for decoder in model.__dict__.pop("_decoders", {}).values():
        decoder.free()
