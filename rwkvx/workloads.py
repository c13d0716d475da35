"""Named workloads: the models, batches and kernel shapes that the benchmarks (``benchmarks/``) and the timing
scripts (``scripts/*_launches.py``) run, the random device buffers they fill, and the timing of an op list.

The reference model is the ``base`` preset's (rwkvx/presets.py), the 0.22B RWKV-X model, at that preset's
training batch: :data:`BASE` (B = 8, T = 4096). :data:`BASE_SHAPES` names the sizes one layer's kernels see
in its training step (C = 768, H = 12, N = 64, F = 3072, V = 65536, MoBA chunk 512, top-3); the per-family
benchmarks time every kernel at those sizes. :data:`STEP_WORKLOADS` are the whole-step configurations of
``benchmarks/bench_step.py``; :data:`WKV7_SHAPES` and :data:`MOBA_SHAPES` the extra attention and WKV
shapes that the family benchmarks and the per-launch scripts share.

Timing needs a GPU (:func:`time_alone`, :func:`sdpa_dense`); everything else here is plain data and imports without one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from .config import DECAY_SCALE, Config
from .cu import moba
from .presets import get_preset
from .runtime.dtypes import ELEM_BYTES, check_elem, round_to, to_storage
from .runtime.ops import DevPtr
from .runtime.timing import warm_time_ms

ALONE_REPEATS = 20          # runs of one launch timed alone (scripts/*_launches.py)
# The H200 SXM's dense tensor-core peak per element type, TFLOP/s (fp32 without tensor cores): the
# denominator of the model FLOP utilisation (MFU) the step benchmarks report.
H200_PEAK_TFLOPS = {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}


class Workload(NamedTuple):
    """A model and the batch one training step runs on."""

    config: Config
    batch_size: int
    seq_len: int


def preset_workload(name: str, batch_size: int | None = None, seq_len: int | None = None,
                    **model_changes: Any) -> Workload:
    """Preset ``name``'s model (with ``model_changes`` applied) at its training batch, or at ``batch_size``
    sequences of ``seq_len`` tokens where given."""
    preset = get_preset(name, device="gpu")
    train = preset["train"]
    return Workload(Config(**{**preset["model"], **model_changes}),
                    train.batch_size if batch_size is None else batch_size,
                    train.seq_len if seq_len is None else seq_len)


BASE = preset_workload("base")      # the 0.22B model at B = 8, T = 4096

# The step benchmarks' configurations (name: the preset, the batch). Reference points measured on the
# same H200 are in docs/PERFORMANCE.md.
STEP_WORKLOADS: dict[str, Workload] = {
    "small_B8_T512": preset_workload("small"),                     # launch-bound
    "base_B8_T4096": BASE,
    "base_B1_T16384": preset_workload("base", 1, 16384),
    "pure_B8_T4096": preset_workload("base", n_attn_layer=0),        # pure RWKV-7
    "pure_B16_T512": preset_workload("base", 16, 512, n_attn_layer=0),
    "base_B1_T131072": preset_workload("base", 1, 131072),          # one long sequence: within 40 GB
    "pure1.5b_B4_T4096": preset_workload("rwkv7-1.5b", 4, 4096),        # the released sizes
    "pure2.9b_B4_T4096": preset_workload("rwkv7-2.9b", 4, 4096),
}


@dataclass(frozen=True)
class KernelShapes:
    """The sizes one layer's kernels see in a training step of a :class:`Workload`."""

    B: int          # sequences
    T: int          # tokens per sequence
    C: int          # model width
    H: int          # heads
    N: int          # head size
    F: int          # channel-mix hidden width
    V: int          # vocabulary
    chunk: int      # MoBA block size
    top_k: int      # MoBA blocks each query attends to (its own included)

    @property
    def R(self) -> int:
        """Rows (tokens) of the batch: B·T."""
        return self.B * self.T

    @classmethod
    def of(cls, workload: Workload) -> "KernelShapes":
        """The shapes of ``workload``'s step."""
        cfg, B, T = workload
        return cls(B, T, cfg.n_embd, cfg.n_head, cfg.head_size, cfg.ffn_dim, cfg.vocab_size, cfg.moba_chunk_size,
                   cfg.moba_top_k)


BASE_SHAPES = KernelShapes.of(BASE)

_RWKV7_1B5 = KernelShapes.of(preset_workload("rwkv7-1.5b", 4))   # the 1.5B RWKV-7 (C = 2048) at B = 4

