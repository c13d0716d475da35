"""The GPU decoder's op lists executed on the CPU (tests/emulator.py: every kernel its oracle twin,
GEMMs and copies as such): the prompt window's forward with its state copies after each sequence's
prefix (prompts of different lengths), then one step per token from there, each sequence at its own
position, gives the oracle's logits at every position the steps see (a state-tuned model's: every
sequence from the initial WKV states; a LoRA model's: every adapted projection with its factors). The
benchmarks' model shapes run too (a few blocks of each, in bf16 through the emulator's exact mode, and
tf32). This checks the decoder's plumbing (what each op reads and writes, the copies' offsets and
strides, the position and token inputs) without a GPU; the kernels themselves are checked against the
same twins by tests/gpu/test_decode.py."""
import numpy as np
import pytest

from emulator import Memory, run, write_tensors
from rwkvx import Config
from rwkvx.presets import get_preset
from rwkvx.decoder import own_span, prefill_ops, prefix_len, state_sizes, step_ops, weight_pointers
from rwkvx.arena import Layout
from rwkvx.step import StepBuilder
from rwkvx.cu._common import carve, carved_bytes
from rwkvx.oracle import Oracle, rel_err
from rwkvx.sampling import sample_rows
from rwkvx.runtime.device import H200

from seeding import seeded_rng
from tuned_models import tuned_model

BASE, STATE, HOST, WEIGHTS = 1 << 40, 1 << 42, 1 << 44, 1 << 46
SEQUENTIAL = {"wkv7": "sequential"}     # the emulator's WKV7 twin stands for the sequential kernel
MOBA = dict(vocab_size=67, n_embd=32, head_size=8, n_rwkv_layer=3, n_attn_layer=2, moba_chunk_size=4,
            moba_top_k=3)
CASES = {   # name: (config, B, T, prompt length of each sequence, prompt window)
    "moba": (MOBA, 2, 23, (10, 17), 24),                            # prefixes of 8 and 16 tokens
    "moba_prompt_ends_a_block": (MOBA, 1, 17, (9,), 12),
    "moba_long_prompt": (MOBA, 2, 30, (21, 4), 24),                  # several WKV checkpoints; no prefix
    "moba_short": (dict(MOBA, moba_chunk_size=16), 1, 9, (3,), 8),  # no prefix, no block completes
    "top_k_1_no_ln0": (dict(MOBA, moba_top_k=1, ln0=False), 2, 15, (13, 13), 16),
    "big_top_k_leftover": (dict(MOBA, n_rwkv_layer=5, moba_top_k=7, moba_chunk_size=2), 1, 19, (17,), 20),
    "rwkv_only": (dict(vocab_size=40, n_embd=32, head_size=16, n_rwkv_layer=2), 3, 12, (9, 2, 12), 12),
    # more sequences than dec_gemv takes: the step with the forward's GEMMs (and dec_ln_shift)
    "moba_b9": (dict(MOBA, n_rwkv_layer=2, n_attn_layer=1), 9, 12, (9, 2, 12, 5, 1, 8, 10, 3, 11), 12),
}


# tuned models: state tuning (every sequence starts from the initial WKV states; sequences with and
# without a prefix through the forward, several WKV checkpoints) and LoRA (every target the model has,
# the factors applied in the prefill's GEMMs and in the step's, fused step and not; at scale 1 the fused
# step's update products are dec_gemv residual jobs)
TUNED = [(n, "state") for n in ("moba", "moba_long_prompt", "rwkv_only")] + [
    (n, "lora") for n in ("moba", "rwkv_only", "moba_b9")] + [(n, "lora_unit") for n in ("moba", "rwkv_only")]


