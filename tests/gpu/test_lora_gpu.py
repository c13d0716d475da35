"""LoRA on the GPU backend: the model's factor gradients against the float64 oracle's (docs/SPEC.md §4's
model-level limits of tests/gpu/test_model_parity.py), a GPU LoRA run against the CPU backend's (the
AdamW parity bounds of tests/gpu/test_train_gpu.py), every parameter bit for bit unchanged; exact resume
from the LoRA file, graph replay == eager, greedy generation with the factors, the CLI; and a trained adapter
merged into the weights gives the GPU model the loss the CPU backend computes for the adapted model."""
import numpy as np
import pytest

from rwkvx import generate
from rwkvx.lora import LoraSettings, init_factors, merge
from rwkvx.model import Model
from rwkvx.oracle import Oracle, rel_err
from rwkvx.training.trainer import Trainer

from seeding import seeded_batches, seeded_rng
from test_model_parity import TOLERANCES, TRAINING_LIKE_TOLERANCES
from test_lora_plan import emulated_grads, random_draw
from test_state_tuning_gpu import check_tuned_grads, check_tuning_matches_cpu, check_tuning_resumes_exactly, fp32_cases
from tuned_models import CFG, CFG64, GRADIENT_LORA, T, random_factors

LORA = dict(tune="lora", lora_rank=4, lora_alpha=8.0, seq_len=T, lr=1e-2, lr_min=1e-3, warmup=1, steps=6,
            grad_clip=1.0, weight_decay=0.1, lora_targets=("att.key", "att.output", "ffn.value", "moba.value"))


def with_factors(cfg, rng, B: int):
    """A large adapter's factors and a random batch (tests/test_lora_plan.py's draw: every factor gets a
    gradient)."""
    factors, tokens, targets = random_draw(cfg, GRADIENT_LORA, B, T, rng)
    return dict(lora=factors, lora_scale=GRADIENT_LORA.scale), tokens, targets


def bf16_storable_factors(params: dict):
    """:func:`with_factors` for a model of ``params``, redrawn until bf16 storage alone keeps every factor's
    gradient within half the bf16 limit: the step emulated on the CPU with its stores rounded to bf16
    (tests/test_lora_plan.py, tests/emulator.py). On some draws the gradients of these large adapters are
    that sensitive to the rounding of the forward's operands (block 0's receptance and key factors up to
    0.3 off from bf16 storage alone, a third of the draws over the limit), whoever computes them; the GPU's
    own roundings must then fit in the other half."""
    limit = TRAINING_LIKE_TOLERANCES["bf16"][1]

    def draw(cfg, rng, B: int):
        for _ in range(20):
            kwargs, tokens, targets = with_factors(cfg, rng, B)
            ref = Oracle(cfg, params, dtype=np.float64, **kwargs).loss_and_grads(tokens, targets)[1]
            stored = emulated_grads(cfg, params, kwargs["lora"], GRADIENT_LORA, tokens, targets, exact=False)
            if all(rel_err(g, ref[n]) <= limit / 2 for n, g in stored.items()):
                return kwargs, tokens, targets
        pytest.skip("no draw whose bf16-stored factor gradients are within half the limit")
    return draw


@fp32_cases
def test_lora_gradients_match_oracle_fp32(random_params, cfg, wkv7, recompute, B):
    params = {k: v.astype(np.float32) for k, v in random_params(cfg, 41).items()}
    check_tuned_grads(cfg, params, B, "fp32", *TOLERANCES["fp32"], with_factors, methods={"wkv7": wkv7},
                      recompute=recompute)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_lora_gradients_match_oracle_reduced_precision(training_like, precision):
    params = training_like(CFG64, 42)
    check_tuned_grads(CFG64, params, 3, precision, *TRAINING_LIKE_TOLERANCES[precision],
                      bf16_storable_factors(params) if precision == "bf16" else with_factors)


def test_gpu_lora_matches_cpu(random_params):
    """Warm-up, clipping over the factor gradients, weight decay (which the factors do not get)."""
    check_tuning_matches_cpu({k: v.astype(np.float32) for k, v in random_params(CFG, 43).items()}, LORA, "lora")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_lora_resumes_exactly(tmp_path, random_params, precision):
    def untrained(trainer):
        settings = trainer.config.lora
        return dict(lora=init_factors(CFG, settings, trainer.config.seed), lora_scale=settings.scale)

    check_tuning_resumes_exactly(tmp_path / "lora.safetensors",
                                 {k: v.astype(np.float32) for k, v in random_params(CFG, 44).items()},
                                 dict(LORA, precision=precision), "lora", untrained)


def test_greedy_generation_from_a_lora_trainer_equals_the_merged_models(random_params):
    """A LoRA Trainer on the GPU generates with its factors applied: the greedy tokens of the merged
    weights' model (up to an fp32 near-tie), not the base model's."""
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 45).items()}
    trainer = Trainer(CFG, params, backend="gpu", batch_size=2, **LORA)
    rng = seeded_rng(45)
    settings = LoraSettings(LORA["lora_rank"], LORA["lora_alpha"], LORA["lora_targets"])
    factors = random_factors(CFG, settings, rng)
    trainer.backend.model.load_lora_factors(factors)
    prompt, n = rng.integers(0, CFG.vocab_size, 7), 16
    new = generate(trainer, prompt, n, temperature=0)
    merged = Model(CFG, merge(CFG, params, factors, settings.scale), 1, len(prompt) + n)
    logits = merged.forward(np.concatenate([prompt, new])[None])[0]
    for i in range(n):
        top = np.sort(logits[len(prompt) - 1 + i])
        if top[-1] - top[-2] < 1e-3 * abs(top[-1]):         # a near-tie: the rest may diverge
            break
        assert new[i] == logits[len(prompt) - 1 + i].argmax(), f"token {i}"
    base = Model(CFG, params, 1, len(prompt) + n)
    assert not np.array_equal(new, generate(base, prompt, n, temperature=0)), "the factors were not read"


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
