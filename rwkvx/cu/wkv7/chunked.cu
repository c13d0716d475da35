// rwkvx/cu/wkv7/chunked.cu -- RWKV-7 WKV recurrence in chunked form, state products on tensor cores.
//
// Same recurrence and layouts as rwkvx/cu/wkv7/sequential.cu (S is N x N, row i = value, column j = key):
//     sa_t = S_{t-1} a_t ;  S_t = S_{t-1} diag(w_t) + sa_t b_t^T + v_t k_t^T ;  y_t = S_t r_t
// from S_{-1} = s_init[h] (the initial state shared by the B sequences; 0 when NULL).
// Per chunk of L = 16 tokens with entering state S0 and cw_t = prod_{s<=t} w_s, cx_t = cw_t / w_t,
// PL = cw_{L-1}:  rt = r cw, at = a cx, kh = k / cw, bh = b / cw  (w >= exp(-e^-0.5), the decay clamp,
// bounds 1/cw <= 1.6e4: no overflow at L = 16);
//     Aab = slower(at bh^T), Aak = slower(at kh^T), Arb = lower(rt bh^T), Ark = lower(rt kh^T),
//     M = (I - Aab)^-1  (unit lower triangular, forward substitution in fp32);
//     Qa = M at, Ca = M Aak, Qr = rt + Arb Qa, Cr = Ark + Arb Ca, Kt = kh PL, Bt = bh PL;
//     U = Qa S0^T + Ca V  (U's rows are sa_t) ;  Y = Qr S0^T + Cr V ;  S_L^T = diag(PL) S0^T + Kt^T V + Bt^T U.
// Backward (dS = dL/dS_L from the later chunks):  Qb = M^T Bt, Db = (Arb M)^T,
//     dX = Qb dS^T + Db dY ;  dV = Kt dS^T + Ark^T dY + Aak^T dX ;  dS0^T = diag(PL) dS^T + rt^T dY + at^T dX,
// and per chunk the key-space gradients from S0, dS, U, V, dY, dX (wkv7c_backward_grads).
// rwkvx/cu/wkv7/chunked_model.py is the numpy model of exactly these steps (checked against the oracle).
//
// Kernels (n_c = ceil(T/L) chunks; the last one is padded logically: w = 1, r = k = v = a = b = dy = 0):
//   wkv7c_intra           grid (n_c, H, B): the chunk operators above, all chunks at once (products on tensor
//                         cores in 3xTF32, one tf32 pass in bf16; the inverse by forward substitution in
//                         fp32), into a record per chunk: the forward set, the backward set, or both at once
//                         (`mode`; both: the recompute's forward keeps the backward's records).
//   wkv7c_forward_state   grid (P, H, B S): the sequential pass, over each of S segments of the sequence. A group of one or two warps = 8 value rows of
//                         S (rows are independent given the records; with two, each warp half of the keys and
//                         the pair sums its partial products over the keys), fp32 state in shared memory,
//                         products on mma.sync m16n8k8 tf32 (3xTF32 with WKV_EXACT) with fp32 accumulation;
//                         y, sa and the chunk-entering states S0 out.
//   wkv7c_backward_state  grid (P, H, B S): the reverse pass carrying dS (fp32) the same way; dv, dX and the
//                         chunk-ending dS out, and (ds_part not NULL) the dS left after chunk 0, each
//                         sequence's gradient of the initial state, for wkv7_state_reduce's sum over them.
//   The initial state costs one pointer test per block: it is the forward's carried state at chunk 0 (and so
//   the chunk-0 slot of the saved S0, which the gradient kernel reads like any other).
//   Segmented scan (S > 1, where B H alone leaves the device idle): a summary walk of every segment from 0
//   and from the identity (its exit Z and transition Tr: S_exit = S_entry Tr + Z), wkv7c_segment_carry
//   (grid (N/8, H, B)) over the segments for their true entering states, then the plain walk of every
//   segment from its entering state -- the same chunk steps as S = 1 (the checkpoints within rounding).
//   wkv7c_backward_grads  grid (n_c, H, B): dr, dw, dk, da, db of each chunk (the products over the value
//                         rows with S0 and dS on tensor cores in tf32 or 3xTF32, the [L, L] ones as intra's, the rest
//                         fp32 on CUDA cores).
// The decay's part of S_L (diag(PL) S0) stays in fp32: only the new terms are rounded to tf32 each chunk
// (carried as tf32 hi + lo pairs with WKV_EXACT, the fp32 precision's path).
// Deterministic: no atomics, fixed summation orders.

#include "common.cuh"
#include "ptx.cuh"
#include "cp_async.cuh"
#if !defined(HEAD_SIZE) || !defined(WKV_L) || !defined(WKV_STAGES) || !defined(WKV_FREC) || !defined(WKV_BREC) \
    || !defined(WKV_INTRA_THREADS) || !defined(WKV_SPLIT_OPERATORS) || !defined(WKV_EXACT)
#error "wkv7/chunked.cu: HEAD_SIZE and the WKV_* defines come from rwkvx/cu/wkv7/ops.py"
#endif
#include "wkv7/fragments.cuh"

