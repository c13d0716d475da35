"""The chunked WKV7 algorithm of rwkvx/cu/wkv7/chunked.cu, as its numpy model rwkvx/cu/wkv7/chunked_model.py,
against the float64 oracle: exact in float64 (<= 1e-10), and in float32 with the kernels' tf32 operand
rounding within the GPU tests' limits (the tf32 limit 5e-3, with a margin: <= 2e-3), for T not a multiple
of the chunk (1, 15, 17, 40), decays near both ends of their range, head sizes 32 and 64.

"tf32" rounds the chunk operators' products as the kernels do with fp32 inputs (3xTF32), "tf32_operators"
as with bf16 inputs (one tf32 pass, rwkvx/cu/wkv7/ops.py SPLIT_OPERATORS). "3xtf32" is the design an fp32
path on the chunked kernels would need: every operand of every product as a
tf32 hi + lo pair (records included; today's records are single tf32 values and S0 enters one pass). In
float32 it stays within the fp32 kernel limit 1e-5 (measured ~3e-7 at T = 256..4096, about the float32
algorithm's own 1-2e-7), where single tf32 operands give 1e-4 to 5e-4.

The segmented scan (the state passes cut into segments, walked from 0 and from the identity, their
entering states carried across) is held to the same limits against the one walk and the oracle."""
import numpy as np
import pytest

from rwkvx.config import DECAY_SCALE
from rwkvx.cu.wkv7 import chunked_model as CM
from rwkvx.cu.wkv7.ops import segment_layout
from rwkvx.oracle import rel_err, wkv7_backward, wkv7_forward
from rwkvx.runtime.dtypes import round_tf32

from seeding import seeded_rng

GRADS = ("dr", "dw", "dk", "dv", "da", "db")


def _inputs(T, N, rng, shift):
    """One (sequence, head) as the model's [1, T, 1, N] tensors: the GPU tests' input distribution."""
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))     # noqa: E731
    shp = (1, T, 1, N)
    kk = rng.standard_normal(shp)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    w = np.exp(-DECAY_SCALE * sig(rng.standard_normal(shp) + shift))
    x = dict(r=0.5 * rng.standard_normal(shp), w=w, k=0.5 * rng.standard_normal(shp),
             v=0.5 * rng.standard_normal(shp), a=-kk, b=kk * sig(rng.standard_normal(shp)))
    return x, rng.standard_normal(shp)


CASES = [(1, 64, 0.0), (15, 64, 0.0), (17, 32, 0.0), (40, 64, -4.0), (40, 64, 8.0), (200, 64, 0.0),
         (100, 32, 8.0)]


# (state products' operand rounding, chunk operators' operand rounding, arithmetic, limit)
PRECISIONS = {"f64": (CM.identity, CM.identity, np.float64, 1e-10),
              "tf32": (round_tf32, CM.split3, np.float32, 2e-3),             # fp32 inputs: operators split
              "tf32_operators": (round_tf32, round_tf32, np.float32, 2e-3),  # bf16 inputs: one pass
              "3xtf32": (CM.split3, CM.split3, np.float32, 1e-5)}


@pytest.mark.parametrize("prec", list(PRECISIONS))
@pytest.mark.parametrize("T,N,shift", CASES, ids=[f"T{t}-N{n}-s{s:g}" for t, n, s in CASES])
def test_chunked_model_matches_oracle(T, N, shift, prec):
    x, dy = _inputs(T, N, seeded_rng(T * 1000 + N * 10 + int(shift) + 8), shift)   # one seed per case (shift >= -8)
    args = [x[n] for n in "rwkvab"]
    want_y, want_g = wkv7_forward(*args), wkv7_backward(*args, dy)
    one = [z[0, :, 0] for z in args]
    rnd, op, dt, tol = PRECISIONS[prec]
    y, sa, _ = CM.forward(*one, rnd=rnd, dt=dt, op=op)
    assert rel_err(y, want_y[0, :, 0]) <= tol
    for name, got, want in zip(GRADS, CM.backward(*one, dy[0, :, 0], rnd=rnd, dt=dt, op=op), want_g):
        if name == "dw" and T == 1:
            assert not got.any(), "dw of the first token must be exactly 0 (S_{-1} = 0)"
            continue
        assert rel_err(got, want[0, :, 0]) <= tol, name


