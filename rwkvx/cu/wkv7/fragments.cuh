// rwkvx/cu/wkv7/fragments.cuh -- the tf32 tensor-core operations of the chunked WKV7 kernels (chunked.cu):
// fragments read through element accessors A(m, k), B(k, n), the hi + lo tf32 splits of 3xTF32, records
// in fragment order, and the products built from them. Which products are split follows WKV_EXACT and
// WKV_SPLIT_OPERATORS (rwkvx/cu/wkv7/ops.py).
#pragma once

#include "common.cuh"
#include "mma.cuh"
#if !defined(WKV_EXACT) || !defined(WKV_SPLIT_OPERATORS)
#error "wkv7/fragments.cuh: WKV_EXACT and WKV_SPLIT_OPERATORS come from rwkvx/cu/wkv7/ops.py"
#endif

namespace wkv7c {

// WKV_EXACT (the fp32 precision's path, f32 inputs): every product in 3xTF32, the records kept in fp32
// (split at each use) -- fp32-class results. Otherwise (tf32, bf16) the state passes' and the gradient
// kernel's products over the value rows take one tf32 operand per side.
constexpr bool EXACT = WKV_EXACT;

// The tf32 fragments of the 16x8 A tile and the 8x8 B tile at k0; A(m, k) and B(k, n) read the operands.
template <class FA>
__device__ __forceinline__ void frag_a(unsigned (&a)[4], FA A, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    a[0] = to_tf32(A(g, k0 + q)); a[1] = to_tf32(A(g + 8, k0 + q));
    a[2] = to_tf32(A(g, k0 + q + 4)); a[3] = to_tf32(A(g + 8, k0 + q + 4));
}
template <class FB>
__device__ __forceinline__ void frag_b(unsigned (&b)[2], FB B, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    b[0] = to_tf32(B(k0 + q, g)); b[1] = to_tf32(B(k0 + q + 4, g));
}
// B as hi + lo tf32 parts (~fp32 exact): for v and dy, whose per-element tf32 rounding would show in
// gradients that are single dot products with them at small T
template <class FB>
__device__ __forceinline__ void frag_b_split(unsigned (&hi)[2], unsigned (&lo)[2], FB B, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const float x0 = B(k0 + q, g), x1 = B(k0 + q + 4, g);
    hi[0] = to_tf32(x0); hi[1] = to_tf32(x1);
    lo[0] = to_tf32(x0 - __uint_as_float(hi[0])); lo[1] = to_tf32(x1 - __uint_as_float(hi[1]));
}
// B's fragment at k-step k0: hi, and with SPLIT (always when EXACT) lo
template <bool SPLIT, class FB>
__device__ __forceinline__ void frag_b_for(unsigned (&b)[2], unsigned (&lo)[2], FB B, int k0) {
    if constexpr (SPLIT || EXACT) frag_b_split(b, lo, B, k0);
    else frag_b(b, B, k0);
}
// A B operand's fragments of every k-step, loaded (and split as frag_b_for does) once for several products
template <int K>
struct BFrags { unsigned hi[K / 8][2], lo[K / 8][2]; };
// v and dy need the lo part only in fp32: bf16 values are exact in tf32 (their lo part is zero)
constexpr bool XSPLIT = sizeof(floatX) == sizeof(float);
template <int K, bool SPLIT, class FB>
__device__ __forceinline__ BFrags<K> load_bfrags(FB B) {
    BFrags<K> f;
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {
        frag_b_for<SPLIT>(f.hi[k0 / 8], f.lo[k0 / 8], B, k0);
    }
    return f;
}
template <int K>
__device__ __forceinline__ void frag_b(unsigned (&b)[2], const BFrags<K>& f, int k0) {
    b[0] = f.hi[k0 / 8][0]; b[1] = f.hi[k0 / 8][1];
}
template <int K>
__device__ __forceinline__ void frag_b_split(unsigned (&hi)[2], unsigned (&lo)[2], const BFrags<K>& f, int k0) {
    hi[0] = f.hi[k0 / 8][0]; hi[1] = f.hi[k0 / 8][1]; lo[0] = f.lo[k0 / 8][0]; lo[1] = f.lo[k0 / 8][1];
}
// Where element (m, k) of an [M][K] A operand lies in fragment order: 16 x 8 tiles (m-tile major, then
// k-step), in a tile lane 4 (m % 8) + k % 4 holds its a0..a3 = (g, q), (g + 8, q), (g, q + 4), (g + 8, q + 4)
// at 4 lane + (m / 8) % 2 + 2 ((k / 4) % 2).
template <int K>
__device__ __forceinline__ int frag_pos(int m, int k) {
    return ((m >> 4) * (K / 8) + (k >> 3)) * 128 + (((m & 7) << 2) + (k & 3)) * 4 + ((m >> 3) & 1)
           + 2 * ((k >> 2) & 1);
}
// A record section's value as stored: tf32-rounded, or fp32 when EXACT
__device__ __forceinline__ float rec_value(float x) { return EXACT ? x : round_tf32(x); }
// One m-tile of a record section in fragment order as an mma A operand
struct FragOp { const float* p; };
__device__ __forceinline__ float4 frag_load(FragOp A, int k0) {
    return *reinterpret_cast<const float4*>(A.p + ((k0 >> 3) * 32 + (threadIdx.x & 31)) * 4);
}
__device__ __forceinline__ void frag_a(unsigned (&a)[4], FragOp A, int k0) {
    const float4 v = frag_load(A, k0);
    a[0] = __float_as_uint(v.x); a[1] = __float_as_uint(v.y); a[2] = __float_as_uint(v.z); a[3] = __float_as_uint(v.w);
}
// A 16x8 accumulator into a warp's [16][8] tile (row m, column n)
__device__ __forceinline__ void put_tile(float* tile, const float (&d)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) tile[acc_m(e) * 8 + acc_n(e)] = d[e];
}
// A record section [M][K] in fragment order (frag_pos<K>), A(m, k) its values: piece f (of M K / 4) is one
// lane's a0..a3 of one tile, written with one 16-byte store (consecutive threads, consecutive pieces)
template <int K, class FA>
__device__ __forceinline__ void put_section(float* dst, int M, FA A, int f0, int nf) {
    for (int f = f0; f < M * K / 4; f += nf) {
        const int tile = f >> 5, ln = f & 31;
        const int m = 16 * (tile / (K / 8)) + (ln >> 2), k = 8 * (tile % (K / 8)) + (ln & 3);
        *reinterpret_cast<float4*>(dst + 4 * f) = make_float4(rec_value(A(m, k)), rec_value(A(m + 8, k)),
                                                              rec_value(A(m, k + 4)), rec_value(A(m + 8, k + 4)));
    }
}
// A warp's 16 x 8 tile W (row m, column n) as one fragment-order tile of a record section (128 floats)
__device__ __forceinline__ void put_tile_frag(float* dst, const float (*W)[8]) {
    const int lane = threadIdx.x & 31;
    put_section<8>(dst, 16, [&](int m, int n) { return W[m][n]; }, lane, 32);
}

