"""State tuning on the GPU backend: the model's state gradients against the float64 oracle's (docs/SPEC.md
§4's model-level limits of tests/gpu/test_model_parity.py), and a GPU state-tuning run against the CPU
backend's (the AdamW parity bounds of tests/gpu/test_train_gpu.py), every parameter bit for bit unchanged;
exact resume from the state file, graph replay == eager, and generation from states refused."""
import numpy as np
import pytest

from rwkvx import Config, generate
from rwkvx.model import Model
from rwkvx.oracle import Oracle, rel_err
from rwkvx.state_tuning import state_shapes, zero_states
from rwkvx.training.trainer import Trainer

from seeding import seeded_batches, seeded_rng
from test_model_parity import TOLERANCES, TRAINING_LIKE_TOLERANCES

# T <= chunk * top_k: every past block is selected, so no selection near-ties between CPU and GPU;
# T = 45 is not a multiple of the chunked WKV7's 16 tokens
CFG = Config(vocab_size=97, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=1,
             moba_chunk_size=16, moba_top_k=3)
CFG64 = Config(vocab_size=97, n_embd=128, head_size=64, n_rwkv_layer=2, n_attn_layer=1,
               moba_chunk_size=16, moba_top_k=3)
T = 45
SETTINGS = dict(tune="state", seq_len=T, lr=1e-2, lr_min=1e-3, warmup=1, steps=6, grad_clip=1.0,
                weight_decay=0.1)


def random_states(cfg, rng):
    """Initial states of a state's size (a tuned one's scale), float32."""
    return {n: (0.5 * rng.standard_normal(s)).astype(np.float32) for n, s in state_shapes(cfg).items()}


def check_state_grads(cfg, params, B, precision, loss_tol, tol, methods=None, recompute=True):
    """Loss and state gradients of a Model with random initial states against the float64 oracle's."""
    rng = seeded_rng()
    states = random_states(cfg, rng)
    tokens, targets = rng.integers(0, cfg.vocab_size, (2, B, T))
    model = Model(cfg, params, B, T, precision=precision, methods=methods, recompute=recompute, states=states)
    model.poison()
    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref = Oracle(cfg, params, dtype=np.float64, states=states).loss_and_grads(tokens, targets)
    errors = {n: rel_err(grads[n], ref[n]) for n in states}
    print(f"\n{precision} {methods or ''} B={B}: loss {abs(loss - ref_loss) / abs(ref_loss):.2e}, "
          + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert set(grads) == set(states) and all(np.isfinite(g).all() for g in grads.values())
    assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss)
    assert all(e <= tol for e in errors.values()), errors
    after = model.params()
    assert all(np.array_equal(after[n], params[n]) for n in params), "a frozen parameter changed"


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("cfg, wkv7", [(CFG, "sequential"), (CFG64, "sequential"), (CFG64, "chunked_exact")],
                         ids=["N16-sequential", "N64-sequential", "N64-chunked_exact"])
def test_state_gradients_match_oracle_fp32(random_params, cfg, wkv7, recompute, B):
    params = {k: v.astype(np.float32) for k, v in random_params(cfg, 21).items()}
    check_state_grads(cfg, params, B, "fp32", *TOLERANCES["fp32"], methods={"wkv7": wkv7}, recompute=recompute)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_state_gradients_match_oracle_reduced_precision(training_like, precision):
    check_state_grads(CFG64, training_like(CFG64, 22), 3, precision, *TRAINING_LIKE_TOLERANCES[precision])


def test_gpu_state_tuning_matches_cpu(random_params):
    """Six steps (warm-up, clipping over the state gradients, weight decay that must not touch them): the
    states within the AdamW parity bound of the CPU backend's (float64), the model bit for bit as it was."""
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 23).items()}
    gpu = Trainer(CFG, params, backend="gpu", batch_size=3, **SETTINGS)
    cpu = Trainer(CFG, params, backend="cpu", cpu_dtype=np.float64, batch_size=3, **SETTINGS)
    for tokens, targets in seeded_batches(6, CFG.vocab_size, 3, T):
        lg, lc = gpu.step(tokens, targets), cpu.step(tokens, targets)
        assert abs(lg - lc) <= 1e-5 * abs(lc)
    sg, sc = gpu.states, cpu.states
    errors = {n: rel_err(sg[n], sc[n]) for n in sc}
    print("\nstates after 6 steps: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(sc[n].any() for n in sc) and all(e <= 1e-4 for e in errors.values()), errors
    assert gpu.last_stats["grad_norm"] == pytest.approx(cpu.last_stats["grad_norm"], rel=1e-4)
    assert gpu.last_stats["lr"] == pytest.approx(cpu.last_stats["lr"], rel=1e-12)
    after = gpu.params
    assert all(np.array_equal(after[n], params[n]) for n in params), "a frozen parameter changed"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_state_tuning_resumes_exactly(tmp_path, random_params, precision):
    """N steps straight == N/2, save (a state file), load, N/2 — bit for bit; graph replay == eager."""
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 24).items()}
    kw = dict(SETTINGS, batch_size=2, precision=precision)
    data = seeded_batches(6, CFG.vocab_size, 2, T)
    straight = Trainer(CFG, params, backend="gpu", **kw)
    losses = [straight.step(*d) for d in data]
    half = Trainer(CFG, params, backend="gpu", **kw)
    first = [half.step(*d) for d in data[:3]]
    half.save(tmp_path / "state.safetensors")
    resumed = Trainer.load(tmp_path / "state.safetensors", backend="gpu", params=params)
    assert resumed.step_count == 3
    second = [resumed.step(*d) for d in data[3:]]
    assert first + second == losses
    a, b = straight.states, resumed.states
    assert all(np.array_equal(a[n], b[n]) for n in a)
    eager = Model(CFG, params, 2, T, precision=precision, recompute=straight.backend.model.recompute,
                  states=zero_states(CFG))
    eager.configure_optimizer(straight.schedule, 0.1, 1.0)
    assert [eager.train_step(*d, graph=False) for d in data] == losses
    assert all(np.array_equal(eager.states()[n], a[n]) for n in a)


def test_generation_from_states_is_refused_on_the_gpu(random_params):
    trainer = Trainer(CFG, random_params(CFG, 25), backend="gpu", batch_size=2, **SETTINGS)
    with pytest.raises(ValueError, match="zero WKV states"):
        generate(trainer, np.array([1, 2, 3]), 2)


def test_cli_state_tuning_on_the_gpu(tmp_path, capsys, random_params):
    """train --tune state --device gpu from a model: the state file, an exact --resume on the GPU, and
    sampling from the states on the CPU."""
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
    assert main(["sample", "--ckpt", str(model), "--state", str(a), "--tokens", "3", "--temperature", "0"]) == 0
    assert "sampling runs on the CPU (the oracle): the GPU decoder starts" in capsys.readouterr().err
