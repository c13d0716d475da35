// rwkvx/cu/moba/mma.cu — MoBA attention on tensor cores (method "mma"; HEAD_SIZE 32, 64, 128). Same launch
// structure, scratch and merge as exact.cu (selection, qlist, part/lpart merged by logsumexp, dk/dv
// key-block-major, written once; docs and buffers: moba.cuh); only the attention tiles differ:
//   * floatX = bf16: mma.sync m16n8k16 bf16; floatX = float: two mma.sync m16n8k8 tf32 per 16-wide
//     k-step (operands rounded with cvt.rna.tf32.f32). fp32 accumulation, fp32 softmax statistics;
//     the probabilities (and dS) are rounded to the operand type for the second product.
//   * the forward and dq kernels give each of their MQT / 32 warps 16 * MQM queries of a 64-query tile
//     (N <= 64: 2 warps x 32, each K, V fragment serving two 16-row tiles; N = 128: 4 x 16) and loop over
//     64-key tiles; dk/dv gives each of 4 warps 16 keys of a 64-key tile and loops over query tiles.
//   * scores in the log2 domain (exp2f); lse / lpart stay natural logs (the same buffers as exact.cu's).
//   * every operand tile sits in shared memory row-major as in global memory ([token][HS], rows padded
//     by 16 bytes), staged with 16-byte cp.async; the tiles the loop walks (keys; dk/dv: queries) are
//     double-buffered: the next tile's copies are in flight while the current one is computed.
//   * registers budgeted for MOBA_MMA_MINB_<group> CTAs per SM (__launch_bounds__; ops.py, mma_min_blocks).
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 / m16n8k8"), g = lane / 4, t = lane % 4:
//   C/D (16x8 fp32): c[0], c[1] = row g, cols 2t, 2t+1; c[2], c[3] = row g+8, same cols.
//   bf16 A (16x16): a[0] = row g, k 2t..2t+1; a[1] = row g+8, k 2t..; a[2] = row g, k 2t+8..; a[3] = row g+8,
//   k 2t+8..; B (16x8): b[0] = k 2t..2t+1, col g; b[1] = k 2t+8.., col g. bf16 fragments are read with
//   ldmatrix (x4; .trans for B operands stored [k][n]), see mload_a / mload_b / mload_bt.
//   tf32 A (16x8): a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4); B: b0 = (k t, col g),
//   b1 = (k t+4, col g). The k order inside one mma is free as long as A and B agree: operands read from
//   shared memory along their rows (the head dimension) use k positions t, t+4 -> elements t, t+4 (one
//   scalar load each, conflict-free with rows of HS + 4 floats); the second products take A from the
//   probabilities' C fragments, which map k positions t -> 2t and t+4 -> 2t+1 (a C pair (c[0], c[1]) is
//   an A pair without shuffles), so their B reads rows 2t, 2t+1 of the [k][n] tile.
// Shared memory (layouts: rwkvx/cu/moba/ops.py, mma_smem_layouts): int/float side arrays first (word
// offsets), then floatX tiles from byte 4 * MOBA_SM_M*_SIDE (element offsets).

#include "moba/moba.cuh"
#if !defined(MOBA_MMA_Q) || !defined(MOBA_MMA_K) || !defined(MOBA_MMA_KVQ) || !defined(MOBA_MMA_LD) \
    || !defined(MOBA_MMA_QTHREADS) || !defined(MOBA_MMA_MINB_MKV) || !defined(MOBA_SM_MKV_SIDE)
#error "moba/mma.cu: the tensor-core tiles and shared-memory layouts come from rwkvx/cu/moba/ops.py"
#endif
#include "cp_async.cuh"
#include "mma.cuh"

#define MQ MOBA_MMA_Q              // queries per forward / dq CTA (4 warps x 16)
#define MK MOBA_MMA_K              // keys per tile (forward, dq) and per dk/dv CTA
#define MKVQ MOBA_MMA_KVQ          // queries per dk/dv tile
#define MLD MOBA_MMA_LD            // row stride of every [rows][HS] operand tile (elements)
#define MNT (HS / 8)               // 8-column n-tiles of a [16][HS] accumulator
#define MQT MOBA_MMA_QTHREADS      // threads of the forward and dq kernels (query tiles of MQ)
#define MQM (MQ / 16 / (MQT / 32)) // 16-row query tiles per warp of those (sharing each K, V fragment load)
#define MVEC (16 / (int)sizeof(floatX))   // elements in 16 bytes (one cp.async)
#define MROWV (HS / MVEC)          // 16-byte units of a head row

static_assert(MQ == MOBA_FQ, "the mma kernels reuse the tile offsets toff_f of moba_scan");
static_assert(MK == 16 * (NTHR / 32), "dk/dv: one warp per 16 keys");
static_assert(MQM * 16 * (MQT / 32) == MQ && MQ <= MQT, "fwd, dq: whole row tiles per warp, a thread per query");
static_assert(HS % 16 == 0 && MK % 16 == 0 && MKVQ % 16 == 0, "16-wide k-steps, n-tiles in pairs");
static_assert((MLD * sizeof(floatX)) % 16 == 0, "16-byte aligned rows for cp.async and ldmatrix");

static constexpr float MOBA_LOG2E = 1.4426950408889634f;
static constexpr float MOBA_LN2 = 0.6931471805599453f;

static __device__ __forceinline__ int moba_lane() { return threadIdx.x & 31; }