@pytest.mark.parametrize("prec", list(PRECISIONS))
@pytest.mark.parametrize("T,N,shift", CASES, ids=[f"T{t}-N{n}-s{s:g}" for t, n, s in CASES])
def test_chunked_model_from_an_initial_state(T, N, shift, prec):
    """From an initial state s0 (chunk 0's S0), y, every gradient and ds0 (the dS left after chunk 0)
    against the oracle, within the same limits."""
    rng = seeded_rng(T * 1000 + N * 10 + int(shift) + 9)
    x, dy = _inputs(T, N, rng, shift)
    s0 = 0.5 * rng.standard_normal((1, 1, N, N))
    args = [x[n] for n in "rwkvab"]
    want_y, want_g = wkv7_forward(*args, state=s0), wkv7_backward(*args, dy, state=s0)
    one = [z[0, :, 0] for z in args]
    rnd, op, dt, tol = PRECISIONS[prec]
    y, _, S0 = CM.forward(*one, rnd=rnd, dt=dt, s0=s0[0, 0], op=op)
    assert np.array_equal(S0[0], s0[0, 0].astype(dt))
    assert rel_err(y, want_y[0, :, 0]) <= tol
    got = CM.backward(*one, dy[0, :, 0], rnd=rnd, dt=dt, s0=s0[0, 0], op=op)
    for name, g, want in zip(GRADS, got, want_g):
        assert rel_err(g, want[0, :, 0]) <= tol, name
    assert rel_err(got[-1], want_g[-1][0, 0]) <= tol, "ds0"


# draws (seeds of _inputs, then s0) on which r.b, r.k or dy.v cancel: the Gram diagonal of 3xTF32 products of
# rt, bh (r, b scaled by cw, 1/cw) put da 3.2e-4, dk 3.9e-4, dv 7.3e-5 from the oracle
CANCELLING_SEEDS = {"da": 446, "dk": 1068, "dv": 844}


@pytest.mark.parametrize("grad", list(CANCELLING_SEEDS))
def test_chunked_exact_t1_gradients_at_cancelling_dots(grad):
    """T = 1 from s0: dv, da, dk are the vectors dy, s0^T dy, r scaled by r.k, r.b, dy.v alone, so each one's
    relative error is that dot's. chunked_exact's compensated diagonals (row_dots) keep all three within the
    fp32 kernel limit on float32 inputs where the terms of one of them cancel."""
    rng = seeded_rng(CANCELLING_SEEDS[grad])
    x, dy = _inputs(1, 64, rng, 0.0)
    s0 = 0.5 * rng.standard_normal((1, 1, 64, 64))
    f32 = lambda z: z.astype(np.float32).astype(np.float64)     # noqa: E731 - the inputs a kernel reads
    args, dy, s0 = [f32(x[n]) for n in "rwkvab"], f32(dy), f32(s0)
    r, k, v, b = (args["rwkvab".index(n)][0, 0, 0] for n in "rkvb")
    u, w = {"da": (r, b), "dk": (dy[0, 0, 0], v), "dv": (r, k)}[grad]
    assert abs(u @ w) < 1e-2 * np.abs(u * w).sum(), "the draw no longer cancels: pick a new seed"
    want = wkv7_backward(*args, dy, state=s0)
    rnd, op, dt, tol = PRECISIONS["3xtf32"]
    got = CM.backward(*(z[0, :, 0] for z in args), dy[0, :, 0], rnd=rnd, dt=dt, s0=s0[0, 0], op=op)
    for name, g, w in zip(GRADS, got, want):
        assert rel_err(g, w[0, :, 0]) <= tol, name


