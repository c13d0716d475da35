// layernorm/ln_shift_bwd.cu — the backward of ln_shift_fwd in one pass: the token shift's transpose, its
// mixes' gradients and the LayerNorm backward of the shift's input gradient (rwkvx).
//
//   h      = LN(x), recomputed from x with the saved mean and rstd (ln_quad: ln_shift_fwd's bits of h)
//   dh[r]  = sum_j d_j[r] * (1 - m_j) + d_j[r + 1] * m_j     (the second term where r + 1 is in r's sequence
//            of T rows; 6 mixes: tm_shift_bwd's expression, 1 mix: cm_mix_backward's, so the same bits)
//   dx     = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)),  g = dh * w,  xhat = (x - mean) * rstd
//            written or added to dx (accumulate); dx_copy (may be NULL) gets dx rounded to floatX
//            (ln_backward_dx's arithmetic and order: the same bits for the same dh)
//   part_mix[p, j, c] = sum over the rows r of walk p of d_j[r, c] * (shift(h)[r, c] - h[r, c])
//   part_ln[p, 0, c]  = sum over the rows of walk p of dh * xhat,  part_ln[p, 1, c] = sum of dh
//            each NULL when not wanted (frozen parameters); reduce_partials sums them over the walks.
//
// Buffers: x, dx f32 [R, C] (the residual stream and its gradient); w, b, m_j f32 [C]; mean, rstd f32 [R]
// (ln_shift_fwd's); d_j floatX [R, C]; part_mix f32 [P, LNS_M, C], part_ln f32 [P, 2, C]. C % 4 == 0,
// every pointer aligned to 4 elements; dx and dx_copy alias neither x, the d_j nor each other (layernorm/ops.py
// checks). h and dh are never
// in memory. LN_NQ, LNS_M, LNB_THREADS (the block's threads, at most) and LNB_MIN_BLOCKS (the blocks per SM
// the registers are budgeted for) come from rwkvx/cu/layernorm/ops.py: LN_NQ = 1 takes up to 192 threads,
// 2 blocks (<= 168 registers: the 6-mix build took 171 unbounded, one block of 6 warps per SM), LN_NQ = 2
// up to 256, 1 block.
//
// One block walks the rows of one walk p = blockIdx.x down from the last:
// walk p covers rows [tile * rpt + s * sub, + sub) of its row tile (tile = p / ry, s = p % ry,
// sub = ceil(rpt / ry)), tm_shift_bwd's partial rows, so that the mixes' partial sums are its bits.
// Thread tid owns the quads i = tid + NT*k of every row (NT = blockDim.x): for k < LN_NQ it keeps x, h and
// d_j of row r + 1 (the row the walk left) in registers (the next row's shifted input and dh's second term) and its partial
// sums; quads beyond NT*LN_NQ (rows wider than 2048 at LN_NQ = 2) read them again and add their partial
// sums into their walk's own partial rows in memory. The row sums of the LayerNorm backward go through
// shared memory: each quad's terms (ln_bwd_quad_sums), then every warp adds them in ln_backward_dx's
// order (per lane the quads lane, lane + 32, ..., then the butterfly). Dynamic shared memory: two rows'
// terms, 2 * 8 * C/4 bytes.

#include "common.cuh"
#if !defined(LN_NQ) || !defined(LNS_M) || !defined(LNB_THREADS) || !defined(LNB_MIN_BLOCKS)
#error "layernorm/ln_shift_bwd.cu: LN_NQ, LNS_M, LNB_THREADS and LNB_MIN_BLOCKS come from rwkvx/cu/layernorm/ops.py"
#endif
#include "layernorm/ln_row.cuh"

static_assert(LNS_M == 1 || LNS_M == 6, "LNS_M: 6 mixes (time mix) or 1 (channel mix)");

// dh of quad i from the mixes' gradients of its row (dc) and of the next row (dn, read where has_next)
static __device__ __forceinline__ f4 lnb_dh(const quadX (&dc)[LNS_M], const quadX (&dn)[LNS_M], bool has_next,
                                            const float* const (&mp)[6], int i)
{
#if LNS_M == 6
    f4 g = f4_zero();
#pragma unroll
    for (int j = 0; j < 6; ++j) {
        const f4 m = load4(mp[j] + 4 * i), dcur = widen(dc[j]);
        const f4 dnx = has_next ? widen(dn[j]) : f4_zero();
#pragma unroll
        for (int e = 0; e < 4; ++e) g.v[e] += dcur.v[e] * (1.f - m.v[e]) + dnx.v[e] * m.v[e];
    }
#else
    const f4 m = load4(mp[0] + 4 * i), dcur = widen(dc[0]);
    f4 g;
#pragma unroll
    for (int e = 0; e < 4; ++e) g.v[e] = dcur.v[e] * (1.0f - m.v[e]);
    if (has_next) {
        const f4 dnx = widen(dn[0]);
#pragma unroll
        for (int e = 0; e < 4; ++e) g.v[e] += dnx.v[e] * m.v[e];
    }
#endif
    return g;
}

