"""AdamW (RWKV-LM conventions, PyTorch semantics) and the warmup + cosine schedule vs hand-written references."""
import math

import numpy as np
import pytest

from rwkvx.optim import AdamW, Schedule
from rwkvx.oracle.adamw import clip_coefficient, global_grad_norm, lr_multiplier, uses_weight_decay

from seeding import seeded_rng

from seeding import seeded_rng

NAMES_SHAPES = {
    "rwkv.emb.weight": (7, 4),                     # 2-D *.weight: decayed
    "rwkv.blocks.0.att.key.weight": (4, 4),        # 2-D *.weight: decayed
    "rwkv.blocks.0.att.w0": (1, 1, 4),             # 2x learning rate, no decay
    "rwkv.blocks.0.att.w1": (4, 3),                # 2-D but not *.weight: no decay
    "rwkv.blocks.0.ln1.weight": (4,),              # 1-D *.weight: no decay
    "rwkv.blocks.0.att.r_k": (2, 2),               # no decay
}


def _params(seed=0):
    rng = seeded_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in NAMES_SHAPES.items()}


def _grads(step, scale=1.0):
    rng = seeded_rng(100 + step)
    return {n: (scale * rng.standard_normal(s)).astype(np.float32) for n, s in NAMES_SHAPES.items()}


def reference_adamw(params, grad_seq, lrs, wd, clip, b1=0.9, b2=0.99, eps=1e-18):
    """Element-by-element float64 AdamW written straight from the formulas (PyTorch semantics)."""
    p = {n: v.astype(np.float64).copy() for n, v in params.items()}
    m = {n: np.zeros_like(v) for n, v in p.items()}
    v2 = {n: np.zeros_like(v) for n, v in p.items()}
    for t, (grads, lr) in enumerate(zip(grad_seq, lrs), start=1):
        g64 = {n: g.astype(np.float64) for n, g in grads.items()}
        norm = math.sqrt(sum(float((g * g).sum()) for g in g64.values()))
        c = min(1.0, clip / (norm + 1e-6)) if clip else 1.0
        for n in p:
            lr_p = lr * (2.0 if n.endswith("att.w0") else 1.0)
            wd_p = wd if (n.endswith(".weight") and p[n].ndim == 2) else 0.0
            flat_p, flat_g = p[n].reshape(-1), (g64[n] * c).reshape(-1)
            flat_m, flat_v = m[n].reshape(-1), v2[n].reshape(-1)
            for i in range(flat_p.size):
                flat_p[i] = flat_p[i] * (1 - lr_p * wd_p)
                flat_m[i] = b1 * flat_m[i] + (1 - b1) * flat_g[i]
                flat_v[i] = b2 * flat_v[i] + (1 - b2) * flat_g[i] ** 2
                mhat = flat_m[i] / (1 - b1 ** t)
                vhat = flat_v[i] / (1 - b2 ** t)
                flat_p[i] -= lr_p * mhat / (math.sqrt(vhat) + eps)
    return p, m, v2


@pytest.mark.parametrize("clip", [None, 0.5])
def test_adamw_matches_reference(clip):
    params = _params()
    sched = Schedule(lr_max=0.01, lr_min=0.001, warmup=2, total_steps=5)
    opt = AdamW(params, sched, weight_decay=0.1, grad_clip=clip)
    grad_seq = [_grads(t, scale=3.0) for t in range(5)]
    for g in grad_seq:
        stats = opt.step(g)
    assert opt.step_count == 5
    assert stats["lr"] == pytest.approx(0.001)
    ref_p, ref_m, ref_v = reference_adamw(_params(), grad_seq, [sched.lr_at(t) for t in range(1, 6)],
                                          0.1, clip)
    for n in params:
        assert params[n].dtype == np.float32
        np.testing.assert_allclose(params[n], ref_p[n], rtol=2e-5, atol=2e-6, err_msg=n)
        np.testing.assert_allclose(opt.m[n], ref_m[n], rtol=2e-5, atol=1e-7, err_msg=n)
        np.testing.assert_allclose(opt.v[n], ref_v[n], rtol=2e-5, atol=1e-7, err_msg=n)


def test_param_groups():
    assert uses_weight_decay("rwkv.emb.weight", (7, 4))
    assert uses_weight_decay("moba.0.att.key.weight", (4, 4))
    assert not uses_weight_decay("rwkv.blocks.0.att.w1", (4, 3))
    assert not uses_weight_decay("rwkv.ln_out.weight", (4,))
    assert not uses_weight_decay("rwkv.blocks.0.att.w0", (1, 1, 4))
    assert lr_multiplier("rwkv.blocks.3.att.w0") == 2.0
    assert lr_multiplier("rwkv.blocks.3.att.w1") == 1.0
    assert lr_multiplier("rwkv.blocks.3.att.a0") == 1.0


def test_first_step_size_and_groups():
    """Step 1 with bias correction moves every element by ~lr_p (sign of -g); decay only where due."""
    params = _params()
    before = {n: p.copy() for n, p in params.items()}
    g = _grads(0)
    lr, wd = 0.01, 0.5
    AdamW(params, Schedule(lr_max=lr, lr_min=lr), weight_decay=wd).step(g)
    for n in params:
        lr_p = lr * (2 if n.endswith("att.w0") else 1)
        decayed = before[n] * (1 - lr_p * wd) if (n.endswith(".weight") and before[n].ndim == 2) \
            else before[n]
        np.testing.assert_allclose(params[n], decayed - lr_p * np.sign(g[n]), rtol=1e-5, atol=1e-6,
                                   err_msg=n)


