"""State tuning on the CPU backend: only the initial WKV states train (AdamW), the model stays bit for
bit, the state file round-trips, resumes exactly and starts generation; the CLI runs it end to end;
clear errors for what the GPU does not run (data-parallel state tuning, generation from states),
shapes that do not fit and models without RWKV blocks. The GPU backend's state tuning:
tests/gpu/test_state_tuning_gpu.py."""
import dataclasses

import numpy as np
import pytest

from rwkvx import Config, generate, init_params, load_checkpoint, save_checkpoint
from rwkvx.cli import main
from rwkvx.optim import AdamW, Schedule
from rwkvx.checkpoint import export_rwkv7_pth
from rwkvx.oracle import Oracle, rel_err
from rwkvx.pth import read_pth, write_pth
from rwkvx.runtime.dtypes import round_to
from rwkvx.state_tuning import export_states_pth, load_states, save_states, state_name, state_shapes, zero_states
from rwkvx.training import TrainConfig, Trainer
from rwkvx.training.trainer import gpu_unavailable_reason

from seeding import seeded_rng
from tuned_models import random_states
from test_cli import TINY, _log

CFG = Config(vocab_size=256, n_embd=16, n_rwkv_layer=2, n_attn_layer=1, head_size=8,
             moba_chunk_size=4, moba_top_k=2)
B, T = 2, 12
SETTINGS = dict(backend="cpu", tune="state", batch_size=B, seq_len=T, lr=1e-2, lr_min=1e-3,
                warmup=1, steps=4, grad_clip=1.0, weight_decay=0.1)


def _batches(n, seed=0):
    rng = seeded_rng(seed)
    return [(rng.integers(0, 256, (B, T)), rng.integers(0, 256, (B, T))) for _ in range(n)]


def test_only_the_states_train_with_adamw(random_params):
    params = random_params(CFG, 1)
    trainer = Trainer(CFG, params, **SETTINGS)
    states = zero_states(CFG)
    opt = AdamW(states, Schedule(1e-2, 1e-3, 1, 4), weight_decay=0.1, grad_clip=1.0)
    for x, y in _batches(3):
        loss = trainer.step(x, y)
        ref_loss, grads = Oracle(CFG, params, dtype=np.float32, states=states).loss_and_grads(x, y)
        opt.step({n: grads[n] for n in states})
        assert loss == ref_loss
    tuned = trainer.states
    assert set(tuned) == set(state_shapes(CFG))
    for n, s in tuned.items():
        assert s.dtype == np.float32 and s.any()
        np.testing.assert_array_equal(s, states[n], err_msg=n)
    for n, p in trainer.params.items():      # the model is frozen, bit for bit
        np.testing.assert_array_equal(p, params[n].astype(np.float32), err_msg=n)


def check_exact_resume(tmp_path, cfg, params, settings, tuned):
    """4 steps straight == 2 steps, save, :meth:`Trainer.load` given the frozen model, 2 steps: what
    ``tuned(trainer)`` returns, bit for bit. Returns the file the trainer wrote at step 2 (with meta
    ``{"note": 1}``)."""
    batches = _batches(4, seed=1)
    straight = Trainer(cfg, params, **settings)
    for x, y in batches:
        straight.step(x, y)
    half = Trainer(cfg, params, **settings)
    for x, y in batches[:2]:
        half.step(x, y)
    path = tmp_path / "adapter.safetensors"
    half.save(path, meta={"note": 1})
    with pytest.raises(ValueError, match="pass the model's parameters"):
        Trainer.load(path, backend="cpu")
    resumed = Trainer.load(path, backend="cpu", params=params)
    assert resumed.step_count == 2 and resumed.meta == {"note": 1}
    for x, y in batches[2:]:
        resumed.step(x, y)
    for n, value in tuned(straight).items():
        np.testing.assert_array_equal(tuned(resumed)[n], value, err_msg=n)
    return path


def test_state_file_resumes_exactly(tmp_path, random_params):
    path = check_exact_resume(tmp_path, CFG, random_params(CFG, 2), SETTINGS, lambda t: t.states)
    saved_cfg, saved, extra = load_states(path)
    assert saved_cfg == CFG and extra["meta"]["step"] == 2
    assert set(saved) == {"blocks.0.att.state", "blocks.1.att.state"}


