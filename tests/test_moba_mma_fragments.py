"""CPU check of the register bookkeeping of mma.cu's tensor-core helpers against the PTX ISA.

``mma_bf16`` / ``mma_tf32`` implement one warp-wide mma.sync exactly as the PTX ISA defines its
fragments ("Matrix Fragments for mma.m16n8k16" with .bf16, "mma.m16n8k8" with .tf32: which lane holds
which element of A, B, C); ``ldmatrix_x4`` implements ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16
("Warp-level matrix load instruction: ldmatrix": lane 8i + r gives the address of row r of matrix i,
register i of lane l receives row l/4, elements 2(l%4), 2(l%4)+1 of matrix i, or with .trans the matrix
transposed). The functions below transliterate mma.cu's lane arithmetic (ldsm_row16 / ldsm_col16 /
ldsm_nrow / ldsm_ncol, mload_a / mload_b / mload_bt, mma_xyt, mma_pz, mstage_row / mstage_col) over a
flat shared-memory image whose row padding holds NaN, so an address off by one element shows. Their
products must equal plain matrix products: X Y^T for mma_xyt, P Z for mma_pz with P given as C fragments
(the C -> A reuse of the probabilities without shuffles); their shared-memory reads must be free of bank
conflicts with the row strides of rwkvx/cu/moba/ops.py.
"""
import numpy as np
import pytest

from rwkvx.cu import moba
from rwkvx.runtime.dtypes import ELEM_BYTES

from seeding import seeded_rng

LANES = 32
XTYPE = {"bf16": "bf16", "tf32": "f32"}


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
    """mma.cu's mma16: c += A (16x16) B (16x8) from per-lane pairs a[4], b[2]."""
    if kind == "bf16":
        return mma_bf16(c, a, b)
    # two k8 steps: {a_lo.x, a_hi.x, a_lo.y, a_hi.y} x {b.x, b.y}
    for lo, hi, bb in ((0, 1, 0), (2, 3, 1)):
        c = mma_tf32(c, [[a[ln][lo][0], a[ln][hi][0], a[ln][lo][1], a[ln][hi][1]] for ln in range(LANES)],
                     [[b[ln][bb][0], b[ln][bb][1]] for ln in range(LANES)])
    return c


def ldmatrix_x4(smem, addrs, trans):
    """ldmatrix .x4 .b16 over a flat element image: addrs[lane] = element address of one 8-element row."""
    regs = [[None] * 4 for _ in range(LANES)]
    for i in range(4):
        M = np.array([smem[addrs[8 * i + r]: addrs[8 * i + r] + 8] for r in range(8)])
        for lane in range(LANES):
            g, t = _gt(lane)
            regs[lane][i] = (M[2 * t, g], M[2 * t + 1, g]) if trans else (M[g, 2 * t], M[g, 2 * t + 1])
    return regs


# mma.cu's lane -> row / column offsets of the ldmatrix addresses
def ldsm_row16(lane):
    return lane & 15


def ldsm_col16(lane):
    return 8 * (lane >> 4)


def ldsm_nrow(lane):
    return (lane & 7) + 8 * (lane >> 4)


def ldsm_ncol(lane):
    return 8 * ((lane >> 3) & 1)


class Smem:
    """A flat shared-memory image (elements) that records every warp-wide read for the bank check."""

    def __init__(self, data, esize):
        self.data, self.esize, self.reads = data, esize, []

    def ldsm(self, addrs, trans):
        self.reads.append(("ldsm", addrs))
        return ldmatrix_x4(self.data, addrs, trans)

    def lds(self, addrs):
        self.reads.append(("lds", addrs))
        return [self.data[a] for a in addrs]


def _pairs(first, second):
    return [(x, y) for x, y in zip(first, second)]


