"""LoRA on the CPU backend: only the factors train (AdamW), the model stays bit for bit, the LoRA file
round-trips and resumes exactly, merging gives the adapted model; the CLI trains, resumes, samples and
exports with it; clear errors for data-parallel GPU tuning, settings that cannot work and files that
do not fit."""
import dataclasses
import json

import numpy as np
import pytest

from rwkvx import Config, init_params, load_checkpoint, save_checkpoint
from rwkvx.checkpoint import read_safetensors
from rwkvx.cli import main
from rwkvx.lora import (DEFAULT_TARGETS, LoraSettings, init_factors, load_lora, lora_shapes, merge,
                        save_lora)
from rwkvx.optim import AdamW, Schedule
from rwkvx.oracle import Oracle
from rwkvx.training import TrainConfig, Trainer
from rwkvx.training.trainer import gpu_unavailable_reason
from rwkvx.validate import FieldError

from seeding import seeded_rng
from test_cli import TINY, _log
from test_state_tuning import CFG, SETTINGS as STATE_SETTINGS
from test_state_tuning import _batches, check_exact_resume

# the model test_cli's TINY flags (and test_dist_cpu's SMALL) train
TINY_CFG = Config(vocab_size=256, n_embd=32, n_rwkv_layer=1, n_attn_layer=1, head_size=16,
                  moba_chunk_size=8, moba_top_k=2)
SETTINGS = dict(STATE_SETTINGS, tune="lora", lora_rank=2, lora_alpha=4.0,
                lora_targets=DEFAULT_TARGETS + ("moba.key",), seed=3)


def test_only_the_factors_train_with_adamw(random_params):
    params = random_params(CFG, 1)
    trainer = Trainer(CFG, params, **SETTINGS)
    lora = TrainConfig(**{k: v for k, v in SETTINGS.items() if k != "backend"}).lora
    factors = init_factors(CFG, lora, seed=3)
    opt = AdamW(factors, Schedule(1e-2, 1e-3, 1, 4), weight_decay=0.1, grad_clip=1.0)
    for x, y in _batches(3):
        loss = trainer.step(x, y)
        ref_loss, grads = Oracle(CFG, params, dtype=np.float32, lora=factors,
                                 lora_scale=lora.scale).loss_and_grads(x, y)
        opt.step({n: grads[n] for n in factors})
        assert loss == ref_loss
    tuned = trainer.lora
    assert list(tuned) == list(lora_shapes(CFG, lora))
    for n, f in tuned.items():
        assert f.dtype == np.float32 and f.any(), n
        np.testing.assert_array_equal(f, factors[n], err_msg=n)
    for n, p in trainer.params.items():      # the model is frozen, bit for bit
        np.testing.assert_array_equal(p, params[n].astype(np.float32), err_msg=n)


def test_init_is_seeded_per_factor():
    """B zero; A uniform in [-1/sqrt(in), 1/sqrt(in)), each factor drawn from its own generator (the
    seed and its name): the same values whatever else is adapted, other values for another seed."""
    lora = LoraSettings(4, 4.0, DEFAULT_TARGETS)
    factors = init_factors(CFG, lora, seed=5)
    for name, f in factors.items():
        if name.endswith("lora_B"):
            assert not f.any(), name
        else:
            bound = 1 / np.sqrt(f.shape[0])
            assert f.min() >= -bound and f.max() < bound and f.std() > bound / 3, name
    alone = init_factors(CFG, lora._replace(targets=("ffn.value",)), seed=5)
    for name, f in alone.items():
        np.testing.assert_array_equal(f, factors[name], err_msg=name)
    other = init_factors(CFG, lora, seed=6)
    assert not np.array_equal(other["rwkv.blocks.0.att.key.lora_A"], factors["rwkv.blocks.0.att.key.lora_A"])


def test_lora_file_resumes_exactly(tmp_path, random_params):
    path = check_exact_resume(tmp_path, CFG, random_params(CFG, 2), SETTINGS, lambda t: t.lora)
    saved_cfg, saved, settings, extra = load_lora(path)
    assert saved_cfg == CFG and extra["meta"]["step"] == 2
    assert settings == LoraSettings(2, 4.0, DEFAULT_TARGETS + ("moba.key",))
    assert set(extra["tensors"]) == {f"optim.{m}.{n}" for m in "mv" for n in saved}


