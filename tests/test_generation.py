"""Stateful generation on the CPU: the oracle's stateful forward (prompt in parallel, then one token at
a time) against the full forward at every position, the stateful twins against their stateless forms,
and rwkvx.generate (argument checks, determinism, greedy = argmax of a full forward re-run)."""
import numpy as np
import pytest

import rwkvx
from rwkvx import Config
from rwkvx.generation import stream
from rwkvx.oracle import (Oracle, channel_mix_shift_forward, moba_attention_cached, moba_attention_forward,
                          moba_block_means, rel_err, time_shift_forward, wkv7_forward)

from seeding import seeded_rng

MOBA = dict(vocab_size=67, n_embd=32, head_size=8, n_rwkv_layer=3, n_attn_layer=2, moba_chunk_size=4,
            moba_top_k=3)
CASES = {   # name: (config, B, T, prompt lengths)
    # decode crosses block boundaries; early queries have fewer past blocks than top_k - 1
    "moba": (MOBA, 2, 27, (1, 4, 7)),
    "moba_b1": (MOBA, 1, 20, (3,)),
    "moba_top1": (dict(MOBA, moba_top_k=1, moba_chunk_size=5), 2, 21, (6,)),
    "moba_big_topk": (dict(MOBA, moba_top_k=6, moba_chunk_size=3, n_attn_layer=1), 3, 25, (2,)),
    "rwkv_only": (dict(vocab_size=50, n_embd=32, head_size=16, n_rwkv_layer=2), 2, 18, (5,)),
    "leftover_no_ln0": (dict(MOBA, n_rwkv_layer=5, n_attn_layer=2, ln0=False), 2, 19, (8,)),
}
TOL = {np.float32: 1e-5, np.float64: 1e-13}


