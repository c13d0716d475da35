// rwkvx/cu/moba/exact.cu — MoBA attention on CUDA cores in fp32 (method "exact"): tiles of queries and keys
// widened to fp32 in shared memory, TX x TY threads per tile, online softmax (docs and buffers: moba.cuh).

#include "moba/moba.cuh"
#if !defined(MOBA_LDH) || !defined(MOBA_FK) || !defined(MOBA_DQ_K) || !defined(MOBA_KV_K) || !defined(MOBA_KV_Q) \
    || !defined(MOBA_FLDP) || !defined(MOBA_DLDP) || !defined(MOBA_KLDP) || !defined(MOBA_SM_KV_QTOK)
#error "moba/exact.cu: the tiles and the shared-memory layouts come from rwkvx/cu/moba/ops.py"
#endif

#define LDH MOBA_LDH               // padded shared-memory row stride of [rows][HS] tiles
#define NC ((HS + 15) / 16)        // output columns per thread (col = tx + 16*c)
#define TX 16                      // threads along columns
#define TY 8                       // threads along rows

static_assert(TX * TY == NTHR, "the attention tiles assume TX x TY threads");
static_assert(MOBA_FQ % TY == 0 && MOBA_FK % TX == 0, "forward tiles");
static_assert(MOBA_DQ_Q % TY == 0 && MOBA_DQ_K % TX == 0, "dq tiles");
static_assert(MOBA_KV_K % TY == 0 && MOBA_KV_Q % TX == 0, "dk/dv tiles");
static_assert(MOBA_FK % 4 == 0 && MOBA_DQ_K % 4 == 0 && MOBA_KV_Q % 4 == 0, "float4 rows");

// ------------------------------------------------------------------------------------------------
// helpers
// ------------------------------------------------------------------------------------------------

