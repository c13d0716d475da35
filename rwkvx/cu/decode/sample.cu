// rwkvx/cu/decode/sample.cu -- the decoder step's sampling: from each row of logits and one uniform draw u,
// the token rwkvx/sampling.py's contract chooses (temperature, top-k, top-p, greedy), written as an int.
//
// The contract is exact: the tokens' order is an integer key, the weights are integers computed with
// exactly rounded float64 steps (__dadd_rn / __dmul_rn / __ddiv_rn: never fused), and every sum is an
// integer sum, so the result does not depend on the order of any reduction and equals the numpy sampler's.
//
// Order key (larger = earlier): the logit's float bits made order-preserving (NaN as -inf, -0 as +0),
// then the complement of the token id (ties: the lower id first). Every key is distinct, so "the first
// tokens of the order whose mass reaches a target" is found by a radix descent over the 64-bit key, one
// byte at a time from the top: a histogram of the masses of each byte value among the keys that share
// the bytes chosen so far (one per warp, added up in warp order), then the byte at which the running
// mass (from the top) reaches the target.
// Three descents: the top-k cut (mass 1 per token), the nucleus (the contract's weights), the draw.
//
// A row is read by a cluster of SMP_CLUSTER blocks (one per SM, the passes over the row shared out:
// a single block's passes over V = 65536 logits made the kernel a third of a batch-1 generation step):
// each block takes every SMP_CLUSTER-th run of SMP_THREADS logits, and every block combines the
// blocks' partial results (a maximum, integer sums, the 256 bucket masses of a descent's level) from
// their shared memory (distributed shared memory, between cluster barriers), so each takes the same
// decisions. Integer sums do not depend on the order, so the result is the single block's.
//
// SMP_* constants come from rwkvx/cu/decode/ops.py (which takes them from rwkvx/sampling.py).

#include "common.cuh"
#include "cluster.cuh"
#if !defined(SMP_THREADS) || !defined(SMP_WEIGHT_BITS) || !defined(SMP_EXP_COEFFS) || !defined(SMP_CLUSTER)
#error "decode/sample.cu: the SMP_* constants come from rwkvx/cu/decode/ops.py"
#endif

namespace smp {
typedef unsigned long long u64;
constexpr int NT = SMP_THREADS;
constexpr int NW = NT / 32;
constexpr int CL = SMP_CLUSTER;
__constant__ double EXP_C[] = {SMP_EXP_COEFFS};
constexpr int DEGREE = sizeof(EXP_C) / sizeof(EXP_C[0]) - 1;
static_assert(NT % 32 == 0, "SMP_THREADS: whole warps");

__device__ __forceinline__ float clean(float f) {   // NaN counts as -inf, -0 as +0
    return isnan(f) ? -__int_as_float(0x7f800000) : (f == 0.f ? 0.f : f);
}

__device__ __forceinline__ u64 order_key(float f, int i) {
    unsigned b = __float_as_uint(clean(f));
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(0xFFFFFFFFu - (unsigned)i);
}

__device__ __forceinline__ int key_token(u64 key) { return (int)(0xFFFFFFFFu - (unsigned)(key & 0xFFFFFFFFu)); }

// the contract's weight of logit z given the largest m: floor(e((z - m) / T) * 2^BITS), 0 below the cutoff
__device__ __forceinline__ u64 weight(float zf, double m, double T) {
    const double z = (double)clean(zf);
    if (isinf(m)) return z == m ? (1ull << SMP_WEIGHT_BITS) : 0ull;
    const double x = __ddiv_rn(__dsub_rn(z, m), T);
    if (!(x >= SMP_CUTOFF)) return 0ull;
    const double n = floor(__dadd_rn(__dmul_rn(x, SMP_INV_LN2), 0.5));
    const double r = __dsub_rn(__dsub_rn(x, __dmul_rn(n, SMP_LN2_HI)), __dmul_rn(n, SMP_LN2_LO));
    double p = EXP_C[DEGREE];
#pragma unroll
    for (int k = DEGREE - 1; k >= 0; --k) p = __dadd_rn(__dmul_rn(p, r), EXP_C[k]);
    // times 2^(n + BITS), a normal power of two (n >= -34): exact, as ldexp
    const double scale = __longlong_as_double((long long)((int)n + SMP_WEIGHT_BITS + 1023) << 52);
    return (u64)floor(__dmul_rn(p, scale));
}

struct Shared {
    u64 hist[NW * 256];        // one histogram per warp: same-bucket atomics contend within a warp only
    u64 local[256];            // this block's bucket masses (read by the cluster's blocks)
    u64 total[256];            // the cluster's bucket masses
    u64 warp[NW];
    u64 part;                  // this block's partial max / sum (read by the cluster's blocks)
    u64 prefix, above, through;
};

// the u64 at p (in this block's shared memory) in the shared memory of the cluster's block `rank`
__device__ __forceinline__ u64 remote(const u64* p, unsigned rank) { return ld_shared_cluster_u64(cluster_map(p, rank)); }

// this thread's logits: run rank, rank + CL, ... of SMP_THREADS consecutive logits
template <class F>
__device__ __forceinline__ void for_my_logits(const floatX* row, int V, F f) {
    for (int i = cluster_ctarank() * NT + threadIdx.x; i < V; i += CL * NT) f(to_f32(row[i]), i);
}

// an integer sum (MAX: a maximum) over the cluster's threads (exact, so any order gives it); every
// thread gets it
template <bool MAX>
__device__ __forceinline__ u64 cluster_reduce(u64 v, Shared& sh) {
    for (int o = 16; o > 0; o >>= 1) {
        const u64 u = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? max(v, u) : v + u;
    }
    if ((threadIdx.x & 31) == 0) sh.warp[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 s = 0;
        for (int w = 0; w < NW; ++w) s = MAX ? max(s, sh.warp[w]) : s + sh.warp[w];
        sh.part = s;
    }
    cluster_sync();
    u64 s = 0;
    for (int r = 0; r < CL; ++r) s = MAX ? max(s, remote(&sh.part, r)) : s + remote(&sh.part, r);
    cluster_sync();
    return s;
}

// The key K at which the mass of the keys >= K (in the order, from the top) first reaches target
// (1 <= target <= the total mass); sh.through = that mass. COUNT: every token weighs 1, else its weight.
template <bool COUNT>
__device__ u64 descend(const floatX* row, int V, double m, double T, u64 target, Shared& sh) {
    const int tid = threadIdx.x;
    if (tid == 0) { sh.prefix = 0; sh.above = 0; }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int k = tid; k < NW * 256; k += NT) sh.hist[k] = 0;
        __syncthreads();
        const u64 prefix = sh.prefix;
        const u64 hi = shift == 56 ? 0ull : ~0ull << (shift + 8);     // the bytes chosen so far
        for_my_logits(row, V, [&](float z, int i) {
            const u64 key = order_key(z, i);
            if ((key & hi) != prefix) return;
            const u64 mass = COUNT ? 1ull : weight(z, m, T);
            if (mass) atomicAdd(&sh.hist[(tid >> 5) * 256 + (int)((key >> shift) & 255)], mass);
        });
        __syncthreads();
        for (int b = tid; b < 256; b += NT) {
            u64 own = 0;
#pragma unroll
            for (int w = 0; w < NW; ++w) own += sh.hist[w * 256 + b];
            sh.local[b] = own;
        }
        cluster_sync();
        for (int b = tid; b < 256; b += NT) {
            u64 all = 0;
            for (int r = 0; r < CL; ++r) all += remote(&sh.local[b], r);
            sh.total[b] = all;
        }
        cluster_sync();    // every block has read the others' masses (and its own totals are written)
        if (tid < 32) {    // warp 0: lane l holds buckets 255-8l .. 248-8l; the running mass from the top
            u64 own = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) own += sh.total[255 - 8 * tid - j];
            u64 run = own;
            for (int o = 1; o < 32; o <<= 1) {
                const u64 up = __shfl_up_sync(0xffffffffu, run, o);
                if (tid >= o) run += up;
            }
            const u64 need = target - sh.above;          // > 0 and <= the mass of this range
            const unsigned reached = __ballot_sync(0xffffffffu, run >= need);
            const int lane = __ffs(reached) - 1;
            if (tid == lane) {
                u64 acc = sh.above + run - own;
                int b = 255 - 8 * tid;
                while (acc + sh.total[b] < target) acc += sh.total[b--];
                sh.above = acc;
                sh.through = acc + sh.total[b];
                sh.prefix = prefix | ((u64)b << shift);
            }
        }
        __syncthreads();
    }
    return sh.prefix;
}
}  // namespace smp

