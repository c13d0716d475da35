// layernorm/ln_row.cuh — one warp's LayerNorm of one row: the arithmetic every row-wise LayerNorm forward
// shares (ln_forward, ln_shift_fwd), so that their statistics and outputs are the same bits.
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