// max / sum over the 16 lanes of a half-warp that share a tile row (fixed xor tree: deterministic)
static __device__ __forceinline__ float moba_row_max(float v)
{
#pragma unroll
    for (int o = TX / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

static __device__ __forceinline__ float moba_row_sum(float v)
{
#pragma unroll
    for (int o = TX / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

static __device__ __forceinline__ bool moba_col_ok(int col)
{
    return (HS % 16 == 0) || col < HS;
}

// Rows tok[0..R) of a [T, H, HS] head slice (base = &x[b, 0, h, 0], row stride tstride) into the fp32
// tile dst [R][LDH]; tok < 0 gives a zero row. Coalesced 4-element loads.
static __device__ __forceinline__ void moba_load_rows(float* __restrict__ dst, const floatX* __restrict__ base,
                                                      size_t tstride, const int* tok, int R)
{
    for (int idx = threadIdx.x; idx < R * HS4; idx += blockDim.x) {
        const int r = idx / HS4, c4 = idx - r * HS4;
        const int t = tok[r];
        store4(dst + r * LDH + c4 * 4, t >= 0 ? load4(base + (size_t)t * tstride + c4 * 4) : f4_zero());
    }
}

// Rows u0 .. u0+nk-1 (contiguous tokens; rows nk..R-1 zero)
static __device__ __forceinline__ void moba_load_range(float* __restrict__ dst, const floatX* __restrict__ base,
                                                       size_t tstride, int u0, int nk, int R)
{
    for (int idx = threadIdx.x; idx < R * HS4; idx += blockDim.x) {
        const int r = idx / HS4, c4 = idx - r * HS4;
        store4(dst + r * LDH + c4 * 4, r < nk ? load4(base + (size_t)(u0 + r) * tstride + c4 * 4) : f4_zero());
    }
}

// The carve-ups of the attention kernels (layouts: rwkvx/cu/moba/ops.py).
struct MobaFwdSmem {
    float *Q, *K, *V, *P;                 // [FQ][LDH] [FK][LDH] [FK][LDH] [FQ][FLDP]
    int *qtok, *qent;                     // [FQ] [FQ]
    __device__ MobaFwdSmem()
        : Q(moba_smem_f(0)), K(moba_smem_f(MOBA_SM_FWD_K)), V(moba_smem_f(MOBA_SM_FWD_V)),
          P(moba_smem_f(MOBA_SM_FWD_P)), qtok(moba_smem_i(MOBA_SM_FWD_QTOK)), qent(moba_smem_i(MOBA_SM_FWD_QENT)) {}
};
struct MobaDqSmem {
    float *Q, *dO, *K, *V, *dS, *lse, *D; // [DQ_Q][LDH] x2, [DQ_K][LDH] x2, [DQ_Q][DLDP], [DQ_Q] x2
    int *qtok, *qent;                     // [DQ_Q] [DQ_Q]
    __device__ MobaDqSmem()
        : Q(moba_smem_f(0)), dO(moba_smem_f(MOBA_SM_DQ_DO)), K(moba_smem_f(MOBA_SM_DQ_K)),
          V(moba_smem_f(MOBA_SM_DQ_V)), dS(moba_smem_f(MOBA_SM_DQ_DS)), lse(moba_smem_f(MOBA_SM_DQ_LSE)),
          D(moba_smem_f(MOBA_SM_DQ_D)), qtok(moba_smem_i(MOBA_SM_DQ_QTOK)), qent(moba_smem_i(MOBA_SM_DQ_QENT)) {}
};
struct MobaKvSmem {
    float *K, *V, *Q, *dO, *P, *dS, *lse, *D;   // [KV_K][LDH] x2, [KV_Q][LDH] x2, [KV_K][KLDP] x2, [KV_Q] x2
    int *qtok;                                  // [KV_Q]
    __device__ MobaKvSmem()
        : K(moba_smem_f(0)), V(moba_smem_f(MOBA_SM_KV_V)), Q(moba_smem_f(MOBA_SM_KV_Q)),
          dO(moba_smem_f(MOBA_SM_KV_DO)), P(moba_smem_f(MOBA_SM_KV_P)), dS(moba_smem_f(MOBA_SM_KV_DS)),
          lse(moba_smem_f(MOBA_SM_KV_LSE)), D(moba_smem_f(MOBA_SM_KV_D)), qtok(moba_smem_i(MOBA_SM_KV_QTOK)) {}
};

// acc[i][c] += A[row_i] . B[col_c] over HS, A rows ty + TY*i, B rows tx + TX*c (both [.][LDH] in smem).
// Summation in ascending n (fixed order).
template <int RI, int CJ>
static __device__ __forceinline__ void moba_dot_tile(float (&acc)[RI][CJ], const float* __restrict__ A,
                                                     const float* __restrict__ Bm, int ty, int tx)
{
#pragma unroll 2
    for (int n = 0; n < HS; n += 4) {
        float4 bv[CJ];
#pragma unroll
        for (int c = 0; c < CJ; ++c) bv[c] = *reinterpret_cast<const float4*>(Bm + (tx + TX * c) * LDH + n);
#pragma unroll
        for (int i = 0; i < RI; ++i) {
            const float4 av = *reinterpret_cast<const float4*>(A + (ty + TY * i) * LDH + n);
#pragma unroll
            for (int c = 0; c < CJ; ++c) {
                float s = acc[i][c];
                s = fmaf(av.x, bv[c].x, s);
                s = fmaf(av.y, bv[c].y, s);
                s = fmaf(av.z, bv[c].z, s);
                s = fmaf(av.w, bv[c].w, s);
                acc[i][c] = s;
            }
        }
    }
}

// out[i][c2] += sum_u P[row_i][u] * V[u][col_c2], P [.][LDP] rows ty + TY*i, V [.][LDH], u in [0, NU).
template <int RI, int NU, int LDP>
static __device__ __forceinline__ void moba_pv_tile(float (&out)[RI][NC], const float* __restrict__ P,
                                                    const float* __restrict__ V, int ty, int tx)
{
#pragma unroll 2
    for (int u = 0; u < NU; u += 4) {
        float vv[4][NC];
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const int col = tx + TX * c;
                vv[e][c] = moba_col_ok(col) ? V[(u + e) * LDH + col] : 0.f;
            }
#pragma unroll
        for (int i = 0; i < RI; ++i) {
            const float4 pv = *reinterpret_cast<const float4*>(P + (ty + TY * i) * LDP + u);
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                float s = out[i][c];
                s = fmaf(pv.x, vv[0][c], s);
                s = fmaf(pv.y, vv[1][c], s);
                s = fmaf(pv.z, vv[2][c], s);
                s = fmaf(pv.w, vv[3][c], s);
                out[i][c] = s;
            }
        }
    }
}

// Keys and values u0 .. u0+nk-1 of a head slice into the tiles Ks, Vs [TK][LDH] (rows nk.. zero).
template <int TK>
static __device__ __forceinline__ void moba_load_kv(float* Ks, float* Vs, const floatX* __restrict__ k,
                                                    const floatX* __restrict__ v, size_t tstride, int u0, int nk)
{
    moba_load_range(Ks, k, tstride, u0, nk, TK);
    moba_load_range(Vs, v, tstride, u0, nk, TK);
}


// ------------------------------------------------------------------------------------------------
// forward attention core: one key tile [u0, u0+nk) against the query tile in Qs (rows ty + TY*i),
// online softmax in fp32. causal: key u visible to query t iff u <= t (t = qtok[row]; qtok < 0 rows
// see nothing). Ks, Vs [FK][LDH], Ps [FQ][FLDP].
// ------------------------------------------------------------------------------------------------
#define FRQ (MOBA_FQ / TY)
#define FCK (MOBA_FK / TX)
#define FLDP MOBA_FLDP

static __device__ __forceinline__ void moba_fwd_tile(const float* __restrict__ Qs, const float* __restrict__ Ks,
                                                     const float* __restrict__ Vs, float* __restrict__ Ps,
                                                     const int* __restrict__ qtok, int u0, int nk, bool causal,
                                                     float scale, float (&m)[FRQ], float (&l)[FRQ],
                                                     float (&acc)[FRQ][NC])
{
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    float s[FRQ][FCK];
#pragma unroll
    for (int i = 0; i < FRQ; ++i)
#pragma unroll
        for (int c = 0; c < FCK; ++c) s[i][c] = 0.f;
    moba_dot_tile<FRQ, FCK>(s, Qs, Ks, ty, tx);
#pragma unroll
    for (int i = 0; i < FRQ; ++i) {
        const int r = ty + TY * i;
        const int t = qtok[r];
        float mx = -MOBA_INF;
#pragma unroll
        for (int c = 0; c < FCK; ++c) {
            const int kc = tx + TX * c;
            const bool vis = kc < nk && t >= 0 && (!causal || u0 + kc <= t);
            s[i][c] = vis ? s[i][c] * scale : -MOBA_INF;
            mx = fmaxf(mx, s[i][c]);
        }
        mx = moba_row_max(mx);
        const float mnew = fmaxf(m[i], mx);
        const float mref = (mnew == -MOBA_INF) ? 0.f : mnew;
        const float alpha = expf(m[i] - mref);
        float rs = 0.f;
#pragma unroll
        for (int c = 0; c < FCK; ++c) {
            const float p = expf(s[i][c] - mref);
            Ps[r * FLDP + tx + TX * c] = p;
            rs += p;
        }
        rs = moba_row_sum(rs);
        l[i] = l[i] * alpha + rs;
        m[i] = mnew;
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[i][c] *= alpha;
    }
    __syncthreads();
    moba_pv_tile<FRQ, MOBA_FK, FLDP>(acc, Ps, Vs, ty, tx);
    __syncthreads();
}

// The query tile in Qs against keys u .. uend-1 in tiles of FK, from a fresh online-softmax state.
static __device__ __forceinline__ void moba_fwd_attend(const MobaFwdSmem& sm, const floatX* __restrict__ k,
                                                       const floatX* __restrict__ v, size_t tstride, int u,
                                                       int uend, bool causal, float scale, float (&m)[FRQ],
                                                       float (&l)[FRQ], float (&acc)[FRQ][NC])
{
#pragma unroll
    for (int i = 0; i < FRQ; ++i) {
        m[i] = -MOBA_INF;
        l[i] = 0.f;
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[i][c] = 0.f;
    }
    for (int u0 = u; u0 < uend; u0 += MOBA_FK) {
        const int nk = min(MOBA_FK, uend - u0);
        moba_load_kv<MOBA_FK>(sm.K, sm.V, k, v, tstride, u0, nk);
        __syncthreads();
        moba_fwd_tile(sm.Q, sm.K, sm.V, sm.P, sm.qtok, u0, nk, causal, scale, m, l, acc);
    }
}

// ------------------------------------------------------------------------------------------------
// (5) forward over the selected past blocks: CTA = (block j, tile of up to FQ queries that selected j)
//     writes part[bh, t, s, :] = softmax-weighted v over block j (normalised), lpart = its logsumexp.
//     grid (ceil(Emax/FQ) + nblk, H, B), block NTHR, dynamic smem MobaFwdSmem
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NTHR)
moba_fwd_past(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
              const int* __restrict__ idx, const int* __restrict__ qlist, float* __restrict__ part,
              float* __restrict__ lpart, int T, int H, int chunk, int K1, int nblk, int Emax, float scale)
{
    const MobaFwdSmem sm;
    int *qtok = sm.qtok, *qent = sm.qent;

    const int h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    int j;
    if (!moba_past_queries<MOBA_FQ>(idx, qlist, bh, nblk, Emax, K1, 1, qent, qtok, j)) return;
    const MobaHead hd(b, h, T, H);
    moba_load_rows(sm.Q, q + hd.hoff, hd.tstride, qtok, MOBA_FQ);

    float m[FRQ], l[FRQ], acc[FRQ][NC];
    // block j is complete (a later block exists): all of it, no mask
    moba_fwd_attend(sm, k + hd.hoff, v + hd.hoff, hd.tstride, j * chunk, (j + 1) * chunk, false, scale, m, l, acc);
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
#pragma unroll
    for (int i = 0; i < FRQ; ++i) {
        const int p = qent[ty + TY * i];
        if (p < 0) continue;
        const size_t e = (size_t)bh * T * K1 + p;
        const float inv = 1.f / l[i];
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int col = tx + TX * c;
            if (moba_col_ok(col)) part[e * HS + col] = acc[i][c] * inv;
        }
        if (tx == 0) lpart[e] = m[i] + logf(l[i]);
    }
}