namespace wkv7c {

constexpr int HN = HEAD_SIZE;
constexpr int L = WKV_L;
constexpr int LN = L * HN, LL = L * L;
constexpr int NS = WKV_STAGES;                  // chunks of inputs staged (in flight) in the state passes
static_assert(NS >= 2, "the state passes need at least double buffering");
static_assert(L == 16, "the mma tiling assumes chunks of 16 tokens");
static_assert(HN == 32 || HN == 64, "the chunked kernels support head sizes 32 and 64");

// A chunk record: two token-major [L][HN] sections, two key-major [HN][L] sections, NLL [L][L]
// sections, PL [HN]. Forward: Qa, Qr | Kt^T, Bt^T | Ca, Cr.  Backward: Qb, Kt | rt^T, at^T | Db, Ark^T, Aak^T.
// Every section but PL is only ever an mma A operand, so wkv7c_intra stores it in fragment order
// (frag_pos: each lane's four A values of a k-step side by side, one 16-byte load) and rounded to tf32 (the
// same bits a conversion at each use would give; in fp32 when EXACT, for a hi + lo split at each use); the
// state passes copy records to shared memory as they are.
template <int NLL>
struct Rec {
    static constexpr int TM = 0, KM = 2 * LN, LQ = 4 * LN, PL = 4 * LN + NLL * LL, SIZE = PL + HN;
    static_assert(SIZE % 4 == 0 && LN % 128 == 0, "records are copied and read in 16-byte pieces");
};
using FRec = Rec<2>;
using BRec = Rec<3>;
static_assert(FRec::SIZE == WKV_FREC && BRec::SIZE == WKV_BREC, "record sizes disagree with rwkvx/cu/wkv7/ops.py");

__device__ __forceinline__ long long tok(int bb, int T, int t, int H, int h) {   // element of (bb, t, h, 0)
    return (((long long)bb * T + t) * H + h) * HN;
}

// x . y over the HN keys, by the four lanes of a quad (lane q: keys q, q + 4, ...), compensated (Ogita,
// Rump and Oishi's Dot2: each product's and each addition's rounding error summed on the side, in rounded
// fp32 operations that are never contracted): as accurate as the dot summed in twice fp32's precision and
// then rounded to fp32, so it keeps its digits where the terms cancel up to a condition number of ~1e7; the
// result in lane q = 0. WKV_EXACT takes the diagonals of the
// Gram matrices from it (r_t.k_t, r_t.b_t, dy_t.v_t, dy_t.u_t): at T = 1 each is the whole scale of a
// gradient (dv, da, dk, db), so its relative error is that gradient's, and a sum of 64 rounded terms
// (3xTF32 on rt, bh: r and b scaled by cw and 1/cw first) loses digits wherever they cancel.
template <class FX, class FY>
__device__ __forceinline__ float quad_dot2(FX X, FY Y, int q) {
    float s = 0.f, c = 0.f;
    auto two_sum = [&](float p, float pe) {          // s + p exactly = t + e; e and pe go to c
        const float t = __fadd_rn(s, p), z = __fsub_rn(t, s);
        const float e = __fadd_rn(__fsub_rn(s, __fsub_rn(t, z)), __fsub_rn(p, z));
        c = __fadd_rn(c, __fadd_rn(e, pe));
        s = t;
    };
#pragma unroll
    for (int j = q; j < HN; j += 4) {
        const float x = X(j), y = Y(j), p = __fmul_rn(x, y);
        two_sum(p, fmaf(x, y, -p));                  // fmaf: the product's rounding error, exactly
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        const float so = __shfl_xor_sync(0xffffffffu, s, o), co = __shfl_xor_sync(0xffffffffu, c, o);
        two_sum(so, co);
    }
    return __fadd_rn(s, c);
}

// 4 elements of floatX, cp.async
__device__ __forceinline__ void cp4x(float* d, const float* s) { cp16(d, s); }
__device__ __forceinline__ void cp4x(__nv_bfloat16* d, const __nv_bfloat16* s) { cp8(d, s); }

// Stage one chunk record into shared memory as it is, cp.async.
template <class R>
__device__ __forceinline__ void stage_record(float* dst, const float* src, int tid, int nt) {
    for (int e = tid; e < R::SIZE / 4; e += nt) cp16(dst + 4 * e, src + 4 * e);
}

// Stage rows [i0, i0 + NR) of tokens c*L .. c*L+L-1 of one floatX [B,T,H,N] tensor into dst [L][NR + 8]
// (zeros beyond T, and everywhere for a NULL src: a segment's transition walk has no inputs).
__device__ __forceinline__ void stage_rows(floatX* dst, const floatX* src, int bb, int T, int c, int H, int h,
                                           int i0, int NR, int tid, int nt) {
    const int R4 = NR / 4;
    for (int e = tid; e < L * R4; e += nt) {
        const int sl = e / R4, c4 = e - sl * R4, t = c * L + sl;
        floatX* d = dst + sl * (NR + 8) + 4 * c4;
        if (t < T && src != nullptr) cp4x(d, src + tok(bb, T, t, H, h) + i0 + 4 * c4);
        else { d[0] = from_f32(0.f); d[1] = from_f32(0.f); d[2] = from_f32(0.f); d[3] = from_f32(0.f); }
    }
}

// One chunk's [L][HN] tile of a [B,T,H,N] tensor in registers, NT threads, 4 elements per load; tokens
// past T read as `pad`. A kernel loads all its tiles before storing any (one memory round trip).
template <int NT>
struct ChunkTile {
    static constexpr int V4 = HN / 4, PER = L * V4 / NT;
    static_assert(L * V4 % NT == 0, "a chunk tile spreads evenly over the threads");
    f4 x[PER];
    template <class S>
    __device__ __forceinline__ void load(const S* src, float pad, int bb, int T, int c, int H, int h, int tid) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int e = tid + i * NT, t = e / V4, tt = c * L + t;
            if (tt < T) x[i] = load4(src + tok(bb, T, tt, H, h) + 4 * (e % V4));
            else x[i].v[0] = x[i].v[1] = x[i].v[2] = x[i].v[3] = pad;
        }
    }
    template <int LD>
    __device__ __forceinline__ void store(float (*dst)[LD], int tid) const {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int e = tid + i * NT, t = e / V4, c4 = e % V4;
#pragma unroll
            for (int u = 0; u < 4; ++u) dst[t][4 * c4 + u] = x[i].v[u];
        }
    }
};

}  // namespace wkv7c

using namespace wkv7c;