// A pair of k elements of one row, as mma operand register(s).
#if FLOATX_BF16
struct MPair { unsigned r; };
static __device__ __forceinline__ MPair mpair_of(float a, float b)
{
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);     // a in the low half: the lower k index
    return {*reinterpret_cast<const unsigned*>(&h)};
}
// c += A (16 x 16) * B (16 x 8)
static __device__ __forceinline__ void mma16(float (&c)[4], const MPair (&a)[4], const MPair (&b)[2])
{
    mma_bf16(c, a[0].r, a[1].r, a[2].r, a[3].r, b[0].r, b[1].r);
}
// ldmatrix x4 (mma.cuh's) into operand pairs
static __device__ __forceinline__ void ldsm_x4(MPair (&r)[4], const floatX* p)
{
    ldmatrix_x4(r[0].r, r[1].r, r[2].r, r[3].r, p);
}
static __device__ __forceinline__ void ldsm_x4_trans(MPair (&r)[4], const floatX* p)
{
    ldmatrix_x4_trans(r[0].r, r[1].r, r[2].r, r[3].r, p);
}
// The row / column offsets each lane addresses. ldsm_row16 / ldsm_col16: matrices (rows 0-7, cols 0-7),
// (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15) of a 16x16 block;
// ldsm_nrow / ldsm_ncol: (rows 0-7, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15).
static __device__ __forceinline__ int ldsm_row16(int lane) { return lane & 15; }
static __device__ __forceinline__ int ldsm_col16(int lane) { return 8 * (lane >> 4); }
static __device__ __forceinline__ int ldsm_nrow(int lane) { return (lane & 7) + 8 * (lane >> 4); }
static __device__ __forceinline__ int ldsm_ncol(int lane) { return 8 * ((lane >> 3) & 1); }

// a = X[r0 .. r0+16)[k0 .. k0+16) (X [rows][MLD], k contiguous): the A operand of mma16
static __device__ __forceinline__ void mload_a(MPair (&a)[4], const floatX* X, int r0, int k0)
{
    const int lane = moba_lane();
    ldsm_x4(a, X + (r0 + ldsm_row16(lane)) * MLD + k0 + ldsm_col16(lane));
}
// b[j] = the B operand (k k0 .. k0+16, col n) of n-tile j < 2 from Y rows n0 + 8j + n (Y [n][MLD], k contiguous)
static __device__ __forceinline__ void mload_b(MPair (&b)[2][2], const floatX* Y, int n0, int k0)
{
    const int lane = moba_lane();
    MPair r[4];
    ldsm_x4(r, Y + (n0 + ldsm_nrow(lane)) * MLD + k0 + ldsm_ncol(lane));
    b[0][0] = r[0]; b[0][1] = r[1]; b[1][0] = r[2]; b[1][1] = r[3];
}
// b[j] = the B operand (k rows k0 .. k0+16, col n0 + 8j + n) of n-tile j < 2 from Z [k][MLD] (n contiguous)
static __device__ __forceinline__ void mload_bt(MPair (&b)[2][2], const floatX* Z, int k0, int n0)
{
    const int lane = moba_lane();
    MPair r[4];
    ldsm_x4_trans(r, Z + (k0 + ldsm_row16(lane)) * MLD + n0 + ldsm_col16(lane));
    b[0][0] = r[0]; b[0][1] = r[1]; b[1][0] = r[2]; b[1][1] = r[3];
}
#else
struct MPair { unsigned x, y; };
static __device__ __forceinline__ MPair mpair_of(float a, float b) { return {to_tf32(a), to_tf32(b)}; }
// c += A (16 x 8) * B (8 x 8): A rows g, g+8 as the pairs a_lo, a_hi (k t, t+4), B column g as the pair b
static __device__ __forceinline__ void mma8(float (&c)[4], const MPair& a_lo, const MPair& a_hi, const MPair& b)
{
    const unsigned a[4] = {a_lo.x, a_hi.x, a_lo.y, a_hi.y}, bk[2] = {b.x, b.y};
    mma_tf32(c, a, bk);
}
// c += A (16 x 16) * B (16 x 8) as two k8 steps (the first pairs, then the second pairs)
static __device__ __forceinline__ void mma16(float (&c)[4], const MPair (&a)[4], const MPair (&b)[2])
{
    mma8(c, a[0], a[1], b[0]);
    mma8(c, a[2], a[3], b[1]);
}
// Elements p[0] and p[d] as a pair (k positions t and t+4 of one k8 step).
static __device__ __forceinline__ MPair mpair_ld(const float* p, int d) { return mpair_of(p[0], p[d]); }
// The same fragments as the bf16 loaders (tf32 k order: see the header of this section).
static __device__ __forceinline__ void mload_a(MPair (&a)[4], const floatX* X, int r0, int k0)
{
    const int lane = moba_lane(), g = lane >> 2, t = lane & 3;
    const float* p = X + (r0 + g) * MLD + k0 + t;
    a[0] = mpair_ld(p, 4);
    a[1] = mpair_ld(p + 8 * MLD, 4);
    a[2] = mpair_ld(p + 8, 4);
    a[3] = mpair_ld(p + 8 * MLD + 8, 4);
}
static __device__ __forceinline__ void mload_b(MPair (&b)[2][2], const floatX* Y, int n0, int k0)
{
    const int lane = moba_lane(), g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float* p = Y + (n0 + 8 * j + g) * MLD + k0 + t;
        b[j][0] = mpair_ld(p, 4);
        b[j][1] = mpair_ld(p + 8, 4);
    }
}
static __device__ __forceinline__ void mload_bt(MPair (&b)[2][2], const floatX* Z, int k0, int n0)
{
    const int lane = moba_lane(), g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float* p = Z + (k0 + 2 * t) * MLD + n0 + 8 * j + g;
        b[j][0] = mpair_ld(p, MLD);
        b[j][1] = mpair_ld(p + 8 * MLD, MLD);
    }
}
#endif

// c[m][nt] += X[r0 + 16m .. +16)[0 .. HS) * Y[8nt .. 8nt+8)[0 .. HS)^T for m < MT, nt < NT (X, Y [.][MLD],
// k contiguous): each B fragment is loaded once for the MT row tiles of the warp.
template <int MT, int NT>
static __device__ __forceinline__ void mma_xyt(float (&c)[MT][NT][4], const floatX* __restrict__ X, int r0,
                                               const floatX* __restrict__ Y)
{
#pragma unroll 2                          // full unrolling hoists every k-step's loads: 50+ more registers
    for (int k0 = 0; k0 < HS; k0 += 16) {
        MPair a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) mload_a(a[m], X, r0 + 16 * m, k0);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            MPair b[2][2];
            mload_b(b, Y, 8 * nt, k0);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                mma16(c[m][nt], a[m], b[0]);
                mma16(c[m][nt + 1], a[m], b[1]);
            }
        }
    }
}
template <int NT>
static __device__ __forceinline__ void mma_xyt(float (&c)[NT][4], const floatX* __restrict__ X, int r0,
                                               const floatX* __restrict__ Y)
{
    mma_xyt<1, NT>(reinterpret_cast<float (&)[1][NT][4]>(c), X, r0, Y);
}