// ------------------------------------------------------------------------------------------------
// (6) forward over the own block (causal) + merge of the past partials; writes o and lse.
//     CTA = (query tile of up to FQ queries inside one block). tiles per block tpc = ceil(chunk/FQ).
//     grid (nblk*tpc, H, B), block NTHR, dynamic smem MobaFwdSmem
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NTHR)
moba_fwd_own(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
             const int* __restrict__ sel, const float* __restrict__ part, const float* __restrict__ lpart,
             floatX* __restrict__ o, float* __restrict__ lse, int T, int H, int chunk, int K1, float scale,
             floatX* __restrict__ olo)
{
    const MobaFwdSmem sm;
    int* qtok = sm.qtok;

    const int h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    int kstart, q1;
    if (!moba_own_queries<MOBA_FQ>(T, chunk, qtok, kstart, q1)) return;
    const MobaHead hd(b, h, T, H);
    moba_load_rows(sm.Q, q + hd.hoff, hd.tstride, qtok, MOBA_FQ);

    float m[FRQ], l[FRQ], acc[FRQ][NC];
    moba_fwd_attend(sm, k + hd.hoff, v + hd.hoff, hd.tstride, kstart, q1, true, scale, m, l, acc);
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
#pragma unroll
    for (int i = 0; i < FRQ; ++i) {
        const int t = qtok[ty + TY * i];
        if (t < 0) continue;
        float mi = m[i], li = l[i];
        moba_merge_partials(sel, lpart, part, ((size_t)bh * T + t) * K1, K1, mi, li,
                            [&](const float* pr, float alpha, float beta) {
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const int col = tx + TX * c;
                const float pv = moba_col_ok(col) ? pr[col] : 0.f;
                acc[i][c] = fmaf(acc[i][c], alpha, beta * pv);
            }
        });
        const size_t orow = hd.hoff + (size_t)t * hd.tstride;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int col = tx + TX * c;
            if (moba_col_ok(col)) moba_store_out(o, olo, orow, col, acc[i][c] / li);
        }
        if (tx == 0) lse[(size_t)bh * T + t] = mi + logf(li);
    }
}

