"""Lean AdamW moments (rwkvx.oracle.adamw, TrainConfig.optimizer_memory="lean"): m and v stored as bf16,
stochastically rounded by a hash of (step, flat index, m or v).

What makes them safe to train with: the rounding is unbiased and deterministic, the update itself uses
the float32 moments (the first step equals the float32 optimizer's bit for bit), a resumed run is exact,
and the trajectory stays within a stated bound of the float32 one (measured in the last test).
"""
import numpy as np
import pytest

from rwkvx import Config, init_params
from rwkvx.optim import AdamW, Schedule, bf16_moment_bits
from rwkvx.oracle.adamw import _fmix32, bf16_stochastic, rounding_bits
from rwkvx.runtime.dtypes import bf16_bits_to_f32
from rwkvx.training import TrainConfig, Trainer

from seeding import seeded_rng

# Lean against float32 moments after STEPS steps of the model below (CPU backend, float32): the distance
# of the parameters, relative to how far the float32 run moved them, and the largest loss difference.
# Measured 0.022 and 4.3e-4; the bounds leave about 2x and 5x.
STEPS, PARAM_BOUND, LOSS_BOUND = 60, 0.05, 2e-3


def test_fmix32_is_murmur3s_finaliser():
    h = _fmix32(np.array([0, 1, 0xFFFFFFFF], np.uint32))
    assert h.tolist() == [0, 0x514E28B7, 0x81F16F39]


def test_rounding_is_to_a_neighbour_unbiased_and_deterministic():
    rng = seeded_rng()
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-20, 20, 4096)).astype(np.float32)
    down = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)            # truncation toward zero
    up = down + np.uint16(1)
    exact = bf16_bits_to_f32(down) == x
    for t in (1, 2, 1000):
        bits = bf16_stochastic(x, rounding_bits(t, np.arange(x.size), 0))
        assert np.array_equal(bits, bf16_stochastic(x, rounding_bits(t, np.arange(x.size), 0)))
        assert ((bits == down) | ((bits == up) & ~exact)).all()
    # one value rounded with 2**16 draws: the mean is the value (the draws' mean of the upper choice
    # is its distance from the lower neighbour over the gap, to within the draws' discreteness)
    value = np.float32(1.0 + 2.0 ** -10 + 2.0 ** -14)
    draws = bf16_bits_to_f32(bf16_stochastic(np.full(1 << 16, value), rounding_bits(7, np.arange(1 << 16), 1)))
    assert abs(draws.astype(np.float64).mean() - float(value)) < 2.0 ** -7 / 200


def test_special_values():
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, -1.5], np.float32)
    bits = bf16_stochastic(x, np.full(x.size, 0xFFFF, np.uint32))
    assert bits.tolist() == [0x7F80, 0xFF80, 0x7FC0, 0x0000, 0x8000, 0xBFC0]


def _params():
    rng = seeded_rng(3)
    return {"rwkv.blocks.0.att.key.weight": rng.standard_normal((6, 5)).astype(np.float32),
            "rwkv.blocks.0.ln1.weight": rng.standard_normal(7).astype(np.float32)}


def test_first_step_equals_float32_moments():
    """m = v = 0 before step 1 and the update reads the float32 moments: after one step the parameters are
    the float32 optimizer's bit for bit, and each stored moment is a bf16 neighbour of its float32 one."""
    schedule = Schedule(lr_max=1e-2, lr_min=1e-3, warmup=0, total_steps=10)
    opts = {m: AdamW(_params(), schedule, weight_decay=0.1, grad_clip=1.0, moments=m) for m in ("f32", "bf16")}
    rng = seeded_rng()
    grads = {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in opts["f32"].params.items()}
    for opt in opts.values():
        opt.step(grads)
    for n in grads:
        assert np.array_equal(opts["f32"].params[n], opts["bf16"].params[n])
        for ref, lean in ((opts["f32"].m[n], opts["bf16"].m[n]), (opts["f32"].v[n], opts["bf16"].v[n])):
            gap = np.abs(bf16_bits_to_f32(lean) - ref)
            assert (gap <= 2.0 ** -7 * np.abs(ref)).all()


def test_state_dict_round_trip_and_refusal():
    schedule = Schedule(lr_max=1e-2, total_steps=10)
    lean = AdamW(_params(), schedule, moments="bf16")
    rng = seeded_rng()
    for _ in range(3):
        lean.step({n: rng.standard_normal(p.shape).astype(np.float32) for n, p in lean.params.items()})
    state = lean.state_dict()
    assert state["meta"]["optim"]["moments"] == "bf16"
    again = AdamW(_params(), schedule, moments="bf16")
    again.load_state_dict(state)
    assert all(np.array_equal(again.m[n], lean.m[n]) and np.array_equal(again.v[n], lean.v[n]) for n in lean.m)
    standard = AdamW(_params(), schedule)
    standard.load_state_dict(state)                      # bf16 values are float32 values: lean -> standard
    standard.step({n: np.ones_like(p) for n, p in standard.params.items()})
    with pytest.raises(ValueError, match="not bf16"):     # float32 moments do not fit bf16 exactly
        again.load_state_dict(standard.state_dict())
    with pytest.raises(ValueError, match="not bf16"):
        bf16_moment_bits(np.array([1.0 + 2.0 ** -12], np.float32), "m")
    with pytest.raises(ValueError, match="moments"):
        AdamW(_params(), schedule, moments="fp8")


def test_trainer_config_and_lean_trajectory():
    with pytest.raises(ValueError, match="optimizer_memory"):
        TrainConfig(optimizer_memory="tiny")
    assert TrainConfig(optimizer_memory="lean").moments == "bf16"
    cfg = Config(vocab_size=64, n_embd=64, n_rwkv_layer=2, head_size=16)
    data = seeded_rng(0).integers(0, 64, (STEPS, 4, 33))
    runs = {}
    for memory in ("standard", "lean"):
        trainer = Trainer(cfg, init_params(cfg, 0), backend="cpu", batch_size=4, seq_len=32, steps=STEPS, lr=3e-3,
                          warmup=5, optimizer_memory=memory)
        runs[memory] = ([trainer.step(b[:, :-1], b[:, 1:]) for b in data], trainer.params)
    p0 = init_params(cfg, 0)
    (loss_f, pf), (loss_l, pl) = runs["standard"], runs["lean"]
    moved = np.sqrt(sum(np.sum((pf[n] - p0[n]).astype(np.float64) ** 2) for n in p0))
    apart = np.sqrt(sum(np.sum((pl[n] - pf[n]).astype(np.float64) ** 2) for n in p0))
    assert 0 < apart <= PARAM_BOUND * moved, (apart / moved, PARAM_BOUND)
    assert max(abs(a - b) for a, b in zip(loss_f, loss_l)) <= LOSS_BOUND


def test_cli_lean_run_resumes_and_a_standard_run_cannot_turn_lean(tmp_path, capsys):
    from rwkvx.cli import main
    from test_cli import TINY
    lean, standard = tmp_path / "lean", tmp_path / "standard"
    assert main(["train", *TINY, "--steps", "2", "--optimizer-memory", "lean", "--out", str(lean)]) == 0
    assert main(["train", "--resume", str(lean), "--steps", "3", "--no-progress"]) == 0
    assert main(["train", *TINY, "--steps", "2", "--out", str(standard)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--resume", str(standard), "--steps", "3", "--optimizer-memory", "lean"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot resume with bf16 moments" in err[0]
