"""The GPU decoder's op lists executed on the CPU (tests/emulator.py: every kernel its oracle twin,
GEMMs and copies as such): the prompt window's forward with its state copies after each sequence's
prefix (prompts of different lengths), then one step per token from there, each sequence at its own
position, gives the oracle's logits at every position the steps see (a state-tuned model's: every
sequence from the initial WKV states; a LoRA model's: every adapted projection with its factors). This checks the decoder's plumbing (what each op reads and
writes, the copies' offsets and strides, the position and token inputs) without a GPU; the kernels
themselves are checked against the same twins by tests/gpu/test_decode.py."""
import numpy as np
import pytest

from emulator import Memory, run
from rwkvx import Config
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


@pytest.mark.parametrize("name, tune", [(n, None) for n in CASES] + TUNED)
def test_decoder_plans_give_the_oracle_logits_at_every_position(name, tune, random_params):
    kwargs, B, T, lens, window = CASES[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    seed = int(rng.integers(1 << 31))
    params = {n: p.astype(np.float32) for n, p in random_params(cfg, seed).items()}
    tuned = tuned_model(cfg, tune, rng)
    oracle = Oracle(cfg, params, dtype=np.float32, **tuned["oracle"])
    for _ in range(20):            # no near-tie of the MoBA gate (two float32 paths may break it apart)
        tokens = rng.integers(0, cfg.vocab_size, (B, T))
        gaps = Oracle(cfg, params).moba_gate_gaps(tokens)
        if all((g >= 1e-4).all() for g in gaps):
            break
    want = oracle.forward(tokens)

    mem = Memory()
    layout = Layout(cfg, B, window, H200, "fp32", recompute=True, methods=SEQUENTIAL, **tuned["layout"])
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

    offsets = {"params": layout.region_offsets["params"], "states": layout.state_offsets, "lora": layout.lora_offsets}
    for region, tensors in {"params": params, **tuned["tensors"]}.items():
        flat = np.zeros(layout.counts[region], np.float32)
        for n, (off, size) in offsets[region].items():
            flat[off:off + size] = tensors[n].ravel()
        mem.write(weights[region], flat)
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
        logits = mem.read(BASE + layout.offsets["logits"], B * cfg.vocab_size, (B, cfg.vocab_size))
        errs += [(rel_err(logits[b], want[b, lengths[b]]), b, lengths[b]) for b in np.flatnonzero(active)]
        np.testing.assert_array_equal(mem.read(pin_next, B, elem="i32"),       # the step's sampler's choice
                                      sample_rows(logits.astype(np.float32), u, temperature, top_k, top_p))
        lengths += active
    worst = max(errs)
    assert worst[0] <= 1e-5, f"seed {seed}: sequence {worst[1]} position {worst[2]}: {worst[0]:.2e}"
    if tune:        # the states or factors were read: the logits differ from the untuned model's
        assert rel_err(Oracle(cfg, params, dtype=np.float32).forward(tokens), want) > 1e-2
