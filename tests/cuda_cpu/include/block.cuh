// tests/cuda_cpu/include/block.cuh -- the CPU stand-in for rwkvx/cu/block.cuh (same functions).
#pragma once

// bar.sync id, COUNT: completes when COUNT threads of the block have arrived at barrier `id`
template <int COUNT>
__device__ __forceinline__ void named_barrier(int id) { cpuexec::barrier(id, COUNT, "bar.sync (named barrier)"); }
__device__ __forceinline__ unsigned dynamic_smem_size() { return cpuexec_dynamic_smem_size(); }
