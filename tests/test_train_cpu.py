"""Trainer on the CPU backend (oracle + numpy AdamW): learning, exact resume, checkpoints, devices."""
import numpy as np
import pytest

from rwkvx import Config, init_params, save_checkpoint
from rwkvx.data import BatchSampler, eval_batches, load_tokens, split_train_val, unigram_entropy
from rwkvx.optim import AdamW, Schedule
from rwkvx.training.trainer import (CPUBackend, Trainer, forward_padded, gpu_unavailable_reason, pad_batch,
                         resolve_device)

from seeding import seeded_rng

# A small RWKV-X: two RWKV blocks and one MoBA block (chunk 16, top-2 of 4 blocks per query).
CFG = Config(vocab_size=256, n_embd=32, n_rwkv_layer=2, n_attn_layer=1, head_size=16,
             moba_chunk_size=16, moba_top_k=2)
B, T = 8, 64


def _trainer(**kw):
    args = dict(backend="cpu", batch_size=B, seq_len=T, lr=4e-3, lr_min=4e-4, warmup=5,
                steps=10, weight_decay=0.01, grad_clip=1.0, seed=0)
    args.update(kw)
    return Trainer(CFG, init_params(CFG, args["seed"]), **args)


def test_training_on_embedded_corpus_beats_unigram_entropy():
    data = load_tokens(None)
    train, val = split_train_val(data.tokens, T, 0.05)
    entropy = unigram_entropy(train, 256)
    steps = 80
    trainer = _trainer(steps=steps, warmup=5, weight_decay=0.0)
    sampler = BatchSampler(train, B, T, seed=0)
    batches = eval_batches(val, B, T, max_batches=2)
    initial = np.mean([trainer.evaluate(x, y) for x, y in batches])
    assert abs(initial - np.log(256)) < 0.5          # untrained: close to uniform over bytes
    losses = [trainer.step(*sampler.next()) for _ in range(steps)]
    assert trainer.step_count == steps
    final = np.mean([trainer.evaluate(x, y) for x, y in batches])
    assert np.mean(losses[-10:]) < entropy - 0.3, (losses[-10:], entropy)
    assert final < entropy - 0.3, (final, entropy)
    assert all(np.isfinite(losses))


def test_step_matches_oracle_plus_adamw():
    """The CPU backend's step is exactly: oracle(float32) loss_and_grads, then optim.AdamW."""
    from rwkvx.oracle import Oracle

    params = init_params(CFG, 3)
    trainer = Trainer(CFG, params, backend="cpu", batch_size=2, seq_len=32, lr=1e-3,
                      lr_min=1e-4, warmup=2, steps=4, weight_decay=0.1, grad_clip=0.5)
    rng = seeded_rng(0)
    ref = {n: p.copy() for n, p in params.items()}
    opt = AdamW(ref, Schedule(1e-3, 1e-4, 2, 4), weight_decay=0.1, grad_clip=0.5)
    for _ in range(3):
        x = rng.integers(0, 256, (2, 32))
        y = rng.integers(0, 256, (2, 32))
        loss = trainer.step(x, y)
        ref_loss, grads = Oracle(CFG, ref, dtype=np.float32).loss_and_grads(x, y)
        opt.step(grads)
        assert loss == ref_loss
    got = trainer.params
    for n in ref:
        np.testing.assert_array_equal(got[n], ref[n], err_msg=n)
    assert trainer.last_stats["lr"] == pytest.approx(Schedule(1e-3, 1e-4, 2, 4).lr_at(3))