def stateful_logits(oracle, tokens, prompt_len):
    """Logits of every position: the prompt in one call, then one call per token."""
    logits, state = oracle.stateful_forward(tokens[:, :prompt_len])
    out = [logits]
    for t in range(prompt_len, tokens.shape[1]):
        step, state = oracle.stateful_forward(tokens[:, t:t + 1], state)
        out.append(step)
    assert state.length == tokens.shape[1]
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stateful_logits_equal_full_forward_at_every_position(name, dtype, random_params, training_like):
    kwargs, B, T, prompt_lens = CASES[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    seed = int(rng.integers(1 << 31))
    params = training_like(cfg, seed) if name == "moba" else random_params(cfg, seed)
    oracle = Oracle(cfg, params, dtype=dtype)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    full = oracle.forward(tokens)
    for k in prompt_lens:
        got = stateful_logits(oracle, tokens, k)
        assert got.dtype == dtype and got.shape == full.shape
        worst = max(rel_err(got[:, t], full[:, t]) for t in range(T))
        assert worst <= TOL[dtype], f"seed {seed}, prompt {k}: worst position rel err {worst:.2e}"


def test_stateful_forward_in_chunks_and_state_is_not_modified(random_params):
    cfg = Config(**MOBA)
    oracle = Oracle(cfg, random_params(cfg, 3), dtype=np.float64)
    tokens = seeded_rng(3).integers(0, cfg.vocab_size, (2, 30))
    full = oracle.forward(tokens)
    a, state = oracle.stateful_forward(tokens[:, :5])
    snapshot = {key: {n: v.copy() for n, v in carry.items()} for key, carry in state.blocks.items()}
    b, s2 = oracle.stateful_forward(tokens[:, 5:16], state)       # 11 tokens: blocks complete inside
    c, _ = oracle.stateful_forward(tokens[:, 16:], s2)
    assert rel_err(np.concatenate([a, b, c], axis=1), full) <= 1e-13
    again, _ = oracle.stateful_forward(tokens[:, 5:6], state)      # the first state still holds
    assert rel_err(again[:, 0], full[:, 5]) <= 1e-13
    for key, carry in state.blocks.items():
        for n, v in carry.items():
            np.testing.assert_array_equal(v, snapshot[key][n], err_msg=f"{key} {n}")


def test_stateful_forward_rejects_a_mismatched_state(random_params):
    cfg = Config(**MOBA)
    oracle = Oracle(cfg, random_params(cfg, 0))
    _, state = oracle.stateful_forward(np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match="state holds 2 sequences"):
        oracle.stateful_forward(np.zeros((1, 1), np.int64), state)
    with pytest.raises(TypeError, match="DecodeState"):
        oracle.stateful_forward(np.zeros((2, 1), np.int64), {"blocks": {}})
    with pytest.raises(ValueError, match="out of range"):
        oracle.stateful_forward(np.full((2, 1), cfg.vocab_size), state)


# ------------------------------------------------------------------ the stateful forms of the twins

def test_wkv7_state_carries_exactly():
    rng = seeded_rng(0)
    B, T, H, N = 2, 11, 3, 8
    x = [rng.standard_normal((B, T, H, N)) for _ in range(6)]
    x[1] = np.exp(-0.6 * rng.uniform(size=(B, T, H, N)))          # decay in (0, 1)
    y, final = wkv7_forward(*x, return_state=True)
    np.testing.assert_array_equal(y, wkv7_forward(*x))
    y1, s1 = wkv7_forward(*(t[:, :4] for t in x), return_state=True)
    y2, s2 = wkv7_forward(*(t[:, 4:] for t in x), state=s1, return_state=True)
    np.testing.assert_array_equal(np.concatenate([y1, y2], axis=1), y)
    np.testing.assert_array_equal(s2, final)
    # S_T against the recurrence written out
    S = np.zeros((B, H, N, N))
    r, w, k, v, a, b = x
    for t in range(T):
        sa = np.einsum("bhij,bhj->bhi", S, a[:, t])
        S = S * w[:, t, :, None, :] + sa[..., None] * b[:, t, :, None, :] + v[:, t, ..., None] * k[:, t, :, None, :]
    assert rel_err(final, S) < 1e-13
    f32 = wkv7_forward(*(t.astype(np.float32) for t in x), return_state=True)
    assert all(o.dtype == np.float32 for o in f32)
    with pytest.raises(ValueError, match="state must have shape"):
        wkv7_forward(*x, state=np.zeros((B, H, N, N + 1)))


def test_token_shifts_with_a_carried_row():
    rng = seeded_rng(1)
    B, T, C = 3, 5, 8
    x = rng.standard_normal((B * T, C))
    mixes, mix = rng.uniform(size=(6, C)), rng.uniform(size=C)
    rows = x.reshape(B, T, C)
    head, tail = rows[:, :2].reshape(-1, C), rows[:, 2:].reshape(-1, C)
    for full, first, second in (
            (time_shift_forward(x, mixes, T), time_shift_forward(head, mixes, 2),
             time_shift_forward(tail, mixes, T - 2, prev=rows[:, 1])),
            (channel_mix_shift_forward(x, mix, T)[None], channel_mix_shift_forward(head, mix, 2)[None],
             channel_mix_shift_forward(tail, mix, T - 2, prev=rows[:, 1])[None])):
        joined = np.concatenate([first.reshape(len(first), B, 2, C), second.reshape(len(second), B, T - 2, C)],
                                axis=2)
        np.testing.assert_array_equal(joined.reshape(full.shape), full)


@pytest.mark.parametrize("chunk, top_k, Tq", [(4, 3, 1), (4, 3, 6), (3, 1, 2), (2, 8, 1), (5, 2, 13)])
def test_moba_attention_cached_is_the_forward_at_the_last_positions(chunk, top_k, Tq):
    rng = seeded_rng(chunk * 100 + top_k * 10 + Tq)
    B, T, H, N = 2, 19, 3, 8
    q, k, v = (rng.standard_normal((B, T, H, N)) for _ in range(3))
    o_full, sel_full = moba_attention_forward(q, k, v, chunk, top_k)
    kmean = moba_block_means(k[:, :(T // chunk) * chunk], chunk)
    o, sel = moba_attention_cached(q[:, T - Tq:], k, v, kmean, chunk, top_k)
    np.testing.assert_array_equal(o, o_full[:, T - Tq:])
    np.testing.assert_array_equal(sel, sel_full[:, :, T - Tq:])
    o32, _ = moba_attention_cached(*(a.astype(np.float32) for a in (q[:, -Tq:], k, v)), kmean, chunk, top_k)
    assert o32.dtype == np.float32
    if top_k > 1:                                         # the gate needs every complete block's mean
        with pytest.raises(ValueError, match="kmean"):
            moba_attention_cached(q[:, -1:], k, v, kmean[:, :, :1], chunk, top_k)
    with pytest.raises(ValueError, match="Tk"):
        moba_attention_cached(q, k[:, :3], v[:, :3], kmean, chunk, top_k)


# ------------------------------------------------------------------ rwkvx.generate

@pytest.fixture
def small(random_params):
    cfg = Config(vocab_size=40, n_embd=32, head_size=8, n_rwkv_layer=2, n_attn_layer=1,
                 moba_chunk_size=4, moba_top_k=2)
    return cfg, random_params(cfg, 7)


def test_greedy_generation_is_the_argmax_of_a_full_forward_rerun(small):
    cfg, params = small
    oracle = Oracle(cfg, params, dtype=np.float64)
    prompt = seeded_rng(0).integers(0, cfg.vocab_size, (2, 6))
    new = rwkvx.generate(oracle, prompt, 12, temperature=0)
    assert new.shape == (2, 12) and new.dtype == np.int64
    seq = prompt
    for i in range(12):           # the old way: the whole sequence again for every token
        np.testing.assert_array_equal(new[:, i], oracle.forward(seq)[:, -1].argmax(-1))
        seq = np.concatenate([seq, new[:, i:i + 1]], axis=1)


def test_generate_is_deterministic_and_accepts_trainers(small):
    cfg, params = small
    trainer = rwkvx.Trainer(cfg, params, backend="cpu")
    a = rwkvx.generate(trainer, [1, 2, 3], 10, temperature=0.9, top_p=0.8, seed=5)
    b = rwkvx.generate(Oracle(cfg, params, dtype=np.float32), np.array([1, 2, 3]), 10, temperature=0.9,
                       top_p=0.8, seed=5)
    assert a.shape == (10,) and np.array_equal(a, b) and ((0 <= a) & (a < cfg.vocab_size)).all()
    c = rwkvx.generate(trainer, [1, 2, 3], 10, temperature=0.9, top_p=0.8, seed=6)
    assert not np.array_equal(a, c)
    assert rwkvx.generate(trainer, [[1], [2]], 0).shape == (2, 0)
    steps = stream(trainer, [1, 2, 3], 10, temperature=0.9, top_p=0.8, seed=5)
    np.testing.assert_array_equal(np.concatenate(list(steps)), a)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompt_tokens=[]), ValueError, "non-empty"),
    (dict(prompt_tokens=[[]]), ValueError, "non-empty"),
    (dict(prompt_tokens=[1, 40]), ValueError, "out of range"),
    (dict(prompt_tokens=[1, -1]), ValueError, "out of range"),
    (dict(prompt_tokens=[1.0, 2.0]), TypeError, "integer"),
    (dict(prompt_tokens=np.zeros((1, 2, 3), np.int64)), ValueError, "1-D"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.0), ValueError, "max_new_tokens"),
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    (dict(top_k=2.0), TypeError, "top_k must be an int"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    (dict(end_token=40), ValueError, "end_token"),
    (dict(end_token=-1), ValueError, "end_token"),
    (dict(end_token=1.0), ValueError, "end_token"),
    (dict(prompt_tokens=[[1, 2], []]), ValueError, r"prompt_tokens\[1\] must be non-empty"),
    (dict(prompt_tokens=[[1, 2], [3, 40, 1]]), ValueError, r"prompt_tokens\[1\]\[0, 1\] = 40 is out of range"),
])
def test_generate_rejects_bad_arguments(small, kwargs, error, message, monkeypatch):
    import rwkvx.generation

    def no_session(*args):
        raise AssertionError("a session was opened before the arguments were checked")

    monkeypatch.setattr(rwkvx.generation, "open_session", no_session)   # the GPU's decoder included
    cfg, params = small
    args = dict(model_or_trainer=Oracle(cfg, params), prompt_tokens=[1, 2], max_new_tokens=3)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        rwkvx.generate(**args)
    with pytest.raises(error, match=message):
        stream(**args)
    with pytest.raises(TypeError, match="Trainer, rwkvx.Model or"):
        rwkvx.generate(object(), [1], 1)


