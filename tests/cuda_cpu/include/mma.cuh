// tests/cuda_cpu/include/mma.cuh -- the CPU stand-in for rwkvx/cu/mma.cuh (same functions): tf32 rounding as
// cvt.rna.tf32.f32 (to nearest, ties away from zero) and mma.sync m16n8k8 tf32 as a warp collective over
// the PTX fragment layouts (rwkvx/cu/mma.cuh lists them). The tensor core reads the top 19 bits of each
// operand; its sum of the 8 products and C is taken here in float64, rounded once to fp32.
#pragma once

__device__ __forceinline__ unsigned to_tf32(float x) {
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;             // inf, NaN: as they are
    return (u + 0x1000u) & 0xffffe000u;                          // half an ulp of tf32 up in magnitude, cut
}
__device__ __forceinline__ float round_tf32(float x) { return __uint_as_float(to_tf32(x)); }

namespace cpuexec {
struct MmaTf32Lane { float* d; const unsigned* a; const unsigned* b; };

inline void mma_tf32_warp(void* const* payload, unsigned) {
    double A[16][8], B[8][8], C[16][8];
    auto tf = [](unsigned u) { return (double)__uint_as_float(u & 0xffffe000u); };
    for (int lane = 0; lane < 32; ++lane) {
        const MmaTf32Lane& m = *static_cast<const MmaTf32Lane*>(payload[lane]);
        const int g = lane >> 2, q = lane & 3;
        A[g][q] = tf(m.a[0]); A[g + 8][q] = tf(m.a[1]); A[g][q + 4] = tf(m.a[2]); A[g + 8][q + 4] = tf(m.a[3]);
        B[q][g] = tf(m.b[0]); B[q + 4][g] = tf(m.b[1]);
        C[g][2 * q] = m.d[0]; C[g][2 * q + 1] = m.d[1]; C[g + 8][2 * q] = m.d[2]; C[g + 8][2 * q + 1] = m.d[3];
    }
    auto D = [&](int i, int j) {
        double s = C[i][j];
        for (int k = 0; k < 8; ++k) s += A[i][k] * B[k][j];
        return (float)s;
    };
    for (int lane = 0; lane < 32; ++lane) {
        const MmaTf32Lane& m = *static_cast<const MmaTf32Lane*>(payload[lane]);
        const int g = lane >> 2, q = lane & 3;
        m.d[0] = D(g, 2 * q); m.d[1] = D(g, 2 * q + 1); m.d[2] = D(g + 8, 2 * q); m.d[3] = D(g + 8, 2 * q + 1);
    }
}
}  // namespace cpuexec

// d (16x8, fp32) += A (16x8) B (8x8), tf32 operands; all 32 lanes of the warp together
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    cpuexec::MmaTf32Lane lane{d, a, b};
    cpuexec::warp_op(cpuexec::W_CUSTOM, 0xffffffffu, 0, 0, 32, "mma.sync m16n8k8 tf32", cpuexec::mma_tf32_warp, &lane);
}

__device__ __forceinline__ int acc_m(int e) { return ((threadIdx.x & 31) >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int acc_n(int e) { return 2 * (threadIdx.x & 3) + (e & 1); }
