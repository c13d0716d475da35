// rwkvx/cu/wkv7/state.cuh -- one token of the RWKV-7 WKV recurrence on a register-held state row, shared by
// the sequence kernels (wkv7/sequential.cu) and the single-token step of generation (decode.cu), so both run the
// same arithmetic in the same order.
//
// Thread mapping (Q = WKV_Q lanes per state row, lanes of a row adjacent in a warp, M = N/Q elements per
// lane): the lane rq of row `row` holds S[row, j0 .. j0+M-1], j0 = rq*M. Row sums (sa, y) are M-term
// partial sums (VW accumulator chains) added over the Q lanes with shuffle-xor.
// Needs HEAD_SIZE and WKV_Q (from the declarations in rwkvx/cu) and common.cuh.
#pragma once

namespace wkv7 {

constexpr int HN = HEAD_SIZE;
constexpr int Q = WKV_Q;                                    // lanes per state row
constexpr int M = HN / Q;                                   // elements per lane and role
constexpr int VW = (M % 4 == 0) ? 4 : ((M % 2 == 0) ? 2 : 1);   // vector width for M-runs

static_assert(HN == 4 || HN == 8 || HN == 16 || HN == 32 || HN == 64 || HN == 128,
              "HEAD_SIZE must be one of 4, 8, 16, 32, 64, 128");
static_assert(Q == 4, "WKV_Q must be 4 (shuffle masks assume quads)");

// load / store VW consecutive floats (16/8/4-byte aligned by construction)
__device__ __forceinline__ void ldv(const float* p, float* o) {
    if constexpr (VW == 4) { float4 t = *reinterpret_cast<const float4*>(p); o[0] = t.x; o[1] = t.y; o[2] = t.z; o[3] = t.w; }
    else if constexpr (VW == 2) { float2 t = *reinterpret_cast<const float2*>(p); o[0] = t.x; o[1] = t.y; }
    else { o[0] = p[0]; }
}
__device__ __forceinline__ void ldv(const __nv_bfloat16* p, float* o) {
    if constexpr (VW == 4) {
        const f4 t = load4(p); o[0] = t.v[0]; o[1] = t.v[1]; o[2] = t.v[2]; o[3] = t.v[3];
    } else if constexpr (VW == 2) {
        const float2 t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p)); o[0] = t.x; o[1] = t.y;
    } else { o[0] = __bfloat162float(p[0]); }
}
__device__ __forceinline__ void stv(float* p, const float* o) {
    if constexpr (VW == 4) { *reinterpret_cast<float4*>(p) = make_float4(o[0], o[1], o[2], o[3]); }
    else if constexpr (VW == 2) { *reinterpret_cast<float2*>(p) = make_float2(o[0], o[1]); }
    else { p[0] = o[0]; }
}

// Sum over the `width` adjacent lanes of a group (width in {1,2,4}); every lane gets the total.
// The mask names the lane's quad: all four lanes of a quad always execute this together.
__device__ __forceinline__ float group_sum(float x, int width) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned mask = 0xFu << (lane & ~3u);
    if (width >= 2) x += __shfl_xor_sync(mask, x, 1);
    if (width >= 4) x += __shfl_xor_sync(mask, x, 2);
    return x;
}

__device__ __forceinline__ float vw_sum(const float* acc) {
    if constexpr (VW == 4) return (acc[0] + acc[1]) + (acc[2] + acc[3]);
    else if constexpr (VW == 2) return acc[0] + acc[1];
    else return acc[0];
}
// Partial row dot sum_m S[m] * vec[j0 + m] over this lane's M columns, with VW independent accumulator
// chains (shorter dependency chain); fixed summation order.
__device__ __forceinline__ float row_dot(const float* S, const floatX* vec) {
    float acc[VW];
#pragma unroll
    for (int u = 0; u < VW; ++u) acc[u] = 0.f;
#pragma unroll
    for (int m = 0; m < M; m += VW) {
        float x[VW];
        ldv(vec + m, x);
#pragma unroll
        for (int u = 0; u < VW; ++u) acc[u] = fmaf(S[m + u], x[u], acc[u]);
    }
    return vw_sum(acc);
}
// The token's addition to S[row, j]: sa b_j + v_row k_j. One function for the forward's update and the
// backward's step back, so the backward subtracts exactly what the forward added.
__device__ __forceinline__ float state_add(float sa, float bj, float vi, float kj) { return fmaf(sa, bj, vi * kj); }
// S[row, j] <- S[row, j] w_j + sa b_j + v_row k_j
__device__ __forceinline__ float state_update(float s, float wj, float sa, float bj, float vi, float kj) {
    return fmaf(s, wj, state_add(sa, bj, vi, kj));
}

// One token for this lane's entries S (state row `row`, columns j0 ..; r, w, k, a, b point at element j0
// of the token's vectors, vi = v[row]) in two halves: sa = S a with S before the token (token_sa), then
// S <- S diag(w) + sa b^T + v k^T, returning y_row = S r with S after (token_update). Every lane of the
// row calls both together; each gets sa and y.
__device__ __forceinline__ float token_sa(const float (&S)[M], const floatX* a) {
    return group_sum(row_dot(S, a), Q);
}
__device__ __forceinline__ float token_update(float (&S)[M], const floatX* r, const float* w, const floatX* k,
                                              float vi, const floatX* b, float sa) {
    float ya[VW];
#pragma unroll
    for (int u = 0; u < VW; ++u) ya[u] = 0.f;
#pragma unroll
    for (int m = 0; m < M; m += VW) {
        float wv[VW], bv[VW], kv[VW], rv[VW];
        ldv(w + m, wv);
        ldv(b + m, bv);
        ldv(k + m, kv);
        ldv(r + m, rv);
#pragma unroll
        for (int u = 0; u < VW; ++u) {
            const float s = state_update(S[m + u], wv[u], sa, bv[u], vi, kv[u]);
            S[m + u] = s;
            ya[u] = fmaf(s, rv[u], ya[u]);
        }
    }
    return group_sum(vw_sum(ya), Q);
}

}  // namespace wkv7