def test_lora_file_format(tmp_path):
    """The documented layout: float32 factors under <matrix>.lora_A / .lora_B, and the metadata."""
    lora = LoraSettings(2, 3.0, ("att.key", "ffn.value"))
    factors = init_factors(CFG, lora)
    save_lora(tmp_path / "l.safetensors", CFG, factors, lora)
    tensors, codes, metadata = read_safetensors(tmp_path / "l.safetensors")
    assert sorted(tensors) == sorted(f"{m}.lora_{f}" for m in (
        "rwkv.blocks.0.att.key", "rwkv.blocks.1.att.key", "rwkv.blocks.0.ffn.value",
        "rwkv.blocks.1.ffn.value", "moba.0.ffn.value") for f in "AB")
    assert set(codes.values()) == {"F32"}
    assert tensors["rwkv.blocks.0.ffn.value.lora_A"].shape == (CFG.ffn_dim, 2)
    assert tensors["rwkv.blocks.0.ffn.value.lora_B"].shape == (2, CFG.n_embd)
    assert metadata["format"] == "rwkvx-lora"
    assert json.loads(metadata["adapter"]) == {"rank": 2, "alpha": 3.0, "targets": ["att.key", "ffn.value"]}
    assert Config.from_dict(json.loads(metadata["config"])) == CFG


def test_a_lora_file_that_does_not_fit_is_refused(tmp_path):
    lora = LoraSettings(2, 2.0, ("att.key",))
    wider = dataclasses.replace(CFG, n_embd=32, head_size=16)
    save_lora(tmp_path / "l.safetensors", wider, init_factors(wider, lora), lora)
    with pytest.raises(ValueError, match=r"att\.key\.lora_A has shape \(32, 2\), .* need \(16, 2\)"):
        load_lora(tmp_path / "l.safetensors", CFG)
    deeper = dataclasses.replace(CFG, n_rwkv_layer=3)
    with pytest.raises(ValueError, match=r"missing rwkv\.blocks\.2\.att\.key\.lora_A"):
        load_lora(tmp_path / "l.safetensors", deeper)
    moba = LoraSettings(2, 2.0, ("moba.key",))
    save_lora(tmp_path / "moba.safetensors", CFG, init_factors(CFG, moba), moba)
    with pytest.raises(ValueError, match="does not fit this model .*has no MoBA attention blocks"):
        load_lora(tmp_path / "moba.safetensors", dataclasses.replace(CFG, n_attn_layer=0))
    save_checkpoint(tmp_path / "m.safetensors", CFG, init_params(CFG))
    with pytest.raises(ValueError, match="not a LoRA file"):
        load_lora(tmp_path / "m.safetensors")


def test_merged_trained_adapter_is_the_adapted_model(random_params):
    """The trainer's forward (adapted) == the float64 oracle of the merged weights, within rounding."""
    params = random_params(CFG, 4)
    trainer = Trainer(CFG, params, **dict(SETTINGS, cpu_dtype="float64"))
    for x, y in _batches(2, seed=2):
        trainer.step(x, y)
    x = _batches(1, seed=3)[0][0]
    merged = merge(CFG, {n: p.astype(np.float32).astype(np.float64) for n, p in params.items()}, trainer.lora,
                   trainer.config.lora.scale)
    np.testing.assert_allclose(Oracle(CFG, merged).forward(x), trainer.forward(x), rtol=1e-12, atol=1e-12)
    assert not np.allclose(Oracle(CFG, params).forward(x), trainer.forward(x), rtol=1e-6, atol=1e-6)


