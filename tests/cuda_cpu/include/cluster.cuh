// tests/cuda_cpu/include/cluster.cuh -- the CPU stand-in for rwkvx/cu/cluster.cuh (same functions). The blocks
// of a cluster run together, each with its own shared memory; a shared::cluster address names a block by
// rank and a place in its shared memory, wherever that is kept (cpuexec::cluster_at). An mbarrier phase
// completes when its arrivals and its transaction bytes are all in; a wait parks the thread until then.
#pragma once

__device__ __forceinline__ unsigned cluster_ctarank() {
    const uint3 o = {cpuexec::rt.origin[0], cpuexec::rt.origin[1], cpuexec::rt.origin[2]};
    const unsigned* c = cpuexec::rt.cluster;
    return (blockIdx.x - o.x) + c[0] * ((blockIdx.y - o.y) + c[1] * (blockIdx.z - o.z));
}
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
    return rank << 24 | (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ unsigned long long ld_shared_cluster_u64(unsigned addr) {
    unsigned long long v;
    std::memcpy(&v, cpuexec::cluster_at(addr, sizeof v), sizeof v);
    return v;
}
// one thread runs at a time: release or not, what it wrote is seen by every thread that runs after it
__device__ __forceinline__ void cluster_arrive() { ++cpuexec::rt.fibers[cpuexec::rt.cur].cluster_arrived; }
__device__ __forceinline__ void cluster_arrive_relaxed() { cluster_arrive(); }
__device__ __forceinline__ void cluster_wait() {
    cpuexec::Fiber& f = cpuexec::rt.fibers[cpuexec::rt.cur];
    f.state = cpuexec::CLUSTER; f.cluster_phase = f.cluster_arrived; f.what = "barrier.cluster.wait";
    cpuexec::park();
}
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}

template <int COUNT>
__device__ __forceinline__ void mbarrier_init(const void* bar) {
    static_assert(COUNT > 0 && COUNT < 0x8000, "mbarrier arrival count");
    cpuexec::MBarrier* m = cpuexec::mbarrier_at(cluster_ctarank(), (unsigned)__cvta_generic_to_shared(bar));
    m->count_phase = COUNT; m->pending = COUNT; m->tx = 0;
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(const void* bar, unsigned bytes) {
    cpuexec::MBarrier* m = cpuexec::mbarrier_at(cluster_ctarank(), (unsigned)__cvta_generic_to_shared(bar));
    m->tx += (int32_t)bytes;
    if (!m->pending) cpuexec::trap("mbarrier.arrive on a phase with no arrival pending");
    --m->pending;
    m->complete_if_done();
}
// one thread runs at a time: what it wrote is seen by every thread that runs after it
__device__ __forceinline__ void fence_mbarrier_init() {}
template <int PARITY>
__device__ __forceinline__ void mbarrier_wait_parity(const void* bar) {
    cpuexec::Fiber& f = cpuexec::rt.fibers[cpuexec::rt.cur];
    f.mbar = (unsigned)__cvta_generic_to_shared(bar);
    f.mbar_parity = PARITY & 1;
    if (cpuexec::mbarrier_at(cluster_ctarank(), f.mbar)->phase() != f.mbar_parity) return;
    f.state = cpuexec::MBAR; f.what = "mbarrier.try_wait.parity";
    cpuexec::park();
}

namespace cpuexec {
template <class T> inline void st_async(unsigned addr, T v, unsigned bar) {
    std::memcpy(cluster_at(addr, sizeof v), &v, sizeof v);
    if ((addr >> 24) != (bar >> 24)) trap("st.async to one block counted on another block's mbarrier");
    MBarrier* m = reinterpret_cast<MBarrier*>(cluster_at(bar, 8));
    m->tx -= (int32_t)sizeof v;
    m->complete_if_done();
}
}  // namespace cpuexec
__device__ __forceinline__ void st_async_b32(unsigned addr, unsigned v, unsigned bar) { cpuexec::st_async(addr, v, bar); }
__device__ __forceinline__ void st_async_b64(unsigned addr, unsigned long long v, unsigned bar) { cpuexec::st_async(addr, v, bar); }
