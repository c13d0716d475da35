"""The device initialisation on a CPU (rwkvx/cu/init, rwkvx/device_init.py, docs/SPEC.md §2.4): the
twin's generator (rwkvx.oracle.init) against Philox's known answers and the normal / uniform laws, its
Cholesky QR, and the launch builders' op lists. tests/gpu/test_init.py holds the kernels to the twin."""
import math
import types

import numpy as np
import pytest

from rwkvx import Config, init_params, param_shapes
from rwkvx.cu import init
from rwkvx.oracle import init as twin
from rwkvx.cu.init.ops import CHOL_DIAG, TRSM_ROWS
from emulator import Memory, run
from rwkvx.cu._common import carve
from rwkvx.device_init import pass_ops, random_params, scratch_bytes, scratch_sizes
from rwkvx.params import (EMB_INIT_RANGE, ORTHOGONALITY_TOL, complete_params, householder_columns,
                          orthogonal_tensors, orthonormal_columns)
from rwkvx.presets import PRESETS, get_preset
from rwkvx.runtime import DevPtr, Gemm, Launch, Memset
from rwkvx.runtime.device import H200
from seeding import seeded_rng

CFG = Config(vocab_size=300, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=1)
KS_CRITICAL = 1.95          # sqrt(n) * D at the 0.1 % level of the Kolmogorov-Smirnov test


