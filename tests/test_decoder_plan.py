"""The GPU decoder's op lists, built on the CPU (no device; plans assume an H200): the prompt's forward
with its state copies and the one-token step, every pointer inside the decoder's own part of its arena,
the state arena or the model's weights, the step on B rows with decode.cu where a block looks at
earlier tokens; on a stand-in device (tests/lazy_device.py), a decoder keeps its model's weights
allocated."""
import gc

import numpy as np
import pytest

from lazy_device import install
from rwkvx import Config, init_params
from rwkvx.decoder import (ACTIVATIONS, TRAINING_REGIONS, WEIGHT_REGIONS, DecodeStepBuilder, Decoder,
                           PrefillBuilder, _gemv_jobs, own_span, prefix_len, state_sizes, step_ops, weight_pointers)
from rwkvx.arena import Layout
from rwkvx.lora import DEFAULT_TARGETS, TARGETS, LoraSettings, lora_shapes
from rwkvx.precision import DEFAULT_PRECISION
from rwkvx.cu import decode
from rwkvx.cu._common import carve, carved_bytes
from rwkvx.runtime.device import H200
from rwkvx.runtime.dtypes import ELEM_BYTES
from rwkvx.step import StepBuilder
from rwkvx.runtime.ops import Copy, Gemm, Launch, flatten_ops
from rwkvx.model import Model
from rwkvx.sampling import Sampling
from seeding import seeded_rng
from tuned_models import tuned_model

BASE, STATE, WEIGHTS = 1 << 40, 1 << 42, 1 << 44
SMALL = dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=2, moba_chunk_size=8,
             moba_top_k=3)
CONFIGS = [   # config, B, prompt window, max_len, prompt length
    (SMALL, 2, 20, 40, 17),
    (SMALL, 1, 32, 40, 30),                 # several WKV checkpoints before the prefix's end
    (dict(SMALL, moba_top_k=1, ln0=False), 1, 16, 20, 9),
    (dict(vocab_size=50, n_embd=32, head_size=8, n_rwkv_layer=2), 3, 16, 16, 16),
    (dict(vocab_size=65536, n_embd=768, head_size=64, n_rwkv_layer=12, n_attn_layer=4, moba_chunk_size=512,
          moba_top_k=3), 1, 1024, 1536, 600),                       # the chunked WKV7 (head size 64)
]
FORWARD_ONLY_OF_SEQUENCES = {"ln_shift_fwd", "tm_shift_fwd", "cm_shift_mix", "wkv7_forward", "moba_kmean",
                             "moba_select", "moba_fwd_own", "moba_fwd_past"}


def build(kwargs, B, window, max_len, P):
    layout = Layout(Config(**kwargs), B, window, H200, DEFAULT_PRECISION, recompute=True, ln_outputs=True)
    weights_of = StepBuilder(layout, WEIGHTS, {})
    weights = weight_pointers(weights_of)
    sizes = state_sizes(layout, max_len)
    state = carve(STATE, sizes)
    args = (layout, BASE, weights, state, max_len)
    prefixes = (prefix_len(P, layout.methods["wkv7"]),) * B
    return (layout, carved_bytes(sizes), PrefillBuilder(*args, prefixes).forward(),
            DecodeStepBuilder(*args).forward())


def pointers(op):
    if isinstance(op, Launch):
        return [(v, 0) for kind, v in op.args if kind == "p" and v]
    if isinstance(op, Gemm):
        return [(op.A, 0), (op.B, 0), (op.C, 0), (op.D, 0)]
    if isinstance(op, Copy):
        return [(op.dst, op.nbytes), (op.src, op.nbytes)]
    return []


@pytest.mark.parametrize("kwargs, B, window, max_len, P", CONFIGS)
def test_decoder_plans_stay_inside_their_arenas(kwargs, B, window, max_len, P):
    layout, state_bytes, prefill, step = build(kwargs, B, window, max_len, P)
    start, end = own_span(layout)
    weights = [(WEIGHTS + layout.offsets[n], WEIGHTS + layout.offsets[n] + layout.nbytes(n)) for n in WEIGHT_REGIONS if n in layout.offsets]
    for ops in (prefill, step):
        for op in flatten_ops(ops):
            for ptr, nbytes in pointers(op):
                spans = [(BASE + start, BASE + end), (STATE, STATE + state_bytes), *weights]
                assert any(lo <= ptr and ptr + nbytes <= hi for lo, hi in spans), (op, hex(ptr))