def test_generation_starts_from_a_loaded_state(tmp_path, random_params):
    """Greedy generation from a loaded state == the forward with that s0, token by token."""
    params = random_params(CFG, 3)
    rng = seeded_rng(4)
    states = {n: rng.standard_normal(s).astype(np.float32) for n, s in state_shapes(CFG).items()}
    save_states(tmp_path / "s.safetensors", CFG, states)
    _, loaded, _ = load_states(tmp_path / "s.safetensors", CFG)
    oracle = Oracle(CFG, params, dtype=np.float32, states=loaded)
    prompt = rng.integers(0, 256, 5)
    new = generate(oracle, prompt, 4, temperature=0)
    seq = np.concatenate([prompt, new])
    logits = oracle.forward(seq[None, :-1])[0]
    np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1:], axis=-1), new)
    assert not np.array_equal(new, generate(Oracle(CFG, params, dtype=np.float32), prompt, 4,
                                            temperature=0))


def test_a_state_that_does_not_fit_is_refused(tmp_path):
    other = dataclasses.replace(CFG, n_embd=32, head_size=16)
    save_states(tmp_path / "s.safetensors", other, zero_states(other))
    with pytest.raises(ValueError, match=r"blocks\.0\.att\.state has shape \(2, 16, 16\).*\(2, 8, 8\)"):
        load_states(tmp_path / "s.safetensors", CFG)
    deeper = dataclasses.replace(CFG, n_rwkv_layer=3)
    with pytest.raises(ValueError, match="missing blocks.2.att.state"):
        load_states(tmp_path / "s.safetensors", deeper)
    with pytest.raises(ValueError, match="not a state file"):
        save_checkpoint(tmp_path / "m.safetensors", CFG, init_params(CFG))
        load_states(tmp_path / "m.safetensors")


def test_gpu_and_misuse_are_clear_errors():
    params = init_params(CFG)
    with pytest.raises(ValueError, match="data-parallel tuning is not built"):
        Trainer(CFG, params, **dict(SETTINGS, backend="gpu"), world=object())   # refused before any GPU work
    with pytest.raises(ValueError, match="only when state tuning"):
        Trainer(CFG, params, backend="cpu", states=zero_states(CFG))
    with pytest.raises(ValueError, match="tune"):
        TrainConfig(tune="prefix")
    assert Trainer(CFG, params, **dict(SETTINGS, backend="auto")).device == (
        "cpu" if gpu_unavailable_reason() else "gpu")


def test_a_model_without_rwkv_blocks_has_no_state():
    cfg = Config(vocab_size=8, n_embd=8, n_rwkv_layer=1, head_size=8)
    object.__setattr__(cfg, "n_rwkv_layer", 0)    # Config itself refuses this; the check stands alone
    with pytest.raises(ValueError, match="has none"):
        state_shapes(cfg)


def test_cli_state_tuning_from_a_model(tmp_path, capsys, random_params):
    """train --tune state --init-from: progress, the state file as checkpoint, exact --resume, sample."""
    base = tmp_path / "base"
    assert main(["train", *TINY, "--steps", "1", "--out", str(base)]) == 0
    model = base / "checkpoint.safetensors"
    const = ["--lr", "1e-2", "--lr-min", "1e-2", "--warmup", "0", "--eval-every", "2", "--ckpt-every", "2"]
    a, b = tmp_path / "a", tmp_path / "b"
    capsys.readouterr()
    tune = ["train", "--tune", "state", "--init-from", str(model), *TINY, *const]
    assert main([*tune, "--steps", "4", "--out", str(a)]) == 0
    printed = capsys.readouterr().out
    assert "state tuning:" in printed and str(a / "state.safetensors") in printed
    assert "--state" in printed
    assert not (a / "checkpoint.safetensors").exists()
    assert [int(r["step"]) for r in _log(a / "log.csv")] == [1, 2, 3, 4]
    assert main([*tune, "--steps", "2", "--out", str(b)]) == 0
    with pytest.raises(SystemExit):
        main(["train", "--resume", str(b), "--tune", "full", "--steps", "4", "--device", "cpu"])
    assert "--tune cannot change a resumed run" in capsys.readouterr().err
    assert main(["train", "--resume", str(b), "--steps", "4", "--device", "cpu", "--no-progress"]) == 0
    _, sa, _ = load_states(a / "state.safetensors")
    _, sb, eb = load_states(b / "state.safetensors")
    for n in sa:
        np.testing.assert_array_equal(sa[n], sb[n], err_msg=n)
    assert eb["meta"]["step"] == 4 and eb["meta"]["train"]["tune"] == "state"
    assert all(s.any() for s in sa.values())

    capsys.readouterr()
    sample = ["sample", "--ckpt", str(model), "--tokens", "5", "--temperature", "0", "--device", "cpu"]
    assert main([*sample, "--state", str(a)]) == 0
    text = capsys.readouterr().out
    assert text
    with pytest.raises(SystemExit):
        main(["sample", "--ckpt", str(a), "--device", "cpu"])
    assert "is a state file" in capsys.readouterr().err
    # the states as an RWKV-PEFT .pth state file: sampling from it gives the same text
    assert main(["export", "--state", str(a), "--out", str(tmp_path / "state.pth")]) == 0
    assert "blocks.{i}.att.time_state" in capsys.readouterr().out
    assert main([*sample, "--state", str(tmp_path / "state.pth")]) == 0
    assert capsys.readouterr().out == text
    for bad, message in ((["--ckpt", str(model), "--state", str(a)], "one of them"), ([], "one of them"),
                         (["--state", str(a), "--drop-attention"], "not to --state")):
        with pytest.raises(SystemExit) as exc:
            main(["export", *bad, "--out", str(tmp_path / "x.pth")])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.pth").exists()