// o[m][nt] += P_m (16 x KD, the C fragments p[m][KD/8]) * Z[0 .. KD)[8nt .. 8nt+8) for m < MT, nt < MNT
// (Z [KD][MLD]; each B fragment loaded once for the MT row tiles)
template <int MT, int KD>
static __device__ __forceinline__ void mma_pz(float (&o)[MT][MNT][4], const float (&p)[MT][KD / 8][4],
                                              const floatX* __restrict__ Z)
{
#pragma unroll
    for (int ks = 0; ks < KD / 16; ++ks) {
        MPair a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            a[m][0] = mpair_of(p[m][2 * ks][0], p[m][2 * ks][1]);
            a[m][1] = mpair_of(p[m][2 * ks][2], p[m][2 * ks][3]);
            a[m][2] = mpair_of(p[m][2 * ks + 1][0], p[m][2 * ks + 1][1]);
            a[m][3] = mpair_of(p[m][2 * ks + 1][2], p[m][2 * ks + 1][3]);
        }
#pragma unroll
        for (int nt = 0; nt < MNT; nt += 2) {
            MPair b[2][2];
            mload_bt(b, Z, 16 * ks, 8 * nt);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                mma16(o[m][nt], a[m], b[0]);
                mma16(o[m][nt + 1], a[m], b[1]);
            }
        }
    }
}
template <int KD>
static __device__ __forceinline__ void mma_pz(float (&o)[MNT][4], const float (&p)[KD / 8][4],
                                              const floatX* __restrict__ Z)
{
    mma_pz<1, KD>(reinterpret_cast<float (&)[1][MNT][4]>(o), reinterpret_cast<const float (&)[1][KD / 8][4]>(p), Z);
}