def test_prompts_of_different_lengths_end_on_their_own(small):
    """A batch of prompts of different lengths: each sequence is its own greedy run, its draws are
    default_rng([seed, b]), and it stops at end_token or after max_new_tokens."""
    from rwkvx.sampling import sample_token
    cfg, params = small
    oracle = Oracle(cfg, params, dtype=np.float32)
    rng = seeded_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in (5, 1, 9)]
    greedy = rwkvx.generate(oracle, prompts, 7, temperature=0)
    assert isinstance(greedy, list) and [len(g) for g in greedy] == [7, 7, 7]
    for prompt, got in zip(prompts, greedy):
        np.testing.assert_array_equal(got, rwkvx.generate(oracle, prompt, 7, temperature=0))

    sampled = rwkvx.generate(oracle, prompts, 6, temperature=1.2, top_k=10, top_p=0.9, seed=4)
    for b, (prompt, got) in enumerate(zip(prompts, sampled)):     # the contract, token by token
        u, seq = np.random.default_rng([4, b]).random(6), list(prompt)
        for k in range(6):
            logits = oracle.forward(np.array([seq]))[0, -1]
            seq.append(sample_token(logits, u[k], 1.2, 10, 0.9))
        np.testing.assert_array_equal(got, seq[len(prompt):])

    end = int(greedy[1][2])                    # the third token of sequence 1 ends it there
    ended = rwkvx.generate(oracle, prompts, 7, temperature=0, end_token=end)
    for full, got in zip(greedy, ended):
        stop = list(full).index(end) + 1 if end in full else len(full)
        np.testing.assert_array_equal(got, full[:stop])
    steps = list(stream(oracle, prompts, 7, temperature=0, end_token=end))
    assert all((s[1] == -1) for s in steps[3:]) and steps[2][1] == end     # ended: -1 from then on


