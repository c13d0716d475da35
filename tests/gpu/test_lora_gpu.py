"""LoRA on the GPU backend: the model's factor gradients against the float64 oracle's (docs/SPEC.md §4's
model-level limits of tests/gpu/test_model_parity.py), a GPU LoRA run against the CPU backend's (the
AdamW parity bounds of tests/gpu/test_train_gpu.py), every parameter bit for bit unchanged; exact resume
from the LoRA file, graph replay == eager, the GPU decoder's refusal, the CLI; and a trained adapter
merged into the weights gives the GPU model the loss the CPU backend computes for the adapted model."""
import numpy as np
import pytest

from rwkvx import generate
from rwkvx.lora import TARGETS, LoraSettings, init_factors, lora_shapes, merge
from rwkvx.model import Model
from rwkvx.oracle import Oracle, rel_err
from rwkvx.training.trainer import Trainer

from seeding import seeded_batches, seeded_rng
from test_model_parity import TOLERANCES, TRAINING_LIKE_TOLERANCES
from test_state_tuning_gpu import CFG, CFG64, T

SETTINGS = LoraSettings(4, 8.0, tuple(TARGETS))     # every projection of both block kinds
LORA = dict(tune="lora", lora_rank=4, lora_alpha=8.0, seq_len=T, lr=1e-2, lr_min=1e-3, warmup=1, steps=6,
            grad_clip=1.0, weight_decay=0.1, lora_targets=("att.key", "att.output", "ffn.value", "moba.value"))


def random_factors(cfg, rng, settings=SETTINGS):
    """Factors of a trained adapter's scale (B not zero, so every factor gets a gradient), float32."""
    return {n: (0.3 * rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
            for n, s in lora_shapes(cfg, settings).items()}


def check_lora_grads(cfg, params, B, precision, loss_tol, tol, methods=None, recompute=True):
    """Loss and factor gradients of a Model with random factors against the float64 oracle's."""
    rng = seeded_rng()
    factors = random_factors(cfg, rng)
    tokens, targets = rng.integers(0, cfg.vocab_size, (2, B, T))
    model = Model(cfg, params, B, T, precision=precision, methods=methods, recompute=recompute, lora=factors,
                  lora_scale=SETTINGS.scale)
    model.poison()
    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref = Oracle(cfg, params, dtype=np.float64, lora=factors,
                           lora_scale=SETTINGS.scale).loss_and_grads(tokens, targets)
    errors = {n: rel_err(grads[n], ref[n]) for n in factors}
    worst = sorted(errors.items(), key=lambda e: -e[1])[:4]
    print(f"\n{precision} {methods or ''} B={B}: loss {abs(loss - ref_loss) / abs(ref_loss):.2e}, worst "
          + ", ".join(f"{n} {e:.2e}" for n, e in worst))
    assert set(grads) == set(factors) and all(np.isfinite(g).all() for g in grads.values())
    assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss)
    assert all(e <= tol for e in errors.values()), worst
    after = model.params()
    assert all(np.array_equal(after[n], params[n]) for n in params), "a frozen parameter changed"
    assert all(np.array_equal(f, factors[n]) for n, f in model.lora_factors().items())


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("cfg, wkv7", [(CFG, "sequential"), (CFG64, "sequential"), (CFG64, "chunked_exact")],
                         ids=["N16-sequential", "N64-sequential", "N64-chunked_exact"])
def test_lora_gradients_match_oracle_fp32(random_params, cfg, wkv7, recompute, B):
    params = {k: v.astype(np.float32) for k, v in random_params(cfg, 41).items()}
    check_lora_grads(cfg, params, B, "fp32", *TOLERANCES["fp32"], methods={"wkv7": wkv7}, recompute=recompute)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_lora_gradients_match_oracle_reduced_precision(training_like, precision):
    check_lora_grads(CFG64, training_like(CFG64, 42), 3, precision, *TRAINING_LIKE_TOLERANCES[precision])


