// tests/cuda_cpu/include/ptx.cuh -- the CPU stand-in for rwkvx/cu/ptx.cuh (same functions).
#pragma once

// bar.sync id, COUNT: completes when COUNT threads of the block have arrived at barrier `id`
template <int COUNT>
__device__ __forceinline__ void named_barrier(int id) { cpuexec::barrier(id, COUNT, "bar.sync (named barrier)"); }
__device__ __forceinline__ unsigned dynamic_smem_size() { return cpuexec_dynamic_smem_size(); }
// a register-allocation hint on the GPU; nothing to do here
__device__ __forceinline__ void opaque(float&) {}
// 2^x to fp32 accuracy (the GPU's approximation is not emulated), subnormal inputs and results flushed to zero
__device__ __forceinline__ float ex2_approx(float x) {
    const float y = exp2f(std::fabs(x) < 1.17549435e-38f ? 0.f : x);
    return y < 1.17549435e-38f ? 0.f : y;
}