// =============================================================================================
// Chunk operators.  grid (n_c, H, B), block WKV_INTRA_THREADS = 4 warps.  rec [B, H, n_c, REC]: mode 0 the
// forward record (FRec), mode 1 the backward record (BRec), mode 2 both (FRec into rec, BRec into brec: one
// pass over the inputs and one M for the two).  Phases: (1) one thread per key column j: the
// decay products and rt, at, kh, bh; (2) warp m: Gram matrix m (Aab, Aak, Arb, Ark) on tensor cores;
// (3) warp 0: M = (I - Aab)^-1, the other warps write the sections that need no M; (4) the products with M
// on tensor cores, every warp a few 16 x 8 tiles.
// =============================================================================================
extern "C" __global__ void __launch_bounds__(WKV_INTRA_THREADS)
wkv7c_intra(const floatX* __restrict__ r, const float* __restrict__ w, const floatX* __restrict__ k,
            const floatX* __restrict__ a, const floatX* __restrict__ b, float* __restrict__ rec,
            float* __restrict__ brec, int T, int H, int mode)
{
    static_assert(WKV_INTRA_THREADS == 128 && HN <= 64, "wkv7c_intra: one warp per Gram matrix, N <= 64");
    constexpr int SP = HN + 4, LP = L + 1;          // SP: conflict-free mma fragments; LP: column reads
    __shared__ __align__(16) float rt[L][SP], at[L][SP], kh[L][SP], bh[L][SP];
    __shared__ float wv[L][HN];
    __shared__ float G[4][L][LP];                    // Aab, Aak (strictly lower), Arb, Ark (lower)
    __shared__ float Mi[L][LP];
    __shared__ float Wt[4][L][8];                    // per warp: one 16 x 8 tile, accumulator -> B operand
    __shared__ float PL[HN];
    __shared__ float diag[2][L];                     // WKV_EXACT: the diagonals of Arb, Ark (quad_dot2)
    const int c = blockIdx.x, h = blockIdx.y, bb = blockIdx.z, tid = threadIdx.x;
    const int wid = tid >> 5, lane = tid & 31, nC = gridDim.x;

    {                                                // (1) the chunk's inputs (padding: w = 1, the rest 0)
        ChunkTile<WKV_INTRA_THREADS> xr, xw, xk, xa, xb;
        xr.load(r, 0.f, bb, T, c, H, h, tid);
        xw.load(w, 1.f, bb, T, c, H, h, tid);
        xk.load(k, 0.f, bb, T, c, H, h, tid);
        xa.load(a, 0.f, bb, T, c, H, h, tid);
        xb.load(b, 0.f, bb, T, c, H, h, tid);
        xr.store(rt, tid); xw.store(wv, tid); xk.store(kh, tid); xa.store(at, tid); xb.store(bh, tid);
    }
    __syncthreads();
    if constexpr (EXACT) {                           // quad tid / 4: r_t.b_t (quads 0-15), r_t.k_t (16-31)
        static_assert(8 * L == WKV_INTRA_THREADS, "wkv7c_intra: one quad per (diagonal, token)");
        const int t = (tid >> 2) & (L - 1), m = tid >> 6;
        const float(*Y)[SP] = m ? kh : bh;
        const float d = quad_dot2([&](int j) { return rt[t][j]; }, [&](int j) { return Y[t][j]; }, tid & 3);
        if ((tid & 3) == 0) diag[m][t] = d;
        __syncthreads();                             // r, k, b read before the decay products rewrite them
    }
    if (tid < HN) {                                  // one column: the decay products in token order
        float p = 1.f;
#pragma unroll
        for (int t = 0; t < L; ++t) {
            const float cx = p;
            p *= wv[t][tid];
            rt[t][tid] *= p;
            at[t][tid] *= cx;
            kh[t][tid] /= p;
            bh[t][tid] /= p;
        }
        PL[tid] = p;
    }
    __syncthreads();
    {                                                // (2) warp m: X_m Y_m^T, masked to its triangle
        const float(*X)[SP] = wid < 2 ? at : rt;
        const float(*Y)[SP] = (wid & 1) ? kh : bh;
        float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        gram3<HN>(d, [&](int m, int kk) { return X[m][kk]; }, [&](int n, int kk) { return Y[n][kk]; });
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = acc_m(e), s = 8 * nt + acc_n(e);
                G[wid][t][s] = (wid < 2 ? s < t : s <= t) ? (EXACT && s == t ? diag[wid - 2][t] : d[nt][e]) : 0.f;
            }
    }
    __syncthreads();
    const long long chunk = (long long)(bb * H + h) * nC + c;
    const bool fwd = mode != 1, bwd = mode != 0;
    float* fout = rec + chunk * FRec::SIZE;
    float* bout = (mode == 2 ? brec : rec) + chunk * BRec::SIZE;
    const float(*Aab)[LP] = G[0], (*Aak)[LP] = G[1], (*Arb)[LP] = G[2], (*Ark)[LP] = G[3];
    if (wid == 0) {                                  // (3) column s of M = I + Aab M (rows of M above s are 0)
        if (lane < L) {
            float m[L];
#pragma unroll
            for (int t = 0; t < L; ++t) {
                float acc = t == lane ? 1.f : 0.f;
#pragma unroll
                for (int u = 0; u < t; ++u) acc = fmaf(Aab[t][u], m[u], acc);
                m[t] = acc;
                Mi[t][lane] = acc;
            }
        }
    } else {
        const int e0 = tid - 32, ne = WKV_INTRA_THREADS - 32;
        if (fwd) {
            using R = FRec;
            float* out = fout;
            for (int e = e0; e < HN; e += ne) out[R::PL + e] = PL[e];
            put_section<L>(out + R::KM, HN, [&](int j, int t) { return kh[t][j] * PL[j]; }, e0, ne);       // Kt^T
            put_section<L>(out + R::KM + LN, HN, [&](int j, int t) { return bh[t][j] * PL[j]; }, e0, ne);  // Bt^T
        }
        if (bwd) {
            using R = BRec;
            float* out = bout;
            for (int e = e0; e < HN; e += ne) out[R::PL + e] = PL[e];
            put_section<HN>(out + R::TM + LN, L, [&](int t, int j) { return kh[t][j] * PL[j]; }, e0, ne);  // Kt
            put_section<L>(out + R::KM, HN, [&](int j, int t) { return rt[t][j]; }, e0, ne);               // rt^T
            put_section<L>(out + R::KM + LN, HN, [&](int j, int t) { return at[t][j]; }, e0, ne);          // at^T
            put_section<L>(out + R::LQ + LL, L, [&](int t, int s) { return Ark[s][t]; }, e0, ne);          // Ark^T
            put_section<L>(out + R::LQ + 2 * LL, L, [&](int t, int s) { return Aak[s][t]; }, e0, ne);      // Aak^T
        }
    }
    __syncthreads();
    // (4) the products with M, 3xTF32: warp w the column tiles w, w + 4 of the [L, N] sections, warps 2
    //     and 3 one column tile each of the [L, L] ones; a warp's tile of Qa / Ca passes through Wt[w]
    //     on its way from accumulator to B operand
    auto Mat = [](const float(*A)[LP]) { return [=](int m, int kk) { return A[m][kk]; }; };
    float(*W)[8] = Wt[wid];
    // column tile nt of X = M B into section sx, then of Z = Z0 + Arb X into section sz (both in fragment
    // order: column tile nt is the sections' tile nt)
    auto m_then_arb = [&](auto B, auto Z0, float* sx, float* sz, int nt) {
        float x[4] = {0.f, 0.f, 0.f, 0.f}, z[4];
        mm3<L>(x, Mat(Mi), [&](int kk, int n) { return B(kk, 8 * nt + n); });
        put_tile(W[0], x);
#pragma unroll
        for (int e = 0; e < 4; ++e) z[e] = Z0(acc_m(e), 8 * nt + acc_n(e));
        __syncwarp();
        put_tile_frag(sx + 128 * nt, W);
        mm3<L>(z, Mat(Arb), [&](int kk, int n) { return W[kk][n]; });
        __syncwarp();                                // every lane has read X from W
        put_tile(W[0], z);
        __syncwarp();
        put_tile_frag(sz + 128 * nt, W);
    };
    if (fwd) {
        using R = FRec;
        float* out = fout;
        for (int nt = wid; nt < HN / 8; nt += 4) {   // Qa = M at, Qr = rt + Arb Qa
            m_then_arb([&](int kk, int j) { return at[kk][j]; }, [&](int t, int j) { return rt[t][j]; },
                       out + R::TM, out + R::TM + LN, nt);
            __syncwarp();                            // W is rewritten by the next tile
        }
        if (wid >= 2)                                // Ca = M Aak, Cr = Ark + Arb Ca
            m_then_arb([&](int kk, int s) { return Aak[kk][s]; }, [&](int t, int s) { return Ark[t][s]; },
                       out + R::LQ, out + R::LQ + LL, wid - 2);
        __syncwarp();                                // W is rewritten by the backward set's tiles
    }
    if (bwd) {
        using R = BRec;
        float* out = bout;
        for (int nt = wid; nt < HN / 8; nt += 4) {   // Qb = M^T Bt
            float qb[4] = {0.f, 0.f, 0.f, 0.f};
            mm3<L>(qb, [&](int m, int kk) { return Mi[kk][m]; }, [&](int kk, int n) { return bh[kk][8 * nt + n]; });
#pragma unroll
            for (int e = 0; e < 4; ++e) qb[e] *= PL[8 * nt + acc_n(e)];
            put_tile(W[0], qb);
            __syncwarp();
            put_tile_frag(out + R::TM + 128 * nt, W);
            __syncwarp();                            // W is rewritten by the next tile
        }
        if (wid >= 2) {                              // Db[t][s] = (Arb M)[s][t]
            const int nt = wid - 2;
            float pm[4] = {0.f, 0.f, 0.f, 0.f};
            mm3<L>(pm, Mat(Arb), [&](int kk, int n) { return Mi[kk][8 * nt + n]; });
#pragma unroll
            for (int e = 0; e < 4; ++e) out[R::LQ + frag_pos<L>(8 * nt + acc_n(e), acc_m(e))] = rec_value(pm[e]);
        }
    }
}

