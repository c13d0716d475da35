// tests/cuda_cpu/include/cuda_cpu.h -- what a CUDA kernel file needs to compile with g++ and run on the CPU:
// the CUDA keywords, vector types, built-in variables and intrinsics, and a runtime in which every GPU
// thread of a block is a fiber. Force-included (g++ -include) before the kernel file; tests/cuda_cpu/
// executor.py compiles each kernel file with it into a shared library (see tests/cuda_cpu/README.md).
//
// Scheduling: the blocks of a grid run one after another, those of a thread-block cluster together; every
// thread runs until it reaches a synchronisation point (a block or named barrier, a warp collective, an
// mma, the cluster barrier, an mbarrier wait) or exits, in increasing or decreasing thread order (the
// launch's `descending`; a cluster's blocks in rank order). A synchronisation point completes
// when all of its participants have arrived; its threads then run again, in the same order. Nothing
// runs in parallel, so a plain read-modify-write is atomic; a missing barrier shows as a difference
// between the two orders. A point that can never complete is a deadlock: the launch fails naming it.
#pragma once
#if !defined(__x86_64__)
#error "the CPU kernel runtime switches fibers with x86-64 assembly"
#endif
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/mman.h>
#include <vector>

// ---- keywords ---------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __cluster_dims__(...)       // the executor reads a kernel's cluster shape from its source
#define __constant__ static const  // read-only on the device; rwkvx's are initialised in the source
#define __align__(n) __attribute__((aligned(n)))
// A block's shared variables are static storage, in a section of their own that every block starts with
// filled with 0xff bytes (NaN floats): shared memory starts undefined on the GPU, so a read before a write
// shows. (The executor rewrites `extern __shared__` arrays into pointers to the dynamic shared memory
// buffer below, which starts the same way.) The blocks of a cluster each have their own copy: the running
// thread's block's is in place, the others' are kept aside (see enter_block).
#define __shared__ static __attribute__((section("cpuexec_shared")))
extern "C" char __start_cpuexec_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_cpuexec_shared[] __attribute__((weak, visibility("hidden")));

// ---- vector types -----------------------------------------------------------------------------------
struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct __align__(8) float2 { float x, y; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8) uint2 { unsigned x, y; };
struct __align__(16) uint4 { unsigned x, y, z, w; };
struct __align__(8) int2 { int x, y; };
struct __align__(16) int4 { int x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }

static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static constexpr int warpSize = 32;