@pytest.mark.parametrize("kwargs, B, window, max_len, P", CONFIGS)
def test_step_is_one_token_per_sequence(kwargs, B, window, max_len, P):
    cfg = Config(**kwargs)
    layout, _, prefill, step = build(kwargs, B, window, max_len, P)
    step = flatten_ops(step)
    names = [op.name for op in step if isinstance(op, Launch)]
    assert not FORWARD_ONLY_OF_SEQUENCES & set(names)
    assert names.count("dec_shift") == 2 * cfg.n_rwkv_layer + cfg.n_attn_layer
    assert names.count("dec_wkv7") == cfg.n_rwkv_layer and names.count("dec_moba") == cfg.n_attn_layer
    assert all(op.n == B for op in step if isinstance(op, Gemm))     # every GEMM on B rows
    # each block adds its two outputs to the stream in the GEMMs (C = the stream read, D = the sum)
    adding = [op for op in step if isinstance(op, Gemm) and op.beta and op.C != op.D]
    assert len(adding) == 2 * cfg.n_blocks
    # the prompt's forward saves the WKV checkpoints (the state after its last token) for the copies
    ckpt = BASE + layout.offsets["wkv_ckpt"]
    saving = [op for op in flatten_ops(prefill) if isinstance(op, Launch) and op.name.startswith("wkv7")
              and any(value == ckpt for _, value in op.args)]
    assert len(saving) == cfg.n_rwkv_layer


def step_kernels(cfg, B, precision, max_len=64):
    """The launches and GEMMs of the decoder's step (step_ops) for B sequences."""
    layout = Layout(cfg, B, 16, H200, precision, recompute=True, ln_outputs=True)
    weights_of = StepBuilder(layout, WEIGHTS, {})
    state = carve(STATE, state_sizes(layout, max_len))
    ops = step_ops(layout, BASE, weight_pointers(weights_of), state, max_len, 1 << 46, 1 << 47,
                   1 << 48)
    return [op for op in flatten_ops(ops) if isinstance(op, (Launch, Gemm))]


def test_decoder_builders_need_the_layernorm_outputs():
    """The decoder's builders store and shift h1 and h2: a training layout, without them, is refused."""
    cfg, B, max_len = Config(**SMALL), 2, 40
    layout = Layout(cfg, B, 16, H200, DEFAULT_PRECISION, recompute=True)
    state = carve(STATE, state_sizes(layout, max_len))
    weights = weight_pointers(StepBuilder(layout, WEIGHTS, {}))
    with pytest.raises(ValueError, match="ln_outputs=True"):
        DecodeStepBuilder(layout, BASE, weights, state, max_len)
    with pytest.raises(ValueError, match="ln_outputs=True"):
        PrefillBuilder(layout, BASE, weights, state, max_len, (8, 8))


def gemv_jobs(op):
    """(x, w, out, n, k, mode) of each job of a dec_gemv launch."""
    a = {name: value for (name, _), (_, value) in zip(decode.DEC_GEMV.params, op.args)}
    return [(a[f"x{j}"], a[f"w{j}"], a[f"y{j}"] or a[f"r{j}"], a[f"n{j}"], a[f"k{j}"], a[f"mode{j}"])
            for j in range(decode.GEMV_JOBS) if a[f"n{j}"]]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("B", [1, 8, 9])
