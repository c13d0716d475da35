"""The GPU decoder's op lists executed on the CPU (tests/emulator.py: every kernel its oracle twin,
GEMMs and copies as such): the prompt's forward with its state copies, then one step per token, gives
the oracle's logits at every position. This checks the decoder's plumbing (what each op reads and
writes, the copies' offsets and strides, the position and token inputs) without a GPU; the kernels
themselves are checked against the same twins by tests/gpu/test_decode.py."""
import numpy as np
import pytest

from emulator import Memory, run
from rwkvx import Config
from rwkvx.decoder import PREFILL_METHODS, decoder_ops, state_sizes
from rwkvx.arena import Layout
from rwkvx.step import StepBuilder
from rwkvx.cu._common import carve, carved_bytes
from rwkvx.oracle import Oracle, rel_err
from rwkvx.runtime.device import H200

from seeding import seeded_rng

BASE, STATE, HOST = 1 << 40, 1 << 42, 1 << 44
MOBA = dict(vocab_size=67, n_embd=32, head_size=8, n_rwkv_layer=3, n_attn_layer=2, moba_chunk_size=4,
            moba_top_k=3)
CASES = {   # name: (config, B, T, prompt length)
    "moba": (MOBA, 2, 23, 6),
    "moba_prompt_ends_a_block": (MOBA, 1, 17, 8),
    "moba_long_prompt": (MOBA, 2, 30, 13),                           # several WKV checkpoints
    "moba_short": (dict(MOBA, moba_chunk_size=16), 1, 9, 3),       # no block completes
    "top_k_1_no_ln0": (dict(MOBA, moba_top_k=1, ln0=False), 2, 15, 5),
    "big_top_k_leftover": (dict(MOBA, n_rwkv_layer=5, moba_top_k=7, moba_chunk_size=2), 1, 19, 1),
    "rwkv_only": (dict(vocab_size=40, n_embd=32, head_size=16, n_rwkv_layer=2), 3, 12, 4),
}


@pytest.mark.parametrize("name", CASES)
def test_decoder_plans_give_the_oracle_logits_at_every_position(name, random_params):
    kwargs, B, T, P = CASES[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    seed = int(rng.integers(1 << 31))
    params = {n: p.astype(np.float32) for n, p in random_params(cfg, seed).items()}
    oracle = Oracle(cfg, params, dtype=np.float32)
    for _ in range(20):            # no near-tie of the MoBA gate (two float32 paths may break it apart)
        tokens = rng.integers(0, cfg.vocab_size, (B, T))
        gaps = Oracle(cfg, params).moba_gate_gaps(tokens)
        if all((g >= 1e-4).all() for g in gaps):
            break
    want = oracle.forward(tokens)

    mem = Memory()
    layout = Layout(cfg, B, P, H200, "fp32", recompute=True, methods=PREFILL_METHODS)
    mem.add(BASE, layout.total)
    names = [*Layout.host_inputs(B * P), "loss_t"]
    host = {n: HOST + i * (1 << 24) for i, n in enumerate(names)}
    for n in names:
        mem.add(host[n], layout.nbytes(n))
    sizes = state_sizes(layout, T)
    mem.add(STATE, carved_bytes(sizes))
    pin_in, pin_logits = HOST + (1 << 30), HOST + (1 << 31)
    mem.add(pin_in, 4 * (B + 1))
    mem.add(pin_logits, 4 * B * cfg.vocab_size)
    builder = StepBuilder(layout, BASE, host)
    ops = builder.build()
    prefill, step = decoder_ops(layout, BASE, carve(STATE, sizes), T, ops.stage_tokens, pin_in, pin_logits)

    flat = np.zeros(layout.counts["params"], np.float32)
    for n, (off, size) in layout.param_offsets.items():
        flat[off:off + size] = params[n].ravel()
    mem.write(BASE + layout.offsets["params"], flat)
    mem.write(host["tokens"], tokens[:, :P], "i32")
    run(mem, prefill)
    V, rows = cfg.vocab_size, layout.head_rows
    prompt_logits = []
    for head, r0 in zip(ops.head, builder.head_chunks()):     # the model's head, chunk by chunk
        run(mem, head)
        n = min(rows, B * P - r0)
        prompt_logits.append(mem.read(BASE + layout.offsets["logits"], n * V, (n, V)))
    got = [np.concatenate(prompt_logits).reshape(B, P, V)]
    for t in range(P, T):
        mem.write(pin_in, [*tokens[:, t], t], "i32")
        run(mem, step)
        got.append(mem.read(pin_logits, B * V, (B, 1, V)))
    got = np.concatenate(got, axis=1)
    errs = [rel_err(got[:, t], want[:, t]) for t in range(T)]
    assert max(errs) <= 1e-5, f"seed {seed}: position {int(np.argmax(errs))}: {max(errs):.2e}"