// ------------------------------------------------------------------------------------------------
// backward dq core: one key tile [u0, u0+nk) against the query tile (Qs, dOs rows ty + TY*i)
//   P = exp(scale*q.k - lse), dP = do.v, dS = P*(dP - D); acc += dS @ K
// Ks, Vs [DQ_K][LDH]; dSs [DQ_Q][DLDP]
// ------------------------------------------------------------------------------------------------
#define DRQ (MOBA_DQ_Q / TY)
#define DCK (MOBA_DQ_K / TX)
#define DLDP MOBA_DLDP

static __device__ __forceinline__ void moba_dq_tile(const float* __restrict__ Qs, const float* __restrict__ dOs,
                                                    const float* __restrict__ Ks, const float* __restrict__ Vs,
                                                    float* __restrict__ dSs, const int* __restrict__ qtok,
                                                    const float* __restrict__ lse_s, const float* __restrict__ D_s,
                                                    int u0, int nk, bool causal, float scale,
                                                    float (&acc)[DRQ][NC])
{
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    float s[DRQ][DCK], dp[DRQ][DCK];
#pragma unroll
    for (int i = 0; i < DRQ; ++i)
#pragma unroll
        for (int c = 0; c < DCK; ++c) { s[i][c] = 0.f; dp[i][c] = 0.f; }
    moba_dot_tile<DRQ, DCK>(s, Qs, Ks, ty, tx);
    moba_dot_tile<DRQ, DCK>(dp, dOs, Vs, ty, tx);
#pragma unroll
    for (int i = 0; i < DRQ; ++i) {
        const int r = ty + TY * i;
        const int t = qtok[r];
        const float lt = lse_s[r], Dt = D_s[r];
#pragma unroll
        for (int c = 0; c < DCK; ++c) {
            const int kc = tx + TX * c;
            const bool vis = kc < nk && t >= 0 && (!causal || u0 + kc <= t);
            const float p = vis ? expf(s[i][c] * scale - lt) : 0.f;
            dSs[r * DLDP + kc] = p * (dp[i][c] - Dt);
        }
    }
    __syncthreads();
    moba_pv_tile<DRQ, MOBA_DQ_K, DLDP>(acc, dSs, Ks, ty, tx);
    __syncthreads();
}