namespace wkv7c {
// Warps per 8 state rows (a group): 1, or 2 that each take half of the keys and sum their partial
// products (WKV_KEY_WARPS, chosen per launch by rwkvx/cu/wkv7/ops.py: a shorter chain per chunk where few
// blocks share the device, extra exchange work where many do).
constexpr int KW = WKV_KEY_WARPS;
static_assert(KW == 1 || KW == 2, "a group of state rows is one warp or a key-split pair");
constexpr int KH = HN / KW;     // keys per warp
constexpr int LW = L / KW;      // tokens whose outputs each warp of a group stores
constexpr int SP4 = HN + 4;     // stride of the group's state rows
// Shared memory of the state passes (floats): NS staged records, NS staged [L][NR + 8] floatX row
// tiles, and per group its 8 rows of the carried state [8][SP4], per warp two [L][8] tiles (the chunk's
// products on their way to the next product and to global memory) and, key-split, the exchange of
// partial sums [KW][8][32].
constexpr int GROUP_FLOATS = 8 * SP4 + KW * 2 * L * 8 + (KW > 1 ? KW * 8 * 32 : 0);
template <class R>
__host__ __device__ constexpr int state_smem_floats(int NR, int ngroups) {
    return NS * R::SIZE + (NS * L * (NR + 8) * (int)sizeof(floatX) + 15) / 16 * 4 + ngroups * GROUP_FLOATS;
}
static_assert(SP4 % 4 == 0 && GROUP_FLOATS % 4 == 0, "the state rows and tiles are read in 16-byte pieces");
// The chunk walk of a state pass: body(g, slot) for steps g = 0..G-1 while the inputs of steps
// g+1 .. g+NS-1 are being copied in; issue(g, slot) starts step g's copies into ring slot g % NS
// (one commit group per step, empty past the end so that the wait count stays NS - 1).
template <class Issue, class Body>
__device__ __forceinline__ void ring_walk(int G, Issue issue, Body body) {
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
        if (s < G) issue(s, s);
        cp_commit();
    }
    for (int g = 0; g < G; ++g) {
        if (g + NS - 1 < G) issue(g + NS - 1, (g + NS - 1) % NS);
        cp_commit();
        cp_wait<NS - 1>();
        __syncthreads();
        body(g, g % NS);
        __syncthreads();                     // slot g % NS is refilled at step g + 1
    }
}
// The warp's keys of its group's 8 carried rows (state or dS, Cw [8][SP4] from the warp's first key) to dst
// (the same rows and keys of a [.., N, N] slot).
__device__ __forceinline__ void store_rows(float* dst, const float* Cw, int lane) {
    for (int e = lane; e < 2 * KH; e += 32) {
        const int row = e / (KH / 4), c4 = e % (KH / 4);
        const float4 s = *reinterpret_cast<const float4*>(Cw + row * SP4 + 4 * c4);
        *reinterpret_cast<float4*>(dst + row * HN + 4 * c4) = s;
    }
}
// store_rows out of line, for the backward pass's one store after its chunk walk (dS_{-1}): inlined there,
// ptxas gives chunked_exact's N = 64 two-warp backward pass 64 registers and spills in the chunk loop.
__device__ __noinline__ void store_rows_once(float* dst, const float* Cw, int lane) { store_rows(dst, Cw, lane); }
// The warp's LW tokens of a [L][8] tile (tokens c*L + t, the group's 8 rows from column ig) to a
// [B,T,H,N] tensor, four elements per store: two lanes per token instead of the accumulator's
// eight scattered elements per lane. The caller __syncwarp()s between put_tile and this.
template <class O>
__device__ __forceinline__ void store_tile(O* out, const float* tile, int bb, int T, int c, int H, int h, int ig,
                                           int wk, int lane) {
    const int t = wk * LW + lane / 2, q = lane & 1, tt = c * L + t;
    if (lane < 2 * LW && tt < T) store4(out + tok(bb, T, tt, H, h) + ig + 4 * q, load4(tile + t * 8 + 4 * q));
}
// The group's two partial sums over the keys of two 16x8 accumulators, summed in both warps (the same
// bits in each, a + b == b + a), through the group's exchange buffer xch [2][8][32] and its named barrier;
// nothing for a one-warp group.
__device__ __forceinline__ void group_sum(float (&d1)[4], float (&d2)[4], float* xch, int wk, int group, int lane) {
    if constexpr (KW > 1) {
        float* mine = xch + wk * 8 * 32;
        const float* theirs = xch + (1 - wk) * 8 * 32;
#pragma unroll
        for (int e = 0; e < 4; ++e) { mine[e * 32 + lane] = d1[e]; mine[(4 + e) * 32 + lane] = d2[e]; }
        named_barrier<64>(1 + group);
#pragma unroll
        for (int e = 0; e < 4; ++e) { d1[e] += theirs[e * 32 + lane]; d2[e] += theirs[(4 + e) * 32 + lane]; }
    }
}
// d1 += A1 B and d2 += A2 B over the warp's part of the chunk's tokens (the K of the [L, L] products;
// the group's partial sums then add up to the whole product)
template <bool SPLIT, class FA1, class FA2>
__device__ __forceinline__ void token_part(float (&d1)[4], FA1 A1, float (&d2)[4], FA2 A2, const BFrags<L>& B, int wk) {
    if (wk == 0) mma_acc2<LW, SPLIT, 0>(d1, A1, d2, A2, B);
    else if constexpr (KW > 1) mma_acc2<LW, SPLIT, LW>(d1, A1, d2, A2, B);
}
// One chunk's step of the carried rows (Cw holds C^T by key): C^T = diag(PL) C^T + K0 B0 + K1 B1, with K0, K1
// the record's two key-major sections (forward: Kt^T V + Bt^T U; backward: rt^T dY + at^T dX), over the warp's
// keys; the decay term stays fp32.
template <class R>
__device__ __forceinline__ void carry_chunk(float* Cw, const float* Rs, const BFrags<L>& B0, const BFrags<L>& B1,
                                            int wk) {
#pragma unroll
    for (int i = 0; i < KH / 16; ++i) {                      // C^T rows 16 mt .. 16 mt + 15 (keys)
        const int mt = wk * (KH / 16) + i;
        float d[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = 16 * mt + acc_m(e);
            d[e] = Rs[R::PL + key] * Cw[acc_n(e) * SP4 + key];
        }
        mma_acc<L, XSPLIT>(d, FragOp{Rs + R::KM + 16 * mt * L}, B0);
        mma_acc<L>(d, FragOp{Rs + R::KM + LN + 16 * mt * L}, B1);
#pragma unroll
        for (int e = 0; e < 4; ++e) Cw[acc_n(e) * SP4 + 16 * mt + acc_m(e)] = d[e];
    }
}
// The launch must give the dynamic shared memory this layout needs (rwkvx/cu/wkv7/ops.py computes it).
template <class R>
__device__ __forceinline__ void check_smem(int NR, int ngroups) {
    if (dynamic_smem_size() < 4u * state_smem_floats<R>(NR, ngroups)) __trap();
}
// A state-pass thread's place: group (8 state rows), warp wk of the group (keys wk*KH .. +KH-1), and the
// group's tiles in shared memory
struct StatePlace {
    int group, wk, kh0, lane;
    float *rows, *tile0, *tile1, *xch;
    // init: the carried rows' first values, the group's rows of an [N, N] state from row 0 of its block
    // (NULL: zeros, or with eye the rows i0 + .. of the identity: a transition walk)
    template <class R>
    __device__ __forceinline__ StatePlace(float* sm, int NR, R, const float* init, bool eye, int i0) {
        const int tid = threadIdx.x;
        lane = tid & 31; group = tid / (32 * KW); wk = (tid >> 5) % KW; kh0 = wk * KH;
        rows = sm + state_smem_floats<R>(NR, 0) + group * GROUP_FLOATS;      // [8][SP4], shared by the group
        tile0 = rows + 8 * SP4 + wk * 2 * L * 8;                            // [L][8]
        tile1 = tile0 + L * 8;                                              // [L][8]
        xch = rows + 8 * SP4 + KW * 2 * L * 8;                              // [KW][8][32]
        const float* src = init != nullptr ? init + group * 8 * HN + kh0 : nullptr;
        for (int e = lane; e < 8 * KH; e += 32) {
            const int row = e / KH, key = kh0 + e % KH;
            rows[row * SP4 + key] = src != nullptr ? src[row * HN + e % KH]
                                                   : (eye && i0 + 8 * group + row == key ? 1.f : 0.f);
        }
    }
};
// A state-pass block's segment (rwkvx/cu/wkv7/ops.py: segment_layout): the chunks of a sequence are cut
// into S = ceil(n_c / m) segments of m chunks (the last one shorter), grid (P or 2P, H, B S). The plain
// walk (summary 0; S = 1 is today's whole-sequence walk) takes each segment from its true entering state;
// the summary walk (summary 1) takes blocks p < P from 0 (the segment's exit Z, its inputs' part) and
// blocks P + p from the identity without inputs (its transition Tr: S_exit = S_entry Tr + Z, each row
// linear on its own) and writes them to seg [B, H, S, 2, N, N] (slots (s, 0), (s, 1));
// wkv7c_segment_carry then turns the slots (s, 0) into the true exits.
struct Segment {
    int S, sg, bb, c0, n, P, p;
    bool trans;
    __device__ __forceinline__ Segment(int nC, int m, int summary) {
        S = (nC + m - 1) / m; sg = blockIdx.z % S; bb = blockIdx.z / S;
        c0 = sg * m; n = min(m, nC - c0);
        P = gridDim.x >> summary; p = blockIdx.x % P; trans = blockIdx.x >= P;
    }
    // the [N, N] slot (s, kind) of seg for this block's sequence and head h
    __device__ __forceinline__ float* slot(float* seg, int H, int h, int s, int kind) const {
        return seg + ((((long long)bb * H + h) * S + s) * 2 + kind) * HN * HN;
    }
};
}  // namespace wkv7c