# WKV7 timings (name: B, T, H at N = BASE_SHAPES.N): the 0.22B step, a short-sequence batch, one long
# sequence, a wide model (C = 4096), and the 1.5B RWKV-7 at B = 4.
WKV7_SHAPES: dict[str, tuple[int, int, int]] = {
    f"B{b}_T{t}_H{h}": (b, t, h)
    for b, t, h in ((BASE.batch_size, BASE.seq_len, BASE_SHAPES.H), (16, 512, BASE_SHAPES.H),
                    (1, 16384, BASE_SHAPES.H), (BASE.batch_size, BASE.seq_len, 64),
                    (_RWKV7_1B5.B, _RWKV7_1B5.T, _RWKV7_1B5.H))}

# MoBA timings (name: B, T, chunk at BASE_SHAPES' H, N and top_k): the 0.22B step, and one 64k-token
# sequence in 4096-token blocks.
MOBA_SHAPES: dict[str, tuple[int, int, int]] = {
    f"B{BASE.batch_size}-T{BASE.seq_len}": (BASE.batch_size, BASE.seq_len, BASE_SHAPES.chunk),
    "B1-T65536": (1, 65536, 4096)}


class RandomBuffers:
    """Device buffers filled with random values (never zeros) for timing, kept alive until this object is
    dropped. ``b(count)`` is a buffer of ``count`` activations (element type ``xtype``); ``b(count, elem,
    scale, offset)`` one of element type ``elem`` holding N(offset, scale²) values; ``values=`` uploads
    given values instead."""

    # one random block, repeated to fill each buffer: cheap to make for GB-sized buffers
    _pool = np.random.default_rng(0).standard_normal(1 << 22)

    def __init__(self, dev, xtype: str):
        self.dev, self.xtype, self.keep = dev, check_elem(xtype, "RandomBuffers xtype"), []

    def __call__(self, count: int, elem: str = "x", scale: float = 1.0, offset: float = 0.0,
                 values=None) -> DevPtr:
        """A new buffer of ``count`` elements of ``elem`` ("x": the activation type)."""
        elem = self.xtype if elem == "x" else check_elem(elem, "RandomBuffers elem")
        buf = self.dev.alloc(max(count * ELEM_BYTES[elem], 256))
        self.keep.append(buf)
        ptr = buf.typed(elem)
        if values is not None:
            self.dev.upload(ptr, to_storage(elem, values))
            return ptr
        block = to_storage(elem, self._pool * scale + offset)
        for start in range(0, count, block.size):
            self.dev.upload(ptr.offset(start), block[:count - start])
        return ptr


def wkv7_decay(logits) -> np.ndarray:
    """The decay exp(-DECAY_SCALE * sigmoid(x)) of decay logits x, in float64: what rwkvx's WKV7 kernels read
    (the time mix computes it from the decay LoRA's output), and what RWKV-LM's clampw kernels compute from
    the raw logits they read, in (exp(-DECAY_SCALE), 1)."""
    return np.exp(-DECAY_SCALE / (1 + np.exp(-np.asarray(logits, np.float64))))


def wkv7_decay_logit_grad(d_decay, logits) -> np.ndarray:
    """The gradient of the decay logits x from the gradient of their decay (rwkvx's WKV7 dw), in float64:
    d_decay * decay * (-DECAY_SCALE) * sigmoid(x) * (1 - sigmoid(x)) -- the dw of a kernel that reads x."""
    x = np.asarray(logits, np.float64)
    s = 1 / (1 + np.exp(-x))
    return np.asarray(d_decay, np.float64) * wkv7_decay(x) * (-DECAY_SCALE) * s * (1 - s)


def wkv7_decay_logits(n: int) -> np.ndarray:
    """The n decay logits of :func:`wkv7_inputs` (float64 values), N(0, 1) rounded to bf16: a kernel that
    reads bf16 logits (RWKV-LM's) then sees exactly the logits whose decay rwkvx's kernels read."""
    return round_to("bf16", np.random.default_rng(4).standard_normal(n))


