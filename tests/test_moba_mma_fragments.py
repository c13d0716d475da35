"""CPU check of the register bookkeeping of moba.cu's tensor-core helpers (mma_xyt, mma_py, mfrag_row /
mfrag_col, the bf16 mma16 and the tf32 pair of k8 steps) against the PTX ISA's fragment layouts.

``mma_bf16`` / ``mma_tf32`` implement one warp-wide mma.sync exactly as the PTX ISA defines its
fragments ("Matrix Fragments for mma.m16n8k16" with .bf16, "mma.m16n8k8" with .tf32: which lane holds
which element of A, B, C). The helpers below transliterate what each lane of moba.cu loads into its
registers. Their products must equal plain matrix products: X Y^T for mma_xyt, P Yt^T with P given as
C fragments for mma_py (the C -> A reuse of the probabilities without shuffles).
"""
import numpy as np
import pytest

LANES = 32


def _gt(lane):
    return lane >> 2, lane & 3


def _c_pos(lane, i):
    """C/D fragment element i of a lane: (row, col) in the 16 x 8 tile."""
    g, t = _gt(lane)
    return g + 8 * (i >> 1), 2 * t + (i & 1)


def mma_bf16(c, a, b):
    """mma.m16n8k16 .bf16: a[lane][4 regs][2 halves], b[lane][2][2], c[lane][4] -> d (PTX ISA layouts)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(LANES):
        g, t = _gt(lane)
        for reg in range(4):
            for half in range(2):
                A[g + 8 * (reg & 1), 2 * t + half + 8 * (reg >> 1)] = a[lane][reg][half]
        for reg in range(2):
            for half in range(2):
                B[2 * t + half + 8 * reg, g] = b[lane][reg][half]
    D = A @ B
    return [[c[lane][i] + D[_c_pos(lane, i)] for i in range(4)] for lane in range(LANES)]


def mma_tf32(c, a, b):
    """mma.m16n8k8 .tf32: a[lane][4], b[lane][2], c[lane][4] -> d (PTX ISA layouts)."""
    A, B = np.zeros((16, 8)), np.zeros((8, 8))
    for lane in range(LANES):
        g, t = _gt(lane)
        A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = a[lane]
        B[t, g], B[t + 4, g] = b[lane]
    D = A @ B
    return [[c[lane][i] + D[_c_pos(lane, i)] for i in range(4)] for lane in range(LANES)]


def mma16(kind, c, a, b):
    """moba.cu's mma16: c += A (16x16) B (16x8) from per-lane element pairs a[4], b[2]."""
    if kind == "bf16":
        return mma_bf16(c, a, b)
    # two k8 steps: {a_lo.x, a_hi.x, a_lo.y, a_hi.y} x {b.x, b.y}
    for lo, hi, bb in ((0, 1, 0), (2, 3, 1)):
        c = mma_tf32(c, [[a[ln][lo][0], a[ln][hi][0], a[ln][lo][1], a[ln][hi][1]] for ln in range(LANES)],
                     [[b[ln][bb][0], b[ln][bb][1]] for ln in range(LANES)])
    return c


def pair(M, row, col):
    return (M[row, col], M[row, col + 1])


def mma_xyt(kind, X, r0, Y, NT, KD):
    """moba.cu's mma_xyt: c[nt] = X[r0:r0+16, :KD] Y[8nt:8nt+8, :KD]^T, per-lane C fragments."""
    c = [[[0.0] * 4 for _ in range(LANES)] for _ in range(NT)]
    for k0 in range(0, KD, 16):
        a = []
        for lane in range(LANES):
            g, t2 = lane >> 2, 2 * (lane & 3)
            a.append([pair(X, r0 + g, k0 + t2), pair(X, r0 + g + 8, k0 + t2),
                      pair(X, r0 + g, k0 + 8 + t2), pair(X, r0 + g + 8, k0 + 8 + t2)])
        for nt in range(NT):
            b = [[pair(Y, 8 * nt + (ln >> 2), k0 + 2 * (ln & 3)), pair(Y, 8 * nt + (ln >> 2), k0 + 8 + 2 * (ln & 3))]
                 for ln in range(LANES)]
            c[nt] = mma16(kind, c[nt], a, b)
    return c


def mma_py(kind, p, Yt, MNT, KD):
    """moba.cu's mma_py: o[nt] = P Yt[8nt:8nt+8, :KD]^T with P (16 x KD) given as C fragments p[KD/8]."""
    o = [[[0.0] * 4 for _ in range(LANES)] for _ in range(MNT)]
    for ks in range(KD // 16):
        a = [[(p[2 * ks][ln][0], p[2 * ks][ln][1]), (p[2 * ks][ln][2], p[2 * ks][ln][3]),
              (p[2 * ks + 1][ln][0], p[2 * ks + 1][ln][1]), (p[2 * ks + 1][ln][2], p[2 * ks + 1][ln][3])]
             for ln in range(LANES)]
        for nt in range(MNT):
            b = [[pair(Yt, 8 * nt + (ln >> 2), 16 * ks + 2 * (ln & 3)),
                  pair(Yt, 8 * nt + (ln >> 2), 16 * ks + 8 + 2 * (ln & 3))] for ln in range(LANES)]
            o[nt] = mma16(kind, o[nt], a, b)
    return o


def gather(c, rows, cols):
    """The matrix [16, 8 * NT] held by C fragments c[nt] (mfrag_row / mfrag_col of moba.cu)."""
    M = np.full((rows, cols), np.nan)
    for nt, frag in enumerate(c):
        for lane in range(LANES):
            for e in range(4):
                r, col = _c_pos(lane, e)
                M[r, 8 * nt + col] = frag[lane][e]
    return M


@pytest.mark.parametrize("kind", ["bf16", "tf32"])
@pytest.mark.parametrize("HS", [32, 64])
def test_score_and_value_products(kind, HS):
    rng = np.random.default_rng(7)
    keys, r0 = 32, 16
    X, Y, V = rng.standard_normal((48, HS)), rng.standard_normal((keys, HS)), rng.standard_normal((keys, HS))
    s = mma_xyt(kind, X, r0, Y, keys // 8, HS)
    S = gather(s, 16, keys)
    np.testing.assert_allclose(S, X[r0:r0 + 16] @ Y.T, rtol=1e-12, atol=1e-12)
    # the probabilities stay in their C fragments for the second product
    o = mma_py(kind, s, np.ascontiguousarray(V.T), HS // 8, keys)
    np.testing.assert_allclose(gather(o, 16, HS), S @ V, rtol=1e-12, atol=1e-10)


def test_a_wrong_layout_is_caught():
    """The check can fail: swapping the two k halves of the B fragment breaks the product."""
    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((16, 16)), rng.standard_normal((8, 16))
    a = [[pair(X, ln >> 2, 2 * (ln & 3)), pair(X, (ln >> 2) + 8, 2 * (ln & 3)),
          pair(X, ln >> 2, 8 + 2 * (ln & 3)), pair(X, (ln >> 2) + 8, 8 + 2 * (ln & 3))] for ln in range(LANES)]
    b = [[pair(Y, ln >> 2, 8 + 2 * (ln & 3)), pair(Y, ln >> 2, 2 * (ln & 3))] for ln in range(LANES)]
    c = mma16("bf16", [[0.0] * 4 for _ in range(LANES)], a, b)
    assert not np.allclose(gather([c], 16, 8), X @ Y.T)