# Random123's published known answers for Philox-4x32-10: (counter, key, output)
@pytest.mark.parametrize("ctr, key, out", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(ctr, key, out):
    words = twin.philox(*([c] for c in ctr), *key)
    assert tuple(int(w[0]) for w in words) == out


def _ks(sample: np.ndarray, cdf) -> float:
    """sqrt(n) times the Kolmogorov-Smirnov distance of ``sample`` from the law with ``cdf``."""
    x = np.sort(sample)
    f = cdf(x)
    n = len(x)
    return math.sqrt(n) * max((np.arange(1, n + 1) / n - f).max(), (f - np.arange(n) / n).max())


_PHI = np.frompyfunc(lambda v: 0.5 * (1.0 + math.erf(v / math.sqrt(2.0))), 1, 1)


@pytest.mark.parametrize("seed, name", [(0, "rwkv.head.weight"), (12345, "rwkv.blocks.7.att.key.weight"),
                                        (2**64 - 1, "x")])
def test_normal_draws_are_standard_gaussians(seed, name):
    z = twin.normal(200_001, init.draw_keys(seed, name))
    assert z.dtype == np.float64 and z.shape == (200_001,)
    assert abs(z.mean()) < 4 / math.sqrt(len(z)) and abs(z.var() - 1) < 4 * math.sqrt(2 / len(z))
    assert _ks(z[:20_000], lambda x: _PHI(x).astype(np.float64)) < KS_CRITICAL
    # the pairs are independent: no correlation between a block's two values
    assert abs(np.corrcoef(z[:-1:2], z[1::2])[0, 1]) < 4 / math.sqrt(len(z) / 2)


def test_uniform_draws():
    lo, width = -EMB_INIT_RANGE, 2 * EMB_INIT_RANGE
    u = twin.uniform(100_003, init.draw_keys(9, "rwkv.emb.weight"), lo, width)
    assert u.dtype == np.float32 and u.min() >= lo and u.max() < lo + width
    assert _ks(u.astype(np.float64), lambda x: (x - lo) / width) < KS_CRITICAL
    assert abs(u.mean()) < 4 * width / math.sqrt(12 * len(u))


def test_box_muller_is_the_exact_formula_to_float64_rounding():
    """The fixed log / sin / cos polynomials: r cos(2 pi u2), r sin(2 pi u2), r = sqrt(-2 ln u1) to a few ulp."""
    w = twin.block_words(np.arange(50_000), init.draw_keys(3, "t"))
    z0, z1 = twin.box_muller(w)
    a = ((w[0] << np.uint64(32)) | w[1]) >> np.uint64(12)
    b = ((w[2] << np.uint64(32)) | w[3]) >> np.uint64(11)
    r = np.sqrt(-2 * np.log((2 * a.astype(np.float64) + 1) * 2.0 ** -53))
    angle = 2 * np.pi * b.astype(np.float64) * 2.0 ** -53
    np.testing.assert_allclose(z0, r * np.cos(angle), rtol=0, atol=4e-15 * r.max())
    np.testing.assert_allclose(z1, r * np.sin(angle), rtol=0, atol=4e-15 * r.max())
    x = np.linspace(2.0 ** -53, 1 - 2.0 ** -53, 10_001)
    np.testing.assert_allclose(twin.fixed_log(x), np.log(x), rtol=4e-16, atol=0)


def test_draws_depend_on_seed_name_and_index_only():
    keys = init.draw_keys(5, "a")
    z = twin.normal(1001, keys)
    assert np.array_equal(z, twin.normal(1001, init.draw_keys(5, "a")))
    assert np.array_equal(z[:300], twin.normal(300, keys))             # a prefix: the element index alone
    others = [twin.normal(1001, init.draw_keys(s, n)) for s, n in ((6, "a"), (5, "b"), (2**32 + 5, "a"))]
    assert all(abs(np.corrcoef(z, o)[0, 1]) < 0.2 for o in others)
    u = twin.uniform(1001, keys, 0.0, 1.0)
    assert np.array_equal(u[:7], twin.uniform(7, keys, 0.0, 1.0))
    # past the twin's first chunk of blocks, element 2j + 1 is still block j's second value
    j = 2 * twin._CHUNK + 1
    tail = twin.normal(2 * j + 2, keys)[-2:]
    assert np.array_equal(tail, np.concatenate(twin.box_muller(twin.block_words(np.array([j]), keys))))


def test_seed_range():
    assert init.seed_key(2**64 - 1) == (0xFFFFFFFF, 0xFFFFFFFF) and init.seed_key(2**32) == (0, 1)
    for bad in (-1, 2**64, 1.0, True):
        with pytest.raises(ValueError, match="2\\^64"):
            init.seed_key(bad)
    with pytest.raises(ValueError, match="2\\^64"):             # refused before any GPU is looked for
        init_params(CFG, 2**64, device="gpu")
    with pytest.raises(ValueError, match="cpu, gpu"):
        init_params(CFG, 0, device="cuda")


@pytest.mark.parametrize("preset", PRESETS)
def test_tensor_keys_are_distinct_on_the_presets(preset):
    names = list(param_shapes(Config(**get_preset(preset)["model"])))
    assert len({init.tensor_key(n) for n in names}) == len(names)


@pytest.mark.parametrize("shape", [(300, 64), (64, 64), (130, 129), (1000, 16)])
def test_twin_cholesky_qr_is_householder_qr(shape):
    """The device algorithm's Q (blocks of NB, a second pass when needed) is Householder QR's with R's
    diagonal positive, orthonormal in float64, and rounds to float32 with QᵀQ = I to 1e-6."""
    a = seeded_rng(shape[0] * 7 + shape[1]).standard_normal(shape)
    q = twin.orthonormal_columns(a)
    np.testing.assert_allclose(q, householder_columns(a), atol=1e-10)
    np.testing.assert_allclose(q.T @ q, np.eye(shape[1]), atol=ORTHOGONALITY_TOL)
    assert (np.diag(q.T @ a) > 0).all()                      # R = QᵀA: its diagonal positive
    q32 = q.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(q32.T @ q32, np.eye(shape[1]), atol=1e-6)


def test_twin_blocks_match_lapack():
    rng = seeded_rng(5)
    a = rng.standard_normal((400, 150))
    g = a.T @ a
    lower = twin.cholesky(g)
    np.testing.assert_allclose(lower, np.linalg.cholesky(g), rtol=0, atol=1e-12 * np.abs(lower).max())
    np.testing.assert_allclose(twin.solve(a, lower), a @ np.linalg.inv(lower).T, atol=1e-12)
    bad = g.copy()
    bad[100, 100] = -1.0                                      # not positive definite in the second block
    assert twin.cholesky(bad) is None


def test_twin_second_pass_and_fallback():
    rng = seeded_rng(11)
    u, v = householder_columns(rng.standard_normal((200, 40))), householder_columns(rng.standard_normal((40, 40)))
    ill = (u * np.logspace(0, -6, 40)) @ v.T                 # condition number 1e6: one pass is not enough
    q = twin.orthonormal_columns(ill)
    np.testing.assert_allclose(q.T @ q, np.eye(40), atol=ORTHOGONALITY_TOL)
    np.testing.assert_allclose(q, householder_columns(ill), atol=1e-6)
    singular = rng.standard_normal((50, 8))
    singular[:, 7] = 0.0                                      # no Cholesky factor: Householder QR of the draw
    np.testing.assert_array_equal(twin.orthonormal_columns(singular), householder_columns(singular))


def test_twin_params_have_the_initialisation_law():
    """init_params(device="gpu")'s values as the twin computes them: names, shapes, the closed-form
    tensors equal to the host path's, orthogonal tensors orthogonal with their gains, the embedding
    uniform; other seeds give other tensors."""
    params = complete_params(CFG, twin.random_params(CFG, 4))
    host = init_params(CFG, 4)
    assert list(params) == list(host)
    random = {"rwkv.emb.weight", *orthogonal_tensors(CFG)}
    for name, value in params.items():
        assert value.shape == host[name].shape and value.dtype == np.float32
        if name not in random:
            np.testing.assert_array_equal(value, host[name])
    for name, (shape, gain) in orthogonal_tensors(CFG).items():
        w = params[name].astype(np.float64) / gain
        gram = w @ w.T if shape[0] <= shape[1] else w.T @ w
        np.testing.assert_allclose(gram, np.eye(len(gram)), atol=1e-5)
        assert not np.array_equal(params[name], host[name])
    emb = params["rwkv.emb.weight"]
    assert emb.min() >= -EMB_INIT_RANGE and emb.max() < EMB_INIT_RANGE
    other = twin.random_params(CFG, 5)
    assert not np.array_equal(other["rwkv.head.weight"], params["rwkv.head.weight"])


def test_twin_orthogonal_matches_the_host_algorithm_on_the_same_draw():
    a = twin.normal(256 * 64, init.draw_keys(1, "w")).reshape(256, 64)
    q = twin.orthogonal(1, "w", (64, 256), 0.1)             # wide: the transposed Q
    np.testing.assert_allclose(q, (0.1 * orthonormal_columns(a)).T.astype(np.float32), atol=1e-7)


def _emulated_scratch():
    """CPU memory (tests/emulator.py) holding random_params' scratch for a C = 192 model (draws up to
    300 x 192), and its carved buffers."""
    cfg, mem, base = Config(vocab_size=300, n_embd=192, head_size=16, n_rwkv_layer=2), Memory(), 1 << 30
    mem.add(base, scratch_bytes(cfg))
    return mem, carve(base, scratch_sizes(cfg))


@pytest.mark.parametrize("shape, gain", [((300, 64), 0.5), ((130, 129), 1.0), ((64, 192), 0.1)])
def test_the_op_lists_compute_the_twins_tensor(shape, gain):
    """The GPU path's op lists (the draw, pass_ops, the store), run by tests/emulator.py on the CPU, give
    the twin's orthogonal tensor: which buffer each op reads and writes, offsets, leading dimensions,
    transposes and order (the kernels themselves: tests/gpu/test_init.py)."""
    mem, buf = _emulated_scratch()
    m, n = max(shape), min(shape)
    run(mem, init.normal(buf["a"], m * n, 5, "t", H200))
    run(mem, pass_ops(buf, m, n, H200, first=True))
    assert mem.read(buf["info"], 1, elem="i32")[0] == 0
    assert mem.read(buf["deviation"], 1, elem="f64")[0] <= ORTHOGONALITY_TOL      # one pass is enough here
    run(mem, init.store(buf["out"], buf["a"], m, n, gain, shape[0] < shape[1], H200))
    got, want = mem.read(buf["out"], m * n, shape), twin.orthogonal(5, "t", shape, gain).astype(np.float64)
    assert (np.abs(got - want) <= np.spacing(np.abs(want).astype(np.float32))).all()   # float32 rounding


def test_the_second_pass_op_list_reorthogonalises():
    """An ill-conditioned draw (condition number 1e6): the first pass leaves QᵀQ further than
    ORTHOGONALITY_TOL from I, the second pass (from the Gram matrix the first left) brings it back."""
    rng = seeded_rng(12)
    u, v = householder_columns(rng.standard_normal((200, 100))), householder_columns(rng.standard_normal((100, 100)))
    ill = (u * np.logspace(0, -6, 100)) @ v.T
    mem, buf = _emulated_scratch()
    mem.write(buf["a"], ill, "f64")
    run(mem, pass_ops(buf, 200, 100, H200, first=True))
    assert mem.read(buf["deviation"], 1, elem="f64")[0] > ORTHOGONALITY_TOL
    run(mem, pass_ops(buf, 200, 100, H200, first=False))
    assert mem.read(buf["info"], 1, elem="i32")[0] == 0
    q = mem.read(buf["a"], 200 * 100, (200, 100), elem="f64")
    np.testing.assert_allclose(q.T @ q, np.eye(100), atol=ORTHOGONALITY_TOL)
    np.testing.assert_allclose(q, twin.orthonormal_columns(ill), atol=1e-9)


def test_the_first_pass_reports_a_gram_matrix_that_is_not_positive_definite():
    mem, buf = _emulated_scratch()
    a = seeded_rng(8).standard_normal((200, 100))
    a[:, 70] = 0.0
    mem.write(buf["a"], a, "f64")
    run(mem, pass_ops(buf, 200, 100, H200, first=True))
    assert mem.read(buf["info"], 1, elem="i32")[0] == 71              # the failing column + 1


class _EmulatedDevice:
    """rwkvx.runtime.Device's part that random_params uses, with its memory and plans on the CPU
    (tests/emulator.py); _Plan stands in for rwkvx._core.Plan."""
    info = H200

    def __init__(self):
        self.mem, self.plans = Memory(), 0
        self.cublas = types.SimpleNamespace(prepare=lambda gemms, scratch=None, tune=True: [])

    def alloc(self, nbytes: int):
        base = 1 << 40
        self.mem.add(base, nbytes)
        return types.SimpleNamespace(ptr=base, close=lambda: None)

    def download(self, ptr, shape, dtype):
        elem = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.int32): "i32"}[np.dtype(dtype)]
        return self.mem.array(int(ptr), elem, int(np.prod(shape))).reshape(shape).copy()

    def upload(self, ptr, array):
        self.mem.write(int(ptr), array, "f64")


