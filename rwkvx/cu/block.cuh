// rwkvx/cu/block.cuh -- block-level PTX: named barriers and the launch's dynamic shared memory size.
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