def test_the_rwkv_package_runs_from_an_exported_state_file(tmp_path, monkeypatch, random_params):
    """The exported model and state files, read by the ``rwkv`` pip package (ChatRWKV's engine, an outside
    reference; its RWKV-7 state per block is [att shift, WKV state, ffn shift], the WKV state loaded
    from the file as RWKV-Runner does): its logits from the state equal the oracle's from the same
    states. Skipped where PyTorch or the package is missing."""
    pytest.importorskip("torch", reason="the rwkv package runs on PyTorch, which is not installed")
    import torch
    for name, value in (("RWKV_V7_ON", "1"), ("RWKV_JIT_ON", "0"), ("RWKV_CUDA_ON", "0")):
        monkeypatch.setenv(name, value)                  # read when rwkv.model is imported
    package = pytest.importorskip("rwkv.model", reason="the rwkv package is not installed")
    cfg = Config(vocab_size=256, n_embd=128, head_size=64, n_rwkv_layer=2)
    params = {n: p.astype(np.float32) for n, p in random_params(cfg, 9).items()}
    rng = seeded_rng(9)
    states = random_states(cfg, rng)
    export_rwkv7_pth(tmp_path / "model.pth", cfg, params, dtype="fp32")
    export_states_pth(tmp_path / "state.pth", cfg, states)
    engine = package.RWKV(model=str(tmp_path / "model"), strategy="cpu fp32")
    saved = torch.load(tmp_path / "state.pth", weights_only=True)
    zeros = lambda: torch.zeros(cfg.n_embd, dtype=torch.float32)   # noqa: E731
    state = [t for i in range(cfg.n_rwkv_layer) for t in (zeros(), saved[f"blocks.{i}.att.time_state"].float(), zeros())]
    tokens = rng.integers(0, cfg.vocab_size, 12)
    logits, _ = engine.forward(tokens.tolist(), state, full_output=True)
    want = Oracle(cfg, params, dtype=np.float64, states=states).forward(tokens[None])[0]
    assert rel_err(logits.numpy(), want) <= 1e-5
    assert rel_err(Oracle(cfg, params, dtype=np.float64).forward(tokens[None])[0], want) > 1e-2