def wkv7_inputs(b: RandomBuffers, B: int, T: int, H: int, N: int) -> tuple[list[DevPtr], int]:
    """The six inputs of rwkvx.cu.wkv7.forward (r, w, k, v, a, b) for [B, T, H, N] in the ranges training
    gives them (decay w in (exp(-DECAY_SCALE), 1), f32 in every precision: the decay of
    :func:`wkv7_decay_logits`; a = -κ̂ and b = κ̂·rate with κ̂ unit rows), and their element count."""
    n = B * T * H * N
    rng = np.random.default_rng(3)
    kk = rng.standard_normal((n // N, N))
    kk = (kk / np.linalg.norm(kk, axis=1, keepdims=True)).reshape(-1)
    rate = 1 / (1 + np.exp(-rng.standard_normal(n)))
    w = wkv7_decay(wkv7_decay_logits(n))
    return [b(n, scale=0.5), b(n, "f32", values=w), b(n, scale=0.5), b(n, scale=0.5), b(n, values=-kk),
            b(n, values=kk * rate)], n


def moba_buffers(b: RandomBuffers, B: int, T: int, H: int, N: int, chunk: int,
                 top_k: int) -> tuple[list[DevPtr], dict[str, DevPtr | None]]:
    """q, k, v, o [B, T, H·N] and the scratch dict of one MoBA block (rwkvx.cu.moba.forward's arguments)."""
    rc = B * T * H * N
    scratch = {name: (b(count, elem) if count else None)
               for name, (count, elem) in moba.scratch_sizes(B, T, H, N, chunk, top_k, b.xtype).items()}
    return [b(rc) for _ in range(4)], scratch


def step_model_flops(cfg: Config, B: int, T: int) -> float:
    """The model FLOPs of one training step (forward and backward, no recompute) of ``cfg`` at B x T: 6 per
    GEMM weight element per token (head included, the embedding a lookup), 24 per WKV7 state element per
    token (8 forward, 16 backward), and 12 N per (query, key) pair each MoBA head attends to (4 N forward:
    Q·K and P·V; 8 N backward). Model FLOPs count no recomputation: the MoBA backward's own recomputed
    scores (``benchmarks/bench_moba.py`` counts the kernels' 10 N) and the recompute's second forward are
    work the model does not need."""
    from .params import gemm_weights, param_shapes
    shapes = param_shapes(cfg)
    gemm = sum(int(np.prod(shapes[name])) for name in gemm_weights(cfg))
    H, N = cfg.n_head, cfg.head_size
    wkv = 24 * H * N * N * cfg.n_rwkv_layer
    attn = 12 * N * H * cfg.n_attn_layer * moba_visible_keys(T, cfg.moba_chunk_size, cfg.moba_top_k)
    return float(B * T * (6 * gemm + wkv) + B * attn)


def mfu(cfg: Config, B: int, T: int, step_ms: float, precision: str) -> float:
    """The model FLOP utilisation of a training step of ``step_ms``: :func:`step_model_flops` per second as
    a share of the H200's dense peak for ``precision``'s arithmetic (:data:`H200_PEAK_TFLOPS`)."""
    return step_model_flops(cfg, B, T) / (step_ms * 1e-3) / (H200_PEAK_TFLOPS[precision] * 1e12)


def moba_visible_keys(T: int, chunk: int, top_k: int) -> int:
    """Keys the queries of one (sequence, head) attend to, summed: each query's own block up to itself and
    the top_k - 1 full blocks it selects (fewer where fewer blocks precede it)."""
    t = np.arange(T, dtype=np.int64)
    blk = t // chunk
    return int(np.sum(t - blk * chunk + 1 + np.minimum(top_k - 1, blk) * chunk))


def sdpa_dense(B: int, T: int, H: int, N: int, chunk: int, top_k: int, backend: str,
               runs: int = ALONE_REPEATS) -> tuple[float, float, Callable[[], None]]:
    """The FlashAttention-class peer of one MoBA block: torch's SDPA (bf16; ``backend`` "flash" or "cudnn")
    on the same visible keys in dense pieces -- the own blocks as causal attention over sequences of one
    chunk, each past selection of a block as non-causal attention of its chunk of queries over the chunk
    of keys. Returns ms of the forward and of forward + backward (CUDA events, ``runs`` runs) and a
    function running the latter once. torch is an outside reference here, not a dependency of rwkvx:
    ImportError without it."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    if backend not in kinds:
        raise ValueError(f"sdpa_dense: backend must be one of {', '.join(kinds)}, got {backend!r}")
    nblk = T // chunk
    pieces = ((B * nblk, True), (B * sum(min(top_k - 1, j) for j in range(nblk)), False))
    tensors = []
    for n, causal in pieces:
        q, k, v = (torch.randn(n, H, chunk, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        tensors.append((q, k, v, torch.randn_like(q), causal))

    def forward():
        with sdpa_kernel(kinds[backend]):
            return [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c)
                    for q, k, v, _, c in tensors]

    def both():
        for out, (*_, do, _c) in zip(forward(), tensors):
            out.backward(do)

    times = []
    for fn in (forward, both):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(runs):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / runs)
    return times[0], times[1], lambda: (both(), torch.cuda.synchronize())


def time_alone(dev, op) -> float:
    """Mean ms of one op run alone (CUDA events, :data:`ALONE_REPEATS` runs after a warm-up run): where a
    forward's or a backward's time goes."""
    from ._core import Plan
    return warm_time_ms(dev, Plan(dev, [op]).run, ALONE_REPEATS)