template <int NT>
static __device__ __forceinline__ void moba_zero(float (&c)[NT][4])
{
#pragma unroll
    for (int i = 0; i < NT; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
}

// max / sum over the 4 lanes of a quad (the lanes that hold one fragment row; fixed xor order)
static __device__ __forceinline__ float moba_quad_max(float v)
{
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}
static __device__ __forceinline__ float moba_quad_sum(float v)
{
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

// 16-byte unit i of an R-row tile: row mstage_row(i), element mstage_col(i) (consecutive threads take
// consecutive units of a row: coalesced reads).
static __device__ __forceinline__ int mstage_row(int i) { return i / MROWV; }
static __device__ __forceinline__ int mstage_col(int i) { return (i % MROWV) * MVEC; }

// R rows of NX head slices (base[x] = &x[b, 0, h, 0], row stride tstride) into dst[x] [R][MLD], cp.async
// by TH threads (the caller commits): row r is token tok(r) (< 0: zeros); on_row(r, t) runs once per row.
template <int R, int TH, int NX, class Tok, class OnRow>
static __device__ __forceinline__ void mstage_rows(floatX* const (&dst)[NX], const floatX* const (&base)[NX],
                                                   size_t tstride, Tok tok, OnRow on_row)
{
    for (int i = threadIdx.x; i < R * MROWV; i += TH) {
        const int r = mstage_row(i), c = mstage_col(i);
        const int t = tok(r);
        const size_t src = (size_t)max(t, 0) * tstride + c;
#pragma unroll
        for (int x = 0; x < NX; ++x) cp16_zfill(dst[x] + r * MLD + c, base[x] + src, t >= 0);
        if (c == 0) on_row(r, t);
    }
}
template <int R, int TH = NTHR, int NX, class Tok>
static __device__ __forceinline__ void mstage_rows(floatX* const (&dst)[NX], const floatX* const (&base)[NX],
                                                   size_t tstride, Tok tok)
{
    mstage_rows<R, TH>(dst, base, tstride, tok, [](int, int) {});
}

// Column of C fragment slot e of n-tile nt: 8nt + 2t + e%2 (its row in the tile: acc_m(e) = g + 8*(e/2)).
static __device__ __forceinline__ int mfrag_col(int nt, int e) { return 8 * nt + acc_n(e); }

// The floatX operand tiles start after the side arrays (side words): element offset off.
static __device__ __forceinline__ floatX* moba_smem_x(int side, int off)
{
    return reinterpret_cast<floatX*>(moba_smem_f(side)) + off;
}

// Per fragment row (query tokens tq[i], < 0: padding), the keys u0 + kc visible to it in a tile of nk
// keys are kc < lim[i]: one compare per score.
static __device__ __forceinline__ void moba_row_limits(const int (&tq)[2], int u0, int nk, bool causal,
                                                       int (&lim)[2])
{
#pragma unroll
    for (int i = 0; i < 2; ++i) lim[i] = tq[i] < 0 ? 0 : (causal ? min(nk, tq[i] - u0 + 1) : nk);
}

// --- forward -----------------------------------------------------------------------------------
struct MobaMFwdSmem {
    int *qtok, *qent;                      // [MQ] [MQ]
    floatX *Q, *K, *V;                     // [MQ][MLD], [2][MK][MLD] x2 (double-buffered key tiles)
    __device__ MobaMFwdSmem()
        : qtok(moba_smem_i(MOBA_SM_MFWD_QTOK)), qent(moba_smem_i(MOBA_SM_MFWD_QENT)),
          Q(moba_smem_x(MOBA_SM_MFWD_SIDE, MOBA_SM_MFWD_Q)),
          K(moba_smem_x(MOBA_SM_MFWD_SIDE, MOBA_SM_MFWD_K)),
          V(moba_smem_x(MOBA_SM_MFWD_SIDE, MOBA_SM_MFWD_V)) {}
};

// Keys and values u0 .. min(u0 + MK, uend) - 1 into key buffer buf (rows past uend zero) and commit
// (with whatever the caller staged before: the first group also carries the query tile).
template <int TH>
static __device__ __forceinline__ void moba_mstage_keys(floatX* Ks, floatX* Vs, int buf, const floatX* k,
                                                        const floatX* v, size_t tstride, int u0, int uend)
{
    floatX* const dst[2] = {Ks + buf * MK * MLD, Vs + buf * MK * MLD};
    const floatX* const src[2] = {k, v};
    mstage_rows<MK, TH>(dst, src, tstride, [=](int r) { return u0 + r < uend ? u0 + r : -1; });
    cp_commit();
}

// The key tiles u .. uend-1 (MK keys each), double-buffered through Ks, Vs [2][MK][MLD] by TH threads:
// tile(u0, nk, K, V) computes on one while the next one's copies are in flight. The first tile's copies
// are committed with whatever the caller staged before; every tile starts with a barrier.
template <int TH, class Tile>
static __device__ __forceinline__ void moba_key_tiles(floatX* Ks, floatX* Vs, const floatX* __restrict__ k,
                                                      const floatX* __restrict__ v, size_t tstride, int u, int uend,
                                                      Tile tile)
{
    moba_mstage_keys<TH>(Ks, Vs, 0, k, v, tstride, u, uend);
    int buf = 0;
    for (int u0 = u; u0 < uend; u0 += MK, buf ^= 1) {
        cp_wait<0>();
        __syncthreads();                       // tile buf landed for all; buf ^ 1 is consumed
        if (u0 + MK < uend) moba_mstage_keys<TH>(Ks, Vs, buf ^ 1, k, v, tstride, u0 + MK, uend);
        tile(u0, min(MK, uend - u0), Ks + buf * MK * MLD, Vs + buf * MK * MLD);
    }
}

// Whether a key tile needs the per-score mask: a partial tile (its zero rows past nk would count), or a
// causal tile with keys after the first query token tfirst of the warp's rows (consecutive tokens).
// Rows of padding queries need no mask: their zero query rows give finite scores, never written back.
static __device__ __forceinline__ bool moba_tile_masked(int u0, int nk, bool causal, int tfirst)
{
    return nk < MK || (causal && u0 + MK - 1 > tfirst);
}

// The scores of keys hidden from their query row (moba_row_limits) set to -inf.
static __device__ __forceinline__ void moba_mask_scores(float (&s)[MK / 8][4], const int (&tq)[2], int u0, int nk,
                                                        bool causal)
{
    int lim[2];
    moba_row_limits(tq, u0, nk, causal, lim);
#pragma unroll
    for (int nt = 0; nt < MK / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (mfrag_col(nt, e) >= lim[e >> 1]) s[nt][e] = -MOBA_INF;
}

// One key tile of the online softmax for 16 queries (fragment rows of tokens tq; raw scores s of keys
// u0 .. u0+nk in the C fragments; masked: moba_tile_masked): the running max m (log2 domain) and sum l,
// the output o rescaled, s replaced by the probabilities (relative to the new max).
static __device__ __forceinline__ void moba_online_softmax(float (&s)[MK / 8][4], const int (&tq)[2], int u0, int nk,
                                                           bool causal, bool masked, float scale2, float (&m)[2],
                                                           float (&l)[2], float (&o)[MNT][4])
{
    if (masked) moba_mask_scores(s, tq, u0, nk, causal);
    float mx[2] = {-MOBA_INF, -MOBA_INF};
#pragma unroll
    for (int nt = 0; nt < MK / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    float alpha[2], mref[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float mnew = fmaxf(m[i], moba_quad_max(mx[i]) * scale2);   // scale2 > 0: the max of the scaled
        mref[i] = (mnew == -MOBA_INF) ? 0.f : mnew;
        alpha[i] = exp2f(m[i] - mref[i]);
        m[i] = mnew;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < MK / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[nt][e] = exp2f(fmaf(s[nt][e], scale2, -mref[e >> 1]));
            rs[e >> 1] += s[nt][e];
        }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + moba_quad_sum(rs[i]);
#pragma unroll
    for (int nt = 0; nt < MNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt][e] *= alpha[e >> 1];
}

// The first query row of this thread's warp in a forward or dq CTA (MQM tiles of 16 rows per warp).
static __device__ __forceinline__ int moba_mq_r0() { return 16 * MQM * (threadIdx.x >> 5); }

// f(mt, i, row) for each query row of this thread in a forward or dq CTA: rows g (i = 0) and g + 8 (i = 1)
// of the warp's row tile mt, row its index in the CTA's tile (what C fragment slots 2i, 2i + 1 hold).
template <class F>
static __device__ __forceinline__ void moba_mq_rows(F f)
{
    const int r0 = moba_mq_r0();
#pragma unroll
    for (int mt = 0; mt < MQM; ++mt)
#pragma unroll
        for (int i = 0; i < 2; ++i) f(mt, i, r0 + 16 * mt + acc_m(2 * i));
}

// Online softmax of the warp's 16 * MQM queries (sm.Q rows from moba_mq_r0(), tokens sm.qtok, staged by
// the caller with cp.async, not yet committed) over keys u .. uend-1 in tiles of MK. Per thread and row
// tile mt: rows g and g+8 -> m[mt][i] (running max, log2 domain), l[mt][i] (sum), o[mt] (un-normalised).
static __device__ __forceinline__ void moba_mfwd_attend(const MobaMFwdSmem& sm, const floatX* __restrict__ k,
                                                        const floatX* __restrict__ v, size_t tstride, int u,
                                                        int uend, bool causal, float scale2, float (&m)[MQM][2],
                                                        float (&l)[MQM][2], float (&o)[MQM][MNT][4])
{
    const int r0 = moba_mq_r0();
    int tq[MQM][2];
#pragma unroll
    for (int mt = 0; mt < MQM; ++mt) {
        m[mt][0] = m[mt][1] = -MOBA_INF;
        l[mt][0] = l[mt][1] = 0.f;
        moba_zero(o[mt]);
        tq[mt][0] = sm.qtok[r0 + 16 * mt + acc_m(0)];
        tq[mt][1] = sm.qtok[r0 + 16 * mt + acc_m(2)];
    }
    const int tfirst = sm.qtok[r0];
    moba_key_tiles<MQT>(sm.K, sm.V, k, v, tstride, u, uend, [&](int u0, int nk, const floatX* Ks,
                                                                 const floatX* Vs) {
        float s[MQM][MK / 8][4];
#pragma unroll
        for (int mt = 0; mt < MQM; ++mt) moba_zero(s[mt]);
        mma_xyt<MQM, MK / 8>(s, sm.Q, r0, Ks);
        const bool masked = moba_tile_masked(u0, nk, causal, tfirst);
#pragma unroll
        for (int mt = 0; mt < MQM; ++mt)
            moba_online_softmax(s[mt], tq[mt], u0, nk, causal, masked, scale2, m[mt], l[mt], o[mt]);
        mma_pz<MQM, MK>(o, s, Vs);
    });
}

// The query rows of a forward CTA (tokens sm.qtok) into sm.Q, cp.async (committed with the first keys).
static __device__ __forceinline__ void moba_mstage_fwd_queries(const MobaMFwdSmem& sm, const floatX* q,
                                                               size_t tstride)
{
    floatX* const dst[1] = {sm.Q};
    const floatX* const src[1] = {q};
    const int* qtok = sm.qtok;
    mstage_rows<MQ, MQT>(dst, src, tstride, [=](int r) { return qtok[r]; });
}

// (5m) = (5) on tensor cores: grid (ceil(Emax/MQ) + nblk, H, B), block MQT, smem MobaMFwdSmem
extern "C" __global__ void __launch_bounds__(MQT, MOBA_MMA_MINB_MFWD)
moba_fwd_past_mma(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
                  const int* __restrict__ idx, const int* __restrict__ qlist, float* __restrict__ part,
                  float* __restrict__ lpart, int T, int H, int chunk, int K1, int nblk, int Emax, float scale)
{
    const MobaMFwdSmem sm;
    const int h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    int j;
    if (!moba_past_queries<MQ>(idx, qlist, bh, nblk, Emax, K1, 1, sm.qent, sm.qtok, j)) return;
    const MobaHead hd(b, h, T, H);
    moba_mstage_fwd_queries(sm, q + hd.hoff, hd.tstride);
    float m[MQM][2], l[MQM][2], o[MQM][MNT][4];
    moba_mfwd_attend(sm, k + hd.hoff, v + hd.hoff, hd.tstride, j * chunk, (j + 1) * chunk, false, scale * MOBA_LOG2E,
                     m, l, o);
    moba_mq_rows([&](int mt, int i, int row) {
        const int p = sm.qent[row];
        if (p < 0) return;
        const size_t e = (size_t)bh * T * K1 + p;
        const float inv = 1.f / l[mt][i];
#pragma unroll
        for (int nt = 0; nt < MNT; ++nt)
            *reinterpret_cast<float2*>(part + e * HS + mfrag_col(nt, 0)) =
                make_float2(o[mt][nt][2 * i] * inv, o[mt][nt][2 * i + 1] * inv);
        if ((threadIdx.x & 3) == 0) lpart[e] = (m[mt][i] + log2f(l[mt][i])) * MOBA_LN2;
    });
}

// (6m) = (6) on tensor cores: grid (nblk*ceil(chunk/MQ), H, B), block MQT, smem MobaMFwdSmem
extern "C" __global__ void __launch_bounds__(MQT, MOBA_MMA_MINB_MFWD)
moba_fwd_own_mma(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
                 const int* __restrict__ sel, const float* __restrict__ part, const float* __restrict__ lpart,
                 floatX* __restrict__ o, float* __restrict__ lse, int T, int H, int chunk, int K1, float scale,
                 floatX* __restrict__ olo)
{
    const MobaMFwdSmem sm;
    const int h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    int kstart, q1;
    if (!moba_own_queries<MQ>(T, chunk, sm.qtok, kstart, q1)) return;
    const MobaHead hd(b, h, T, H);
    const int* qtok = sm.qtok;
    moba_mstage_fwd_queries(sm, q + hd.hoff, hd.tstride);
    float m[MQM][2], l[MQM][2], acc[MQM][MNT][4];
    moba_mfwd_attend(sm, k + hd.hoff, v + hd.hoff, hd.tstride, kstart, q1, true, scale * MOBA_LOG2E, m, l, acc);
    moba_mq_rows([&](int mt, int i, int row) {
        const int t = qtok[row];
        if (t < 0) return;
        float mi = m[mt][i] * MOBA_LN2, li = l[mt][i];      // natural-log domain, as lpart
        moba_merge_partials(sel, lpart, part, ((size_t)bh * T + t) * K1, K1, mi, li,
                            [&](const float* pr, float alpha, float beta) {
#pragma unroll
            for (int nt = 0; nt < MNT; ++nt) {
                const float2 pv = *reinterpret_cast<const float2*>(pr + mfrag_col(nt, 0));
                acc[mt][nt][2 * i] = fmaf(acc[mt][nt][2 * i], alpha, beta * pv.x);
                acc[mt][nt][2 * i + 1] = fmaf(acc[mt][nt][2 * i + 1], alpha, beta * pv.y);
            }
        });
        const size_t orow = hd.hoff + (size_t)t * hd.tstride;
        const float inv = 1.f / li;
#pragma unroll
        for (int nt = 0; nt < MNT; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c)
                moba_store_out(o, olo, orow, mfrag_col(nt, c), acc[mt][nt][2 * i + c] * inv);
        if ((threadIdx.x & 3) == 0) lse[(size_t)bh * T + t] = mi + logf(li);
    });
}

// --- backward dq -------------------------------------------------------------------------------
struct MobaMDqSmem {
    int *qtok, *qent;                      // [MQ] [MQ]
    float *lse2, *D;                       // [MQ] [MQ]: lse * log2(e), delta
    floatX *Q, *dO, *K, *V;                // [MQ][MLD] x2, [2][MK][MLD] x2 (double-buffered key tiles)
    __device__ MobaMDqSmem()
        : qtok(moba_smem_i(MOBA_SM_MDQ_QTOK)), qent(moba_smem_i(MOBA_SM_MDQ_QENT)),
          lse2(moba_smem_f(MOBA_SM_MDQ_LSE)), D(moba_smem_f(MOBA_SM_MDQ_D)),
          Q(moba_smem_x(MOBA_SM_MDQ_SIDE, MOBA_SM_MDQ_Q)),
          dO(moba_smem_x(MOBA_SM_MDQ_SIDE, MOBA_SM_MDQ_DO)),
          K(moba_smem_x(MOBA_SM_MDQ_SIDE, MOBA_SM_MDQ_K)),
          V(moba_smem_x(MOBA_SM_MDQ_SIDE, MOBA_SM_MDQ_V)) {}
};

// Q, dO rows of the query tokens sm.qtok (cp.async, committed with the first keys), lse * log2(e) and delta.
static __device__ __forceinline__ void moba_mstage_dq_queries(const MobaMDqSmem& sm, const floatX* __restrict__ q,
                                                              const floatX* __restrict__ dout,
                                                              const float* __restrict__ lse,
                                                              const float* __restrict__ delta, size_t tstride,
                                                              size_t bhT)
{
    const int* qtok = sm.qtok;
    floatX* const dst[2] = {sm.Q, sm.dO};
    const floatX* const src[2] = {q, dout};
    mstage_rows<MQ, MQT>(dst, src, tstride, [=](int r) { return qtok[r]; });
    for (int r = threadIdx.x; r < MQ; r += MQT) {
        const int t = qtok[r];
        sm.lse2[r] = t >= 0 ? lse[bhT + t] * MOBA_LOG2E : 0.f;
        sm.D[r] = t >= 0 ? delta[bhT + t] : 0.f;
    }
}

// dq (without the factor scale) of the warp's 16 * MQM queries (rows from moba_mq_r0()) from keys
// u .. uend-1 in tiles of MK: P = exp2(scale2 * q.k - lse2), dP = do.v, dS = P (dP - D), acc += dS K.
static __device__ __forceinline__ void moba_mdq_attend(const MobaMDqSmem& sm, const floatX* __restrict__ k,
                                                       const floatX* __restrict__ v, size_t tstride, int u,
                                                       int uend, bool causal, float scale2,
                                                       float (&acc)[MQM][MNT][4])
{
    const int r0 = moba_mq_r0();
#pragma unroll
    for (int mt = 0; mt < MQM; ++mt) moba_zero(acc[mt]);
    const int tfirst = sm.qtok[r0];
    moba_key_tiles<MQT>(sm.K, sm.V, k, v, tstride, u, uend, [&](int u0, int nk, const floatX* Ks,
                                                                 const floatX* Vs) {
        float s[MQM][MK / 8][4], dp[MQM][MK / 8][4];
#pragma unroll
        for (int mt = 0; mt < MQM; ++mt) {
            moba_zero(s[mt]);
            moba_zero(dp[mt]);
        }
        mma_xyt<MQM, MK / 8>(s, sm.Q, r0, Ks);
        mma_xyt<MQM, MK / 8>(dp, sm.dO, r0, Vs);
        const bool masked = moba_tile_masked(u0, nk, causal, tfirst);
#pragma unroll
        for (int mt = 0; mt < MQM; ++mt) {
            // (after the tile's barrier: the caller's tokens, lse2 and D are visible)
            const int r = r0 + 16 * mt;
            const int tq[2] = {sm.qtok[r + acc_m(0)], sm.qtok[r + acc_m(2)]};
            const float l2[2] = {sm.lse2[r + acc_m(0)], sm.lse2[r + acc_m(2)]};
            const float Dq[2] = {sm.D[r + acc_m(0)], sm.D[r + acc_m(2)]};
            if (masked) moba_mask_scores(s[mt], tq, u0, nk, causal);
#pragma unroll
            for (int nt = 0; nt < MK / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = e >> 1;
                    const float p = exp2f(fmaf(s[mt][nt][e], scale2, -l2[i]));    // exp2(-inf) = 0: hidden keys
                    s[mt][nt][e] = p * (dp[mt][nt][e] - Dq[i]);
                }
        }
        mma_pz<MQM, MK>(acc, s, Ks);
    });
}

// (8m) = (8) on tensor cores: grid (ceil(Emax/MQ) + nblk, H, B), block MQT, smem MobaMDqSmem
extern "C" __global__ void __launch_bounds__(MQT, MOBA_MMA_MINB_MDQ)
moba_bwd_dq_past_mma(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
                     const floatX* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                     const int* __restrict__ idx, const int* __restrict__ qlist, float* __restrict__ part,
                     int T, int H, int chunk, int K1, int nblk, int Emax, float scale)
{
    const MobaMDqSmem sm;
    const int h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    int j;
    if (!moba_past_queries<MQ>(idx, qlist, bh, nblk, Emax, K1, 1, sm.qent, sm.qtok, j)) return;
    const MobaHead hd(b, h, T, H);
    moba_mstage_dq_queries(sm, q + hd.hoff, dout + hd.hoff, lse, delta, hd.tstride, (size_t)bh * T);
    float acc[MQM][MNT][4];
    moba_mdq_attend(sm, k + hd.hoff, v + hd.hoff, hd.tstride, j * chunk, (j + 1) * chunk, false,
                    scale * MOBA_LOG2E, acc);
    moba_mq_rows([&](int mt, int i, int row) {
        const int p = sm.qent[row];
        if (p < 0) return;
        float* pr = part + ((size_t)bh * T * K1 + p) * HS;
#pragma unroll
        for (int nt = 0; nt < MNT; ++nt)
            *reinterpret_cast<float2*>(pr + mfrag_col(nt, 0)) =
                make_float2(acc[mt][nt][2 * i] * scale, acc[mt][nt][2 * i + 1] * scale);
    });
}

// (9m) = (9) on tensor cores: grid (nblk*ceil(chunk/MQ), H, B), block MQT, smem MobaMDqSmem
extern "C" __global__ void __launch_bounds__(MQT, MOBA_MMA_MINB_MDQ)
moba_bwd_dq_own_mma(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
                    const floatX* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                    const int* __restrict__ sel, const float* __restrict__ part, floatX* __restrict__ dq,
                    int T, int H, int chunk, int K1, float scale)
{
    const MobaMDqSmem sm;
    const int h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    int kstart, q1;
    if (!moba_own_queries<MQ>(T, chunk, sm.qtok, kstart, q1)) return;
    const MobaHead hd(b, h, T, H);
    moba_mstage_dq_queries(sm, q + hd.hoff, dout + hd.hoff, lse, delta, hd.tstride, (size_t)bh * T);
    float acc[MQM][MNT][4];
    moba_mdq_attend(sm, k + hd.hoff, v + hd.hoff, hd.tstride, kstart, q1, true, scale * MOBA_LOG2E, acc);
    const int r0 = moba_mq_r0();     // a loop: moba_mq_rows changes this kernel's machine code (bf16, N = 128)
#pragma unroll
    for (int mt = 0; mt < MQM; ++mt)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int t = sm.qtok[r0 + 16 * mt + acc_m(2 * i)];
            if (t < 0) continue;
            float r[MNT][2];
#pragma unroll
            for (int nt = 0; nt < MNT; ++nt) {
                r[nt][0] = acc[mt][nt][2 * i] * scale;
                r[nt][1] = acc[mt][nt][2 * i + 1] * scale;
            }
            moba_sum_partials(sel, part, ((size_t)bh * T + t) * K1, K1, [&](const float* pr) {
#pragma unroll
                for (int nt = 0; nt < MNT; ++nt) {
                    const float2 pv = *reinterpret_cast<const float2*>(pr + mfrag_col(nt, 0));
                    r[nt][0] += pv.x;
                    r[nt][1] += pv.y;
                }
            });
            floatX* drow = dq + hd.hoff + (size_t)t * hd.tstride;
#pragma unroll
            for (int nt = 0; nt < MNT; ++nt) {
                drow[mfrag_col(nt, 0)] = from_f32(r[nt][0]);
                drow[mfrag_col(nt, 1)] = from_f32(r[nt][1]);
            }
        }
}

// --- backward dk, dv ---------------------------------------------------------------------------
struct MobaMKvSmem {
    int *qtok, *qraw;                      // [2][MKVQ] x2        (the query tiles are double-buffered)
    float *lse, *D;                        // [2][MKVQ] [2][MKVQ] (natural-log lse, delta)
    floatX *K, *V, *Q, *dO;                // [MK][MLD] x2, [2][MKVQ][MLD] x2
    __device__ MobaMKvSmem()
        : qtok(moba_smem_i(MOBA_SM_MKV_QTOK)), qraw(moba_smem_i(MOBA_SM_MKV_QRAW)),
          lse(moba_smem_f(MOBA_SM_MKV_LSE)), D(moba_smem_f(MOBA_SM_MKV_D)),
          K(moba_smem_x(MOBA_SM_MKV_SIDE, MOBA_SM_MKV_K)),
          V(moba_smem_x(MOBA_SM_MKV_SIDE, MOBA_SM_MKV_V)),
          Q(moba_smem_x(MOBA_SM_MKV_SIDE, MOBA_SM_MKV_Q)),
          dO(moba_smem_x(MOBA_SM_MKV_SIDE, MOBA_SM_MKV_DO)) {}
};

// The query tiles of a dk/dv CTA: the own-block tiles first (tokens u0 + MKVQ*tile + r below bend),
// then the tiles of the block's query list ql[ebeg .. eend) (entries t*K1 + s). A list tile's entries
// are copied to sm.qraw one tile ahead (moba_kv_fetch), so that staging it never waits on a global load.
struct MobaKvTiles {
    int nown, ntiles, u0, bend, ebeg, eend, K1;
    const int* ql;
    __device__ bool own(int tile) const { return tile < nown; }
};

// The list entries of tile `tile` (if it is a list tile) into sm.qraw[tile % 2], cp.async (not committed).
static __device__ __forceinline__ void moba_kv_fetch(const MobaMKvSmem& sm, const MobaKvTiles& tl, int tile)
{
    if (tile >= tl.ntiles || tl.own(tile)) return;
    const int e0 = tl.ebeg + (tile - tl.nown) * MKVQ;
    for (int r = threadIdx.x; r < MKVQ; r += NTHR)
        cp4_zfill(sm.qraw + (tile & 1) * MKVQ + r, tl.ql + min(e0 + r, tl.eend - 1), e0 + r < tl.eend);
}

// Query tile `tile` into buffer tile % 2 (Q, dO rows, tokens, lse, delta), cp.async (not committed); a
// list tile's entries must be in sm.qraw (fetched, waited for and synchronised).
static __device__ __forceinline__ void moba_mstage_kv_queries(const MobaMKvSmem& sm, const MobaKvTiles& tl,
                                                              int tile, const floatX* __restrict__ q,
                                                              const floatX* __restrict__ dout,
                                                              const float* __restrict__ lse,
                                                              const float* __restrict__ delta, size_t tstride,
                                                              size_t bhT)
{
    const int buf = tile & 1;
    const bool own = tl.own(tile);
    const int first = tl.u0 + tile * MKVQ, bend = tl.bend, K1 = tl.K1;
    const int* raw = sm.qraw + buf * MKVQ;
    const int nraw = tl.eend - tl.ebeg - (tile - tl.nown) * MKVQ;        // valid entries of a list tile
    auto tok = [=](int r) {
        return own ? (first + r < bend ? first + r : -1) : (r < nraw ? raw[r] / K1 : -1);
    };
    floatX* const dst[2] = {sm.Q + buf * MKVQ * MLD, sm.dO + buf * MKVQ * MLD};
    const floatX* const src[2] = {q, dout};
    int* qtok = sm.qtok + buf * MKVQ;
    float* lse_s = sm.lse + buf * MKVQ;
    float* D_s = sm.D + buf * MKVQ;
    mstage_rows<MKVQ, NTHR>(dst, src, tstride, tok, [=](int r, int t) {
        qtok[r] = t;
        cp4_zfill(lse_s + r, lse + bhT + max(t, 0), t >= 0);
        cp4_zfill(D_s + r, delta + bhT + max(t, 0), t >= 0);
    });
}

// One query tile (buffer buf) against the warp's 16 keys (sm.K, sm.V rows r0.., tokens u0 + row, valid
// below nk): dv += P^T dO, dk += dS^T Q (dk without the factor scale).
static __device__ __forceinline__ void moba_mkv_tile(const MobaMKvSmem& sm, int buf, int u0, int nk, bool causal,
                                                     float scale2, float (&dk)[MNT][4], float (&dv)[MNT][4])
{
    const int r0 = 16 * (threadIdx.x >> 5);
    const floatX* Qs = sm.Q + buf * MKVQ * MLD;
    const floatX* dOs = sm.dO + buf * MKVQ * MLD;
    const int* qtok = sm.qtok + buf * MKVQ;
    const float* lse = sm.lse + buf * MKVQ;
    const float* D = sm.D + buf * MKVQ;
    float s[MKVQ / 8][4], dp[MKVQ / 8][4];
    moba_zero(s);
    moba_zero(dp);
    mma_xyt<MKVQ / 8>(s, sm.K, r0, Qs);      // s[key][query] = k . q
    mma_xyt<MKVQ / 8>(dp, sm.V, r0, dOs);    // dp[key][query] = v . do
    // key row i of this thread sees query token t iff t >= lo[i] (padding keys never; own block: causal)
    int lo[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int kr = r0 + acc_m(2 * i);
        lo[i] = kr >= nk ? 0x7fffffff : (causal ? u0 + kr : 0);
    }
#pragma unroll
    for (int nt = 0; nt < MKVQ / 8; ++nt) {
        const int c = mfrag_col(nt, 0);                       // even: the pair c, c + 1 in one load each
        const int2 tq = *reinterpret_cast<const int2*>(qtok + c);
        const float2 lq = *reinterpret_cast<const float2*>(lse + c);
        const float2 dd = *reinterpret_cast<const float2*>(D + c);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = e & 1 ? tq.y : tq.x;
            // lse * log2(e) rounded first (no contraction into an fma): the dq kernels' lse2; exp2(-inf) = 0
            const float l2 = __fmul_rn(e & 1 ? lq.y : lq.x, MOBA_LOG2E);
            const float p = exp2f(t >= lo[e >> 1] ? s[nt][e] * scale2 - l2 : -MOBA_INF);
            s[nt][e] = p;
            dp[nt][e] = p * (dp[nt][e] - (e & 1 ? dd.y : dd.x));
        }
    }
    mma_pz<MKVQ>(dv, s, dOs);
    mma_pz<MKVQ>(dk, dp, Qs);
}

// (10m) = (10) on tensor cores: grid (ceil(chunk/MK), nblk, B*H), block NTHR, smem MobaMKvSmem
extern "C" __global__ void __launch_bounds__(NTHR, MOBA_MMA_MINB_MKV)
moba_bwd_dkdv_mma(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
                  const floatX* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                  const int* __restrict__ idx, const int* __restrict__ qlist,
                  floatX* __restrict__ dk, floatX* __restrict__ dv,
                  int T, int H, int chunk, int K1, int nblk, int Emax, float scale)
{
    const MobaKeyTile<MK> kt(T, H, chunk);
    if (kt.u0 >= kt.bend) return;
    const MobaMKvSmem sm;
    const int j = kt.j, bh = kt.bh, u0 = kt.u0, bend = kt.bend, nk = kt.nk();
    const MobaHead hd(kt.b, kt.h, T, H);
    const size_t tstride = hd.tstride, hoff = hd.hoff, bhT = (size_t)bh * T;
    const float scale2 = scale * MOBA_LOG2E;
    {
        floatX* const dst[2] = {sm.K, sm.V};
        const floatX* const src[2] = {k + hoff, v + hoff};
        mstage_rows<MK>(dst, src, tstride, [=](int r) { return r < nk ? u0 + r : -1; });
    }
    // own block: queries u0 .. bend-1 (key u visible to t iff u <= t), then the later queries that
    // selected block j (all of block j visible to them)
    MobaKvTiles tl{(bend - u0 + MKVQ - 1) / MKVQ, 0, u0, bend, 0, 0, K1, nullptr};
    if (K1 > 0) {
        const int* offs = idx + (size_t)bh * 3 * (nblk + 1);
        tl.ebeg = offs[j];
        tl.eend = offs[j + 1];
        tl.ql = qlist + (size_t)bh * Emax;
    }
    tl.ntiles = tl.nown + (tl.eend - tl.ebeg + MKVQ - 1) / MKVQ;
    // tile 0 is an own tile: no list entries to wait for
    moba_mstage_kv_queries(sm, tl, 0, q + hoff, dout + hoff, lse, delta, tstride, bhT);
    moba_kv_fetch(sm, tl, 1);
    cp_commit();                                              // (with K, V)
    float dka[MNT][4], dva[MNT][4];
    moba_zero(dka);
    moba_zero(dva);
    for (int tile = 0; tile < tl.ntiles; ++tile) {
        cp_wait<0>();
        __syncthreads();                       // tile landed for all (and the entries of tile + 1); the
                                               // other buffers are consumed
        if (tile + 1 < tl.ntiles) {
            moba_mstage_kv_queries(sm, tl, tile + 1, q + hoff, dout + hoff, lse, delta, tstride, bhT);
            moba_kv_fetch(sm, tl, tile + 2);
            cp_commit();
        }
        moba_mkv_tile(sm, tile & 1, u0, nk, tl.own(tile), scale2, dka, dva);
    }
    const int r0 = 16 * (threadIdx.x >> 5);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = r0 + acc_m(2 * i);
        if (r >= nk) continue;
        const size_t off = hoff + (size_t)(u0 + r) * tstride;
#pragma unroll
        for (int nt = 0; nt < MNT; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                dk[off + mfrag_col(nt, c)] = from_f32(dka[nt][2 * i + c] * scale);
                dv[off + mfrag_col(nt, c)] = from_f32(dva[nt][2 * i + c]);
            }
    }
}
