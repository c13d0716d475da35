// rwkvx/cu/moba/moba.cuh — what the MoBA kernel files share: MoBA sparse attention (docs/SPEC.md §2.3
// "Attn (MoBA)"), forward and backward, fp32 math, flash-style, in three files by job: select.cu (the block
// selection and the query lists, and the backward's delta: the same for both methods), exact.cu (attention
// on CUDA cores in fp32, method "exact") and mma.cu (attention on tensor cores, method "mma").
//
// Layout: q, k, v, o, do, dq, dk, dv floatX [B, T, H, N] (= row-major [B*T, C], c = h*N + n), aligned to
// 4 elements; tiles are widened to fp32 in shared memory. N = HEAD_SIZE (compile-time, 4..256); chunk,
// top_k runtime; K1 = top_k - 1; nblk = ceil(T / chunk); scale = 1/sqrt(N). Per (b, h) "bh" = b*H + h.
// Tile sizes, thread counts, padded row strides and the shared-memory carve-ups (MOBA_SM_*, word
// offsets) come from the declaration in rwkvx/cu/moba/ops.py.
//
// Scratch (see rwkvx/cu/moba/ops.py for sizes; nothing needs zeroing beforehand):
//   kmean  float [B, H, nblk, N]    mean of k over each block
//   sel    int   [B, H, T, K1]      selected past blocks of query t, ascending, -1 padded
//   cnt    int   [B, H, nblk]       number of queries that selected block j
//   idx    int   [B, H, 3, nblk+1]  per bh: offs[j] = sum_{j'<j} cnt[j'] (entries in qlist),
//                                   toff_f[j] = sum_{j'<j} ceil(cnt[j'] / MOBA_FQ),
//                                   toff_d[j] = sum_{j'<j} ceil(cnt[j'] / MOBA_DQ_Q)  (tile offsets)
//   qlist  int   [B, H, Emax]       per bh, for each j the entries t*K1 + s of the queries t whose slot s
//                                   selected j, ascending t, at offs[j] .. offs[j+1]-1
//                                   (Emax = sum_t min(K1, t // chunk), the most entries there can be)
//   part   float [B, H, T, K1, N]   forward: normalised partial output of query t over block sel[t,s];
//                                   backward: dq of query t from the keys of block sel[t,s]
//   lpart  float [B, H, T, K1]      forward: logsumexp of that partial
//   lse    float [B, H, T]          logsumexp (natural log) of the scaled scores over all visible keys
//   delta  float [B, H, T]          backward: D_t = sum_n do[t,n] * o[t,n]
//   olo    bf16  [B, T, H, N]       bf16 activations only: o - bf16(o), the fp32 output's residual (written
//                                   by the forward, kept for the backward's delta)
//
// Forward:  (1) moba_kmean -> (2) moba_select -> (3) moba_scan -> (4) moba_fill -> (5) moba_fwd_past
//           -> (6) moba_fwd_own
// Backward: (7) moba_bwd_delta -> (8) moba_bwd_dq_past -> (9) moba_bwd_dq_own -> (10) moba_bwd_dkdv
// (1)-(4) and (7) are in select.cu, (5), (6), (8)-(10) in exact.cu, their tensor-core versions (5m) ... in
// mma.cu (names ending in _mma).
//
// Determinism: no floating-point atomics. moba_select counts selections with integer atomics (the
// count does not depend on the order); every list position and every float sum has a fixed order:
//   * past attention is key-block-centric: one CTA per (block j, tile of the queries that selected j,
//     gathered in ascending t); it writes a per-(query, slot) partial, merged by the own-block kernel in
//     slot order (forward: logsumexp merge; backward dq: plain sum);
//   * dk, dv: one CTA per (key tile of block j) loops over the own-block query tiles (causal), then the
//     tiles of qlist for j, accumulating in registers, and writes once.
#pragma once

