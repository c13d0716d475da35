"""State tuning on the GPU backend: the model's state gradients against the float64 oracle's (docs/SPEC.md
§4's model-level limits of tests/gpu/test_model_parity.py), and a GPU state-tuning run against the CPU
backend's (the AdamW parity bounds of tests/gpu/test_train_gpu.py), every parameter bit for bit unchanged;
exact resume from the state file, graph replay == eager, and greedy generation from states on the GPU."""
import numpy as np
import pytest

from rwkvx import Config, generate
from rwkvx.model import Model
from rwkvx.oracle import Oracle, rel_err
from rwkvx.state_tuning import zero_states
from rwkvx.training.trainer import Trainer

from seeding import seeded_batches, seeded_rng
from tuned_models import CFG, CFG64, T, random_batch, random_states
from test_model_parity import TOLERANCES, TRAINING_LIKE_TOLERANCES

SETTINGS = dict(tune="state", seq_len=T, lr=1e-2, lr_min=1e-3, warmup=1, steps=6, grad_clip=1.0,
                weight_decay=0.1)


def frozen_bits(model: Model) -> dict[str, np.ndarray]:
    """The bytes of the device regions holding the frozen parameters (float32 values, bf16 GEMM copies)."""
    L = model.layout
    return {r: model.dev.download(model.builder.buf(r), (L.nbytes(r),), np.uint8)
            for r in ("params", "params_x") if L.counts[r]}


def check_tuned_grads(cfg, params, B, precision, loss_tol, tol, tuned, methods=None, recompute=True):
    """Loss and gradients of a Model with the random tensors to tune and the batch of ``tuned(cfg, rng, B)``
    (keyword arguments of both Model and Oracle: ``states=...`` or ``lora=..., lora_scale=...``; tokens and
    targets [B, T]) against the float64 oracle's; the tensors and the parameters unchanged."""
    rng = seeded_rng()
    kwargs, tokens, targets = tuned(cfg, rng, B)
    tensors = kwargs.get("states") or kwargs["lora"]
    model = Model(cfg, params, B, T, precision=precision, methods=methods, recompute=recompute, **kwargs)
    before = frozen_bits(model)
    model.poison()
    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref = Oracle(cfg, params, dtype=np.float64, **kwargs).loss_and_grads(tokens, targets)
    errors = {n: rel_err(grads[n], ref[n]) for n in tensors}
    print(f"\n{precision} {methods or ''} B={B}: loss {abs(loss - ref_loss) / abs(ref_loss):.2e}, worst "
          + ", ".join(f"{n} {e:.2e}" for n, e in sorted(errors.items(), key=lambda e: -e[1])[:4]))
    assert set(grads) == set(tensors) and all(np.isfinite(g).all() for g in grads.values())
    assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss)
    assert all(e <= tol for e in errors.values()), errors
    after = frozen_bits(model)
    assert all(np.array_equal(after[r], before[r]) for r in before), "a frozen parameter changed"


def fp32_cases(test):
    """``test`` parametrized over the fp32 gradient cases: head sizes 16 and 64, the sequential and the
    chunked WKV7, recompute or not, B 1 and 3."""
    for mark in (pytest.mark.parametrize("B", [1, 3]), pytest.mark.parametrize("recompute", [True, False]),
                 pytest.mark.parametrize("cfg, wkv7", [(CFG, "sequential"), (CFG64, "sequential"),
                                                       (CFG64, "chunked_exact")],
                                         ids=["N16-sequential", "N64-sequential", "N64-chunked_exact"])):
        test = mark(test)
    return test


def with_states(cfg, rng, B: int):
    """Random initial states and a random batch."""
    return dict(states=random_states(cfg, rng)), *random_batch(cfg, rng, B)


@fp32_cases
def test_state_gradients_match_oracle_fp32(random_params, cfg, wkv7, recompute, B):
    params = {k: v.astype(np.float32) for k, v in random_params(cfg, 21).items()}
    check_tuned_grads(cfg, params, B, "fp32", *TOLERANCES["fp32"], with_states, methods={"wkv7": wkv7},
                      recompute=recompute)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_state_gradients_match_oracle_reduced_precision(training_like, precision):
    check_tuned_grads(CFG64, training_like(CFG64, 22), 3, precision, *TRAINING_LIKE_TOLERANCES[precision],
                      with_states)


def check_tuning_matches_cpu(params, settings, tuned: str) -> None:
    """Six GPU steps of a tuning run (``settings``: TrainConfig fields) against the CPU backend's
    (float64): every loss within 1e-5, the tuned tensors (the Trainer's attribute ``tuned``) within the
    AdamW parity bound, the optimizer statistics alike, the model bit for bit as it was."""
    gpu = Trainer(CFG, params, backend="gpu", batch_size=3, **settings)
    before = frozen_bits(gpu.backend.model)
    cpu = Trainer(CFG, params, backend="cpu", cpu_dtype=np.float64, batch_size=3, **settings)
    for tokens, targets in seeded_batches(6, CFG.vocab_size, 3, T):
        lg, lc = gpu.step(tokens, targets), cpu.step(tokens, targets)
        assert abs(lg - lc) <= 1e-5 * abs(lc)
    tg, tc = getattr(gpu, tuned), getattr(cpu, tuned)
    errors = {n: rel_err(tg[n], tc[n]) for n in tc}
    print(f"\n{tuned} after 6 steps, worst: " + ", ".join(
        f"{n} {e:.2e}" for n, e in sorted(errors.items(), key=lambda e: -e[1])[:4]))
    assert all(tc[n].any() for n in tc) and all(e <= 1e-4 for e in errors.values()), errors
    assert gpu.last_stats["grad_norm"] == pytest.approx(cpu.last_stats["grad_norm"], rel=1e-4)
    assert gpu.last_stats["lr"] == pytest.approx(cpu.last_stats["lr"], rel=1e-12)
    after = frozen_bits(gpu.backend.model)
    assert all(np.array_equal(after[r], before[r]) for r in before), "a frozen parameter changed"
    assert all(np.array_equal(p, params[n]) for n, p in gpu.params.items())


