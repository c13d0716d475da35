// layernorm/ln_row.cuh — one warp's LayerNorm of one row: the arithmetic every row-wise LayerNorm forward
// shares (ln_forward, ln_shift_fwd), so that their statistics and outputs are the same bits; and the
// per-quad arithmetic of the row-wise backwards (ln_backward_dx, ln_shift_bwd), for the same reason.
// LN_NQ (quads per lane held in registers) comes from the including file's declaration.
#pragma once
#include "common.cuh"

static __device__ __forceinline__ float ln_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Loads the lane's first LN_NQ quads of row xr (quad i = lane + 32k; zeros past C) into v and computes the
// row's mean and rstd. The row's quads are loaded together, one memory round trip per row; quads beyond
// (C > 128*LN_NQ) are read again in each pass. Sums run in the order of a loop over i = lane, lane + 32, ...
// (any LN_NQ gives the same bits), then the xor butterfly.
static __device__ __forceinline__ void ln_row_stats(const float* xr, float4 (&v)[LN_NQ], int lane, int C, float eps,
                                                    float& mu, float& rs)
{
    const int C4 = C >> 2;
#pragma unroll
    for (int k = 0; k < LN_NQ; ++k) v[k] = lane + 32 * k < C4 ? load_quad(xr + 4 * (lane + 32 * k)) : float4{};
    float s = 0.0f;
    auto add = [&](const f4& u) { s += (u.v[0] + u.v[1]) + (u.v[2] + u.v[3]); };
#pragma unroll
    for (int k = 0; k < LN_NQ; ++k)
        if (lane + 32 * k < C4) add(widen(v[k]));
    for (int i = lane + 32 * LN_NQ; i < C4; i += 32) add(load4(xr + 4 * i));
    mu = ln_warp_sum(s) / (float)C;
    float q = 0.0f;
    auto addq = [&](const f4& u) {
        const float a = u.v[0] - mu, bb = u.v[1] - mu, c = u.v[2] - mu, d = u.v[3] - mu;
        q += (a * a + bb * bb) + (c * c + d * d);
    };
#pragma unroll
    for (int k = 0; k < LN_NQ; ++k)
        if (lane + 32 * k < C4) addq(widen(v[k]));
    for (int i = lane + 32 * LN_NQ; i < C4; i += 32) addq(load4(xr + 4 * i));
    rs = 1.0f / sqrtf(ln_warp_sum(q) / (float)C + eps);
}

// The LayerNorm's output of quad i holding u: (u - mu) * rs * w + b.
static __device__ __forceinline__ f4 ln_quad(const f4& u, float mu, float rs, const float* __restrict__ w,
                                             const float* __restrict__ b, int i)
{
    const f4 ww = load4(w + 4 * i), bv = load4(b + 4 * i);
    f4 o;
#pragma unroll
    for (int e = 0; e < 4; ++e) o.v[e] = (u.v[e] - mu) * rs * ww.v[e] + bv.v[e];
    return o;
}

// A quad's terms of the backward's two row sums, with g = dy * w and xhat = (x - mu) * rs: sg = sum of g,
// sgx = sum of g * xhat over the quad, added in pairs. A row's sums add these over its quads i = lane,
// lane + 32, ... in order, then the xor butterfly.
static __device__ __forceinline__ void ln_bwd_quad_sums(const f4& xv, const f4& dv, const f4& ww, float mu, float rs,
                                                        float& sg, float& sgx)
{
    const float g0 = dv.v[0] * ww.v[0], g1 = dv.v[1] * ww.v[1], g2 = dv.v[2] * ww.v[2], g3 = dv.v[3] * ww.v[3];
    sg = (g0 + g1) + (g2 + g3);
    sgx = (g0 * ((xv.v[0] - mu) * rs) + g1 * ((xv.v[1] - mu) * rs))
        + (g2 * ((xv.v[2] - mu) * rs) + g3 * ((xv.v[3] - mu) * rs));
}

// The backward's dx of a quad from the row's means mg = mean_c(g), mgx = mean_c(g * xhat).
static __device__ __forceinline__ f4 ln_bwd_quad_dx(const f4& xv, const f4& dv, const f4& ww, float mu, float rs,
                                                    float mg, float mgx)
{
    f4 o;
#pragma unroll
    for (int e = 0; e < 4; ++e) o.v[e] = rs * (dv.v[e] * ww.v[e] - mg - ((xv.v[e] - mu) * rs) * mgx);
    return o;
}
