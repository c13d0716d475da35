// ln_shift.cu — a LayerNorm fused with the token shift and its mixes (rwkvx): LN1 + the time mix's six
// mixes, LN2 + the channel mix's one.
//
//   h = LN(x; w, b)  (ln_forward's arithmetic, layernorm/ln_row.cuh: the same bits for h, mean and rstd)
//   o_j = h + (shift(h) - h) * m_j,  j < LNS_M,  shift(h)[r] = h[r - 1], zero where r % T == 0
//         (tm_shift_fwd's and cm_shift_mix's expression: the same bits)
//
// Buffers: x f32 [R, C] (the residual stream); w, b, m_j f32 [C]; h f32 [R, C] or NULL (not stored: the
// decoder's prefill reads it; ln_shift_bwd recomputes h from x); mean, rstd f32 [R] (NULL: not saved);
// o_j floatX [R, C]. C % 4 == 0, every pointer aligned to 4 elements (layernorm/ops.py checks).
// Nothing may alias x. LN_WARPS, LN_NQ, LNS_WALK, LNS_M and LNS_MIN_BLOCKS come from rwkvx/cu/layernorm/ops.py.
// LNS_MIN_BLOCKS (the blocks per SM the registers are budgeted for): 3 up to LN_NQ = 6 (<= 168 registers;
// without a bound the 6-mix fp32 build took 230, 2 blocks), 2 above (a tighter bound spills).
//
// One warp walks LNS_WALK consecutive rows (grid = ceil(ceil(R / LNS_WALK) / LN_WARPS), block =
// 32*LN_WARPS). A lane owns the same quads i = lane + 32k of every row, so the previous row's LayerNorm
// output of its first LN_NQ quads stays in its registers; the walk starts by recomputing the row before
// its first (unless that row starts a sequence). Quads beyond 128*LN_NQ channels recompute the previous
// row's output from x with its statistics (kept in registers). Each row's h is read from memory never:
// per row, the kernel reads x once and writes the mixes (and h when given).

#include "common.cuh"
#if !defined(LN_WARPS) || !defined(LN_NQ) || !defined(LNS_WALK) || !defined(LNS_M) || !defined(LNS_MIN_BLOCKS)
#error "layernorm/ln_shift.cu: LN_WARPS, LN_NQ, LNS_WALK, LNS_M and LNS_MIN_BLOCKS come from rwkvx/cu/layernorm/ops.py"
#endif
#include "layernorm/ln_row.cuh"

static_assert(LNS_M == 1 || LNS_M == 6, "LNS_M: 6 mixes (time mix) or 1 (channel mix)");

extern "C" __global__ void __launch_bounds__(32 * LN_WARPS, LNS_MIN_BLOCKS)
ln_shift_fwd(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
             float* __restrict__ h, float* __restrict__ mean_out, float* __restrict__ rstd_out,
             const float* m0, const float* m1, const float* m2, const float* m3, const float* m4, const float* m5,
             floatX* o0, floatX* o1, floatX* o2, floatX* o3, floatX* o4, floatX* o5, int R, int C, int T, float eps)
{
    const float* mp[6] = {m0, m1, m2, m3, m4, m5};
    floatX* op[6] = {o0, o1, o2, o3, o4, o5};
    const int lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * LN_WARPS + (threadIdx.x >> 5)) * LNS_WALK;
    if (r0 >= R) return;
    const int r1 = min(r0 + LNS_WALK, R);
    const int C4 = C >> 2;
    float4 v[LN_NQ];
    f4 prev[LN_NQ];            // the previous row's LayerNorm output of the lane's first LN_NQ quads
#pragma unroll
    for (int k = 0; k < LN_NQ; ++k) prev[k] = f4_zero();
    float mu_p = 0.0f, rs_p = 0.0f;
    if (r0 % T) {
        ln_row_stats(x + (long long)(r0 - 1) * C, v, lane, C, eps, mu_p, rs_p);
#pragma unroll
        for (int k = 0; k < LN_NQ; ++k)
            if (lane + 32 * k < C4) prev[k] = ln_quad(widen(v[k]), mu_p, rs_p, w, b, lane + 32 * k);
    }
    // o_j of quad i (element offset off) from the row's output cur and the previous row's pv
    auto mix = [&](const f4& cur, const f4& pv, long long off, int i) {
#pragma unroll
        for (int j = 0; j < LNS_M; ++j) {
            const f4 m = load4(mp[j] + 4 * i);
            f4 o;
#pragma unroll
            for (int e = 0; e < 4; ++e) o.v[e] = cur.v[e] + (pv.v[e] - cur.v[e]) * m.v[e];
            store4(op[j] + off, o);
        }
    };
    for (int r = r0; r < r1; ++r) {
        const long long row = (long long)r * C;
        const float* xr = x + row;
        float mu, rs;
        ln_row_stats(xr, v, lane, C, eps, mu, rs);
        if (lane == 0) {
            if (mean_out) mean_out[r] = mu;
            if (rstd_out) rstd_out[r] = rs;
        }
        const bool first = r % T == 0;
#pragma unroll
        for (int k = 0; k < LN_NQ; ++k) {
            const int i = lane + 32 * k;
            if (i < C4) {
                const f4 cur = ln_quad(widen(v[k]), mu, rs, w, b, i);
                if (h) store4(h + row + 4 * i, cur);
                mix(cur, first ? f4_zero() : prev[k], row + 4 * i, i);
                prev[k] = cur;
            }
        }
        for (int i = lane + 32 * LN_NQ; i < C4; i += 32) {
            const f4 cur = ln_quad(load4(xr + 4 * i), mu, rs, w, b, i);
            if (h) store4(h + row + 4 * i, cur);
            mix(cur, first ? f4_zero() : ln_quad(load4(xr - C + 4 * i), mu_p, rs_p, w, b, i), row + 4 * i, i);
        }
        mu_p = mu;
        rs_p = rs;
    }
}