// x as a tf32 pair hi + lo (~21 of fp32's 24 bits): three mma per step (lo hi + hi lo + hi hi, "3xTF32")
// give products of fp32 class on tensor cores. WKV_SPLIT_OPERATORS = 0 (bf16, rwkvx/cu/wkv7/ops.py) keeps
// hi only: one tf32 mma per step, products of tf32 class, finer than bf16 inputs.
constexpr bool SPLIT_OPERATORS = WKV_SPLIT_OPERATORS || EXACT;   // EXACT splits every product
__device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
    hi = to_tf32(x);
    lo = SPLIT_OPERATORS ? to_tf32(x - __uint_as_float(hi)) : 0u;
}
// The hi / lo tf32 parts of the A fragment (16 x 8) and the B fragment (8 x 8) at k-step k0, and the three
// mma of one 3xTF32 step (small terms first)
template <class FA>
__device__ __forceinline__ void frag_a3(unsigned (&hi)[4], unsigned (&lo)[4], FA A, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    split_tf32(A(g, k0 + q), hi[0], lo[0]);
    split_tf32(A(g + 8, k0 + q), hi[1], lo[1]);
    split_tf32(A(g, k0 + q + 4), hi[2], lo[2]);
    split_tf32(A(g + 8, k0 + q + 4), hi[3], lo[3]);
}
__device__ __forceinline__ void frag_a3(unsigned (&hi)[4], unsigned (&lo)[4], FragOp A, int k0) {
    const float4 v = frag_load(A, k0);
    split_tf32(v.x, hi[0], lo[0]);
    split_tf32(v.y, hi[1], lo[1]);
    split_tf32(v.z, hi[2], lo[2]);
    split_tf32(v.w, hi[3], lo[3]);
}
template <class FB>
__device__ __forceinline__ void frag_b3(unsigned (&hi)[2], unsigned (&lo)[2], FB B, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    split_tf32(B(k0 + q, g), hi[0], lo[0]);
    split_tf32(B(k0 + q + 4, g), hi[1], lo[1]);
}
__device__ __forceinline__ void mma3(float (&d)[4], const unsigned (&ah)[4], const unsigned (&al)[4],
                                     const unsigned (&bh)[2], const unsigned (&bl)[2]) {
    if constexpr (SPLIT_OPERATORS) {
        mma_tf32(d, al, bh);
        mma_tf32(d, ah, bl);
    }
    mma_tf32(d, ah, bh);
}
// d (16 x 8) += A (16 x K) B (K x 8), A(m, kk) and B(kk, n) accessors, 3xTF32: products whose entries are
// whole coefficients of outputs (the chunk operators), fp32-class on tensor cores
template <int K, class FA, class FB>
__device__ __forceinline__ void mm3(float (&d)[4], FA A, FB B) {
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {
        unsigned ah[4], al[4], bh[2], bl[2];
        frag_a3(ah, al, A, k0);
        frag_b3(bh, bl, B, k0);
        mma3(d, ah, al, bh, bl);
    }
}
// d[nt] (the 16x8 tiles of a 16x16 result) += X Y^T over K, X(m, kk), Y(n, kk) row accessors, 3xTF32
template <int K, class FX, class FY>
__device__ __forceinline__ void gram3(float (&d)[2][4], FX X, FY Y) {
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {
        unsigned ah[4], al[4];
        frag_a3(ah, al, X, k0);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            unsigned bh[2], bl[2];
            frag_b3(bh, bl, [&](int kk, int n) { return Y(8 * nt + n, kk); }, k0);
            mma3(d[nt], ah, al, bh, bl);
        }
    }
}