// ---- arithmetic intrinsics (the fast-math ones computed to fp32 accuracy) ----------------------------
using std::isfinite;
using std::isinf;
using std::isnan;
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline long long __double_as_longlong(double d) { long long u; std::memcpy(&u, &d, 8); return u; }
inline double __longlong_as_double(long long u) { double d; std::memcpy(&d, &u, 8); return d; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double x) { return sqrt(x); }
inline float __saturatef(float x) { return x != x ? 0.f : fminf(fmaxf(x, 0.f), 1.f); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline int __ffs(unsigned x) { return __builtin_ffs(x); }
// loads and stores with cache hints: plain accesses here
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
inline void __threadfence() {}
inline void __threadfence_block() {}

// Dynamic shared memory: one buffer of the most a launch may have (CPUEXEC_DYNAMIC_SMEM_BYTES, defined by
// the executor), at a fixed address, so that `extern __shared__` arrays at namespace scope can be
// rewritten to constant pointers into it; canary bytes after the launch's part catch writes past it.
#ifndef CPUEXEC_DYNAMIC_SMEM_BYTES
#error "CPUEXEC_DYNAMIC_SMEM_BYTES comes from tests/cuda_cpu/executor.py"
#endif
constexpr int SMEM_CANARY_BYTES = 256;
constexpr unsigned char SMEM_CANARY = 0xa5;
alignas(128) static unsigned char cpuexec_smem[CPUEXEC_DYNAMIC_SMEM_BYTES + SMEM_CANARY_BYTES];

// ---- the fiber runtime ----------------------------------------------------------------------------------
namespace cpuexec {

// switch(save, next): store this stack pointer at *save, continue on the stack `next` (callee-saved
// registers on the stacks; a new fiber's stack starts with zeros for them and fiber_main as return address)
extern "C" void cpuexec_switch(void** save, void* next);
asm(R"(
    .text
    .p2align 4
    .hidden cpuexec_switch
    .globl cpuexec_switch
    .type cpuexec_switch, @function
cpuexec_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cpuexec_switch, .-cpuexec_switch
)");

enum State { RUN, BAR, WARP, CLUSTER, MBAR, DONE };
enum WarpOp { W_SYNC, W_SHFL, W_UP, W_DOWN, W_XOR, W_BALLOT, W_ANY, W_ALL, W_MATCH_ANY, W_CUSTOM };
// a collective computed over the warp's lanes once all have arrived (e.g. an mma): lane payloads in lane order
typedef void (*WarpFn)(void* const* payload, unsigned mask);

struct AsyncCopy { void* dst; const void* src; int bytes, src_bytes; int group; };

struct Fiber {
    void* sp;
    State state;
    int bar_id, bar_count;          // BAR: the barrier and its thread count (-1: every thread of the block)
    WarpOp op;                      // WARP: the collective, its member mask, this lane's value and argument
    unsigned mask, value, result;
    int arg, width;
    WarpFn fn;
    void* payload;
    const char* what;               // the synchronisation point, for messages
    std::vector<AsyncCopy> copies;  // cp.async copies issued and not yet performed
    int committed;                  // commit groups closed so far
    int cluster_arrived;            // arrivals at the cluster barrier so far
    int cluster_phase;              // CLUSTER: the arrival count every thread of the cluster must reach
    unsigned mbar, mbar_parity;     // MBAR: the mbarrier (shared address) and the phase waited for
};

constexpr size_t STACK_BYTES = 256 * 1024;
constexpr size_t PAGE = 4096;

struct Runtime {
    std::vector<Fiber> fibers;
    char* stacks = nullptr;
    size_t stacks_for = 0;          // fibers the stack area holds
    void* sched_sp = nullptr;
    int cur = -1, n = 0;            // the running fiber; fibers (the threads of the cluster's blocks)
    int nb = 0, blocks = 1;         // threads a block; blocks a cluster (fiber t: thread t % nb of block t / nb)
    unsigned cluster[3] = {1, 1, 1}, origin[3] = {0, 0, 0};   // cluster shape; blockIdx of its rank 0
    int in_place = 0;               // the block whose shared memory is in place
    std::vector<std::vector<unsigned char>> aside;   // the other blocks' shared memory (static, then dynamic)
    void (*kernel)(const uint64_t*) = nullptr;
    const uint64_t* args = nullptr;
    const char* name = "";
    size_t dyn_smem_bytes = 0;      // of the running launch
    std::string error;
};
static Runtime rt;

inline int lane_of(int t) { return t & 31; }

// The calling fiber parks until the scheduler runs it again.
inline void park() { Fiber& f = rt.fibers[rt.cur]; cpuexec_switch(&f.sp, rt.sched_sp); }

inline void fail(const std::string& msg) {
    if (rt.error.empty()) rt.error = msg;
}

// blockIdx of the cluster's block of rank b (x fastest, as %cluster_ctarank counts)
inline uint3 block_index(int b) {
    return {rt.origin[0] + b % rt.cluster[0], rt.origin[1] + b / rt.cluster[0] % rt.cluster[1],
            rt.origin[2] + b / (rt.cluster[0] * rt.cluster[1])};
}

inline std::string where(int t) {
    char buf[160];
    const uint3 b = block_index(t / rt.nb);
    std::snprintf(buf, sizeof buf, "kernel %s, block (%u,%u,%u), thread %d", rt.name, b.x, b.y, b.z, t % rt.nb);
    return buf;
}

[[noreturn]] inline void fiber_exit() {
    Fiber& f = rt.fibers[rt.cur];
    f.state = DONE;
    f.copies.clear();               // copies never waited for: a kernel that reads them sees stale data
    cpuexec_switch(&f.sp, rt.sched_sp);
    __builtin_unreachable();
}

extern "C" void cpuexec_fiber_main() {
    rt.kernel(rt.args);
    fiber_exit();
}

inline void init_stacks(int n) {
    if ((size_t)n <= rt.stacks_for) return;
    if (rt.stacks) munmap(rt.stacks, rt.stacks_for * STACK_BYTES);
    rt.stacks = (char*)mmap(nullptr, n * STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                            -1, 0);
    if (rt.stacks == MAP_FAILED) { rt.stacks = nullptr; rt.stacks_for = 0; return; }
    for (int i = 0; i < n; ++i) mprotect(rt.stacks + i * STACK_BYTES, PAGE, PROT_NONE);   // overflow guard
    rt.stacks_for = n;
}

inline void start_fiber(int t) {
    Fiber& f = rt.fibers[t];
    void** top = (void**)(rt.stacks + (t + 1) * STACK_BYTES);
    *--top = nullptr;                                   // fiber_main's return address slot (never used)
    *--top = (void*)&cpuexec_fiber_main;
    for (int i = 0; i < 6; ++i) *--top = nullptr;       // rbp rbx r12 r13 r14 r15
    f.sp = top;
    f.state = RUN;
    f.copies.clear();
    f.committed = 0;
    f.cluster_arrived = 0;
}

// ---- shared memory of a cluster's blocks ------------------------------------------------------------------
// A shared address (what __cvta_generic_to_shared gives): the offset into the block's static shared
// section followed by its dynamic shared memory. A shared::cluster address (mapa): the block's rank in
// bits 24 and up, its shared address below.
inline size_t static_shared_bytes() { return __stop_cpuexec_shared - __start_cpuexec_shared; }

inline unsigned shared_address(const void* p) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    const size_t s = static_shared_bytes();
    if (c >= (const unsigned char*)__start_cpuexec_shared && c < (const unsigned char*)__start_cpuexec_shared + s)
        return (unsigned)(c - (const unsigned char*)__start_cpuexec_shared);
    if (c >= cpuexec_smem && c < cpuexec_smem + rt.dyn_smem_bytes) return (unsigned)(s + (c - cpuexec_smem));
    fail(where(rt.cur) + ": a shared-memory address of a pointer that is not into shared memory");
    fiber_exit();
}

// Put block b's shared memory in place (the one in place goes aside): the running thread's block's
// variables are at their addresses.
inline void enter_block(int b) {
    if (b == rt.in_place) return;
    const size_t s = static_shared_bytes(), d = rt.dyn_smem_bytes;
    unsigned char* const out = rt.aside[rt.in_place].data();
    const unsigned char* const in = rt.aside[b].data();
    std::memcpy(out, __start_cpuexec_shared, s);
    std::memcpy(out + s, cpuexec_smem, d);
    std::memcpy(__start_cpuexec_shared, in, s);
    std::memcpy(cpuexec_smem, in + s, d);
    rt.in_place = b;
}

// The bytes at shared address `addr` of the cluster's block of rank b, wherever they are now.
inline unsigned char* shared_at(int b, unsigned addr, size_t bytes) {
    const size_t s = static_shared_bytes();
    if (b < 0 || b >= rt.blocks || addr + bytes > s + rt.dyn_smem_bytes) {
        fail(where(rt.cur) + ": shared::cluster access to block rank " + std::to_string(b) + " at shared address " +
             std::to_string(addr) + " (+" + std::to_string(bytes) + "), outside its cluster's shared memory");
        fiber_exit();
    }
    if (b != rt.in_place) return rt.aside[b].data() + addr;
    return addr < s ? (unsigned char*)__start_cpuexec_shared + addr : cpuexec_smem + (addr - s);
}
inline unsigned char* cluster_at(unsigned cluster_addr, size_t bytes) {
    return shared_at((int)(cluster_addr >> 24), cluster_addr & 0xffffffu, bytes);
}

// An mbarrier (its 8 bytes): the arrivals a phase expects (the phase's parity in the top bit), the
// arrivals still pending, and the transaction bytes still pending (negative: more arrived than expected
// so far). A phase completes when both reach zero.
struct MBarrier {
    uint16_t count_phase, pending;
    int32_t tx;
    unsigned phase() const { return count_phase >> 15; }
    void complete_if_done() {
        if (pending || tx) return;
        count_phase ^= 0x8000;
        pending = count_phase & 0x7fff;
    }
};
static_assert(sizeof(MBarrier) == 8, "an mbarrier is 8 bytes");
inline MBarrier* mbarrier_at(int b, unsigned addr) { return reinterpret_cast<MBarrier*>(shared_at(b, addr, 8)); }

// Collective results for the lanes of `mask` (all at the same WARP point); false after a failure.
inline bool resolve_warp(int base, unsigned mask) {
    Fiber* L = &rt.fibers[base];
    const Fiber& first = L[__builtin_ctz(mask)];
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1)) continue;
        if (L[l].mask != mask || L[l].op != first.op || L[l].fn != first.fn) {
            fail(where(base + l) + ": lanes of one warp collective disagree (" + L[l].what + " vs " + first.what +
                 ", mask or operation differs)");
            return false;
        }
    }
    unsigned vote = 0;
    for (int l = 0; l < 32; ++l)
        if (mask >> l & 1) vote |= (L[l].value != 0u) << l;
    if (first.op == W_CUSTOM) {
        void* payload[32] = {};
        for (int l = 0; l < 32; ++l)
            if (mask >> l & 1) payload[l] = L[l].payload;
        first.fn(payload, mask);
    }
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1)) continue;
        Fiber& f = L[l];
        const int w = f.width, seg = l & ~(w - 1);
        int src = l;
        switch (f.op) {
            case W_SHFL: src = seg + (f.arg & (w - 1)); break;
            case W_UP: src = l - f.arg >= seg ? l - f.arg : l; break;
            case W_DOWN: src = l + f.arg < seg + w ? l + f.arg : l; break;
            case W_XOR: src = (l ^ f.arg) < seg + w ? (l ^ f.arg) : l; break;
            default: break;
        }
        if (src < 0 || src > 31 || !(mask >> src & 1)) {
            fail(where(base + l) + ": " + f.what + " reads lane " + std::to_string(src) + ", which is not in its mask");
            return false;
        }
        switch (f.op) {
            case W_BALLOT: f.result = vote; break;
            case W_ANY: f.result = vote != 0; break;
            case W_ALL: f.result = vote == mask; break;
            case W_MATCH_ANY:
                f.result = 0;
                for (int m = 0; m < 32; ++m)
                    if ((mask >> m & 1) && L[m].value == f.value) f.result |= 1u << m;
                break;
            default: f.result = L[src].value; break;
        }
        f.state = RUN;
    }
    return true;
}