// query-tile preparation shared by the dq kernels: Q, dO rows, lse and delta of the tokens in qtok
static __device__ __forceinline__ void moba_dq_load_queries(float* Qs, float* dOs, float* lse_s, float* D_s,
                                                            const int* qtok, const floatX* __restrict__ q,
                                                            const floatX* __restrict__ dout,
                                                            const float* __restrict__ lse,
                                                            const float* __restrict__ delta,
                                                            size_t hoff, size_t tstride, size_t bhT, int R)
{
    moba_load_rows(Qs, q + hoff, tstride, qtok, R);
    moba_load_rows(dOs, dout + hoff, tstride, qtok, R);
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const int t = qtok[r];
        lse_s[r] = t >= 0 ? lse[bhT + t] : 0.f;
        D_s[r] = t >= 0 ? delta[bhT + t] : 0.f;
    }
}

// dq of the query tile (Q, dO, lse, D in sm) from keys u .. uend-1 in tiles of DQ_K, into a zeroed acc.
static __device__ __forceinline__ void moba_dq_attend(const MobaDqSmem& sm, const floatX* __restrict__ k,
                                                      const floatX* __restrict__ v, size_t tstride, int u, int uend,
                                                      bool causal, float scale, float (&acc)[DRQ][NC])
{
#pragma unroll
    for (int i = 0; i < DRQ; ++i)
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[i][c] = 0.f;
    for (int u0 = u; u0 < uend; u0 += MOBA_DQ_K) {
        const int nk = min(MOBA_DQ_K, uend - u0);
        moba_load_kv<MOBA_DQ_K>(sm.K, sm.V, k, v, tstride, u0, nk);
        __syncthreads();
        moba_dq_tile(sm.Q, sm.dO, sm.K, sm.V, sm.dS, sm.qtok, sm.lse, sm.D, u0, nk, causal, scale, acc);
    }
}