// =============================================================================================
// Forward sequential pass over the chunks of each segment (Segment).  grid (P, H, B S) (summary: 2P),
// block N/P/8 groups of KW warps; block p owns rows p*N/P .. +N/P-1, group q rows 8 q .. 8 q + 7 of those,
// its warp wk the keys wk*N/KW .. +N/KW-1.  rec: forward records of wkv7c_intra.  y [B,T,H,N]; sa_out
// [B,T,H,N] fp32 and s0 [B,H,n_c,N,N] fp32 (the state entering each chunk), both or neither NULL; s_init
// [H,N,N] fp32 the state before t = 0 (NULL: 0); seg: the segments' exits and transitions (segment s > 0
// enters at slot (s - 1, 0)).  The summary walk writes only seg (y, sa_out, s0 NULL) and needs neither the
// last segment's exit nor the first one's transition.  Dynamic shared memory: state_smem_floats.
// =============================================================================================
extern "C" __global__ void __launch_bounds__(HN * 4 * KW)
wkv7c_forward_state(const float* __restrict__ rec, const floatX* __restrict__ v, floatX* __restrict__ y,
                    float* __restrict__ sa_out, float* __restrict__ s0, const float* __restrict__ s_init,
                    float* __restrict__ seg, int T, int H, int m, int summary)
{
    using R = FRec;
    extern __shared__ __align__(16) float sm[];
    const int h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int nC = (T + L - 1) / L;
    const Segment sw(nC, m, summary);
    if (summary && (sw.sg == sw.S - 1 || (sw.trans && sw.sg == 0))) return;
    const int NR = HN / sw.P, bb = sw.bb;
    check_smem<R>(NR, nt / (32 * KW));                         // before anything writes shared memory
    const int i0 = sw.p * NR;
    const float* init = sw.sg == 0 ? (s_init != nullptr ? s_init + (long long)h * HN * HN : nullptr)
                                   : summary ? nullptr : sw.slot(seg, H, h, sw.sg - 1, 0);
    const StatePlace me(sm, NR, R{}, init != nullptr ? init + i0 * HN : nullptr, sw.trans, i0);
    const int ri0 = me.group * 8, ig = i0 + ri0;                 // group's rows (local, global)
    float* recs = sm;                                            // [NS][R::SIZE]
    floatX* vs = reinterpret_cast<floatX*>(sm + NS * R::SIZE);  // [NS][L][NR + 8]
    float *Sw = me.rows, *Uw = me.tile0, *Yw = me.tile1;
    const float* recg = rec + (long long)(bb * H + h) * nC * R::SIZE;

    auto issue = [&](int g, int slot) {
        const int c = sw.c0 + g;
        stage_record<R>(recs + slot * R::SIZE, recg + (long long)c * R::SIZE, tid, nt);
        stage_rows(vs + slot * L * (NR + 8), sw.trans ? nullptr : v, bb, T, c, H, h, i0, NR, tid, nt);
    };
    ring_walk(sw.n, issue, [&](int g, int slot) {
        const int c = sw.c0 + g;
        const float* Rs = recs + slot * R::SIZE;
        const floatX* Vs = vs + slot * L * (NR + 8);
        if (s0 != nullptr)                                         // entering c
            store_rows(s0 + (((long long)(bb * H + h) * nC + c) * HN + ig) * HN + me.kh0, Sw + me.kh0, me.lane);
        auto Sb = [&](int kk, int n) { return Sw[n * SP4 + me.kh0 + kk]; };         // S0^T (the warp's keys, row)
        const BFrags<L> Vb = load_bfrags<L, XSPLIT>(      // V (token, row), for the products below
            [&](int kk, int n) { return to_f32(Vs[kk * (NR + 8) + ri0 + n]); });
        float u[4] = {0.f, 0.f, 0.f, 0.f}, yy[4] = {0.f, 0.f, 0.f, 0.f};
        mma_acc2<KH>(u, FragOp{Rs + R::TM + me.kh0 * 16},           // Qa S0^T
                     yy, FragOp{Rs + R::TM + LN + me.kh0 * 16}, Sb);  // Qr S0^T
        token_part<XSPLIT>(u, FragOp{Rs + R::LQ}, yy, FragOp{Rs + R::LQ + LL}, Vb, me.wk);  // Ca V, Cr V
        group_sum(u, yy, me.xch, me.wk, me.group, me.lane);
        put_tile(Uw, u);
        put_tile(Yw, yy);
        __syncwarp();
        if (y != nullptr) store_tile(y, Yw, bb, T, c, H, h, ig, me.wk, me.lane);
        if (sa_out != nullptr) store_tile(sa_out, Uw, bb, T, c, H, h, ig, me.wk, me.lane);
        const BFrags<L> Ub = load_bfrags<L, false>([&](int kk, int n) { return Uw[kk * 8 + n]; });  // U (token, row)
        carry_chunk<R>(Sw, Rs, Vb, Ub, me.wk);               // S_L^T = diag(PL) S0^T + Kt^T V + Bt^T U
    });
    if (summary)                                              // the segment's exit (ring_walk's last barrier)
        store_rows_once(sw.slot(seg, H, h, sw.sg, sw.trans) + (long long)ig * HN + me.kh0, Sw + me.kh0, me.lane);
}