// ---------------------------------------------------------------------------------------------
// grid (B * SMP_CLUSTER), clusters of SMP_CLUSTER blocks (one row each), block SMP_THREADS.
// logits floatX [B, V]; u double [B] in [0, 1); opts double [3]: temperature, top_p, top_k (0: no
// limit); out int [B]: the chosen token of each row.
// ---------------------------------------------------------------------------------------------
// (the minimum of 1 block an SM: without it ptxas held the build to 40 registers and spilled)
extern "C" __global__ void __cluster_dims__(SMP_CLUSTER, 1, 1) __launch_bounds__(SMP_THREADS, 1)
dec_sample(const floatX* __restrict__ logits, const double* __restrict__ u, const double* __restrict__ opts,
           int* __restrict__ out, int V)
{
    using namespace smp;
    __shared__ Shared sh;
    const int rowi = blockIdx.x / CL;
    const bool writer = cluster_ctarank() == 0 && threadIdx.x == 0;
    const floatX* row = logits + (size_t)rowi * V;
    const double T = opts[0], top_p = opts[1];
    const long long top_k = (long long)opts[2];

    u64 best = 0;                                       // the first token of the order
    for_my_logits(row, V, [&](float z, int i) { best = max(best, order_key(z, i)); });
    best = cluster_reduce<true>(best, sh);
    if (T == 0.0 || top_k == 1) {
        if (writer) out[rowi] = key_token(best);
        return;
    }
    const double m = (double)clean(to_f32(row[key_token(best)]));

    u64 cut = 0;                                        // keys >= cut are kept (top-k)
    if (top_k > 1 && top_k < V) cut = descend<true>(row, V, m, T, (u64)top_k, sh);
    u64 mine = 0;
    for_my_logits(row, V, [&](float z, int i) {
        if (order_key(z, i) >= cut) mine += weight(z, m, T);
    });
    const u64 S = cluster_reduce<false>(mine, sh);
    const u64 target = max(1ull, (u64)ceil(__dmul_rn(top_p, (double)S)));
    descend<false>(row, V, m, T, target, sh);
    const u64 N = sh.through;                           // the nucleus's mass
    u64 t = (u64)floor(__dmul_rn(u[rowi], (double)N));
    if (t >= N) t = N - 1;
    const u64 chosen = descend<false>(row, V, m, T, t + 1, sh);
    if (writer) out[rowi] = key_token(chosen);
}