// Complete every synchronisation point whose participants have all arrived; whether any completed.
inline bool resolve() {
    bool any = false;
    for (int base = 0; base < rt.n; base += base % rt.nb + 32 < rt.nb ? 32 : rt.nb - base % rt.nb) {
        const int end = std::min(base + 32, (base / rt.nb + 1) * rt.nb);   // a warp ends with its block
        for (int l = 0; base + l < end; ++l) {
            Fiber& f = rt.fibers[base + l];
            if (f.state != WARP) continue;
            const unsigned mask = f.mask;
            if (!(mask >> l & 1)) {
                fail(where(base + l) + ": " + f.what + " with a mask that does not hold the calling lane");
                return false;
            }
            bool ready = true;
            for (int m = 0; m < 32; ++m) {
                if (!(mask >> m & 1)) continue;
                if (base + m >= end || rt.fibers[base + m].state == DONE) {
                    fail(where(base + l) + ": " + f.what + " waits for lane " + std::to_string(m) +
                         ", which has exited or does not exist");
                    return false;
                }
                ready = ready && rt.fibers[base + m].state == WARP;
            }
            if (ready) {
                if (!resolve_warp(base, mask)) return false;
                any = true;
            }
        }
    }
    // block barriers, each block's: id -> arrived threads; -1 counts every thread of the block that has not exited
    constexpr int BARRIERS = 16;
    for (int b0 = 0; b0 < rt.n; b0 += rt.nb) {
        int live = 0, arrived[BARRIERS] = {}, count[BARRIERS] = {};
        for (int t = b0; t < b0 + rt.nb; ++t) {
            const Fiber& f = rt.fibers[t];
            live += f.state != DONE;
            if (f.state != BAR) continue;
            if (arrived[f.bar_id] && f.bar_count != count[f.bar_id]) {
                fail(where(t) + ": barrier " + std::to_string(f.bar_id) + " reached with different thread counts");
                return false;
            }
            count[f.bar_id] = f.bar_count;
            ++arrived[f.bar_id];
        }
        bool release[BARRIERS] = {}, some = false;
        for (int id = 0; id < BARRIERS; ++id) {
            if (!arrived[id]) continue;
            const int need = count[id] < 0 ? live : count[id];
            if (arrived[id] > need) {
                fail(where(b0) + ": " + std::to_string(arrived[id]) + " threads at barrier " + std::to_string(id) +
                     ", which expects " + std::to_string(need));
                return false;
            }
            release[id] = arrived[id] == need;
            some = some || release[id];
        }
        if (!some) continue;
        for (int t = b0; t < b0 + rt.nb; ++t)
            if (rt.fibers[t].state == BAR && release[rt.fibers[t].bar_id]) rt.fibers[t].state = RUN;
        any = true;
    }
    // the cluster barrier: a thread waiting for its k-th phase goes on once every thread of the cluster that
    // has not exited has arrived k times
    int arrived = INT32_MAX;           // the fewest arrivals of a thread that has not exited
    for (int t = 0; t < rt.n; ++t)
        if (rt.fibers[t].state != DONE) arrived = std::min(arrived, rt.fibers[t].cluster_arrived);
    for (int t = 0; t < rt.n; ++t) {
        Fiber& f = rt.fibers[t];
        if (f.state == CLUSTER && f.cluster_phase <= arrived) { f.state = RUN; any = true; }
    }
    // mbarrier waits: the phase waited for has completed
    for (int t = 0; t < rt.n; ++t) {
        Fiber& f = rt.fibers[t];
        if (f.state == MBAR && mbarrier_at(t / rt.nb, f.mbar)->phase() != f.mbar_parity) { f.state = RUN; any = true; }
    }
    return any;
}

