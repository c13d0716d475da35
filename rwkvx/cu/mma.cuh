// rwkvx/cu/mma.cuh -- tensor-core pieces that MoBA's moba/mma.cu and WKV7's wkv7/chunked.cu share: rounding
// fp32 to tf32 (also the decode GEMV's operands in tf32), the mma.sync m16n8k8 tf32 product and the lanes of
// its accumulator (C) fragments; MoBA's bf16 m16n8k16 product and its ldmatrix loads.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32), g = lane / 4, q = lane % 4:
//   A 16x8 (row): a0 (g, q), a1 (g+8, q), a2 (g, q+4), a3 (g+8, q+4);  B 8x8 (col): b0 (q, g), b1 (q+4, g);
//   C/D 16x8: c0 (g, 2q), c1 (g, 2q+1), c2 (g+8, 2q), c3 (g+8, 2q+1) (the same for m16n8k16).
#pragma once
#include "cp_async.cuh"     // smem_addr, the shared address ldmatrix takes

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

// d (16x8, fp32) += A (16x16) B (16x8), bf16 operands, two to a register (the lower k index in the low half):
//   A (row): a0 (g, 2q..2q+1), a1 (g+8, 2q..2q+1), a2 (g, 2q+8..2q+9), a3 (g+8, 2q+8..2q+9);
//   B (col): b0 (k 2q..2q+1, n g), b1 (k 2q+8..2q+9, n g)
__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// ldmatrix x4 (16-bit elements, shared memory): lane l gives the address of row l % 8 of 8x8 matrix l / 8 (16
// contiguous bytes); register ri of lane l receives matrix i's row l / 4, elements 2(l%4), 2(l%4)+1 (the
// first in the low half); _trans: rows 2(l%4), 2(l%4)+1 of column l / 4, i.e. the matrix transposed.
// (Operands as scalars and register references: MoBA's operand pairs bind to the asm as they are; arrays
// built from them compile to other machine code.)
__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                  const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_addr(p)));
}

// (row, column) of accumulator element e (0..3) of a 16x8 C tile
__device__ __forceinline__ int acc_m(int e) { return ((threadIdx.x & 31) >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int acc_n(int e) { return 2 * (threadIdx.x & 3) + (e & 1); }
