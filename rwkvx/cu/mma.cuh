// rwkvx/cu/mma.cuh -- tensor-core pieces that MoBA's moba/mma.cu and WKV7's wkv7/chunked.cu share: rounding
// fp32 to tf32 (also the decode GEMV's operands in tf32), the mma.sync m16n8k8 tf32 product and the lanes of
// its accumulator (C) fragments.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32), g = lane / 4, q = lane % 4:
//   A 16x8 (row): a0 (g, q), a1 (g+8, q), a2 (g, q+4), a3 (g+8, q+4);  B 8x8 (col): b0 (q, g), b1 (q+4, g);
//   C/D 16x8: c0 (g, 2q), c1 (g, 2q+1), c2 (g+8, 2q), c3 (g+8, 2q+1) (the same for m16n8k16).
#pragma once

// fp32 -> tf32 (10 explicit mantissa bits), to nearest, ties away from zero; the bits of an fp32 value
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float round_tf32(float x) { return __uint_as_float(to_tf32(x)); }

// d (16x8, fp32) += A (16x8) B (8x8), tf32 operands
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// (row, column) of accumulator element e (0..3) of a 16x8 C tile
__device__ __forceinline__ int acc_m(int e) { return ((threadIdx.x & 31) >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int acc_n(int e) { return 2 * (threadIdx.x & 3) + (e & 1); }