def test_step_fuses_its_layernorms_and_small_batch_products(B, precision):
    """Each token shift runs with its LayerNorm (dec_ln_shift). Up to GEMV_ROWS rows the step's GEMMs and activations become dec_gemv launches: per RWKV block
    the six (block 0) or seven products of the block input's mixes in one launch, the four LoRA
    second layers in a second, then the output (with the residual), the key (with relu^2) and the value
    (with the residual); per attention block r, k, v in one launch, then output, key and value; the
    head in one. No product reads or writes the output of another of its launch. More rows keep the forward's GEMMs."""
    cfg = Config(**CONFIGS[-1][0])
    step = step_kernels(cfg, B, precision)
    names = [op.name if isinstance(op, Launch) else "gemm" for op in step]
    # at every batch size each token shift is fused with the LayerNorm that makes its row
    assert "dec_shift" not in names and names.count("dec_ln_shift") == 2 * cfg.n_rwkv_layer + cfg.n_attn_layer
    if B > decode.GEMV_ROWS:
        assert "dec_gemv" not in names and "gemm" in names
        return
    assert "gemm" not in names and not set(ACTIVATIONS) & set(names)
    gemvs = [op for op in step if isinstance(op, Launch) and op.name == "dec_gemv"]
    # the tf32 precision's products round their operands to TF32, as its GEMMs do
    assert {dict(op.defines)["GEMV_TF32"] for op in gemvs} == {"1" if precision == "tf32" else "0"}
    launches = [gemv_jobs(op) for op in gemvs]
    assert names.count("dec_tmix") == cfg.n_rwkv_layer and "tm_prep_fwd" not in names
    assert len(launches) == 4 * cfg.n_rwkv_layer + 4 * cfg.n_attn_layer + 1
    assert [len(jobs) for jobs in launches[:8]] == [6, 1, 1, 1, 7, 1, 1, 1]    # block 0: no value LoRA
    assert [len(jobs) for jobs in launches[-5:]] == [3, 1, 1, 1, 1]           # the last attention block, the head
    first = [op.name for op in step[names.index("dec_ln_shift"):names.index("dec_tmix") + 1]]
    assert first == ["dec_ln_shift", "dec_gemv", "dec_tmix"]
    for jobs in launches:
        for i, (x, _, out, n, k, _) in enumerate(jobs):
            elem = 2 if precision == "bf16" else 4
            assert not any(x2 <= out < x2 + B * k2 * elem or out <= x2 < out + B * n * elem
                           for j, (x2, _, _, _, k2, _) in enumerate(jobs) if j != i)
    epilogues = {m & (decode.GEMV_KN - 1) for jobs in launches for *_, m in jobs}
    assert epilogues == set(decode.GEMV_EPILOGUES.values())


def test_small_batch_step_keeps_the_gemms_dec_gemv_cannot_take():
    """bf16 rows of C = 4 channels are 8 bytes (and a packed weight may sit off 16 bytes): such Linear
    products stay cuBLAS GEMMs (with their activation kernels); the LoRA products ([k, n] weights, no
    alignment needed) all go to dec_gemv (first layers) and dec_tmix (second layers)."""
    cfg = Config(vocab_size=16, n_embd=4, head_size=4, n_rwkv_layer=2, n_attn_layer=1, moba_chunk_size=4,
                 moba_top_k=2)
    step = step_kernels(cfg, 1, "bf16")
    gemms = [op for op in step if isinstance(op, Gemm)]
    assert gemms and all(op.transa for op in gemms)
    names = [op.name for op in step if isinstance(op, Launch)]
    assert names.count("dec_tmix") == cfg.n_rwkv_layer and names.count("cm_relu_sq_forward") == cfg.n_blocks
    lora = [job for op in step if isinstance(op, Launch) and op.name == "dec_gemv" for job in gemv_jobs(op)
            if job[-1] & decode.GEMV_KN]
    assert len(lora) == 3 + 4 * (cfg.n_rwkv_layer - 1)          # no value LoRA in block 0