// what thread t waits at, in words
inline std::string waits_at(int t) {
    const Fiber& f = rt.fibers[t];
    char buf[96];
    if (f.state == BAR)
        std::snprintf(buf, sizeof buf, " (barrier %d, %s)", f.bar_id,
                      f.bar_count < 0 ? "all threads" : (std::to_string(f.bar_count) + " threads").c_str());
    else if (f.state == CLUSTER)
        std::snprintf(buf, sizeof buf, " (arrival %d)", f.cluster_phase);
    else if (f.state == MBAR)
        std::snprintf(buf, sizeof buf, " (shared address %u, parity %u)", f.mbar, f.mbar_parity);
    else
        std::snprintf(buf, sizeof buf, " (mask 0x%08x)", f.mask);
    return std::string(f.what) + buf;
}

// The threads that have not exited, runs of consecutive threads waiting at the same point.
inline std::string deadlock() {
    std::string msg = "deadlock in kernel " + std::string(rt.name) + ", block (" + std::to_string(rt.origin[0]) + "," +
                      std::to_string(rt.origin[1]) + "," + std::to_string(rt.origin[2]) + ")" +
                      (rt.blocks > 1 ? "'s cluster (threads numbered across its blocks, in rank order)" : "") + ":";
    for (int t = 0; t < rt.n;) {
        if (rt.fibers[t].state == DONE) { ++t; continue; }
        const std::string at = waits_at(t);
        int e = t + 1;
        while (e < rt.n && rt.fibers[e].state != DONE && waits_at(e) == at) ++e;
        msg += (e - t > 1 ? " threads " + std::to_string(t) + "-" + std::to_string(e - 1) : " thread " + std::to_string(t)) +
               " wait at " + at + ";";
        t = e;
    }
    return msg + " none of these can complete";
}