// One row's additions to a quad's partial sums: the mixes' d_j * (shift(h) - h) (shift zero at a
// sequence's first row), the LayerNorm weight's dh * xhat and bias's dh.
static __device__ __forceinline__ void lnb_add_partials(f4 (&pm)[LNS_M], f4& pw, f4& pb, const quadX (&dc)[LNS_M],
                                                        const f4& xv, const f4& hc, const f4& hp, bool first,
                                                        const f4& g, float mu, float rs)
{
    float xx[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) xx[e] = (first ? 0.f : hp.v[e]) - hc.v[e];
#pragma unroll
    for (int j = 0; j < LNS_M; ++j) {
        const f4 dcur = widen(dc[j]);
#pragma unroll
        for (int e = 0; e < 4; ++e) pm[j].v[e] += dcur.v[e] * xx[e];
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        pw.v[e] += g.v[e] * ((xv.v[e] - mu) * rs);
        pb.v[e] += g.v[e];
    }
}

extern "C" __global__ void __launch_bounds__(LNB_THREADS, LNB_MIN_BLOCKS)
ln_shift_bwd(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
             const float* __restrict__ mean, const float* __restrict__ rstd,
             const float* m0, const float* m1, const float* m2, const float* m3, const float* m4, const float* m5,
             const floatX* d0, const floatX* d1, const floatX* d2, const floatX* d3, const floatX* d4,
             const floatX* d5, float* dx, floatX* __restrict__ dx_copy, float* __restrict__ part_mix,
             float* __restrict__ part_ln, int R, int C, int T, int rpt, int ry, int accumulate)
{
    extern __shared__ float2 lnb_shared[];     // [2][C/4]: each quad's (sum g, sum g * xhat), rows alternating
    const float* const mp[6] = {m0, m1, m2, m3, m4, m5};
    const floatX* const dp[6] = {d0, d1, d2, d3, d4, d5};
    const int tid = threadIdx.x, NT = blockDim.x, C4 = C >> 2;
    const long long p = blockIdx.x;
    const int tile0 = (int)(p / ry) * rpt, sub = (rpt + ry - 1) / ry;
    const int beg = tile0 + (int)(p % ry) * sub;
    const int end = min(beg + sub, min(tile0 + rpt, R));
    const float invC = 1.0f / (float)C;
    float* const pmix = part_mix ? part_mix + p * LNS_M * C : nullptr;   // this walk's partial rows
    float* const pln = part_ln ? part_ln + p * 2 * C : nullptr;

    f4 pm[LN_NQ][LNS_M], pw[LN_NQ], pb[LN_NQ];
#pragma unroll
    for (int k = 0; k < LN_NQ; ++k) {
        pw[k] = f4_zero();
        pb[k] = f4_zero();
#pragma unroll
        for (int j = 0; j < LNS_M; ++j) pm[k][j] = f4_zero();
    }
    // quads past the registers add into the partial rows themselves: start them at zero
    for (int i = tid + NT * LN_NQ; i < C4; i += NT) {
        for (int j = 0; j < LNS_M && pmix; ++j) store4(pmix + (long long)j * C + 4 * i, f4_zero());
        if (pln) {
            store4(pln + 4 * i, f4_zero());
            store4(pln + C + 4 * i, f4_zero());
        }
    }
    if (beg < end) {
        int r = end - 1;
        float mu = mean[r], rs = rstd[r];
        float4 xc[LN_NQ];             // x[r], h[r] and d_j[r + 1] of the register quads
        f4 hc[LN_NQ];
        quadX dn[LN_NQ][LNS_M];
        const bool end_has_next = r % T != T - 1;               // then r + 1 < R
#pragma unroll
        for (int k = 0; k < LN_NQ; ++k) {
            const int i = tid + NT * k;
            xc[k] = i < C4 ? load_quad(x + (long long)r * C + 4 * i) : float4{};
            hc[k] = i < C4 ? ln_quad(widen(xc[k]), mu, rs, w, b, i) : f4_zero();
#pragma unroll
            for (int j = 0; j < LNS_M; ++j)
                dn[k][j] = end_has_next && i < C4 ? load_quad(dp[j] + (long long)(r + 1) * C + 4 * i) : quadX{};
        }
        for (; r >= beg; --r) {
            const long long row = (long long)r * C;
            float2* const terms = lnb_shared + ((end - 1 - r) & 1) * C4;
            const int t = r % T;
            const bool first = t == 0, has_next = t != T - 1;
            const float mu_p = r > 0 ? mean[r - 1] : 0.0f, rs_p = r > 0 ? rstd[r - 1] : 0.0f;
            float4 xp[LN_NQ], old[LN_NQ];
            quadX dc[LN_NQ][LNS_M];
#pragma unroll
            for (int k = 0; k < LN_NQ; ++k) {
                const int i = tid + NT * k;
                xp[k] = r > 0 && i < C4 ? load_quad(x + row - C + 4 * i) : float4{};
                old[k] = accumulate && i < C4 ? load_quad(dx + row + 4 * i) : float4{};
#pragma unroll
                for (int j = 0; j < LNS_M; ++j) dc[k][j] = i < C4 ? load_quad(dp[j] + row + 4 * i) : quadX{};
            }
            f4 g[LN_NQ], hp[LN_NQ];
#pragma unroll
            for (int k = 0; k < LN_NQ; ++k) {
                const int i = tid + NT * k;
                hp[k] = f4_zero();
                g[k] = f4_zero();
                if (i < C4) {
                    if (r > 0) hp[k] = ln_quad(widen(xp[k]), mu_p, rs_p, w, b, i);
                    g[k] = lnb_dh(dc[k], dn[k], has_next, mp, i);
                    lnb_add_partials(pm[k], pw[k], pb[k], dc[k], widen(xc[k]), hc[k], hp[k], first, g[k], mu, rs);
                    float qg, qgx;
                    ln_bwd_quad_sums(widen(xc[k]), g[k], load4(w + 4 * i), mu, rs, qg, qgx);
                    terms[i] = make_float2(qg, qgx);
                }
            }
            // the quads past the registers: d_j read here (again for dx), partial sums added in memory
            auto load_d = [&](int i, quadX (&dcw)[LNS_M], quadX (&dnw)[LNS_M]) {
#pragma unroll
                for (int j = 0; j < LNS_M; ++j) {
                    dcw[j] = load_quad(dp[j] + row + 4 * i);
                    dnw[j] = has_next ? load_quad(dp[j] + row + C + 4 * i) : quadX{};
                }
            };
            for (int i = tid + NT * LN_NQ; i < C4; i += NT) {
                quadX dcw[LNS_M], dnw[LNS_M];
                load_d(i, dcw, dnw);
                const f4 xv = load4(x + row + 4 * i), gw = lnb_dh(dcw, dnw, has_next, mp, i);
                const f4 hpw = r > 0 ? ln_quad(load4(x + row - C + 4 * i), mu_p, rs_p, w, b, i) : f4_zero();
                f4 pmw[LNS_M];
#pragma unroll
                for (int j = 0; j < LNS_M; ++j) pmw[j] = pmix ? load4(pmix + (long long)j * C + 4 * i) : f4_zero();
                f4 pww = pln ? load4(pln + 4 * i) : f4_zero(), pbw = pln ? load4(pln + C + 4 * i) : f4_zero();
                lnb_add_partials(pmw, pww, pbw, dcw, xv, ln_quad(xv, mu, rs, w, b, i), hpw, first, gw, mu, rs);
                for (int j = 0; j < LNS_M && pmix; ++j) store4(pmix + (long long)j * C + 4 * i, pmw[j]);
                if (pln) {
                    store4(pln + 4 * i, pww);
                    store4(pln + C + 4 * i, pbw);
                }
                float qg, qgx;
                ln_bwd_quad_sums(xv, gw, load4(w + 4 * i), mu, rs, qg, qgx);
                terms[i] = make_float2(qg, qgx);
            }
            // Every warp adds the row's terms (the same bits in each). The other half of lnb_shared, which
            // the next row writes, was last read before this barrier, so it is the only one per row.
            __syncthreads();
            float mg = 0.0f, mgx = 0.0f;
            for (int i = tid & 31; i < C4; i += 32) {
                const float2 q = terms[i];
                mg += q.x;
                mgx += q.y;
            }
            mg = ln_warp_sum(mg) * invC;
            mgx = ln_warp_sum(mgx) * invC;
            auto out = [&](int i, const f4& xv, const f4& gv, const f4& prev) {
                f4 o = ln_bwd_quad_dx(xv, gv, load4(w + 4 * i), mu, rs, mg, mgx);
                if (accumulate) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) o.v[e] += prev.v[e];
                }
                store4(dx + row + 4 * i, o);
                if (dx_copy) store4(dx_copy + row + 4 * i, o);
            };
#pragma unroll
            for (int k = 0; k < LN_NQ; ++k)
                if (tid + NT * k < C4) out(tid + NT * k, widen(xc[k]), g[k], widen(old[k]));
            for (int i = tid + NT * LN_NQ; i < C4; i += NT) {
                quadX dcw[LNS_M], dnw[LNS_M];
                load_d(i, dcw, dnw);
                out(i, load4(x + row + 4 * i), lnb_dh(dcw, dnw, has_next, mp, i),
                    accumulate ? load4(dx + row + 4 * i) : f4_zero());
            }
#pragma unroll
            for (int k = 0; k < LN_NQ; ++k) {       // one row down: row r is the next row's r + 1
                xc[k] = xp[k];
                hc[k] = hp[k];
#pragma unroll
                for (int j = 0; j < LNS_M; ++j) dn[k][j] = dc[k][j];
            }
            mu = mu_p;
            rs = rs_p;
        }
    }
#pragma unroll
    for (int k = 0; k < LN_NQ; ++k) {
        const int i = tid + NT * k;
        if (i >= C4) continue;
        for (int j = 0; j < LNS_M && pmix; ++j) store4(pmix + (long long)j * C + 4 * i, pm[k][j]);
        if (pln) {
            store4(pln + 4 * i, pw[k]);
            store4(pln + C + 4 * i, pb[k]);
        }
    }
}