def emulated_decode(cfg, params, tokens, lens, window, rng, precision="fp32", tuned=None, exact=False):
    """The decoder's prefill (each sequence's prefix of its prompt of ``lens[b]`` tokens, a window of
    ``window``) then one step per token to the end of ``tokens`` [B, T], emulated on ``precision``'s
    layout (``exact``: :class:`Memory`'s exact mode, the stores' roundings taken out): (relative error of
    the step's logits against ``want`` at that position, sequence, position) of every step of every
    active sequence, ``want`` being the oracle's forward with ``tuned``'s states or factors. Asserts the
    step's sampled tokens are the contract's on its logits."""
    tuned = tuned or dict(oracle={}, layout={}, tensors={})
    B, T = tokens.shape
    want = Oracle(cfg, params, dtype=np.float32, **tuned["oracle"]).forward(tokens)
    mem = Memory(exact)
    layout = Layout(cfg, B, window, H200, precision, recompute=True, methods=SEQUENTIAL, ln_outputs=True,
                    **tuned["layout"])
    start, end = own_span(layout)
    mem.add(BASE + start, end - start)              # the decoder's own part of the layout
    weights_of = StepBuilder(layout, WEIGHTS, {})   # the model's weights (states, factors), in another arena
    mem.add(WEIGHTS, start)
    weights = weight_pointers(weights_of)
    sizes = state_sizes(layout, T)
    mem.add(STATE, carved_bytes(sizes))
    pin_prompt, pin_in, pin_draws, pin_next = HOST, HOST + (1 << 30), HOST + (1 << 31), HOST + (1 << 32)
    mem.add(pin_prompt, 4 * B * window)
    mem.add(pin_in, 8 * B)
    mem.add(pin_draws, 8 * (B + 3))
    mem.add(pin_next, 4 * B)
    state = carve(STATE, sizes)
    prefixes = tuple(prefix_len(n, SEQUENTIAL["wkv7"]) for n in lens)
    prefill = prefill_ops(layout, BASE, weights, state, carved_bytes(sizes), T, prefixes, pin_prompt)
    step = step_ops(layout, BASE, weights, state, T, pin_in, pin_draws, pin_next)

    write_tensors(mem, layout, WEIGHTS, {"params": params, **tuned["tensors"]})
    mem.write(STATE, np.full(carved_bytes(sizes) // 4, np.nan, np.float32))   # the prefill zeroes it
    window_tokens = np.zeros((B, window), np.int64)
    for b, n in enumerate(prefixes):
        window_tokens[b, :n] = tokens[b, :n]
    mem.write(pin_prompt, window_tokens.ravel(), "i32")
    run(mem, prefill)
    # every sequence from its own prefix on, one token per step; a finished one stays put (the
    # decoder's inactive rows: token 0 at its last position)
    lengths, errs = np.array(prefixes), []
    temperature, top_p, top_k = 1.3, 0.95, cfg.vocab_size // 2
    while (lengths < T).any():
        active = lengths < T
        u = rng.random(B)
        mem.write(pin_in, [*np.where(active, tokens[np.arange(B), np.minimum(lengths, T - 1)], 0),
                           *np.where(active, lengths, lengths - 1)], "i32")
        mem.write(pin_draws, [*u, temperature, top_p, top_k], "f64")
        run(mem, step)
        logits = mem.read(BASE + layout.offsets["logits"], B * cfg.vocab_size, (B, cfg.vocab_size),
                          layout.elems["logits"])
        errs += [(rel_err(logits[b], want[b, lengths[b]]), b, lengths[b]) for b in np.flatnonzero(active)]
        np.testing.assert_array_equal(mem.read(pin_next, B, elem="i32"),       # the step's sampler's choice
                                      sample_rows(logits.astype(np.float32), u, temperature, top_k, top_p))
        lengths += active
    return errs


def gate_safe_tokens(cfg, params, rng, B, T):
    """Tokens [B, T] with no near-tie of the MoBA gate (two float32 paths may break it apart)."""
    for _ in range(20):
        tokens = rng.integers(0, cfg.vocab_size, (B, T))
        if all((g >= 1e-4).all() for g in Oracle(cfg, params).moba_gate_gaps(tokens)):
            break
    return tokens


@pytest.mark.parametrize("name, tune", [(n, None) for n in CASES] + TUNED)
def test_decoder_plans_give_the_oracle_logits_at_every_position(name, tune, random_params):
    kwargs, B, T, lens, window = CASES[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    seed = int(rng.integers(1 << 31))
    params = {n: p.astype(np.float32) for n, p in random_params(cfg, seed).items()}
    tuned = tuned_model(cfg, tune, rng)
    tokens = gate_safe_tokens(cfg, params, rng, B, T)
    worst = max(emulated_decode(cfg, params, tokens, lens, window, rng, tuned=tuned))
    assert worst[0] <= 1e-5, f"seed {seed}: sequence {worst[1]} position {worst[2]}: {worst[0]:.2e}"
    if tune:        # the states or factors were read: the logits differ from the untuned model's
        assert rel_err(Oracle(cfg, params, dtype=np.float32).forward(tokens), Oracle(cfg, params, dtype=np.float32,
                       **tuned["oracle"]).forward(tokens)) > 1e-2


# the benchmarks' models (rwkv7-0.1b; the 0.22B RWKV-X's MoBA block, chunk 512, top 3) with fewer blocks and
# a small vocabulary: every width, head size and LoRA rank of the preset, a prompt of 64 tokens
PRESETS = {
    "rwkv7-0.1b": dict(get_preset("rwkv7-0.1b")["model"], n_rwkv_layer=2, vocab_size=300),
    "base": dict(get_preset("base")["model"], n_rwkv_layer=2, n_attn_layer=1, vocab_size=300),
}
PROMPTS = (64, 57, 60, 64, 49, 63, 58, 64)      # each sequence's prompt (B <= 8), in a window of 64


@pytest.mark.parametrize("preset, precision, B", [("rwkv7-0.1b", "bf16", 8), ("rwkv7-0.1b", "tf32", 1),
                                                  ("base", "bf16", 1), ("base", "tf32", 8)])
def test_decoder_plans_at_preset_shapes(preset, precision, B, random_params):
    """The decoder at a preset's shapes in bf16 (the emulator's exact mode: its stores' roundings taken
    out, so the plan's data flow, buffer types and offsets must give the oracle's logits) and tf32."""
    cfg = Config(**PRESETS[preset])
    rng = seeded_rng()
    seed = int(rng.integers(1 << 31))
    params = {n: p.astype(np.float32) for n, p in random_params(cfg, seed).items()}
    tokens = gate_safe_tokens(cfg, params, rng, B, 68)
    worst = max(emulated_decode(cfg, params, tokens, PROMPTS[:B], 64, rng, precision, exact=precision == "bf16"))
    assert worst[0] <= 1e-5, f"seed {seed}: sequence {worst[1]} position {worst[2]}: {worst[0]:.2e}"
