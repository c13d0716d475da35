// rwkvx/cu/ptx.cuh -- small pieces of inline PTX for kernel files (cp_async.cuh and mma.cuh hold the copies
// and the tensor-core products, cluster.cuh the clusters): named barriers, the launch's dynamic shared memory
// size, a register pin, the SFU's 2^x.
// Kernel files take inline asm from these headers only, which tests/cuda_cpu replaces to run them on the CPU.
#pragma once

// Wait at named barrier `id` (1..15; 0 is __syncthreads') until COUNT threads (a multiple of 32) have arrived.
template <int COUNT>
__device__ __forceinline__ void named_barrier(int id) { asm volatile("bar.sync %0, %1;" :: "r"(id), "n"(COUNT) : "memory"); }
// Bytes of dynamic shared memory the launch gave.
__device__ __forceinline__ unsigned dynamic_smem_size() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}
// x opaque to the compiler here (an empty asm reading and writing it): nothing computed from x before is
// reused after, so the compiler cannot keep such values live in registers across this point.
__device__ __forceinline__ void opaque(float& x) { asm volatile("" : "+f"(x)); }
// 2^x by the SFU's approximation (relative error ~2^-22; subnormal inputs and results flushed to zero).
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