inline void set_thread(int t) {
    const int b = t / rt.nb;
    t %= rt.nb;
    threadIdx.x = t % blockDim.x;
    threadIdx.y = t / blockDim.x % blockDim.y;
    threadIdx.z = t / (blockDim.x * blockDim.y);
    blockIdx = block_index(b);
    enter_block(b);
}

// Run one cluster (one block where the kernel has no cluster shape) to its end; false (rt.error set) on a
// failure.
inline bool run_cluster(bool descending) {
    for (int t = 0; t < rt.n; ++t) start_fiber(t);
    for (;;) {
        for (int i = 0; i < rt.n; ++i) {
            const int t = descending ? rt.n - 1 - i : i;
            if (rt.fibers[t].state != RUN) continue;
            rt.cur = t;
            set_thread(t);
            cpuexec_switch(&rt.sched_sp, rt.fibers[t].sp);
            if (!rt.error.empty()) return false;
        }
        bool waiting = false;
        for (int t = 0; t < rt.n; ++t) waiting = waiting || rt.fibers[t].state != DONE;
        if (!waiting) return true;
        // every thread has parked or exited: unless a point completes now, none ever will
        const bool progressed = resolve();
        if (!rt.error.empty()) return false;
        if (!progressed) { fail(deadlock()); return false; }
    }
}