def check_tuning_resumes_exactly(path, params, settings, tuned: str, eager_tuned) -> None:
    """A GPU tuning run: N steps straight == N/2, save (the adapter file ``path``), load, N/2 — bit for
    bit; graph replay == eager. ``eager_tuned(trainer)``: the Model keyword arguments of the run's
    untrained tensors; the Trainer's attribute ``tuned`` ("states" or "lora") reads them back."""
    data = seeded_batches(6, CFG.vocab_size, 2, T)
    straight = Trainer(CFG, params, backend="gpu", batch_size=2, **settings)
    losses = [straight.step(*d) for d in data]
    half = Trainer(CFG, params, backend="gpu", batch_size=2, **settings)
    first = [half.step(*d) for d in data[:3]]
    half.save(path)
    resumed = Trainer.load(path, backend="gpu", params=params)
    assert resumed.step_count == 3
    second = [resumed.step(*d) for d in data[3:]]
    assert first + second == losses
    a, b = getattr(straight, tuned), getattr(resumed, tuned)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    eager = Model(CFG, params, 2, T, precision=straight.config.precision,
                  recompute=straight.backend.model.recompute, **eager_tuned(straight))
    eager.configure_optimizer(straight.schedule, straight.config.weight_decay, straight.config.grad_clip)
    assert [eager.train_step(*d, graph=False) for d in data] == losses
    read = {"states": Model.states, "lora": Model.lora_factors}[tuned]
    assert all(np.array_equal(read(eager)[n], a[n]) for n in a)


def test_gpu_state_tuning_matches_cpu(random_params):
    """Warm-up, clipping over the state gradients, weight decay that must not touch them."""
    check_tuning_matches_cpu({k: v.astype(np.float32) for k, v in random_params(CFG, 23).items()}, SETTINGS,
                             "states")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_state_tuning_resumes_exactly(tmp_path, random_params, precision):
    check_tuning_resumes_exactly(tmp_path / "state.safetensors",
                                 {k: v.astype(np.float32) for k, v in random_params(CFG, 24).items()},
                                 dict(SETTINGS, precision=precision), "states",
                                 lambda trainer: dict(states=zero_states(CFG)))


def test_greedy_generation_from_states_on_the_gpu_is_the_oracles(training_like):
    """A state-tuning Trainer on the GPU generates from its states: greedy tokens are the argmax of the
    float64 oracle's forward from the same states (up to an fp32 near-tie), not the untuned model's."""
    params = training_like(CFG, 25)
    trainer = Trainer(CFG, params, backend="gpu", batch_size=2, **SETTINGS)
    states = random_states(CFG, seeded_rng(25))
    trainer.backend.model.load_states(states)
    prompt, n = seeded_rng(26).integers(0, CFG.vocab_size, 7), 16
    new = generate(trainer, prompt, n, temperature=0)
    logits = Oracle(CFG, params, dtype=np.float64, states=states).forward(np.concatenate([prompt, new])[None])[0]
    for i in range(n):
        row = logits[len(prompt) - 1 + i]
        top = np.sort(row)
        if top[-1] - top[-2] < 1e-3 * abs(top[-1]):         # a near-tie: the rest may diverge
            break
        assert new[i] == row.argmax(), f"token {i}"
    assert not np.array_equal(new, generate(Trainer(CFG, params, backend="gpu", batch_size=2, **SETTINGS), prompt,
                                            n, temperature=0)), "the states were not read"


def test_cli_state_tuning_on_the_gpu(tmp_path, capsys, random_params):
    """train --tune state --device gpu from a model: the state file, an exact --resume on the GPU, and
    sampling from the states on the GPU."""
    from rwkvx import save_checkpoint
    from rwkvx.cli import main
    from rwkvx.state_tuning import load_states

    cfg = Config(vocab_size=256, n_embd=32, n_rwkv_layer=1, n_attn_layer=1, head_size=16,
                 moba_chunk_size=8, moba_top_k=2)
    model = tmp_path / "m.safetensors"
    save_checkpoint(model, cfg, random_params(cfg, 26))
    tune = ["train", "--tune", "state", "--init-from", str(model), "--device", "gpu", "--batch-size", "2",
            "--seq-len", "32", "--no-progress", "--lr", "1e-2", "--lr-min", "1e-2", "--warmup", "0",
            "--ckpt-every", "2"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*tune, "--steps", "4", "--out", str(a)]) == 0
    assert main([*tune, "--steps", "2", "--out", str(b)]) == 0
    assert main(["train", "--resume", str(b), "--steps", "4", "--device", "gpu", "--no-progress"]) == 0
    assert "state tuning:" in capsys.readouterr().out
    _, sa, _ = load_states(a / "state.safetensors")
    _, sb, _ = load_states(b / "state.safetensors")
    assert all(sa[n].any() and np.array_equal(sa[n], sb[n]) for n in sa)
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(model), "--state", str(a), "--tokens", "3", "--temperature", "0",
                 "--device", "gpu"]) == 0
    assert capsys.readouterr().out