class _Plan:
    def __init__(self, dev, ops):
        self.dev, self.ops = dev, ops
        dev.plans += 1

    def run(self):
        run(self.dev.mem, self.ops)


def test_random_params_on_an_emulated_device_are_the_twins(monkeypatch):
    """The whole GPU path (scratch, plans built once per shape, the second pass when the deviation asks
    for it, the store, the embedding, progress) on the emulated device gives the twin's tensors."""
    import rwkvx._core
    monkeypatch.setattr(rwkvx._core, "Plan", _Plan)
    dev, seen = _EmulatedDevice(), []
    got = random_params(CFG, 4, dev, progress=lambda done, total: seen.append((done, total)))
    want = twin.random_params(CFG, 4)
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].dtype == np.float32
        assert (np.abs(got[name] - value) <= np.spacing(np.abs(value))).all(), name
    assert np.array_equal(got["rwkv.emb.weight"], want["rwkv.emb.weight"])
    assert len(seen) == len(want) and seen[-1][0] == seen[-1][1] == sum(v.size for v in want.values())
    # one plan for the embedding, a draw and a store per orthogonal tensor, the passes once per shape
    shapes, tensors = {(max(s), min(s)) for s, _ in orthogonal_tensors(CFG).values()}, len(want) - 1
    assert 1 + 2 * tensors + len(shapes) <= dev.plans <= 1 + 2 * tensors + 2 * len(shapes)