def test_zero_weight_decay_leaves_other_groups_alone():
    params = _params()
    zero = {n: np.zeros(s, np.float32) for n, s in NAMES_SHAPES.items()}
    before = {n: p.copy() for n, p in params.items()}
    AdamW(params, Schedule(lr_max=0.1, lr_min=0.1), weight_decay=0.3).step(zero)
    for n in params:
        if n.endswith(".weight") and before[n].ndim == 2:
            np.testing.assert_allclose(params[n], before[n] * (1 - 0.1 * 0.3), rtol=1e-6)
        else:
            np.testing.assert_array_equal(params[n], before[n])


def test_clipping():
    g = _grads(0, scale=10.0)
    norm = global_grad_norm(g)
    ref = math.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in g.values()))
    assert norm == pytest.approx(ref, rel=1e-12)
    assert clip_coefficient(norm, 1.0) == pytest.approx(1.0 / (norm + 1e-6))
    assert clip_coefficient(norm, None) == 1.0
    assert clip_coefficient(norm, 0.0) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0
    # Clipping a gradient that is already small changes nothing.
    p1, p2 = _params(), _params()
    small = _grads(1, scale=1e-3)
    AdamW(p1, Schedule(), grad_clip=100.0).step(small)
    AdamW(p2, Schedule(), grad_clip=None).step(small)
    for n in p1:
        np.testing.assert_array_equal(p1[n], p2[n])


def test_schedule_key_steps():
    s = Schedule(lr_max=1e-3, lr_min=1e-4, warmup=10, total_steps=110)
    assert s.lr_at(1) == pytest.approx(1e-4)            # 1e-3 * 1/10
    assert s.lr_at(5) == pytest.approx(5e-4)
    assert s.lr_at(9) == pytest.approx(9e-4)
    assert s.lr_at(10) == pytest.approx(1e-3)           # warmup done: lr_max
    assert s.lr_at(60) == pytest.approx(5.5e-4)         # cosine half way: (max + min) / 2
    assert s.lr_at(35) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.25)))
    assert s.lr_at(110) == pytest.approx(1e-4)          # total_steps: lr_min
    assert s.lr_at(500) == 1e-4                         # after: lr_min
    assert all(s.lr_at(t) >= s.lr_at(t + 1) for t in range(10, 120))
    no_warm = Schedule(lr_max=2.0, lr_min=0.0, warmup=0, total_steps=4)
    assert [no_warm.lr_at(t) for t in (1, 2, 3, 4)] == pytest.approx(
        [1 + math.cos(math.pi * p) for p in (0.25, 0.5, 0.75, 1.0)])
    const = Schedule(lr_max=3e-4, lr_min=0.0, warmup=4, total_steps=None)
    assert const.lr_at(2) == pytest.approx(1.5e-4) and const.lr_at(1000) == 3e-4
    with pytest.raises(ValueError):
        s.lr_at(0)
    for bad in ({"lr_max": -1.0}, {"warmup": -1}, {"total_steps": 0}, {"lr_min": float("nan")}):
        with pytest.raises(ValueError):
            Schedule(**bad)


def test_state_dict_round_trip_is_exact():
    sched = Schedule(lr_max=0.01, lr_min=0.001, warmup=1, total_steps=6)
    p_a = _params()
    opt_a = AdamW(p_a, sched, weight_decay=0.1, grad_clip=1.0)
    for t in range(6):
        opt_a.step(_grads(t))
    p_b = _params()
    opt_b = AdamW(p_b, sched, weight_decay=0.1, grad_clip=1.0)
    for t in range(3):
        opt_b.step(_grads(t))
    state = opt_b.state_dict()
    saved_params = {n: p.copy() for n, p in p_b.items()}
    opt_c = AdamW(saved_params, sched, weight_decay=0.1, grad_clip=1.0)
    opt_c.load_state_dict(state)
    assert opt_c.step_count == 3
    for t in range(3, 6):
        opt_c.step(_grads(t))
    for n in p_a:
        np.testing.assert_array_equal(p_a[n], saved_params[n])
        np.testing.assert_array_equal(opt_a.m[n], opt_c.m[n])
        np.testing.assert_array_equal(opt_a.v[n], opt_c.v[n])


def test_errors():
    params = _params()
    opt = AdamW(params, Schedule())
    g = _grads(0)
    del g["rwkv.emb.weight"]
    with pytest.raises(ValueError, match="missing gradient"):
        opt.step(g)
    g = _grads(0)
    g["rwkv.emb.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="shape"):
        opt.step(g)
    g = _grads(0)
    g["rwkv.emb.weight"][0, 0] = np.nan
    with pytest.raises(FloatingPointError):
        opt.step(g)
    with pytest.raises(TypeError):
        AdamW({"x.weight": np.zeros((2, 2))}, Schedule())   # float64 parameter
    with pytest.raises(ValueError):
        AdamW(_params(), Schedule(), weight_decay=-1)
    with pytest.raises(ValueError, match="missing"):
        AdamW(_params(), Schedule()).load_state_dict({"tensors": {}, "meta": {"optim_step": 1}})