#include "common.cuh"
#if !defined(HEAD_SIZE) || !defined(MOBA_NTHR) || !defined(MOBA_FQ) || !defined(MOBA_DQ_Q)
#error "moba/moba.cuh: HEAD_SIZE, MOBA_NTHR and the tiles come from rwkvx/cu/moba/ops.py"
#endif

#define HS HEAD_SIZE
#define HS4 (HS / 4)
#define NTHR MOBA_NTHR             // threads of the attention kernels
static_assert(HS % 4 == 0 && HS >= 4 && HS <= 256, "HEAD_SIZE must be a multiple of 4 in [4, 256]");

#define FULL_MASK 0xffffffffu
#define MOBA_INF __int_as_float(0x7f800000)   // +inf (NVRTC has no <cmath> INFINITY)

// ------------------------------------------------------------------------------------------------
// helpers of both attention methods
// ------------------------------------------------------------------------------------------------

// Merge a partial output of logsumexp lp into the running (max m, sum l): the weights of the running
// output (alpha) and of the partial (beta), both relative to the new max.
static __device__ __forceinline__ void moba_lse_merge(float& m, float& l, float lp, float& alpha, float& beta)
{
    const float mnew = fmaxf(m, lp);
    alpha = expf(m - mnew);
    beta = expf(lp - mnew);
    l = l * alpha + beta;
    m = mnew;
}

// The past partials of query t (sel/lpart/part rows from entry e0 = (bh*T + t)*K1, slots in order, a
// negative sel ends them) merged into the running (max mi, sum li): add(pr, alpha, beta) rescales the
// output by alpha and adds beta times the slot's partial row pr.
template <class Add>
static __device__ __forceinline__ void moba_merge_partials(const int* __restrict__ sel,
                                                           const float* __restrict__ lpart,
                                                           const float* __restrict__ part, size_t e0, int K1,
                                                           float& mi, float& li, Add add)
{
    for (int s = 0; s < K1; ++s) {
        if (sel[e0 + s] < 0) break;
        const float lp = lpart[e0 + s];
        float alpha, beta;
        moba_lse_merge(mi, li, lp, alpha, beta);
        add(part + (e0 + s) * HS, alpha, beta);
    }
}

// o[row + c] = x rounded to floatX; in bf16 also olo[row + c] = the rounding's residual, so that the backward's
// delta is taken from the fp32 output: from the rounded output alone, sum_u dS_tu = D_t(P) - D_t is off by do.(o -
// bf16(o)) and dq_t, dk_u pick up that error times the P-weighted mean of k, q (docs/PERFORMANCE.md, "bf16
// accuracy"). o + olo holds x to about 16 bits. olo is null (and never offset) unless FLOATX_BF16.
static __device__ __forceinline__ void moba_store_out(floatX* __restrict__ o, floatX* __restrict__ olo, size_t row,
                                                      int c, float x)
{
    const floatX hi = from_f32(x);
    o[row + c] = hi;
#if FLOATX_BF16
    olo[row + c] = from_f32(x - to_f32(hi));
#endif
}

// The dq partials of query t (part rows from entry e0 = (bh*T + t)*K1, slots in order, a negative sel
// ends them): add(pr) adds the slot's partial row pr to the query's dq.
template <class Add>
static __device__ __forceinline__ void moba_sum_partials(const int* __restrict__ sel,
                                                         const float* __restrict__ part, size_t e0, int K1, Add add)
{
    for (int s = 0; s < K1; ++s) {
        if (sel[e0 + s] < 0) break;
        add(part + (e0 + s) * HS);
    }
}

// The dynamic shared memory of a launch, as 4-byte words (the MOBA_SM_* offsets count words).
extern __shared__ float4 moba_smem4[];
static __device__ __forceinline__ float* moba_smem_f(int word) { return reinterpret_cast<float*>(moba_smem4) + word; }
static __device__ __forceinline__ int* moba_smem_i(int word) { return reinterpret_cast<int*>(moba_smem4) + word; }