def test_moba_step_checks_its_shared_memory():
    cfg = dict(SMALL, moba_chunk_size=4096, moba_top_k=16)
    with pytest.raises(ValueError, match="shared memory"):
        build(cfg, 1, 16, 1 << 16, 9)
    assert decode.moba_smem_bytes(64, 512, 3, 1536 // 512) <= H200.smem_per_block


TINY = dict(vocab_size=16, n_embd=4, head_size=4, n_rwkv_layer=2, n_attn_layer=1, moba_chunk_size=4, moba_top_k=2)
RANK2 = LoraSettings(2, 3.0, tuple(TARGETS))
LORA_CASES = [   # config, B, prompt window, max_len, prompt length, precision, adapter
    (SMALL, 2, 20, 40, 17, "fp32", RANK2),           # the fused step
    (SMALL, 2, 20, 40, 17, "fp32", LoraSettings(2, 2.0, tuple(TARGETS))),   # scale 1: the update in dec_gemv
    (SMALL, 9, 20, 40, 17, "fp32", RANK2),           # the step with the forward's GEMMs
    (dict(vocab_size=300, n_embd=256, head_size=64, n_rwkv_layer=2, n_attn_layer=1, moba_chunk_size=32,
          moba_top_k=3), 1, 40, 160, 40, "tf32", RANK2),
    (SMALL, 3, 20, 40, 17, "bf16", LoraSettings(3, 4.0, DEFAULT_TARGETS)),
    (TINY, 1, 16, 20, 9, "bf16", LoraSettings(1, 4.0, ("ffn.key",))),   # a bf16 copy of 4 mod 8 values
    # tests/gpu/test_decode.py's "moba" and "moba_b9" decoders, at their own prompt windows
    (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=2, moba_chunk_size=8,
          moba_top_k=3), 2, 5, 64, 5, "fp32", RANK2),
    (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1, moba_chunk_size=8,
          moba_top_k=2), 9, 30, 40, 30, "fp32", RANK2),
]


def lora_build(kwargs, B, window, max_len, P, precision, settings):
    """The layout, the buffers (start, end) a plan may touch — the decoder's own, each weight tensor and
    LoRA factor at its place in the model's arena, the state arena's — and the prefill's and step's ops."""
    layout = Layout(Config(**kwargs), B, window, H200, precision, recompute=True, lora=settings, ln_outputs=True)
    weights = weight_pointers(StepBuilder(layout, WEIGHTS, {}))
    sizes = state_sizes(layout, max_len)
    state = carve(STATE, sizes)
    start, _ = own_span(layout)
    buffers = [(BASE + off, BASE + off + layout.nbytes(n)) for n, off in layout.offsets.items()
               if off >= start]
    tensors = {"params": layout.region_offsets["params"], "params_x": layout.region_offsets["params_x"],
               "lora": layout.lora_offsets, "lora_x": layout.lora_offsets if layout.counts["lora_x"] else {}}
    for region, offsets in tensors.items():
        elem = ELEM_BYTES[layout.elems[region]]
        buffers += [(int(weights[region]) + elem * off, int(weights[region]) + elem * (off + size))
                    for off, size in offsets.values()]
    buffers += [(int(p), int(p) + count * ELEM_BYTES[elem]) for (count, elem), p in
                zip(sizes.values(), state.values()) if p is not None]
    args = (layout, BASE, weights, state, max_len)
    prefix = prefix_len(P, layout.methods["wkv7"])      # 0: shorter than a checkpoint, no prefill pass
    prefill = PrefillBuilder(*args, (prefix,) * B).forward() if prefix else []
    return layout, buffers, prefill, step_ops(*args, 1 << 46, 1 << 47, 1 << 48)


def accesses(op, B):
    """(start, end, what) of every byte range a GEMM, a dec_gemv job (of B rows) or a copy reads or
    writes."""
    if isinstance(op, Gemm):
        p = op.precision

        def span(ptr, rows, cols, ld, elem, what):       # a column-major [rows, cols] operand
            return int(ptr), int(ptr) + (ld * (cols - 1) + rows) * ELEM_BYTES[elem], what
        a = (op.k, op.m) if op.transa else (op.m, op.k)
        b = (op.n, op.k) if op.transb else (op.k, op.n)
        out = [span(op.A, *a, op.lda, p.a, "A"), span(op.B, *b, op.ldb, p.b, "B"),
               span(op.C if op.D is None else op.D, op.m, op.n, op.ldc, p.c, "D")]
        return out + ([span(op.C, op.m, op.n, op.ldc, p.c, "C")] if op.beta else [])
    if isinstance(op, Launch) and op.name == "dec_gemv":
        out = []
        for j, job in enumerate(_gemv_jobs(op)):
            reads, wr = job.spans(B)
            w = int(job.w), int(job.w) + job.n * job.k * ELEM_BYTES[job.w.elem]
            out += [(*r, f"job {j} reads") for r in reads] + [(*wr, f"job {j} writes"), (*w, f"job {j} weight")]
        return out
    if isinstance(op, Copy):
        return [(op.src, op.src + op.nbytes, "src"), (op.dst, op.dst + op.nbytes, "dst")]
    return []


