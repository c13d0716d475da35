// tests/cuda_cpu/include/mma.cuh -- the CPU stand-in for rwkvx/cu/mma.cuh (same functions): tf32 rounding as
// cvt.rna.tf32.f32 (to nearest, ties away from zero); mma.sync m16n8k8 tf32 and m16n8k16 bf16 and ldmatrix
// x4 as warp collectives over the PTX fragment layouts (rwkvx/cu/mma.cuh lists them). The tensor core reads
// the top 19 bits of each tf32 operand; its sum of the products and C is taken here in float64, rounded
// once to fp32.
#pragma once

__device__ __forceinline__ unsigned to_tf32(float x) {
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;             // inf, NaN: as they are
    return (u + 0x1000u) & 0xffffe000u;                          // half an ulp of tf32 up in magnitude, cut
}
__device__ __forceinline__ float round_tf32(float x) { return __uint_as_float(to_tf32(x)); }

namespace cpuexec {
struct MmaTf32Lane { float* d; const unsigned* a; const unsigned* b; };
struct MmaBf16Lane { float* d; unsigned a[4], b[2]; };

// D = A B + C of one warp's m16n8kK product (C and D 16x8 fp32, lane (g, q) holding (g, 2q), (g, 2q+1),
// (g+8, 2q), (g+8, 2q+1)): each lane's A and B fragments placed by `operands(lane, g, q, A, B)`
template <int K, class Lane, class Operands>
inline void mma_warp(void* const* payload, Operands operands) {
    double A[16][K], B[K][8], C[16][8];
    for (int lane = 0; lane < 32; ++lane) {
        const Lane& m = *static_cast<const Lane*>(payload[lane]);
        const int g = lane >> 2, q = lane & 3;
        operands(m, g, q, A, B);
        C[g][2 * q] = m.d[0]; C[g][2 * q + 1] = m.d[1]; C[g + 8][2 * q] = m.d[2]; C[g + 8][2 * q + 1] = m.d[3];
    }
    auto D = [&](int i, int j) {
        double s = C[i][j];
        for (int k = 0; k < K; ++k) s += A[i][k] * B[k][j];
        return (float)s;
    };
    for (int lane = 0; lane < 32; ++lane) {
        const Lane& m = *static_cast<const Lane*>(payload[lane]);
        const int g = lane >> 2, q = lane & 3;
        m.d[0] = D(g, 2 * q); m.d[1] = D(g, 2 * q + 1); m.d[2] = D(g + 8, 2 * q); m.d[3] = D(g + 8, 2 * q + 1);
    }
}

inline void mma_tf32_warp(void* const* payload, unsigned) {
    mma_warp<8, MmaTf32Lane>(payload, [](const MmaTf32Lane& m, int g, int q, double (&A)[16][8], double (&B)[8][8]) {
        auto tf = [](unsigned u) { return (double)__uint_as_float(u & 0xffffe000u); };
        A[g][q] = tf(m.a[0]); A[g + 8][q] = tf(m.a[1]); A[g][q + 4] = tf(m.a[2]); A[g + 8][q + 4] = tf(m.a[3]);
        B[q][g] = tf(m.b[0]); B[q + 4][g] = tf(m.b[1]);
    });
}

inline double bf16_half(unsigned u, int hi) { return cpuexec_bf16_bits_to_f32((unsigned short)(u >> (16 * hi))); }

inline void mma_bf16_warp(void* const* payload, unsigned) {
    mma_warp<16, MmaBf16Lane>(payload, [](const MmaBf16Lane& m, int g, int q, double (&A)[16][16], double (&B)[16][8]) {
        for (int h = 0; h < 2; ++h) {
            A[g][2 * q + h] = bf16_half(m.a[0], h); A[g + 8][2 * q + h] = bf16_half(m.a[1], h);
            A[g][2 * q + 8 + h] = bf16_half(m.a[2], h); A[g + 8][2 * q + 8 + h] = bf16_half(m.a[3], h);
            B[2 * q + h][g] = bf16_half(m.b[0], h); B[2 * q + 8 + h][g] = bf16_half(m.b[1], h);
        }
    });
}
}  // namespace cpuexec

// d (16x8, fp32) += A (16x8) B (8x8), tf32 operands; all 32 lanes of the warp together
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    cpuexec::MmaTf32Lane lane{d, a, b};
    cpuexec::warp_op(cpuexec::W_CUSTOM, 0xffffffffu, 0, 0, 32, "mma.sync m16n8k8 tf32", cpuexec::mma_tf32_warp, &lane);
}

namespace cpuexec {
struct LdmatrixLane { unsigned* r[4]; const unsigned short* row; };

// register i of lane l: two elements of matrix i, whose row j lane 8i + j addresses
template <bool TRANS>
inline void ldmatrix_warp(void* const* payload, unsigned) {
    auto row = [&](int lane) { return static_cast<const LdmatrixLane*>(payload[lane])->row; };
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, q = lane & 3;
        unsigned* const* r = static_cast<const LdmatrixLane*>(payload[lane])->r;
        for (int i = 0; i < 4; ++i) {
            const unsigned lo = TRANS ? row(8 * i + 2 * q)[g] : row(8 * i + g)[2 * q];
            const unsigned hi = TRANS ? row(8 * i + 2 * q + 1)[g] : row(8 * i + g)[2 * q + 1];
            *r[i] = lo | hi << 16;
        }
    }
}
}  // namespace cpuexec

// d (16x8, fp32) += A (16x16) B (16x8), bf16 operands (fragments in rwkvx/cu/mma.cuh); all 32 lanes together
__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    cpuexec::MmaBf16Lane lane{d, {a0, a1, a2, a3}, {b0, b1}};
    cpuexec::warp_op(cpuexec::W_CUSTOM, 0xffffffffu, 0, 0, 32, "mma.sync m16n8k16 bf16", cpuexec::mma_bf16_warp, &lane);
}
__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    cpuexec::LdmatrixLane lane{{&r0, &r1, &r2, &r3}, static_cast<const unsigned short*>(p)};
    cpuexec::warp_op(cpuexec::W_CUSTOM, 0xffffffffu, 0, 0, 32, "ldmatrix x4", cpuexec::ldmatrix_warp<false>, &lane);
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                  const void* p) {
    cpuexec::LdmatrixLane lane{{&r0, &r1, &r2, &r3}, static_cast<const unsigned short*>(p)};
    cpuexec::warp_op(cpuexec::W_CUSTOM, 0xffffffffu, 0, 0, 32, "ldmatrix x4.trans", cpuexec::ldmatrix_warp<true>,
                     &lane);
}

__device__ __forceinline__ int acc_m(int e) { return ((threadIdx.x & 31) >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int acc_n(int e) { return 2 * (threadIdx.x & 3) + (e & 1); }