def _tf32_tiles(sm, starts, pair, half):
    """b[lane][j] = [(p, p + pair), (p + half, p + half + pair)] at p = starts[j][lane] (tf32 B loads)."""
    out = [[None, None] for _ in range(LANES)]
    for j, p in enumerate(starts):
        lo = _pairs(sm.lds(p), sm.lds([q + pair for q in p]))
        hi = _pairs(sm.lds([q + half for q in p]), sm.lds([q + half + pair for q in p]))
        for ln in range(LANES):
            out[ln][j] = [lo[ln], hi[ln]]
    return out


def mload_a(kind, sm, X, ld, r0, k0):
    """a[lane][4] = X[r0 .. r0+16)[k0 .. k0+16) (X: element offset of a [rows][ld] tile)."""
    if kind == "bf16":
        return sm.ldsm([X + (r0 + ldsm_row16(ln)) * ld + k0 + ldsm_col16(ln) for ln in range(LANES)], False)
    p = [X + (r0 + (ln >> 2)) * ld + k0 + (ln & 3) for ln in range(LANES)]
    regs = [_pairs(sm.lds([q + d for q in p]), sm.lds([q + d + 4 for q in p])) for d in (0, 8 * ld, 8, 8 * ld + 8)]
    return [[regs[i][ln] for i in range(4)] for ln in range(LANES)]


def mload_b(kind, sm, Y, ld, n0, k0):
    """b[lane][j][2]: the B operand (k k0 .. k0+16, col n) of n-tile j from Y rows n0 + 8j + n."""
    if kind == "bf16":
        r = sm.ldsm([Y + (n0 + ldsm_nrow(ln)) * ld + k0 + ldsm_ncol(ln) for ln in range(LANES)], False)
        return [[[r[ln][0], r[ln][1]], [r[ln][2], r[ln][3]]] for ln in range(LANES)]
    return _tf32_tiles(sm, [[Y + (n0 + 8 * j + (ln >> 2)) * ld + k0 + (ln & 3) for ln in range(LANES)]
                            for j in range(2)], 4, 8)


def mload_bt(kind, sm, Z, ld, k0, n0):
    """b[lane][j][2]: the B operand (k rows k0 .. k0+16, col n0 + 8j + n) from Z [k][ld], n contiguous."""
    if kind == "bf16":
        r = sm.ldsm([Z + (k0 + ldsm_row16(ln)) * ld + n0 + ldsm_col16(ln) for ln in range(LANES)], True)
        return [[[r[ln][0], r[ln][1]], [r[ln][2], r[ln][3]]] for ln in range(LANES)]
    return _tf32_tiles(sm, [[Z + (k0 + 2 * (ln & 3)) * ld + n0 + 8 * j + (ln >> 2) for ln in range(LANES)]
                            for j in range(2)], ld, 8 * ld)


def mma_xyt(kind, sm, X, r0, Y, ld, NT, KD, MT=1):
    """mma.cu's mma_xyt: c[m][nt] = X[r0+16m : r0+16m+16, :KD] Y[8nt:8nt+8, :KD]^T, per-lane C fragments;
    each B fragment loaded once for the MT row tiles."""
    c = [[[[0.0] * 4 for _ in range(LANES)] for _ in range(NT)] for _ in range(MT)]
    for k0 in range(0, KD, 16):
        a = [mload_a(kind, sm, X, ld, r0 + 16 * m, k0) for m in range(MT)]
        for nt in range(0, NT, 2):
            b = mload_b(kind, sm, Y, ld, 8 * nt, k0)
            for m in range(MT):
                for j in range(2):
                    c[m][nt + j] = mma16(kind, c[m][nt + j], a[m], [b[ln][j] for ln in range(LANES)])
    return c