def test_settings_are_checked():
    for bad, match in [(dict(lora_rank=0), "lora_rank=0 must be >= 1"),
                       (dict(lora_alpha=0.0), "lora_alpha=0.0 must be a finite number > 0"),
                       (dict(lora_targets=("att.key", "bias")), "unknown target 'bias'"),
                       (dict(lora_targets=("att.key", "att.key")), "a target named twice"),
                       (dict(lora_targets=()), "no target")]:
        with pytest.raises(FieldError, match=match):
            TrainConfig(tune="lora", **bad)
    assert TrainConfig(lora_targets="att.key, ffn.key").lora_targets == ("att.key", "ffn.key")
    rwkv7 = dataclasses.replace(CFG, n_attn_layer=0)
    with pytest.raises(FieldError, match="lora_targets='moba.key': this model has no MoBA attention"):
        TrainConfig(tune="lora", lora_targets=("moba.key",)).check_model(rwkv7)
    with pytest.raises(FieldError, match=r"lora_rank=16 must be smaller than both sides of every adapted "
                                         r"matrix \(rwkv\.blocks\.0\.att\.receptance\.weight is \[16, 16\]\)"):
        TrainConfig(tune="lora", lora_rank=16).check_model(CFG)
    TrainConfig(tune="lora", lora_rank=15).check_model(CFG)
    with pytest.raises(FieldError, match="lora_rank=16"):
        Trainer(CFG, init_params(CFG), backend="cpu", tune="lora", lora_rank=16)


def test_gpu_and_misuse_are_clear_errors():
    params = init_params(CFG)
    with pytest.raises(ValueError, match="data-parallel tuning is not built"):
        Trainer(CFG, params, **dict(SETTINGS, backend="gpu"), world=object())   # refused before any GPU work
    factors = init_factors(CFG, LoraSettings(2, 4.0, DEFAULT_TARGETS + ("moba.key",)))
    with pytest.raises(ValueError, match="only when LoRA tuning"):
        Trainer(CFG, params, backend="cpu", lora=factors)
    with pytest.raises(ValueError, match="missing rwkv.blocks.0.att.key.lora_A"):
        Trainer(CFG, params, **dict(SETTINGS, lora_targets=("att.key",)),
                lora={n: f for n, f in factors.items() if ".att.key." not in n})
    assert Trainer(CFG, params, **dict(SETTINGS, backend="auto")).device == (
        "cpu" if gpu_unavailable_reason() else "gpu")


def test_cli_lora_from_a_model(tmp_path, capsys, random_params):
    """train --tune lora --init-from: progress, the LoRA file as checkpoint, exact --resume, sample and
    export with the adapter merged. The model is random (TINY's shape): a fresh one's zero output
    matrices would hide what the time-mix factors do."""
    model = tmp_path / "model.safetensors"
    save_checkpoint(model, TINY_CFG, random_params(TINY_CFG, 8))
    const = ["--lr", "1e-2", "--lr-min", "1e-2", "--warmup", "0", "--eval-every", "2", "--ckpt-every", "2",
             "--lora-rank", "4", "--lora-alpha", "2", "--lora-targets", "att.key,att.value,moba.value"]
    a, b = tmp_path / "a", tmp_path / "b"
    capsys.readouterr()
    tune = ["train", "--tune", "lora", "--init-from", str(model), *TINY, *const]
    assert main([*tune, "--steps", "4", "--out", str(a)]) == 0
    printed = capsys.readouterr().out
    assert "LoRA: 768 factor values trained (3 matrices of att.key,att.value,moba.value; rank 4, " \
           "alpha 2, scale 0.5), the model frozen" in printed
    assert str(a / "lora.safetensors") in printed and f"--lora {a / 'lora.safetensors'}" in printed
    assert not (a / "checkpoint.safetensors").exists()
    assert [int(r["step"]) for r in _log(a / "log.csv")] == [1, 2, 3, 4]
    assert main([*tune, "--steps", "2", "--out", str(b)]) == 0
    assert main(["train", "--resume", str(b), "--steps", "4", "--device", "cpu", "--no-progress"]) == 0
    _, fa, la, _ = load_lora(a / "lora.safetensors")
    _, fb, lb, eb = load_lora(b / "lora.safetensors")
    assert la == lb == LoraSettings(4, 2.0, ("att.key", "att.value", "moba.value"))
    for n in fa:
        np.testing.assert_array_equal(fa[n], fb[n], err_msg=n)
    assert eb["meta"]["step"] == 4 and eb["meta"]["train"]["tune"] == "lora"
    assert all(f.any() for f in fa.values())
    cfg, params, _ = load_checkpoint(model)
    merged = merge(cfg, params, fa, la.scale)



    # sample --lora == sampling from the merged weights; large factors, so that it differs from the base
    rng = seeded_rng(7)
    big = {n: rng.standard_normal(f.shape).astype(np.float32) for n, f in fa.items()}
    save_lora(tmp_path / "big.safetensors", cfg, big, la)
    save_checkpoint(tmp_path / "merged.safetensors", cfg, merge(cfg, params, big, la.scale))
    capsys.readouterr()
    sample = ["sample", "--tokens", "20", "--temperature", "0", "--device", "cpu"]
    outputs = []
    for ckpt in (["--ckpt", str(model), "--lora", str(tmp_path / "big.safetensors")],
                 ["--ckpt", str(tmp_path / "merged.safetensors")], ["--ckpt", str(model)]):
        assert main([*sample, *ckpt]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] != outputs[2]
    with pytest.raises(SystemExit):
        main(["sample", "--ckpt", str(a), "--device", "cpu"])
    assert "is a LoRA file (tuned factors, no model)" in capsys.readouterr().err

    out = tmp_path / "merged.pth"
    assert main(["export", "--ckpt", str(model), "--lora", str(a), "--out", str(out), "--dtype", "fp32",
                 "--drop-attention"]) == 0
    assert "the LoRA file" in capsys.readouterr().out
    _, exported, _ = load_checkpoint(out)
    for n, p in exported.items():
        np.testing.assert_array_equal(p, merged[n], err_msg=n)