// d += A B at k-step k0, B's fragment given: one tf32 mma (two with SPLIT: B's lo part first), or the three
// of 3xTF32 when EXACT
template <bool SPLIT, class FA>
__device__ __forceinline__ void mma_step(float (&d)[4], FA A, const unsigned (&b)[2], const unsigned (&lo)[2],
                                         int k0) {
    unsigned a[4];
    if constexpr (EXACT) {
        unsigned al[4];
        frag_a3(a, al, A, k0);
        mma3(d, a, al, b, lo);
    } else {
        frag_a(a, A, k0);
        if constexpr (SPLIT) mma_tf32(d, a, lo);
        mma_tf32(d, a, b);
    }
}
// d (16 x 8) += A (16 x K) B (K x 8)
template <int K, bool SPLIT = false, class FA, class FB>
__device__ __forceinline__ void mma_acc(float (&d)[4], FA A, FB B) {
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {
        unsigned b[2], lo[2];
        frag_b_for<SPLIT>(b, lo, B, k0);
        mma_step<SPLIT>(d, A, b, lo, k0);
    }
}
// d1 += A1 B and d2 += A2 B over k = K0 .. K0 + K - 1: one load and conversion of each B fragment for both
template <int K, bool SPLIT = false, int K0 = 0, class FA1, class FA2, class FB>
__device__ __forceinline__ void mma_acc2(float (&d1)[4], FA1 A1, float (&d2)[4], FA2 A2, FB B) {
#pragma unroll
    for (int k0 = K0; k0 < K0 + K; k0 += 8) {
        unsigned b[2], lo[2];
        frag_b_for<SPLIT>(b, lo, B, k0);
        mma_step<SPLIT>(d1, A1, b, lo, k0);
        mma_step<SPLIT>(d2, A2, b, lo, k0);
    }
}

}  // namespace wkv7c