// ------------------------------------------------------------------------------------------------
// (8) dq over the selected past blocks: CTA = (block j, tile of up to DQ_Q queries that selected j);
//     part[bh, t, s, :] = scale * sum_{u in block j} dS[t,u] k_u
//     grid (ceil(Emax/DQ_Q) + nblk, H, B), block NTHR, dynamic smem MobaDqSmem
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NTHR)
moba_bwd_dq_past(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
                 const floatX* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                 const int* __restrict__ idx, const int* __restrict__ qlist, float* __restrict__ part,
                 int T, int H, int chunk, int K1, int nblk, int Emax, float scale)
{
    const MobaDqSmem sm;
    int *qtok = sm.qtok, *qent = sm.qent;

    const int h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    int j;
    if (!moba_past_queries<MOBA_DQ_Q>(idx, qlist, bh, nblk, Emax, K1, 2, qent, qtok, j)) return;
    const MobaHead hd(b, h, T, H);
    moba_dq_load_queries(sm.Q, sm.dO, sm.lse, sm.D, qtok, q, dout, lse, delta, hd.hoff, hd.tstride,
                         (size_t)bh * T, MOBA_DQ_Q);
    float acc[DRQ][NC];
    moba_dq_attend(sm, k + hd.hoff, v + hd.hoff, hd.tstride, j * chunk, (j + 1) * chunk, false, scale, acc);
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
#pragma unroll
    for (int i = 0; i < DRQ; ++i) {
        const int p = qent[ty + TY * i];
        if (p < 0) continue;
        float* pr = part + ((size_t)bh * T * K1 + p) * HS;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int col = tx + TX * c;
            if (moba_col_ok(col)) pr[col] = acc[i][c] * scale;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// (9) dq over the own block (causal), plus the past partials in slot order; writes dq.
//     grid (nblk*ceil(chunk/DQ_Q), H, B), block NTHR, dynamic smem MobaDqSmem
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NTHR)
moba_bwd_dq_own(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
                const floatX* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                const int* __restrict__ sel, const float* __restrict__ part, floatX* __restrict__ dq,
                int T, int H, int chunk, int K1, float scale)
{
    const MobaDqSmem sm;
    int* qtok = sm.qtok;

    const int h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    int kstart, q1;
    if (!moba_own_queries<MOBA_DQ_Q>(T, chunk, qtok, kstart, q1)) return;
    const MobaHead hd(b, h, T, H);
    moba_dq_load_queries(sm.Q, sm.dO, sm.lse, sm.D, qtok, q, dout, lse, delta, hd.hoff, hd.tstride,
                         (size_t)bh * T, MOBA_DQ_Q);
    float acc[DRQ][NC];
    moba_dq_attend(sm, k + hd.hoff, v + hd.hoff, hd.tstride, kstart, q1, true, scale, acc);
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
#pragma unroll
    for (int i = 0; i < DRQ; ++i) {
        const int t = qtok[ty + TY * i];
        if (t < 0) continue;
        float r[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) r[c] = acc[i][c] * scale;
        moba_sum_partials(sel, part, ((size_t)bh * T + t) * K1, K1, [&](const float* pr) {
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const int col = tx + TX * c;
                if (moba_col_ok(col)) r[c] += pr[col];
            }
        });
        floatX* drow = dq + hd.hoff + (size_t)t * hd.tstride;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int col = tx + TX * c;
            if (moba_col_ok(col)) drow[col] = from_f32(r[c]);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// (10) dk, dv: CTA = (key tile kt of block j); loops over the own-block queries t >= u (causal) in
//      tiles of KV_Q, then over qlist[offs[j] .. offs[j+1]) in tiles of KV_Q; accumulates
//      dv[u] += P[t,u] do_t and dk[u] += scale * dS[t,u] q_t in registers; writes once.
//      grid (ceil(chunk/KV_K), nblk, B*H), block NTHR, dynamic smem MobaKvSmem
// ------------------------------------------------------------------------------------------------
#define KRK (MOBA_KV_K / TY)
#define KCQ (MOBA_KV_Q / TX)
#define KLDP MOBA_KLDP

static __device__ __forceinline__ void moba_kv_tile(const float* __restrict__ Ks, const float* __restrict__ Vs,
                                                    float* __restrict__ Qs, float* __restrict__ dOs,
                                                    float* __restrict__ Ps, float* __restrict__ dSs,
                                                    float* __restrict__ lse_s, float* __restrict__ D_s,
                                                    const int* __restrict__ qtok,
                                                    const floatX* __restrict__ q, const floatX* __restrict__ dout,
                                                    const float* __restrict__ lse, const float* __restrict__ delta,
                                                    size_t hoff, size_t tstride, size_t bhT,
                                                    int u0, int nk, bool causal, float scale,
                                                    float (&dk)[KRK][NC], float (&dv)[KRK][NC])
{
    // qtok was written before the caller's __syncthreads()
    moba_dq_load_queries(Qs, dOs, lse_s, D_s, qtok, q, dout, lse, delta, hoff, tstride, bhT, MOBA_KV_Q);
    __syncthreads();
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    float s[KRK][KCQ], dp[KRK][KCQ];
#pragma unroll
    for (int i = 0; i < KRK; ++i)
#pragma unroll
        for (int c = 0; c < KCQ; ++c) { s[i][c] = 0.f; dp[i][c] = 0.f; }
    moba_dot_tile<KRK, KCQ>(s, Ks, Qs, ty, tx);      // s[key row][query col] = k_u . q_t
    moba_dot_tile<KRK, KCQ>(dp, Vs, dOs, ty, tx);    // dp = v_u . do_t
#pragma unroll
    for (int i = 0; i < KRK; ++i) {
        const int r = ty + TY * i;
        const int u = u0 + r;
#pragma unroll
        for (int c = 0; c < KCQ; ++c) {
            const int qc = tx + TX * c;
            const int t = qtok[qc];
            const bool vis = r < nk && t >= 0 && (!causal || u <= t);
            const float p = vis ? expf(s[i][c] * scale - lse_s[qc]) : 0.f;
            Ps[r * KLDP + qc] = p;
            dSs[r * KLDP + qc] = p * (dp[i][c] - D_s[qc]);
        }
    }
    __syncthreads();
    moba_pv_tile<KRK, MOBA_KV_Q, KLDP>(dv, Ps, dOs, ty, tx);   // dv[u] += sum_t P[u][t] do[t]
    moba_pv_tile<KRK, MOBA_KV_Q, KLDP>(dk, dSs, Qs, ty, tx);   // dk[u] += sum_t dS[u][t] q[t]
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(NTHR)
moba_bwd_dkdv(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
              const floatX* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
              const int* __restrict__ idx, const int* __restrict__ qlist,
              floatX* __restrict__ dk, floatX* __restrict__ dv,
              int T, int H, int chunk, int K1, int nblk, int Emax, float scale)
{
    const MobaKvSmem sm;
    float *Ks = sm.K, *Vs = sm.V, *Qs = sm.Q, *dOs = sm.dO, *Ps = sm.P, *dSs = sm.dS, *lse_s = sm.lse, *D_s = sm.D;
    int* qtok = sm.qtok;

    const MobaKeyTile<MOBA_KV_K> kt(T, H, chunk);
    if (kt.u0 >= kt.bend) return;
    const int j = kt.j, bh = kt.bh, u0 = kt.u0, bend = kt.bend, nk = kt.nk();
    const MobaHead hd(kt.b, kt.h, T, H);
    const size_t tstride = hd.tstride, hoff = hd.hoff, bhT = (size_t)bh * T;
    moba_load_kv<MOBA_KV_K>(Ks, Vs, k + hoff, v + hoff, tstride, u0, nk);

    float dka[KRK][NC], dva[KRK][NC];
#pragma unroll
    for (int i = 0; i < KRK; ++i)
#pragma unroll
        for (int c = 0; c < NC; ++c) { dka[i][c] = 0.f; dva[i][c] = 0.f; }

    // own block: queries u0 .. bend-1 (key u visible to t iff u <= t)
    for (int t0 = u0; t0 < bend; t0 += MOBA_KV_Q) {
        for (int r = threadIdx.x; r < MOBA_KV_Q; r += NTHR) qtok[r] = (t0 + r < bend) ? t0 + r : -1;
        __syncthreads();
        moba_kv_tile(Ks, Vs, Qs, dOs, Ps, dSs, lse_s, D_s, qtok, q, dout, lse, delta, hoff, tstride, bhT,
                     u0, nk, true, scale, dka, dva);
    }
    // later queries that selected block j (all of block j visible to them); K1 == 0: none
    if (K1 <= 0) goto write_out;
    {
    const int* offs = idx + (size_t)bh * 3 * (nblk + 1);
    const int ebeg = offs[j], eend = offs[j + 1];
    const int* ql = qlist + (size_t)bh * Emax;
    for (int e0 = ebeg; e0 < eend; e0 += MOBA_KV_Q) {
        for (int r = threadIdx.x; r < MOBA_KV_Q; r += NTHR) qtok[r] = (e0 + r < eend) ? ql[e0 + r] / K1 : -1;
        __syncthreads();
        moba_kv_tile(Ks, Vs, Qs, dOs, Ps, dSs, lse_s, D_s, qtok, q, dout, lse, delta, hoff, tstride, bhT,
                     u0, nk, false, scale, dka, dva);
    }
    }
write_out:
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
#pragma unroll
    for (int i = 0; i < KRK; ++i) {
        const int r = ty + TY * i;
        if (r >= nk) continue;
        const size_t off = hoff + (size_t)(u0 + r) * tstride;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int col = tx + TX * c;
            if (moba_col_ok(col)) {
                dk[off + col] = from_f32(dka[i][c] * scale);
                dv[off + col] = from_f32(dva[i][c]);
            }
        }
    }
}