def test_cli_state_tuning_from_given_states(tmp_path, capsys):
    """train --tune state --init-state: the run starts from the given states (ours, or RWKV-PEFT's .pth):
    after one AdamW step of lr L each state entry is within L of where it started, which zeros are
    not; misuse is a one-line error."""
    assert main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "base")]) == 0
    model = tmp_path / "base" / "checkpoint.safetensors"
    cfg = load_checkpoint(model)[0]
    rng = seeded_rng(11)
    start = {n: (0.5 + rng.random(s)).astype(np.float32) for n, s in state_shapes(cfg).items()}
    save_states(tmp_path / "s.safetensors", cfg, start)
    export_states_pth(tmp_path / "s.pth", cfg, start)
    lr = 1e-3
    tune = ["train", "--tune", "state", "--init-from", str(model), *TINY, "--steps", "1", "--lr", str(lr),
            "--lr-min", str(lr), "--warmup", "0", "--device", "cpu", "--no-progress"]
    for source in ("s.safetensors", "s.pth"):
        out = tmp_path / f"run-{source}"
        assert main([*tune, "--init-state", str(tmp_path / source), "--out", str(out)]) == 0
        assert f"starting from {tmp_path / source}" in capsys.readouterr().out
        _, tuned, _ = load_states(out / "state.safetensors")
        assert all(np.abs(tuned[n] - start[n]).max() <= 1.01 * lr for n in start), source
        assert any(not np.array_equal(tuned[n], start[n]) for n in start), "the states did not train"
    for bad, message in ((["--init-state", str(tmp_path / "s.pth")], "needs --tune state"),):
        with pytest.raises(SystemExit) as exc:
            main(["train", *TINY, "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "x"), *bad])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["train", "--resume", str(tmp_path / "run-s.pth"), "--init-state", str(tmp_path / "s.pth"),
              "--device", "cpu"])
    assert exc.value.code == 2 and "continues from its own states" in capsys.readouterr().err


def test_pth_state_files_round_trip(tmp_path):
    """export_states_pth writes float32 blocks.{i}.att.time_state tensors (RWKV-PEFT's names and
    orientation) that load_states reads back exactly, for a given model only; a bf16 file is widened."""
    rng = seeded_rng(7)
    states = {n: rng.standard_normal(s).astype(np.float32) for n, s in state_shapes(CFG).items()}
    export_states_pth(tmp_path / "s.pth", CFG, states)
    tensors, codes = read_pth(tmp_path / "s.pth")
    assert list(tensors) == [f"blocks.{i}.att.time_state" for i in range(CFG.n_rwkv_layer)]
    assert set(codes.values()) == {"F32"}
    assert all(np.array_equal(tensors[f"blocks.{i}.att.time_state"], states[state_name(i)])
               for i in range(CFG.n_rwkv_layer))
    cfg, loaded, extra = load_states(tmp_path / "s.pth", CFG)
    assert cfg == CFG and extra == {"tensors": {}, "meta": {}}
    assert all(np.array_equal(loaded[n], states[n]) for n in states)
    with pytest.raises(ValueError, match="records no model"):
        load_states(tmp_path / "s.pth")
    with pytest.raises(ValueError, match="unexpected blocks.1.att.time_state"):
        load_states(tmp_path / "s.pth", dataclasses.replace(CFG, n_rwkv_layer=1))
    write_pth(tmp_path / "b.pth", {f"blocks.{i}.att.time_state": states[state_name(i)]
                                   for i in range(CFG.n_rwkv_layer)}, dtype="bf16")
    _, widened, _ = load_states(tmp_path / "b.pth", CFG)
    assert all(np.array_equal(widened[n], round_to("bf16", states[n])) for n in states)


def test_data_parallel_state_tuning_equals_one_rank(tmp_path, random_params):
    """2 CPU ranks x B=2 tune the same states as 1 rank x B=4 (float64 oracle: up to rounding). The
    model is random: a fresh one's zero output matrices would leave every state gradient 0."""
    from test_dist_cpu import SMALL, cli

    cfg = Config(vocab_size=256, n_embd=32, n_rwkv_layer=1, n_attn_layer=1, head_size=16,
                 moba_chunk_size=8, moba_top_k=2)
    save_checkpoint(tmp_path / "m.safetensors", cfg, random_params(cfg, 5))
    tune = [*SMALL, "--tune", "state", "--init-from", str(tmp_path / "m.safetensors"), "--steps", "3"]
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = cli(*tune, "--batch-size", "4", "--out", str(one))
    r2 = cli(*tune, "--gpus", "2", "--batch-size", "2", "--out", str(two))
    assert r1.returncode == 0, r1.stderr
    assert r2.returncode == 0, r2.stderr
    _, s1, _ = load_states(one / "state.safetensors")
    _, s2, _ = load_states(two / "state.safetensors")
    for n in s1:
        assert s1[n].any()
        np.testing.assert_allclose(s2[n], s1[n], rtol=0, atol=1e-6, err_msg=n)