def test_equal_prompts_keep_the_array_form(small):
    cfg, params = small
    oracle = Oracle(cfg, params, dtype=np.float32)
    prompts = seeded_rng(5).integers(0, cfg.vocab_size, (3, 4))
    out = rwkvx.generate(oracle, prompts, 5, temperature=0.7, seed=1)
    assert out.shape == (3, 5)
    listed = rwkvx.generate(oracle, list(prompts), 5, temperature=0.7, seed=1, end_token=cfg.vocab_size - 1)
    for row, got in zip(out, listed):
        stop = list(row).index(cfg.vocab_size - 1) + 1 if cfg.vocab_size - 1 in row else 5
        np.testing.assert_array_equal(got, row[:stop])


# ------------------------------------------------------------------ the twins of decode.cu

def test_decode_twins_step_through_a_sequence_as_the_forward_twins():
    from rwkvx.oracle import decode_moba, decode_shift, decode_wkv7
    rng = seeded_rng(4)
    B, T, H, N, chunk, top_k = 2, 14, 2, 4, 3, 3
    C = H * N
    x = rng.standard_normal((B, T, C))
    mixes = rng.uniform(size=(6, C))
    prev = np.zeros((B, C))
    want = time_shift_forward(x.reshape(B * T, C), mixes, T).reshape(6, B, T, C)
    for t in range(T):
        outs, prev = decode_shift(x[:, t], prev, mixes)
        np.testing.assert_array_equal(outs, want[:, :, t])

    r, k, v, a, b = (rng.standard_normal((B, T, H, N)) for _ in range(5))
    w = np.exp(-0.6 * rng.uniform(size=(B, T, H, N)))
    y_full, s_full = wkv7_forward(r, w, k, v, a, b, return_state=True)
    state = np.zeros((B, H, N, N))
    for t in range(T):
        y, state = decode_wkv7(r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], state)
        np.testing.assert_array_equal(y, y_full[:, t])
    np.testing.assert_array_equal(state, s_full)

    q = rng.standard_normal((B, T, H, N))
    o_full, sel_full = moba_attention_forward(q, k, v, chunk, top_k)
    kc = vc = np.zeros((B, 0, H, N))
    kmean = np.zeros((B, H, 0, N))
    for t in range(T):
        o, sel, kc, vc, kmean = decode_moba(q[:, t], k[:, t], v[:, t], kc, vc, kmean, t, chunk, top_k)
        np.testing.assert_array_equal(o, o_full[:, t])
        np.testing.assert_array_equal(sel, sel_full[:, :, t])
        assert kmean.shape[2] == (t + 1) // chunk
    np.testing.assert_array_equal(kmean, moba_block_means(k[:, :(T // chunk) * chunk], chunk))