// =============================================================================================
// Backward sequential pass (the chunks of each segment in reverse).  grid (P, H, B S) (summary: 2P),
// block N/P/8 groups of KW warps (as the forward).  rec: backward records of wkv7c_intra.  dv [B,T,H,N]
// (complete); dx [B,T,H,N] fp32; ds [B,H,n_c,N,N] fp32 = dL/dS at the end of each chunk through the later
// chunks; ds_part [B,H,N,N] fp32 (NULL: not written) = dL/dS_{-1}, the gradient of the initial state, per
// sequence; seg: the segments' exits and transitions walking backwards (dS = 0 after the last segment,
// segment s < S - 1 enters at slot (s + 1, 0)).  The summary walk writes only seg (dv, dx, ds, ds_part
// NULL) and needs neither the first segment's exit nor the last one's transition.  Dynamic shared memory:
// state_smem_floats.
// =============================================================================================
extern "C" __global__ void __launch_bounds__(HN * 4 * KW)
wkv7c_backward_state(const float* __restrict__ rec, const floatX* __restrict__ dy, float* __restrict__ dv,
                     float* __restrict__ dx, float* __restrict__ ds, float* __restrict__ ds_part,
                     float* __restrict__ seg, int T, int H, int m, int summary)
{
    using R = BRec;
    extern __shared__ __align__(16) float sm[];
    const int h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int nC = (T + L - 1) / L;
    const Segment sw(nC, m, summary);
    if (summary && (sw.sg == 0 || (sw.trans && sw.sg == sw.S - 1))) return;
    const int NR = HN / sw.P, bb = sw.bb;
    check_smem<R>(NR, nt / (32 * KW));                         // before anything writes shared memory
    const int i0 = sw.p * NR;
    const float* init = sw.sg == sw.S - 1 || summary ? nullptr : sw.slot(seg, H, h, sw.sg + 1, 0);
    const StatePlace me(sm, NR, R{}, init != nullptr ? init + i0 * HN : nullptr, sw.trans, i0);
    const int ri0 = me.group * 8, ig = i0 + ri0;
    float* recs = sm;
    floatX* ys = reinterpret_cast<floatX*>(sm + NS * R::SIZE);       // dY rows [NS][L][NR + 8]
    float *Gw = me.rows, *Xw = me.tile0, *Vw = me.tile1;              // dS rows, dX and dV tiles
    const float* recg = rec + (long long)(bb * H + h) * nC * R::SIZE;

    auto issue = [&](int g, int slot) {                        // step g = the segment's chunk n - 1 - g
        const int c = sw.c0 + sw.n - 1 - g;
        stage_record<R>(recs + slot * R::SIZE, recg + (long long)c * R::SIZE, tid, nt);
        stage_rows(ys + slot * L * (NR + 8), sw.trans ? nullptr : dy, bb, T, c, H, h, i0, NR, tid, nt);
    };
    ring_walk(sw.n, issue, [&](int g, int slot) {
        const int c = sw.c0 + sw.n - 1 - g;
        const float* Rs = recs + slot * R::SIZE;
        const floatX* Ys = ys + slot * L * (NR + 8);
        if (ds != nullptr)                                                          // after c
            store_rows(ds + (((long long)(bb * H + h) * nC + c) * HN + ig) * HN + me.kh0, Gw + me.kh0, me.lane);
        auto Gb = [&](int kk, int n) { return Gw[n * SP4 + me.kh0 + kk]; };          // dS^T (the warp's keys, row)
        const BFrags<L> Yb = load_bfrags<L, XSPLIT>(      // dY (token, row), for the products below
            [&](int kk, int n) { return to_f32(Ys[kk * (NR + 8) + ri0 + n]); });
        auto LQ = [&](int sec) {
            return FragOp{Rs + R::LQ + sec * LL};
        };
        float xx[4] = {0.f, 0.f, 0.f, 0.f}, vv[4] = {0.f, 0.f, 0.f, 0.f};
        mma_acc2<KH>(xx, FragOp{Rs + R::TM + me.kh0 * 16},           // Qb dS^T
                     vv, FragOp{Rs + R::TM + LN + me.kh0 * 16}, Gb);  // Kt dS^T
        token_part<XSPLIT>(xx, LQ(0), vv, LQ(1), Yb, me.wk);          // Db dY, Ark^T dY
        group_sum(xx, vv, me.xch, me.wk, me.group, me.lane);
        put_tile(Xw, xx);
        __syncwarp();
        if (dx != nullptr) store_tile(dx, Xw, bb, T, c, H, h, ig, me.wk, me.lane);
        const BFrags<L> Xb = load_bfrags<L, false>([&](int kk, int n) { return Xw[kk * 8 + n]; });  // dX (token, row)
        mma_acc<L>(vv, LQ(2), Xb);                                                                 // Aak^T dX
        put_tile(Vw, vv);
        __syncwarp();
        if (dv != nullptr) store_tile(dv, Vw, bb, T, c, H, h, ig, me.wk, me.lane);
        carry_chunk<R>(Gw, Rs, Yb, Xb, me.wk);               // dS0^T = diag(PL) dS^T + rt^T dY + at^T dX
    });
    if (summary)                                              // the segment's exit (ring_walk's last barrier)
        store_rows_once(sw.slot(seg, H, h, sw.sg, sw.trans) + (long long)ig * HN + me.kh0, Gw + me.kh0, me.lane);
    else if (ds_part != nullptr && sw.sg == 0)                // after chunk 0
        store_rows_once(ds_part + ((long long)(bb * H + h) * HN + ig) * HN + me.kh0, Gw + me.kh0, me.lane);
}