@pytest.mark.parametrize("kwargs, B, window, max_len, P, precision, settings", LORA_CASES)
def test_lora_plans_read_and_write_inside_one_buffer_each(kwargs, B, window, max_len, P, precision, settings):
    """Every GEMM operand, dec_gemv job (x·A into lora_h with n = r, the Linear's product, the residual
    add) and copy of a LoRA model's prefill and step lies inside one buffer: a weight tensor, a factor,
    one of the decoder's buffers or of its state arena."""
    layout, buffers, prefill, step = lora_build(kwargs, B, window, max_len, P, precision, settings)
    for op in flatten_ops(prefill) + flatten_ops(step):
        for lo, hi, what in accesses(op, B):
            assert any(b0 <= lo and hi <= b1 for b0, b1 in buffers), (op, what, hex(lo), hi - lo)
    factors = [op for op in flatten_ops(step) if isinstance(op, Launch) and op.name == "dec_gemv"
               for job in _gemv_jobs(op) if job.n == settings.rank]
    assert len(factors) == (len(lora_shapes(Config(**kwargs), settings)) // 2 if B <= decode.GEMV_ROWS else 0)


@pytest.mark.parametrize("kwargs, B, window, max_len, P, precision, settings", LORA_CASES)
def test_decoder_buffers_keep_the_layouts_alignment(kwargs, B, window, max_len, P, precision, settings):
    """The decoder allocates its part of the layout from a buffer's offset: at an aligned allocation
    every one of its buffers is 256-byte aligned, as in the model's arena, whatever the weight and
    factor regions before it hold."""
    layout = Layout(Config(**kwargs), B, window, H200, precision, recompute=True, lora=settings, ln_outputs=True)
    start, end = own_span(layout)
    skipped = [n for n in WEIGHT_REGIONS + TRAINING_REGIONS if n in layout.offsets]
    assert max(layout.offsets[n] + layout.nbytes(n) for n in skipped) <= start < end
    assert all((off - start) % 256 == 0 for off in layout.offsets.values() if off >= start)


class _FakeDecoder:
    """Stands in for rwkvx.decoder.Decoder (which needs a GPU) in decoder_for: records its builds; its
    close is the real one."""
    from rwkvx.decoder import Decoder as _Real
    close = _Real.close

    def __init__(self, model, batch, prompt_cap, max_len):
        self.key, self.prompt_cap, self.max_len, self.freed = (model, batch), prompt_cap, max_len, False
        self.in_use = self.private = False

    def free(self):
        self.freed = True


def _use(D, model, batch, prompt_len, max_len):
    """decoder_for for one finished generation: handed out in use, closed after."""
    decoder = D.decoder_for(model, batch, prompt_len, max_len)
    assert decoder.in_use
    decoder.close()
    return decoder


def test_decoder_for_keeps_one_decoder_per_batch_and_precision(monkeypatch):
    import types

    import rwkvx.decoder as D
    from rwkvx.precision import resolve_precision

    monkeypatch.setattr(D, "Decoder", _FakeDecoder)
    bf16, fp32 = (types.SimpleNamespace(precision=resolve_precision(p)) for p in ("bf16", "fp32"))
    first = _use(D, bf16, 1, 10, 40)
    assert (first.prompt_cap, first.max_len) == (D.MIN_PROMPT_CAP, D.MIN_MAX_LEN)
    assert _use(D, bf16, 1, 3, 200) is first                          # fits: kept
    two = _use(D, bf16, 2, 10, 40)                                     # another batch size: its own
    assert two is not first and _use(D, bf16, 1, 10, 40) is first
    other = _use(D, fp32, 1, 10, 40)                                   # another model (precision): its own
    assert other is not first and other.key[0] is fp32
    grown = _use(D, bf16, 1, 100, 300)                                 # outgrown: rebuilt, the old one freed
    assert first.freed and (grown.prompt_cap, grown.max_len) == (128, 512)
    assert _use(D, bf16, 1, 10, 40) is grown and not two.freed
    D.free_decoders(bf16)
    assert grown.freed and two.freed and not other.freed


def test_decoder_for_gives_a_generation_its_own_decoder_while_the_kept_one_is_in_use(monkeypatch):
    """Two live generations (e.g. interleaved streams) never share a decoder; the second's is freed at
    its close and the kept one survives, even when the second needed a larger one."""
    import types

    import rwkvx.decoder as D
    from rwkvx.precision import resolve_precision

    monkeypatch.setattr(D, "Decoder", _FakeDecoder)
    model = types.SimpleNamespace(precision=resolve_precision("bf16"))
    kept = D.decoder_for(model, 1, 10, 40)
    for need in ((10, 40), (100, 300)):
        own = D.decoder_for(model, 1, *need)
        assert own is not kept and own.private and not kept.freed
        own.close()
        assert own.freed and not kept.freed
    kept.close()
    assert D.decoder_for(model, 1, 10, 40) is kept


@pytest.mark.parametrize("tune", [None, "state"])
def test_a_decoder_keeps_the_weights_it_reads_allocated_when_nobody_keeps_its_model(monkeypatch, tune):
    """Decoder(Model(...), ...), as the decode-step benchmark builds it: the model is dropped at once, and
    the weights (a state-tuned model's initial states, which the prefill copies, too) must stay allocated
    while the decoder lives (tests/lazy_device.py frees a buffer when it is garbage-collected, as the
    device does; on a GPU the prefill's first GEMM would read unmapped memory: an illegal address); they
    are freed with the decoder."""
    dev = install(monkeypatch)
    cfg = Config(vocab_size=50, n_embd=32, head_size=16, n_rwkv_layer=2)
    tuned = tuned_model(cfg, tune, seeded_rng())
    decoder = Decoder(Model(cfg, init_params(cfg, 0), 1, 1, precision="bf16", **tuned["oracle"]), 1, 32, 48)
    gc.collect()
    weights = {n: p for n, p in decoder.weights.items() if p is not None}
    for name, ptr in weights.items():
        dev.mem.bytes(int(ptr), decoder.layout.nbytes(name))       # IndexError once freed
    assert decoder.prefill([np.arange(20) % cfg.vocab_size], Sampling(temperature=0.0)).tolist() == [16]
    decoder.step(np.array([3]), np.array([0.5]))                     # runs the plan's copies on the stand-in
    del decoder
    gc.collect()
    with pytest.raises(IndexError):
        dev.mem.bytes(int(weights["params"]), 1)


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_preset_step_kernels_compile_without_spills(precision):
    """Every decode kernel build the benchmarked presets' steps launch (the 0.22B RWKV-X: RWKV and MoBA
    blocks, head size 64; fused up to 8 sequences, not above) compiles for sm_90 without spilling."""
    from rwkvx.runtime import nvrtc
    ok, why = nvrtc.nvrtc_available()
    if not ok:
        pytest.skip(f"NVRTC is not usable: {why}")
    cfg = Config(**CONFIGS[-1][0])
    builds: dict[tuple, set[str]] = {}
    for B in (1, decode.GEMV_ROWS + 1):
        for op in step_kernels(cfg, B, precision):
            if isinstance(op, Launch) and op.module.startswith("decode/"):
                builds.setdefault((op.module, op.defines), set()).add(op.name)
    assert {n for names in builds.values() for n in names} == {"dec_ln_shift", "dec_gemv", "dec_tmix", "dec_wkv7",
                                                                  "dec_moba", "dec_sample"}
    for (module, defines), names in builds.items():
        usage = nvrtc.resource_usage(module, "sm_90", defines)
        for name in names:
            assert usage[name]["spill_stores"] == 0 and usage[name]["spill_loads"] == 0, (module, defines, name,
                                                                                         usage[name])