// Largest j with toff[j] <= x (toff non-decreasing, toff[0] = 0); false when x >= toff[nblk].
static __device__ __forceinline__ bool moba_find_tile(const int* __restrict__ toff, int nblk, int x,
                                                      int& j, int& tile)
{
    if (x >= toff[nblk]) return false;
    int lo = 0, hi = nblk - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (toff[mid] <= x) lo = mid; else hi = mid - 1;
    }
    j = lo;
    tile = x - toff[lo];
    return true;
}

// The query tile of a key-block-centric CTA of (b, h) = bh: tile `tile` of the entries t*K1 + s of qlist
// that selected block j (blockIdx.x indexes the tiles through the tile offsets in row `toff_row` of idx:
// 1 toff_f, 2 toff_d). qent[r] = entry, qtok[r] = t (-1 past the end). False when this CTA has no tile.
// Ends with __syncthreads().
template <int TQ>
static __device__ __forceinline__ bool moba_past_queries(const int* __restrict__ idx, const int* __restrict__ qlist,
                                                         int bh, int nblk, int Emax, int K1, int toff_row,
                                                         int* qent, int* qtok, int& j)
{
    const int* offs = idx + (size_t)bh * 3 * (nblk + 1);
    const int* toff = offs + toff_row * (nblk + 1);
    const int* qlist_bh = qlist + (size_t)bh * Emax;
    int tile;
    if (!moba_find_tile(toff, nblk, blockIdx.x, j, tile)) return false;
    const int e0 = offs[j] + tile * TQ;
    const int e1 = min(e0 + TQ, offs[j + 1]);
    for (int r = threadIdx.x; r < TQ; r += NTHR) {
        const int p = (e0 + r < e1) ? qlist_bh[e0 + r] : -1;
        qent[r] = p;
        qtok[r] = p >= 0 ? p / K1 : -1;
    }
    __syncthreads();
    return true;
}

// Where head h of sequence b lies in the [B, T, H, N] tensors: token t of it at hoff + t * tstride.
struct MobaHead {
    size_t tstride, hoff;
    __device__ MobaHead(int b, int h, int T, int H)
        : tstride((size_t)H * HS), hoff(((size_t)b * T * H + h) * HS) {}
};

// The key tile of a dk/dv CTA (grid (ceil(chunk / KT), nblk, B*H)): keys u0 .. u0 + nk() - 1 of block j,
// which ends at bend, of head (b, h), bh = b*H + h. The CTA has no keys when u0 >= bend.
template <int KT>
struct MobaKeyTile {
    int j, bh, b, h, u0, bend;
    __device__ MobaKeyTile(int T, int H, int chunk)
        : j(blockIdx.y), bh(blockIdx.z), b(bh / H), h(bh - b * H), u0(j * chunk + blockIdx.x * KT),
          bend(min((j + 1) * chunk, T)) {}
    __device__ int nk() const { return min(KT, bend - u0); }
};

// The query tile of an own-block CTA: tile blockIdx.x % tpc of block blockIdx.x / tpc (tpc tiles of TQ
// queries per block); qtok[r] = q0 + r up to q1. False when the tile starts past T. Ends with
// __syncthreads().
template <int TQ>
static __device__ __forceinline__ bool moba_own_queries(int T, int chunk, int* qtok, int& kstart, int& q1)
{
    const int tpc = (chunk + TQ - 1) / TQ;
    const int cblk = blockIdx.x / tpc, ti = blockIdx.x - cblk * tpc;
    kstart = cblk * chunk;
    const int q0 = kstart + ti * TQ;
    if (q0 >= T) return false;
    q1 = min(min(q0 + TQ, kstart + chunk), T);
    for (int r = threadIdx.x; r < TQ; r += NTHR) qtok[r] = (q0 + r < q1) ? q0 + r : -1;
    __syncthreads();
    return true;
}