// =============================================================================================
// The pass over the segments between the summary walks and the plain walks.  grid (N/8, H, B), block
// (32, 8): 8 state rows, 32 lanes over the columns.  seg [B, H, S, 2, N, N] from the summary walk: slot
// (s, 0) the exit of segment s from 0 (of the first segment walked, from its true entry: already true),
// (s, 1) its transition.  Walking the segments in order (reverse: the backward's order) from the second
// one walked to the last but one, each exit becomes the true one in place: X_s = X_prev Tr_s + Z_s, the
// sum over k in order (fp32 FMA): bit-identical reruns.
// =============================================================================================
extern "C" __global__ void __launch_bounds__(256)
wkv7c_segment_carry(float* __restrict__ seg, int S, int reverse)
{
    __shared__ __align__(16) float Tr[HN][HN];
    __shared__ float X[8][HN];
    const int lane = threadIdx.x, ry = threadIdx.y, tid = ry * 32 + lane, i = 8 * blockIdx.x + ry;
    constexpr int NN = HN * HN, J = HN / 32;
    float* base = seg + ((long long)blockIdx.z * gridDim.y + blockIdx.y) * S * 2 * NN;
    const int d = reverse ? -1 : 1, first = reverse ? S - 2 : 1;
    for (int u = 0; u < J; ++u) X[ry][lane + 32 * u] = base[(first - d) * 2 * NN + i * HN + lane + 32 * u];
    for (int s = first; s != first + d * (S - 2); s += d) {
        float* z = base + s * 2 * NN;
        for (int e = tid; e < NN / 4; e += 256)
            *reinterpret_cast<float4*>(&Tr[0][0] + 4 * e) = *reinterpret_cast<const float4*>(z + NN + 4 * e);
        __syncthreads();
        float x[J];
#pragma unroll
        for (int u = 0; u < J; ++u) {
            float acc = z[i * HN + lane + 32 * u];
#pragma unroll 8
            for (int k = 0; k < HN; ++k) acc = fmaf(X[ry][k], Tr[k][lane + 32 * u], acc);
            x[u] = acc;
        }
        __syncthreads();                             // X and Tr read
#pragma unroll
        for (int u = 0; u < J; ++u) {
            X[ry][lane + 32 * u] = x[u];
            z[i * HN + lane + 32 * u] = x[u];
        }
    }
}

// =============================================================================================
// Per-chunk key-space gradients.  grid (n_c, H, B), block 4*N (N/8 warps): thread (tq, j) =
// (tid / N, tid % N) owns column j of tokens 4 tq .. 4 tq + 3 in the element-wise parts; warp wq computes
// keys 8 wq .. 8 wq + 7 of the products over the value rows dY S0, dX S0, V dS, U dS [L, N] (tensor cores,
// tf32; 3xTF32 when EXACT); dY V^T, dY U^T, dX V^T, dX U^T [L, L] take one warp each (3xTF32: at small T each entry is a whole
// gradient's coefficient).
// sa = U (forward), s0 (forward), ds and dx (backward_state).
//   drt = dY S0 + slower(dY V^T) kh + slower(dY U^T) bh,  dat = dX S0 + slower(dX V^T) kh + slower(dX U^T) bh,
//   dkh = slower(dY V^T)^T rt + slower(dX V^T)^T at + (V dS) PL,  dbh = the same with U,
//   dlog cw = drt rt - dkh kh - dbh bh,  dlog cx = dat at,  dlog PL = PL (sum_i S0 dS + sum_t (V dS) kh + (U dS) bh),
//   dlog w_s = sum_{t>=s} dlog cw_t + sum_{t>s} dlog cx_t + dlog PL,  dw = dlog w / w,
//   dr = drt cw, da = dat cx, dk = dkh / cw, db = dbh / cw; the diagonal of Ark, Arb (no decay in it)
//   adds k (dy.v) + b (dy.u) to dr, r (dy.v) to dk and r (dy.u) to db outside the log-decay sums.
// =============================================================================================
extern "C" __global__ void __launch_bounds__(HN * 4)
wkv7c_backward_grads(const floatX* __restrict__ r, const float* __restrict__ w, const floatX* __restrict__ k,
                     const floatX* __restrict__ v, const floatX* __restrict__ a, const floatX* __restrict__ b,
                     const floatX* __restrict__ dy, const float* __restrict__ sa, const float* __restrict__ s0,
                     const float* __restrict__ ds, const float* __restrict__ dx,
                     floatX* __restrict__ dr, float* __restrict__ dw, float* __restrict__ dk,
                     float* __restrict__ da, float* __restrict__ db, int T, int H)
{
    constexpr int SP = HN + 4, TQ = L / 4, NW = HN / 8;
    __shared__ float rt[L][HN], at[L][HN], kh[L][HN], bh[L][HN], cw[L][HN], wv[L][HN];
    // V, U, dY, dX (mma A operands); then dY S0, dX S0, V dS, U dS; then dlog cw, dlog cx, E
    __shared__ __align__(16) float Vs[L][SP], Us[L][SP], Ys[L][SP], Xs[L][SP];
    __shared__ float dA[4][L][L + 1];                              // dY V^T, dY U^T, dX V^T, dX U^T
    __shared__ float sds[HN];                                      // sum_i S0[i, j] dS[i, j]
    __shared__ float diag[2][L];                                   // WKV_EXACT: dy_t.v_t, dy_t.u_t (quad_dot2)
    const int c = blockIdx.x, h = blockIdx.y, bb = blockIdx.z, tid = threadIdx.x, nt = blockDim.x;
    const int nC = gridDim.x, tq = tid / HN, j = tid % HN;
    const int wq = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;

    {                                                // the chunk's inputs (padding: w = 1, the rest 0)
        ChunkTile<4 * HN> xv, xu, xy, xx, xw, xr, xa, xk, xb;
        xv.load(v, 0.f, bb, T, c, H, h, tid);
        xu.load(sa, 0.f, bb, T, c, H, h, tid);
        xy.load(dy, 0.f, bb, T, c, H, h, tid);
        xx.load(dx, 0.f, bb, T, c, H, h, tid);
        xw.load(w, 1.f, bb, T, c, H, h, tid);
        xr.load(r, 0.f, bb, T, c, H, h, tid);
        xa.load(a, 0.f, bb, T, c, H, h, tid);
        xk.load(k, 0.f, bb, T, c, H, h, tid);
        xb.load(b, 0.f, bb, T, c, H, h, tid);
        xv.store(Vs, tid); xu.store(Us, tid); xy.store(Ys, tid); xx.store(Xs, tid); xw.store(wv, tid);
        xr.store(rt, tid); xa.store(at, tid); xk.store(kh, tid); xb.store(bh, tid);
    }
    // the B operands of the [L, N] products, S0[i, 8 wq + g] and dS[i, 8 wq + g], in flight across the barrier
    float s0f[HN / 4], dsf[HN / 4];
    {
        const long long base = ((long long)(bb * H + h) * nC + c) * HN * HN + 8 * wq + g;
#pragma unroll
        for (int i = 0; i < HN / 4; ++i) {
            const int row = 8 * (i >> 1) + q + 4 * (i & 1);
            s0f[i] = s0[base + row * HN];
            dsf[i] = ds[base + row * HN];
        }
    }
    __syncthreads();
    if (tid < HN) {                                  // the same decay products as wkv7c_intra
        float p = 1.f;
        for (int t = 0; t < L; ++t) {
            const float cx = p;
            p *= wv[t][tid];
            cw[t][tid] = p;
            rt[t][tid] *= p;
            at[t][tid] *= cx;
            kh[t][tid] /= p;
            bh[t][tid] /= p;
        }
    }
    float pYS[4] = {0.f, 0.f, 0.f, 0.f}, pXS[4] = {0.f, 0.f, 0.f, 0.f};
    float pKt[4] = {0.f, 0.f, 0.f, 0.f}, pBt[4] = {0.f, 0.f, 0.f, 0.f};
    {   // [L, N] products: dY S0, dX S0, V dS, U dS (keys 8 wq .. 8 wq + 7)
        float sd = 0.f;
#pragma unroll
        for (int k0 = 0; k0 < HN; k0 += 8) {
            const float s_0 = s0f[k0 / 4], s_1 = s0f[k0 / 4 + 1];
            const float g_0 = dsf[k0 / 4], g_1 = dsf[k0 / 4 + 1];
            sd = fmaf(s_1, g_1, fmaf(s_0, g_0, sd));
            unsigned bs[2], bsl[2], bg[2], bgl[2];      // the lo parts enter only when EXACT
            split_tf32(s_0, bs[0], bsl[0]); split_tf32(s_1, bs[1], bsl[1]);
            split_tf32(g_0, bg[0], bgl[0]); split_tf32(g_1, bg[1], bgl[1]);
            mma_step<false>(pYS, [&](int m, int kk) { return Ys[m][kk]; }, bs, bsl, k0);
            mma_step<false>(pXS, [&](int m, int kk) { return Xs[m][kk]; }, bs, bsl, k0);
            mma_step<false>(pKt, [&](int m, int kk) { return Vs[m][kk]; }, bg, bgl, k0);
            mma_step<false>(pBt, [&](int m, int kk) { return Us[m][kk]; }, bg, bgl, k0);
        }
        sd += __shfl_xor_sync(0xffffffffu, sd, 1);   // the quad's 4 row subsets of column 8 wq + g
        sd += __shfl_xor_sync(0xffffffffu, sd, 2);
        if (q == 0) sds[8 * wq + g] = sd;
    }
    if constexpr (EXACT) {                           // the last 4 warps' quads: dy_t.v_t (0-15), dy_t.u_t (16-31)
        static_assert(8 * L == 128 && 4 * HN >= 128, "one quad of the last 4 warps per (diagonal, token)");
        const int e = tid - (4 * HN - 128), t = (e >> 2) & (L - 1), m = e >> 6;
        if (e >= 0) {
            const float(*Y)[SP] = m ? Us : Vs;
            const float d = quad_dot2([&](int jj) { return Ys[t][jj]; }, [&](int jj) { return Y[t][jj]; }, e & 3);
            if ((e & 3) == 0) diag[m][t] = d;
        }
    }
    if (wq < 4) {                                    // [L, L] products, warp wq the matrix dA[wq]
        const float(*X)[SP] = wq < 2 ? Ys : Xs;
        const float(*Y)[SP] = (wq & 1) ? Us : Vs;
        float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        gram3<HN>(d, [&](int m, int kk) { return X[m][kk]; }, [&](int n, int kk) { return Y[n][kk]; });
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dA[wq][acc_m(e)][8 * nt + acc_n(e)] = d[nt][e];
    }
    __syncthreads();                                 // V, U, dY, dX read: their space takes the products
    float (*dYS)[SP] = Vs, (*dXS)[SP] = Us, (*dKt)[SP] = Ys, (*dBt)[SP] = Xs;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int m = acc_m(e), n = 8 * wq + acc_n(e);
        dYS[m][n] = pYS[e]; dXS[m][n] = pXS[e]; dKt[m][n] = pKt[e]; dBt[m][n] = pBt[e];
    }
    __syncthreads();
    const float PLj = cw[L - 1][j];
    float drt[TQ], dat[TQ], dkh[TQ], dbh[TQ], kt[TQ], bt[TQ];