def mma_pz(kind, p, sm, Z, ld, MNT, KD):
    """mma.cu's mma_pz: o[m][nt] = P_m Z[:KD, 8nt:8nt+8] with P_m (16 x KD) given as C fragments p[m][KD/8]."""
    MT = len(p)
    o = [[[[0.0] * 4 for _ in range(LANES)] for _ in range(MNT)] for _ in range(MT)]
    for ks in range(KD // 16):
        a = [[[(q[2 * ks][ln][0], q[2 * ks][ln][1]), (q[2 * ks][ln][2], q[2 * ks][ln][3]),
               (q[2 * ks + 1][ln][0], q[2 * ks + 1][ln][1]), (q[2 * ks + 1][ln][2], q[2 * ks + 1][ln][3])]
              for ln in range(LANES)] for q in p]
        for nt in range(0, MNT, 2):
            b = mload_bt(kind, sm, Z, ld, 16 * ks, 8 * nt)
            for m in range(MT):
                for j in range(2):
                    o[m][nt + j] = mma16(kind, o[m][nt + j], a[m], [b[ln][j] for ln in range(LANES)])
    return o


def gather(c, rows, cols):
    """The matrix [16, 8 * NT] held by C fragments c[nt] (acc_m / mfrag_col of mma.cu)."""
    M = np.full((rows, cols), np.nan)
    for nt, frag in enumerate(c):
        for lane in range(LANES):
            for e in range(4):
                r, col = _c_pos(lane, e)
                M[r, 8 * nt + col] = frag[lane][e]
    return M


def image(tiles, N, ld):
    """Tiles [rows][N] laid out one after another with row stride ld; the padding is NaN."""
    offsets, flat = [], []
    for t in tiles:
        offsets.append(sum(len(f) for f in flat))
        padded = np.full((t.shape[0], ld), np.nan)
        padded[:, :N] = t
        flat.append(padded.ravel())
    return np.concatenate(flat), offsets


def bank_conflicts(sm):
    """Reads that need more than one shared-memory wavefront (32 banks of 4 bytes)."""
    bad = []
    for kind, addrs in sm.reads:
        words = [a * sm.esize // 4 for a in addrs]
        if kind == "ldsm":                       # one phase per matrix: 8 rows of 16 bytes
            phases = [[w + q for w in words[8 * i: 8 * i + 8] for q in range(4)] for i in range(4)]
        else:                                    # 32-bit loads: all 32 lanes at once, equal words broadcast
            phases = [words]
        for ph in phases:
            banks = {}
            for w in set(ph):
                banks.setdefault(w % 32, []).append(w)
            if any(len(ws) > 1 for ws in banks.values()):
                bad.append((kind, ph))
    return bad


@pytest.mark.parametrize("kind", ["bf16", "tf32"])
@pytest.mark.parametrize("HS", moba.MMA_HEAD_SIZES)
@pytest.mark.parametrize("keys", [32, 64])                 # MKVQ at N = 128, the key tiles (MK)
def test_score_and_value_products(kind, HS, keys):
    rng = seeded_rng(7)
    ld = moba.mma_tiles(HS, XTYPE[kind])["MOBA_MMA_LD"]
    # the forward's and dq's row tiles per warp (mma.cu's MQM), and one (dk/dv)
    for MT in sorted({moba.MMA_ROWS // 16 // (moba.mma_query_threads(HS, XTYPE[kind]) // LANES), 1}):
        r0 = 16
        X = rng.standard_normal((r0 + 16 * MT, HS))
        Y, V = rng.standard_normal((keys, HS)), rng.standard_normal((keys, HS))
        data, (xo, yo, vo) = image([X, Y, V], HS, ld)
        sm = Smem(data, ELEM_BYTES[XTYPE[kind]])
        s = mma_xyt(kind, sm, xo, r0, yo, ld, keys // 8, HS, MT)
        # the probabilities stay in their C fragments for the second product; V is read row-major
        o = mma_pz(kind, s, sm, vo, ld, HS // 8, keys)
        for m in range(MT):
            S = gather(s[m], 16, keys)
            np.testing.assert_allclose(S, X[r0 + 16 * m:r0 + 16 * m + 16] @ Y.T, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(gather(o[m], 16, HS), S @ V, rtol=1e-12, atol=1e-10)
        assert not bank_conflicts(sm), bank_conflicts(sm)[:2]


def test_a_wrong_layout_is_caught():
    """The checks can fail: swapping the two k halves of a B fragment breaks the product, and a row
    stride without the 16-byte padding conflicts."""
    rng = seeded_rng(3)
    X, Y = rng.standard_normal((16, 16)), rng.standard_normal((8, 16))
    a = [[(X[ln >> 2, 2 * (ln & 3)], X[ln >> 2, 2 * (ln & 3) + 1]),
          (X[(ln >> 2) + 8, 2 * (ln & 3)], X[(ln >> 2) + 8, 2 * (ln & 3) + 1]),
          (X[ln >> 2, 8 + 2 * (ln & 3)], X[ln >> 2, 9 + 2 * (ln & 3)]),
          (X[(ln >> 2) + 8, 8 + 2 * (ln & 3)], X[(ln >> 2) + 8, 9 + 2 * (ln & 3)])] for ln in range(LANES)]
    b = [[(Y[ln >> 2, 8 + 2 * (ln & 3)], Y[ln >> 2, 9 + 2 * (ln & 3)]),
          (Y[ln >> 2, 2 * (ln & 3)], Y[ln >> 2, 2 * (ln & 3) + 1])] for ln in range(LANES)]
    c = mma16("bf16", [[0.0] * 4 for _ in range(LANES)], a, b)
    assert not np.allclose(gather([c], 16, 8), X @ Y.T)
    for kind in ("bf16", "tf32"):
        data, (xo, yo) = image([rng.standard_normal((16, 64)), rng.standard_normal((16, 64))], 64, 64)
        sm = Smem(data, ELEM_BYTES[XTYPE[kind]])
        mma_xyt(kind, sm, xo, 0, yo, 64, 2, 64)
        assert bank_conflicts(sm)


# mma.cu's staging map: 16-byte unit i of an R-row tile -> (row, element)
def mstage_row(i, mrowv):
    return i // mrowv


def mstage_col(i, mrowv, mvec):
    return (i % mrowv) * mvec


@pytest.mark.parametrize("xtype", ["f32", "bf16"])
@pytest.mark.parametrize("HS", moba.MMA_HEAD_SIZES)
def test_cp_async_staging_covers_each_row_once(xtype, HS):
    """mstage_rows: every 16-byte unit of every row copied once, to 16-byte aligned destinations, and the
    32 lanes of a warp read whole 16-byte units of consecutive memory per row (coalesced)."""
    esize = ELEM_BYTES[xtype]
    mvec, ld = 16 // esize, moba.mma_tiles(HS, xtype)["MOBA_MMA_LD"]
    mrowv = HS // mvec
    for R in {moba.MMA_ROWS, moba.mma_tiles(HS, xtype)["MOBA_MMA_KVQ"]}:
        seen = set()
        for i0 in range(0, R * mrowv, moba.NTHR):
            for tid in range(moba.NTHR):
                i = i0 + tid
                if i >= R * mrowv:
                    continue
                r, c = mstage_row(i, mrowv), mstage_col(i, mrowv, mvec)
                assert 0 <= r < R and 0 <= c < HS and ((r * ld + c) * esize) % 16 == 0
                seen.add((r, c))
            for w in range(0, moba.NTHR, LANES):        # one warp's units: runs of whole rows' prefixes
                units = [(mstage_row(i0 + w + ln, mrowv), mstage_col(i0 + w + ln, mrowv, mvec))
                         for ln in range(LANES) if i0 + w + ln < R * mrowv]
                for (ra, ca), (rb, cb) in zip(units, units[1:]):
                    assert (rb == ra and cb == ca + mvec) or (rb == ra + 1 and cb == 0)
        assert seen == {(r, c) for r in range(R) for c in range(0, HS, mvec)}