def test_chunked_model_sa_is_the_recurrence():
    """U (the rows the forward saves as sa) is S_{t-1} a_t of the token recurrence."""
    T, N = 37, 32
    x, _ = _inputs(T, N, seeded_rng(T), 0.0)
    r, w, k, v, a, b = (x[n][0, :, 0] for n in "rwkvab")
    _, sa, S0 = CM.forward(r, w, k, v, a, b)
    S = np.zeros((N, N))
    for t in range(T):
        if t % CM.L == 0:
            assert np.allclose(S0[t // CM.L], S, rtol=0, atol=1e-12)
        np.testing.assert_allclose(sa[t], S @ a[t], rtol=0, atol=1e-12)
        S = S * w[t] + np.outer(S @ a[t], b[t]) + np.outer(v[t], k[t])


def test_tf32_rounding():
    """cvt.rna.tf32.f32: 10 mantissa bits kept, nearest, ties away from zero."""
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)
    x = np.array([1 + 2.0 ** -11, -(1 + 2.0 ** -11), 1 + 2.0 ** -12, 1 + 3 * 2.0 ** -11], np.float32)
    np.testing.assert_array_equal(round_tf32(x), np.array([one + ulp, -(one + ulp), one, one + 2 * ulp], np.float32))


SEGMENT_CASES = [(40, 64, 0.0, 2), (200, 64, -4.0, 3), (200, 32, 8.0, 5), (1000, 64, 0.0, 7), (1000, 64, -4.0, 64),
                 (333, 32, 8.0, 4)]


@pytest.mark.parametrize("with_s0", [False, True], ids=["zero", "s0"])
@pytest.mark.parametrize("prec", list(PRECISIONS))
@pytest.mark.parametrize("T,N,shift,S", SEGMENT_CASES, ids=[f"T{t}-N{n}-s{s:g}-S{g}" for t, n, s, g in SEGMENT_CASES])
def test_segmented_scan_matches_unsegmented(T, N, shift, S, prec, with_s0):
    """The segmented scan (segments of m = ceil(n_c / S) chunks, the last one shorter: T is no multiple of
    them; S = 64 at T = 1000: segments of one chunk) against the one-segment walk: the chunk-entering
    states the backward reads, y, sa, every gradient and ds0 within float rounding of the precision (f64:
    1e-10, and in float32 the limits of the oracle test: the transitions take the same roundings as the
    states), and both against the oracle within those limits."""
    rng = seeded_rng(T * 1000 + N * 10 + int(shift) + 8 + 100 * S)
    x, dy = _inputs(T, N, rng, shift)
    s0 = 0.5 * rng.standard_normal((N, N)) if with_s0 else None
    one = [x[n][0, :, 0] for n in "rwkvab"]
    rnd, op, dt, tol = PRECISIONS[prec]
    m, used = segment_layout(T, S)
    assert used > 1 and T % (m * CM.L) != 0
    ref_f = CM.forward(*one, rnd=rnd, dt=dt, s0=s0, op=op)
    got_f = CM.forward(*one, rnd=rnd, dt=dt, s0=s0, segments=S, op=op)
    for name, ref, got in zip(("y", "sa", "S0"), ref_f, got_f):
        assert rel_err(got, ref) <= tol, name
    ref_b = CM.backward(*one, dy[0, :, 0], rnd=rnd, dt=dt, s0=s0, op=op)
    got_b = CM.backward(*one, dy[0, :, 0], rnd=rnd, dt=dt, s0=s0, segments=S, op=op)
    want_g = wkv7_backward(*(x[n] for n in "rwkvab"), dy, state=None if s0 is None else s0[None, None])
    for name, ref, got, want in zip(GRADS + ("ds0",), ref_b, got_b, want_g):
        assert rel_err(got, ref) <= tol, name
        assert rel_err(got, want[0, :, 0] if name != "ds0" else want[0, 0]) <= tol, name