def test_cli_errors_write_nothing(tmp_path, capsys):
    """Combinations that cannot work: one line each, exit status 2, no run directory."""
    base = tmp_path / "base"
    assert main(["train", *TINY, "--steps", "1", "--out", str(base)]) == 0
    assert main(["train", "--tune", "lora", "--init-from", str(base), *TINY, "--steps", "1",
                 "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    out = ["--out", str(tmp_path / "r")]
    for argv, message in [
        (["--lora-rank", "4", *TINY], "--lora-rank, --lora-alpha and --lora-targets are LoRA settings: "
                                      "they need --tune lora"),
        (["--tune", "lora", *TINY, "--lora-rank", "32"], "--lora-rank 32 must be smaller than both sides"),
        (["--tune", "lora", *TINY, "--lora-targets", "att.key,att.gate"], "--lora-targets att.key,att.gate: "
                                                                          "unknown target 'att.gate'"),
        (["--tune", "lora", *TINY, "--n-attn-layer", "0", "--lora-targets", "moba.key"],
         "--lora-targets moba.key: this model has no MoBA attention blocks"),
        (["--resume", str(tmp_path / "run"), "--tune", "full", "--device", "cpu"],
         "the run trains LoRA factors; --tune cannot change a resumed run"),
        (["--resume", str(tmp_path / "run"), "--lora-rank", "2", "--device", "cpu"],
         "the run's LoRA factors have rank 8, alpha 8, targets att.receptance,att.key,att.value,"
         "att.output,ffn.key,ffn.value; --lora-rank, --lora-alpha and --lora-targets cannot change"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["train", *argv, *(out if "--resume" not in argv else [])])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "r").exists()


def test_data_parallel_lora_equals_one_rank(tmp_path, random_params):
    """2 CPU ranks x B=2 train the same factors as 1 rank x B=4 (float64 oracle: up to rounding)."""
    from test_dist_cpu import SMALL, cli

    save_checkpoint(tmp_path / "m.safetensors", TINY_CFG, random_params(TINY_CFG, 5))
    tune = [*SMALL, "--tune", "lora", "--init-from", str(tmp_path / "m.safetensors"), "--steps", "3",
            "--lora-rank", "2"]
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = cli(*tune, "--batch-size", "4", "--out", str(one))
    r2 = cli(*tune, "--gpus", "2", "--batch-size", "2", "--out", str(two))
    assert r1.returncode == 0, r1.stderr
    assert r2.returncode == 0, r2.stderr
    _, f1, _, _ = load_lora(one / "lora.safetensors")
    _, f2, _, _ = load_lora(two / "lora.safetensors")
    for n in f1:
        assert f1[n].any()
        np.testing.assert_allclose(f2[n], f1[n], rtol=0, atol=1e-6, err_msg=n)