def test_exact_resume(tmp_path):
    """N steps straight == N/2 steps, save, load, N/2 steps: parameters and moments bit-identical."""
    tokens = load_tokens(None).tokens[:200_000]
    n = 6

    straight = _trainer(steps=n)
    sampler = BatchSampler(tokens, B, T, seed=5)
    losses = [straight.step(*sampler.next()) for _ in range(n)]

    first = _trainer(steps=n)
    sampler = BatchSampler(tokens, B, T, seed=5)
    resumed_losses = [first.step(*sampler.next()) for _ in range(n // 2)]
    path = tmp_path / "half.safetensors"
    first.save(path, meta={"sampler": sampler.state(), "note": "half way"})
    del first

    second = Trainer.load(path, backend="cpu")
    assert second.step_count == n // 2 and second.meta["note"] == "half way"
    assert second.config == straight.config
    sampler = BatchSampler(tokens, B, T, seed=999)
    sampler.set_state(second.meta["sampler"])
    resumed_losses += [second.step(*sampler.next()) for _ in range(n - n // 2)]

    assert resumed_losses == losses
    a, b = straight.params, second.params
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    sa, sb = straight.backend.optimizer_state(), second.backend.optimizer_state()
    assert sa["meta"] == sb["meta"]
    for name in sa["tensors"]:
        np.testing.assert_array_equal(sa["tensors"][name], sb["tensors"][name], err_msg=name)


def test_load_overrides_and_errors(tmp_path):
    trainer = _trainer()
    trainer.step(np.zeros((B, T), np.int64), np.ones((B, T), np.int64))
    path = tmp_path / "c.safetensors"
    trainer.save(path, tensors={"my.extra": np.arange(3)})
    again = Trainer.load(path, backend="cpu", schedule_steps=50, lr=1e-2)
    assert again.schedule.total_steps == 50 and again.schedule.lr_max == 1e-2
    assert again.step_count == 1
    np.testing.assert_array_equal(again.extra_tensors["my.extra"], np.arange(3))
    assert trainer.extra_tensors == {} and trainer.meta == {}     # set by load, empty before
    with pytest.raises(TypeError, match="unknown"):
        Trainer.load(path, backend="cpu", colour="blue")
    weights_only = tmp_path / "w.safetensors"
    save_checkpoint(weights_only, CFG, init_params(CFG, 0))
    with pytest.raises(ValueError, match="not a trainer checkpoint"):
        Trainer.load(weights_only, backend="cpu")
    with pytest.raises(ValueError, match="clashes"):
        trainer.save(tmp_path / "x.safetensors", tensors={"optim.m.bad": np.zeros(1)})


def test_bad_inputs():
    trainer = _trainer()
    x = np.zeros((B, T), np.int64)
    with pytest.raises(ValueError, match="out of range"):
        trainer.step(x, np.full((B, T), 256))
    with pytest.raises(ValueError, match="out of range"):
        trainer.evaluate(x - 1, x)
    with pytest.raises(ValueError):
        trainer.step(x, x[:, :-1])
    assert trainer.step_count == 0
    with pytest.raises(ValueError, match="precision"):
        _trainer(precision="fp8")
    with pytest.raises(ValueError, match="batch_size"):
        _trainer(batch_size=0)
    with pytest.raises(ValueError, match="device"):
        _trainer(backend="tpu")


def test_evaluate_does_not_change_parameters():
    trainer = _trainer()
    before = trainer.params
    x = seeded_rng(0).integers(0, 256, (B, T))
    l1 = trainer.evaluate(x, x)
    l2 = trainer.evaluate(x, x)
    assert l1 == l2
    for n, p in trainer.params.items():
        np.testing.assert_array_equal(p, before[n])


def test_float64_cpu_backend_agrees_with_float32():
    x = seeded_rng(1).integers(0, 256, (2, 32))
    t32 = Trainer(CFG, init_params(CFG, 0), backend="cpu", batch_size=2, seq_len=32)
    t64 = Trainer(CFG, init_params(CFG, 0), backend="cpu", batch_size=2, seq_len=32,
                  cpu_dtype=np.float64)
    assert isinstance(t64.backend, CPUBackend) and t64.backend.dtype == np.float64
    assert t32.evaluate(x, x) == pytest.approx(t64.evaluate(x, x), rel=1e-5)


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="a GPU backend is usable here")
def test_device_selection_without_gpu():
    kind, note = resolve_device("auto")
    assert kind == "cpu" and "CPU" in note and "training" in note
    assert "sampling runs on the CPU" in resolve_device("auto", "sampling")[1]
    assert _trainer(backend="auto").device == "cpu"
    with pytest.raises(RuntimeError, match="GPU backend cannot be used"):
        _trainer(backend="gpu")


def test_evaluate_equals_oracle_loss():
    from rwkvx.oracle import Oracle

    params = init_params(CFG, 2)
    trainer = Trainer(CFG, params, backend="cpu", batch_size=2, seq_len=32)
    rng = seeded_rng(4)
    x = rng.integers(0, 256, (2, 32))
    y = rng.integers(0, 256, (2, 32))
    y[0, :5] = -100
    ref, _ = Oracle(CFG, params, dtype=np.float32).loss_and_grads(x, y)
    assert trainer.evaluate(x, y) == pytest.approx(ref, rel=1e-12)
    assert trainer.evaluate(x, np.full_like(y, -100)) == 0.0


def test_pad_batch_and_forward_padded():
    """The GPU model's fixed shape: smaller batches padded at the end (tokens 0, targets ignored)
    and the logits cut back to the batch's own positions."""
    x = np.arange(1, 7).reshape(2, 3)
    tok, tgt = pad_batch(x, 3, 5, targets=x + 10)
    assert tok.dtype == tgt.dtype == np.int64 and tok.shape == tgt.shape == (3, 5)
    np.testing.assert_array_equal(tok[:2, :3], x)
    np.testing.assert_array_equal(tgt[:2, :3], x + 10)
    assert not tok[2:].any() and not tok[:, 3:].any()
    assert (tgt[2:] == -100).all() and (tgt[:, 3:] == -100).all()
    assert (pad_batch(x, 2, 3)[1] == -100).all()
    with pytest.raises(ValueError, match="larger than the GPU model"):
        pad_batch(x, 2, 2)

    class Fixed:  # the Model interface forward_padded needs: B, T and a fixed-shape forward
        B, T = 2, 8

        def forward(self, tokens):
            assert tokens.shape == (self.B, self.T)
            return np.repeat(tokens[..., None], 4, axis=-1).astype(np.float32)

    logits = forward_padded(Fixed(), x[:1])
    assert logits.shape == (1, 3, 4)
    np.testing.assert_array_equal(logits[..., 0], x[:1])