// ---- what the kernel calls ------------------------------------------------------------------------------
inline int linear_tid() { return rt.cur; }

inline void barrier(int id, int count, const char* what) {
    Fiber& f = rt.fibers[rt.cur];
    if (id < 0 || id >= 16) {
        fail(where(rt.cur) + ": " + what + " on barrier " + std::to_string(id) + " (barriers are 0..15)");
        fiber_exit();
    }
    f.state = BAR; f.bar_id = id; f.bar_count = count; f.what = what;
    park();
}

inline unsigned warp_op(WarpOp op, unsigned mask, unsigned value, int arg, int width, const char* what,
                        WarpFn fn = nullptr, void* payload = nullptr) {
    Fiber& f = rt.fibers[rt.cur];
    if (width < 1 || width > 32 || (width & (width - 1))) {
        fail(where(rt.cur) + ": " + what + " with width " + std::to_string(width) + " (a power of 2 up to 32)");
        fiber_exit();
    }
    f.state = WARP; f.op = op; f.mask = mask; f.value = value; f.arg = arg; f.width = width; f.what = what;
    f.fn = fn; f.payload = payload;
    park();
    return rt.fibers[rt.cur].result;
}

[[noreturn]] inline void trap(const char* what) {
    fail(where(rt.cur) + ": " + what);
    fiber_exit();
}

}  // namespace cpuexec

inline void __syncthreads() { cpuexec::barrier(0, -1, "__syncthreads"); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { cpuexec::warp_op(cpuexec::W_SYNC, mask, 0, 0, 32, "__syncwarp"); }
[[noreturn]] inline void __trap() { cpuexec::trap("__trap()"); }

template <class T> inline unsigned cpuexec_bits(T v) {
    static_assert(sizeof(T) == 4, "a warp collective of 4-byte values only");
    unsigned u; std::memcpy(&u, &v, 4); return u;
}
// A shuffle of a 4-byte value, or of an 8-byte one as two shuffles of its halves (as CUDA's own double and
// 64-bit integer overloads are made).
template <class T, class Shuffle> inline T cpuexec_shuffle(T v, Shuffle shuffle) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "warp shuffles of 4- or 8-byte values only");
    unsigned words[sizeof(T) / 4];
    std::memcpy(words, &v, sizeof(T));
    for (unsigned& w : words) w = shuffle(w);
    std::memcpy(&v, words, sizeof(T));
    return v;
}
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return cpuexec_shuffle(v, [&](unsigned u) { return cpuexec::warp_op(cpuexec::W_SHFL, mask, u, src, width, "__shfl_sync"); });
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return cpuexec_shuffle(v, [&](unsigned u) { return cpuexec::warp_op(cpuexec::W_UP, mask, u, (int)d, width, "__shfl_up_sync"); });
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return cpuexec_shuffle(v, [&](unsigned u) { return cpuexec::warp_op(cpuexec::W_DOWN, mask, u, (int)d, width, "__shfl_down_sync"); });
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    return cpuexec_shuffle(v, [&](unsigned u) { return cpuexec::warp_op(cpuexec::W_XOR, mask, u, m, width, "__shfl_xor_sync"); });
}
inline unsigned __ballot_sync(unsigned mask, int p) { return cpuexec::warp_op(cpuexec::W_BALLOT, mask, p != 0, 0, 32, "__ballot_sync"); }
inline int __any_sync(unsigned mask, int p) { return (int)cpuexec::warp_op(cpuexec::W_ANY, mask, p != 0, 0, 32, "__any_sync"); }
template <class T> inline unsigned __match_any_sync(unsigned mask, T v) {
    return cpuexec::warp_op(cpuexec::W_MATCH_ANY, mask, cpuexec_bits(v), 0, 32, "__match_any_sync");
}
inline int __all_sync(unsigned mask, int p) { return (int)cpuexec::warp_op(cpuexec::W_ALL, mask, p != 0, 0, 32, "__all_sync"); }

