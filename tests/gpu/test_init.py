"""The device initialisation (rwkvx/cu/init, rwkvx/device_init.py) against its twin (rwkvx.oracle.init): the draws bit
for bit, the fp64 GEMMs and the Cholesky QR pieces to float64 rounding, the orthogonal tensors and the
whole init_params(device="gpu") to float32 rounding, and QᵀQ = I."""
import numpy as np
import pytest

from rwkvx import Config, init_params
from rwkvx.cu import init
from rwkvx.oracle import init as twin
from rwkvx.device_init import _Runner, random_params
from rwkvx.params import EMB_INIT_RANGE, complete_params, householder_columns, orthogonal_tensors
from rwkvx.runtime.gemm import FP64, linear
from seeding import seeded_rng

CFG = Config(vocab_size=300, n_embd=192, head_size=16, n_rwkv_layer=2, n_attn_layer=1)


def _run(dev, ops):
    from rwkvx._core import Plan
    Plan(dev, ops).run()
    dev.synchronize()


def _f32_ulps(got: np.ndarray, want: np.ndarray) -> float:
    """The largest |got - want| in float32 ulps of want (float32 rounding: at most 1)."""
    want = np.asarray(want, np.float32)
    return float((np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want))).max())


@pytest.mark.parametrize("seed, name, count", [(0, "rwkv.head.weight", 1), (7, "a", 100_001),
                                               (2**40 + 3, "rwkv.blocks.3.att.key.weight", 4096 * 65 + 3)])
def test_normal_draws_are_the_twins_bits(dev, seed, name, count):
    buf = dev.alloc(8 * count)
    _run(dev, init.normal(buf.typed("f64"), count, seed, name, dev.info))
    got = dev.download(buf, (count,), np.float64)
    want = twin.normal(count, init.draw_keys(seed, name))
    assert np.array_equal(got.view(np.uint64), want.view(np.uint64)), \
        f"{np.count_nonzero(got != want)} of {count} draws differ from the twin"


@pytest.mark.parametrize("seed, count", [(0, 5), (2**63 + 11, 300 * 192 + 2)])
def test_uniform_draws_are_the_twins_bits(dev, seed, count):
    buf = dev.alloc(4 * count)
    _run(dev, init.uniform(buf.typed("f32"), count, seed, "rwkv.emb.weight", -EMB_INIT_RANGE,
                           2 * EMB_INIT_RANGE, dev.info))
    got = dev.download(buf, (count,), np.float32)
    want = twin.uniform(count, init.draw_keys(seed, "rwkv.emb.weight"), -EMB_INIT_RANGE, 2 * EMB_INIT_RANGE)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fp64_gemm_runs_with_double_scalars(dev):
    """An fp64 GEMM in a Plan reads alpha and beta as doubles: y = x Wᵀ·(-1/3) + y, to float64 rounding."""
    rng = seeded_rng(3)
    x, w, y = rng.standard_normal((70, 40)), rng.standard_normal((50, 40)), rng.standard_normal((70, 50))
    bx, bw, by = dev.to_device(x), dev.to_device(w), dev.to_device(y)
    _run(dev, [linear(bx.typed("f64"), bw.typed("f64"), by.typed("f64"), 70, 40, 50, beta=1.0, alpha=-1 / 3,
                      precision=FP64)])
    np.testing.assert_allclose(dev.download(by, (70, 50), np.float64), y - x @ w.T / 3, rtol=0, atol=1e-13)


@pytest.mark.parametrize("m, n", [(300, 150), (1000, 64), (129, 129)])
def test_cholesky_and_solve_match_the_twin(dev, m, n):
    a = seeded_rng(m + n).standard_normal((m, n))
    ba, bg, info = dev.to_device(a), dev.alloc(8 * n * n), dev.zeros(4)
    A, G = ba.typed("f64"), bg.typed("f64")
    _run(dev, [*init.gram(A, m, n, G), *init.cholesky(G, n, info.typed("i32")), *init.solve(A, m, n, G)])
    assert dev.download(info, (1,), np.int32)[0] == 0
    lower = twin.cholesky(a.T @ a)
    np.testing.assert_allclose(np.tril(dev.download(bg, (n, n), np.float64)), lower, rtol=0,
                               atol=1e-11 * np.abs(lower).max())
    np.testing.assert_allclose(dev.download(ba, (m, n), np.float64), twin.solve(a, lower), rtol=0, atol=1e-9)


def test_cholesky_reports_a_matrix_that_is_not_positive_definite(dev):
    n = 150
    g = np.eye(n)
    g[100, 100] = -1.0
    bg, info = dev.to_device(g), dev.zeros(4)
    _run(dev, init.cholesky(bg.typed("f64"), n, info.typed("i32")))
    assert dev.download(info, (1,), np.int32)[0] == 101          # the failing column + 1


def test_deviation(dev):
    g = np.eye(70) + seeded_rng(1).uniform(-1e-9, 1e-9, (70, 70))
    g[3, 60] = 2e-7
    bg, out = dev.to_device(g), dev.alloc(8)
    _run(dev, init.deviation(bg.typed("f64"), 70, out.typed("f64"), dev.info))
    assert dev.download(out, (1,), np.float64)[0] == np.abs(g - np.eye(70)).max()


@pytest.mark.parametrize("shape, gain", [((300, 64), 0.5), ((192, 192), 1.0), ((130, 129), 0.1),
                                         ((64, 256), 0.1)])
def test_orthogonal_tensors_match_the_twin(dev, shape, gain):
    runner = _Runner(dev, CFG)              # scratch for CFG's largest draw, 300 x 192
    try:
        got = runner.orthogonal(5, "t", shape, gain)
    finally:
        runner.close()
    want = twin.orthogonal(5, "t", shape, gain)
    assert got.shape == shape and got.dtype == np.float32
    assert _f32_ulps(got, want) <= 1.0
    w = got.astype(np.float64) / gain
    gram = w @ w.T if shape[0] < shape[1] else w.T @ w
    np.testing.assert_allclose(gram, np.eye(len(gram)), atol=1e-6)


def test_a_failed_cholesky_falls_back_to_householder_on_the_host(dev):
    """When chol_diag reports a pivot that is not positive, the tensor is the Householder Q of its draw."""
    runner = _Runner(dev, CFG)
    runner._read_info = lambda: 1
    try:
        got = runner.orthogonal(2, "t", (200, 64), 0.5)
    finally:
        runner.close()
    draw = twin.normal(200 * 64, init.draw_keys(2, "t")).reshape(200, 64)
    want = (0.5 * householder_columns(draw)).astype(np.float32)
    assert _f32_ulps(got, want) <= 1.0


def test_init_params_on_the_gpu_is_the_twin_and_deterministic(dev):
    seen = []
    got = init_params(CFG, 3, device="gpu", progress=lambda done, total: seen.append((done, total)))
    want = complete_params(CFG, twin.random_params(CFG, 3))
    assert list(got) == list(want)
    for name in want:
        assert got[name].shape == want[name].shape and got[name].dtype == np.float32
        assert _f32_ulps(got[name], want[name]) <= 1.0, name
    assert np.array_equal(got["rwkv.emb.weight"], want["rwkv.emb.weight"])
    again = random_params(CFG, 3, dev)
    assert all(np.array_equal(again[n], got[n]) for n in again)
    assert len(seen) == 1 + len(orthogonal_tensors(CFG)) and seen[-1][0] == seen[-1][1]
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