def test_cholesky_ops():
    g, info = DevPtr(1 << 20, "f64"), DevPtr(1 << 16, "i32")
    ops = init.cholesky(g, 150, info)                         # blocks 64, 64, 22
    kinds = [type(op).__name__ if not isinstance(op, Launch) else op.name for op in ops]
    assert kinds == ["chol_diag", "trsm_rows", "Gemm"] * 2 + ["chol_diag"]
    assert all(op.precision.compute == "fp64" and op.alpha == -1.0 and op.beta == 1.0
               for op in ops if isinstance(op, Gemm))
    diag = [op for op in ops if isinstance(op, Launch) and op.name == CHOL_DIAG.name]
    assert [dict(zip((n for n, _ in CHOL_DIAG.params), (v for _, v in op.args)))["jb"] for op in diag] == [64, 64, 22]
    solve = init.solve(DevPtr(1 << 24, "f64"), 1000, 150, g)
    assert [type(op).__name__ if not isinstance(op, Launch) else op.name for op in solve] == \
        ["trsm_rows", "Gemm", "trsm_rows", "Gemm", "trsm_rows"]
    assert all(op.grid[0] * op.block[0] >= 1000 for op in solve if isinstance(op, Launch))
    assert isinstance(init.deviation(g, 150, DevPtr(8 << 10, "f64"), H200)[0], Memset)