// shared-memory addresses (the shared window of the CPU runtime: see cpuexec::shared_address)
inline size_t __cvta_generic_to_shared(const void* p) { return cpuexec::shared_address(p); }

// Only the running fiber touches memory and a fiber is never interrupted: every read-modify-write is atomic.
template <class T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T> inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <class T> inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <class T> inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <class T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }


// ---- the launch entry (called by tests/cuda_cpu/executor.py through ctypes) ------------------------------
// grid, block: 3 dimensions each; smem: dynamic shared memory bytes; err: room for a message on failure.
// Returns 0, or 1 with the message in err.
// grid, block, cluster: 3 dimensions each (cluster: the kernel's __cluster_dims__, 1 1 1 without); smem: dynamic
// shared memory bytes; err: room for a message on failure. Returns 0, or 1 with the message in err.
inline int cpuexec_launch_impl(void (*kernel)(const uint64_t*), const char* name, const uint64_t* args,
                               const unsigned* grid, const unsigned* block, const unsigned* cluster,
                               unsigned long long smem, int descending, char* err, int errlen) {
    using namespace cpuexec;
    rt.error.clear();
    rt.kernel = kernel; rt.args = args; rt.name = name;
    gridDim.x = grid[0]; gridDim.y = grid[1]; gridDim.z = grid[2];
    blockDim.x = block[0]; blockDim.y = block[1]; blockDim.z = block[2];
    rt.nb = (int)(block[0] * block[1] * block[2]);
    rt.blocks = (int)(cluster[0] * cluster[1] * cluster[2]);
    rt.n = rt.nb * rt.blocks;
    for (int d = 0; d < 3; ++d) {
        rt.cluster[d] = cluster[d];
        if (grid[d] % cluster[d]) {
            std::snprintf(err, errlen, "kernel %s: grid (%u,%u,%u) is not a whole number of clusters (%u,%u,%u)", name,
                          grid[0], grid[1], grid[2], cluster[0], cluster[1], cluster[2]);
            return 1;
        }
    }
    init_stacks(rt.n);
    if (!rt.stacks) { std::snprintf(err, errlen, "kernel %s: no memory for %d fiber stacks", name, rt.n); return 1; }
    rt.fibers.assign(rt.n, Fiber());
    if (smem > CPUEXEC_DYNAMIC_SMEM_BYTES) {
        std::snprintf(err, errlen, "kernel %s: %llu bytes of dynamic shared memory, more than the %d the CPU runtime has",
                      name, smem, CPUEXEC_DYNAMIC_SMEM_BYTES);
        return 1;
    }
    rt.dyn_smem_bytes = smem;
    for (unsigned z = 0; z < grid[2]; z += cluster[2])
        for (unsigned y = 0; y < grid[1]; y += cluster[1])
            for (unsigned x = 0; x < grid[0]; x += cluster[0]) {
                rt.origin[0] = x; rt.origin[1] = y; rt.origin[2] = z;
                // shared memory starts undefined on the GPU: NaN bytes here make a read before a write show
                std::memset(cpuexec_smem, 0xff, smem);
                std::memset(cpuexec_smem + smem, SMEM_CANARY, SMEM_CANARY_BYTES);
                if (__start_cpuexec_shared != __stop_cpuexec_shared)
                    std::memset(__start_cpuexec_shared, 0xff, static_shared_bytes());
                rt.aside.assign(rt.blocks, std::vector<unsigned char>(static_shared_bytes() + smem, 0xff));
                rt.in_place = 0;
                if (!run_cluster(descending != 0)) {
                    std::snprintf(err, errlen, "%s", rt.error.c_str());
                    return 1;
                }
                for (int i = 0; i < SMEM_CANARY_BYTES; ++i)
                    if (cpuexec_smem[smem + i] != SMEM_CANARY) {
                        std::snprintf(err, errlen, "kernel %s, block (%u,%u,%u)%s: wrote past its %llu bytes of dynamic "
                                      "shared memory", name, x, y, z, rt.blocks > 1 ? "'s cluster" : "", smem);
                        return 1;
                    }
            }
    return 0;
}

inline unsigned cpuexec_dynamic_smem_size() { return (unsigned)cpuexec::rt.dyn_smem_bytes; }