#pragma unroll
    for (int u = 0; u < TQ; ++u) {
        const int t = TQ * tq + u;
        kt[u] = dKt[t][j];
        bt[u] = dBt[t][j];
        float x0 = dYS[t][j], x1 = dXS[t][j], x2 = kt[u] * PLj, x3 = bt[u] * PLj;
        for (int s = 0; s < t; ++s) {
            x0 = fmaf(dA[0][t][s], kh[s][j], fmaf(dA[1][t][s], bh[s][j], x0));
            x1 = fmaf(dA[2][t][s], kh[s][j], fmaf(dA[3][t][s], bh[s][j], x1));
        }
        for (int s = t + 1; s < L; ++s) {
            x2 = fmaf(dA[0][s][t], rt[s][j], fmaf(dA[2][s][t], at[s][j], x2));
            x3 = fmaf(dA[1][s][t], rt[s][j], fmaf(dA[3][s][t], at[s][j], x3));
        }
        drt[u] = x0; dat[u] = x1; dkh[u] = x2; dbh[u] = x3;
    }
    __syncthreads();                                 // every thread has its products: the space is reused
    float (*dlcw)[SP] = Vs, (*dlcx)[SP] = Us, (*E)[SP] = Ys;
#pragma unroll
    for (int u = 0; u < TQ; ++u) {
        const int t = TQ * tq + u, tt = c * L + t;
        const float kht = kh[t][j], bht = bh[t][j], rtt = rt[t][j], att = at[t][j], cwt = cw[t][j];
        dlcw[t][j] = drt[u] * rtt - dkh[u] * kht - dbh[u] * bht;
        dlcx[t][j] = dat[u] * att;
        E[t][j] = kt[u] * kht + bt[u] * bht;
        if (tt < T) {
            const float dyv = EXACT ? diag[0][t] : dA[0][t][t];   // dy_t . v_t
            const float dyu = EXACT ? diag[1][t] : dA[1][t][t];   // dy_t . u_t
            const long long o = tok(bb, T, tt, H, h) + j;
            const float cxt = t > 0 ? cw[t - 1][j] : 1.f;
            dr[o] = from_f32((drt[u] + kht * dyv + bht * dyu) * cwt);
            dk[o] = (dkh[u] + rtt * dyv) / cwt;
            db[o] = (dbh[u] + rtt * dyu) / cwt;
            da[o] = dat[u] * cxt;
        }
    }
    __syncthreads();
    if (tid < HN) {                                  // reverse sums over the chunk's tokens, column j = tid
        float pl = sds[tid];
        for (int t = 0; t < L; ++t) pl += E[t][tid];
        float acc = pl * cw[L - 1][tid], accx = 0.f;
        for (int t = L - 1; t >= 0; --t) {
            acc += dlcw[t][tid];
            const int tt = c * L + t;
            if (tt < T) dw[tok(bb, T, tt, H, h) + tid] = (acc + accx) / wv[t][tid];
            accx += dlcx[t][tid];
        }
    }
}