def test_gpu_lora_matches_cpu(random_params):
    """Six steps (warm-up, clipping over the factor gradients, weight decay): the factors within the
    AdamW parity bound of the CPU backend's (float64), the model bit for bit as it was."""
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 43).items()}
    gpu = Trainer(CFG, params, backend="gpu", batch_size=3, **LORA)
    cpu = Trainer(CFG, params, backend="cpu", cpu_dtype=np.float64, batch_size=3, **LORA)
    for tokens, targets in seeded_batches(6, CFG.vocab_size, 3, T):
        lg, lc = gpu.step(tokens, targets), cpu.step(tokens, targets)
        assert abs(lg - lc) <= 1e-5 * abs(lc)
    fg, fc = gpu.lora, cpu.lora
    errors = {n: rel_err(fg[n], fc[n]) for n in fc}
    print("\nfactors after 6 steps, worst: " + ", ".join(
        f"{n} {e:.2e}" for n, e in sorted(errors.items(), key=lambda e: -e[1])[:4]))
    assert all(fc[n].any() for n in fc) and all(e <= 1e-4 for e in errors.values()), errors
    assert gpu.last_stats["grad_norm"] == pytest.approx(cpu.last_stats["grad_norm"], rel=1e-4)
    assert gpu.last_stats["lr"] == pytest.approx(cpu.last_stats["lr"], rel=1e-12)
    after = gpu.params
    assert all(np.array_equal(after[n], params[n]) for n in params), "a frozen parameter changed"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_lora_resumes_exactly(tmp_path, random_params, precision):
    """N steps straight == N/2, save (a LoRA file), load, N/2 — bit for bit; graph replay == eager."""
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 44).items()}
    kw = dict(LORA, batch_size=2, precision=precision)
    data = seeded_batches(6, CFG.vocab_size, 2, T)
    straight = Trainer(CFG, params, backend="gpu", **kw)
    losses = [straight.step(*d) for d in data]
    half = Trainer(CFG, params, backend="gpu", **kw)
    first = [half.step(*d) for d in data[:3]]
    half.save(tmp_path / "lora.safetensors")
    resumed = Trainer.load(tmp_path / "lora.safetensors", backend="gpu", params=params)
    assert resumed.step_count == 3
    second = [resumed.step(*d) for d in data[3:]]
    assert first + second == losses
    a, b = straight.lora, resumed.lora
    assert all(np.array_equal(a[n], b[n]) for n in a)
    settings = straight.config.lora
    eager = Model(CFG, params, 2, T, precision=precision, recompute=straight.backend.model.recompute,
                  lora=init_factors(CFG, settings, straight.config.seed), lora_scale=settings.scale)
    eager.configure_optimizer(straight.schedule, 0.1, 1.0)
    assert [eager.train_step(*d, graph=False) for d in data] == losses
    assert all(np.array_equal(eager.lora_factors()[n], a[n]) for n in a)


def test_generation_from_a_lora_model_is_refused_on_the_gpu(random_params):
    trainer = Trainer(CFG, random_params(CFG, 45), backend="gpu", batch_size=2, **LORA)
    with pytest.raises(ValueError, match="not LoRA factors"):
        generate(trainer, np.array([1, 2, 3]), 2)


def test_merged_adapter_on_the_gpu_matches_the_gpu_adapter(random_params):
    """A GPU-trained adapter: the adapted model's fp32 loss equals, within 1e-5, the merged weights'
    (what ``sample --lora`` / ``export --lora`` compute) and the CPU backend's for the same factors;
    the adapter moves the loss by far more than that."""
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 46).items()}
    gpu = Trainer(CFG, params, backend="gpu", batch_size=2, precision="fp32", **LORA)
    for tokens, targets in seeded_batches(3, CFG.vocab_size, 2, T):
        gpu.step(tokens, targets)
    scale = gpu.config.lora.scale
    cpu = Trainer(CFG, params, backend="cpu", cpu_dtype="float64", batch_size=2, lora=gpu.lora, **LORA)
    base = Trainer(CFG, params, backend="cpu", cpu_dtype="float64", batch_size=2, **dict(LORA, tune="full"))
    merged = Model(CFG, merge(CFG, params, gpu.lora, scale), 2, T, precision="fp32")
    for tokens, targets in seeded_batches(2, CFG.vocab_size, 2, T, 47):
        expected = cpu.evaluate(tokens, targets)
        assert abs(gpu.evaluate(tokens, targets) - expected) <= 1e-5 * abs(expected)
        assert abs(merged.evaluate(tokens, targets) - expected) <= 1e-5 * abs(expected)
        assert abs(base.evaluate(tokens, targets) - expected) > 1e-4 * abs(expected)


def test_cli_lora_on_the_gpu(tmp_path, capsys, random_params):
    """train --tune lora --device gpu from a model: the LoRA file, an exact --resume on the GPU, and
    sampling with the adapter merged."""
    from rwkvx import Config, save_checkpoint
    from rwkvx.cli import main
    from rwkvx.lora import load_lora

    cfg = Config(vocab_size=256, n_embd=32, n_rwkv_layer=1, n_attn_layer=1, head_size=16,
                 moba_chunk_size=8, moba_top_k=2)
    model = tmp_path / "m.safetensors"
    save_checkpoint(model, cfg, random_params(cfg, 48))
    tune = ["train", "--tune", "lora", "--init-from", str(model), "--device", "gpu", "--batch-size", "2",
            "--seq-len", "32", "--no-progress", "--lr", "1e-2", "--lr-min", "1e-2", "--warmup", "0",
            "--ckpt-every", "2", "--lora-rank", "4"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*tune, "--steps", "4", "--out", str(a)]) == 0
    assert main([*tune, "--steps", "2", "--out", str(b)]) == 0
    assert main(["train", "--resume", str(b), "--steps", "4", "--device", "gpu", "--no-progress"]) == 0
    assert "LoRA:" in capsys.readouterr().out
    _, fa, _, _ = load_lora(a / "lora.safetensors")
    _, fb, _, _ = load_lora(b / "lora.safetensors")
    assert all(np.array_equal(fa[n], fb[n]) for n in fa) and any(fa[n].any() for n in fa if n.endswith("_B"))
    assert main(["sample", "--ckpt", str(model), "--lora", str(a), "--tokens", "3", "--temperature", "0"]) == 0
