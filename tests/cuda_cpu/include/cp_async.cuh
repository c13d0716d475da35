// tests/cuda_cpu/include/cp_async.cuh -- the CPU stand-in for rwkvx/cu/cp_async.cuh (same functions). A
// cp.async copy is queued on its thread and performed when a cp_wait<K> of that thread retires its commit
// group (groups retire oldest first, all but the newest K); copies never waited for are dropped at the
// thread's exit. So a kernel that reads shared memory before the wait that covers it reads stale data.
#pragma once

namespace cpuexec {
inline void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    Fiber& f = rt.fibers[rt.cur];
    f.copies.push_back({dst, src, bytes, src_bytes, -1});
}
}  // namespace cpuexec

// 16 (4) bytes src -> dst when valid, else zeros
__device__ __forceinline__ void cp16_zfill(void* dst, const void* src, bool valid) {
    cpuexec::cp_async(dst, src, 16, valid ? 16 : 0);
}
__device__ __forceinline__ void cp4_zfill(void* dst, const void* src, bool valid) {
    cpuexec::cp_async(dst, src, 4, valid ? 4 : 0);
}
__device__ __forceinline__ void cp16(void* dst, const void* src) { cpuexec::cp_async(dst, src, 16, 16); }
__device__ __forceinline__ void cp8(void* dst, const void* src) { cpuexec::cp_async(dst, src, 8, 8); }
__device__ __forceinline__ void cp_commit() {
    cpuexec::Fiber& f = cpuexec::rt.fibers[cpuexec::rt.cur];
    for (auto& c : f.copies)
        if (c.group < 0) c.group = f.committed;
    ++f.committed;
}
template <int K>
__device__ __forceinline__ void cp_wait() {
    cpuexec::Fiber& f = cpuexec::rt.fibers[cpuexec::rt.cur];
    std::vector<cpuexec::AsyncCopy> keep;
    for (const auto& c : f.copies) {
        if (c.group >= 0 && c.group < f.committed - K) {
            std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset((char*)c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
        } else {
            keep.push_back(c);
        }
    }
    f.copies.swap(keep);
}
