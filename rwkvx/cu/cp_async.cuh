// rwkvx/cu/cp_async.cuh -- asynchronous global -> shared copies (cp.async, sm_80+) and the 32-bit shared
// address they and ldmatrix take.
#pragma once

// (an intrinsic, not inline asm: the compiler folds constant offsets into the instructions' immediates)
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// 16 (4) bytes src -> dst when valid, else zeros (src-size 0: src is not read, but must be a valid address)
__device__ __forceinline__ void cp16_zfill(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp4_zfill(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0) : "memory");
}
// The same address converted in PTX (an asm block the compiler does not see into). cp16 and cp8 take it:
// the chunked WKV7 state passes, their users, were tuned with it, and the intrinsic changes their machine code.
__device__ __forceinline__ unsigned smem_addr_ptx(const void* p) {
    unsigned r;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
// 16 (8) bytes src -> dst; cg: through L2 only, ca: through L1
__device__ __forceinline__ void cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_addr_ptx(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(smem_addr_ptx(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// wait until at most K committed groups of this thread are in flight
template <int K>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(K) : "memory"); }