def test_builders_refuse_bad_sizes_and_buffers():
    a, g = DevPtr(1 << 20, "f64"), DevPtr(1 << 24, "f64")
    with pytest.raises(ValueError, match="n <= m"):
        init.gram(a, 10, 20, g)
    with pytest.raises(ValueError, match="positive"):
        init.normal(a, 0, 1, "x", H200)
    with pytest.raises(TypeError, match="f64"):
        init.normal(DevPtr(1 << 20, "f32"), 10, 1, "x", H200)
    with pytest.raises(TypeError, match="f64"):
        init.cholesky(DevPtr(1 << 20, "f32"), 10, DevPtr(0x100, "i32"))
    assert TRSM_ROWS.file.constants["CQ_NB"] == init.NB


def test_scratch_of_the_large_presets():
    """The scratch docs/SPEC.md §2.4 and rwkvx/device_init.py state: A and the staging buffer of the head,
    the Gram matrix of C x C."""
    gib = {p: scratch_bytes(Config(**get_preset(p)["model"])) / 2**30 for p in ("rwkv7-2.9b", "rwkv7-7.2b")}
    assert round(gib["rwkv7-2.9b"], 1) == 1.9 and round(gib["rwkv7-7.2b"], 1) == 3.1


def test_a_new_run_draws_on_its_backend():
    """python -m rwkvx train: a new full run on the GPU draws there; on the CPU, and a tuning run's fresh
    frozen model on either backend, draw on the host (so a resumed tuning run rebuilds the same model)."""
    from rwkvx.training.setup import _fresh_params
    host = init_params(CFG, 6)
    for kind, tune in (("cpu", "full"), ("gpu", "lora"), ("gpu", "state")):
        params = _fresh_params(CFG, 6, kind, tune, show=False)
        assert all(np.array_equal(params[n], host[n]) for n in host)
