// rwkvx/cu/cluster.cuh -- thread-block clusters in inline PTX: the CTA's rank, the cluster barrier, distributed
// shared memory (mapa, st.async) and mbarriers with transaction counts. Kernel files take cluster PTX from
// these functions only, which tests/cuda_cpu replaces to run them on the CPU.
#pragma once

// This CTA's rank in its cluster.
__device__ __forceinline__ unsigned cluster_ctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// The shared::cluster address of the shared variable at p (this CTA's) in the cluster's CTA `rank`.
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
    return r;
}
// The u64 at shared::cluster address `addr` (cluster_map).
__device__ __forceinline__ unsigned long long ld_shared_cluster_u64(unsigned addr) {
    unsigned long long v;
    asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(addr) : "memory");
    return v;
}
// Arrive at the cluster barrier: with release semantics (this thread's writes before are seen by the
// cluster's threads after their wait), or relaxed (no memory ordering); wait until every thread of the
// cluster has arrived (acquire).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// Every thread of the cluster arrives, then waits for the others.
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}

// The mbarrier at bar (this CTA's shared memory) expects COUNT arrivals a phase.
template <int COUNT>
__device__ __forceinline__ void mbarrier_init(const void* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"((unsigned)__cvta_generic_to_shared(bar)), "n"(COUNT) : "memory");
}
// Arrive at the mbarrier at bar, its phase now also waiting for `bytes` of transactions (st.async).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(const void* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"((unsigned)__cvta_generic_to_shared(bar)), "r"(bytes) : "memory");
}
// This thread's mbarrier initialisations are visible to the cluster (release) before what follows.
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Wait until phase PARITY (0 or 1, modulo 2) of the mbarrier at bar has completed (acquire, cluster scope).
template <int PARITY>
__device__ __forceinline__ void mbarrier_wait_parity(const void* bar) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(bar);
    unsigned done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(addr), "n"(PARITY) : "memory");
}
// Store v at the shared::cluster address `addr` (cluster_map), counting its bytes as transactions done
// on the mbarrier at shared::cluster address `bar` (of the same CTA as addr).
__device__ __forceinline__ void st_async_b32(unsigned addr, unsigned v, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" :: "r"(addr), "r"(v), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async_b64(unsigned addr, unsigned long long v, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];" :: "r"(addr), "l"(v), "r"(bar) : "memory");
}
