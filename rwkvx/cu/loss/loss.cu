// loss.cu — fused log-softmax cross-entropy, forward and backward in one kernel (rwkvx).
//
//   cross_entropy_loss(logits, dlogits, targets, loss, inv_count, R, V, ignore_index)
//     logits   floatX  [R, V]   row-major
//     dlogits  floatX  [R, V]   may be NULL (loss only) and may equal logits (in place: each element is
//                               written by the one thread that read it, after reading it; x[t] is also
//                               read by every thread, before the cluster exchange, and no CTA writes
//                               the row before that exchange has seen every CTA's pass 1)
//     targets  int32   [R]
//     loss     float64 [R]      loss[r] = logsumexp(logits[r]) - logits[r, t]; 0 where t == ignore_index
//     inv_count float64 [1]     device scalar, 1 / (number of rows with t != ignore_index), written by
//                               the host with the targets every step (the graph never changes)
//     dlogits[r, j] = (softmax(logits[r])_j - [j == t]) * inv_count;  rows with t == ignore_index: 0
//   A target outside [0, V) that is not ignore_index (the host validates: never expected) gives loss NaN.
//
// Layout: row r is one thread-block cluster, the CE_CLUSTER CTAs (r, 0..CE_CLUSTER-1) of CE_THREADS
// threads (grid (R, CE_CLUSTER); the cluster shape is a compile-time attribute, so a plain cuLaunchKernel
// launches it). The row is cut into quads (4 consecutive elements); the SPAN = CE_CLUSTER * CE_THREADS
// threads take quads q = g, g + SPAN, ... (g = blockIdx.y * CE_THREADS + tid: coalesced), CE_QUADS of
// them per thread in registers ("a chunk", 128 bytes = 32 registers). A row of at most
// CE_CLUSTER * CE_THREADS * CE_QUADS quads (V <= 65536) is one chunk: it is read from
// DRAM once, and the dlogits come from the registers. Why: a kernel that re-reads each row from memory
// for the gradient, one CTA per row with 3 rows per SM resident, has 396 x 128 KB = 49.5 MiB of rows in
// flight, most of the 60 MiB L2, so part of the re-read goes to DRAM; and as logits may alias dlogits, a
// load-compute-store loop keeps one 8-byte load in flight per thread. Here all CE_QUADS loads of a thread
// are in flight together. Longer rows (and V % 4 != 0, element loads) stream chunk after chunk with an
// online max, and the gradient pass re-reads every chunk but the last, which is still in registers.
//
// Numerics. Everything is in base 2: x * log2e (log2e rounded to float, L) with the reference B = max * L
// rounded to float, so each term is 2^fma(x, L, -B) = one FFMA + one MUFU.EX2 (ex2.approx, rel. err.
// ~2^-22), instead of expf's ~9 instructions plus a float->double conversion (16/clk/SM) and a DADD.
// Per thread the terms of a chunk (<= 4 * CE_QUADS = 32..64 terms, each <= 1) are summed in fp32 with 4
// accumulators (<= 16 terms each: relative error <= ~1e-6 worst case) and added to a float64 sum; sums
// with different references are merged as s_a * 2^(B_a - B) + s_b in float64 with the factor from
// ex2.approx (the exponent differences along any merge path telescope, so the total argument rounding
// is that of one factor, ~1e-6 for the terms that matter). The sum leaves out the target's own term:
// S' = sum over j != t, and S = S' + 2^(x[t] L - B) in float64. So S has a relative error of a few 1e-6 at
// worst, i.e. an absolute error of a few 1e-6 in the loss (limit: 1e-5 relative on losses ~10) and a
// relative error of that size in dlogits (limit 1e-4). The loss is log(S) + B / L - x[t] in float64: B / L
// is the reference in natural units, and the float rounding of L then only enters as L's relative error
// (1.3e-8) times E_p[x - B/L] (at most ~log V), < 2e-7 absolute, whatever the size of the logits.
// dlogits[j] = 2^fma(x, L, -B) * (inv_count / S) for j != t, and dlogits[t] = -(S' / S) * inv_count: why
// S' is summed apart: on a row where softmax puts almost all its mass on t, p_t * inv - inv cancels in
// fp32 (p_t = 1 - 1e-4 keeps ~3 digits), while S' / S is 1 - p_t to the sum's own relative error.
// The reference B is the same either way (the row max): every thread starts from x[t] L, so a thread
// whose quads hold no larger logit scales its terms to that reference.
// All reductions are butterflies of symmetric merges in a fixed order, then fixed-order warp/CTA/cluster
// steps: no atomics, bit-reproducible run to run, and every CTA of the cluster gets the same (B, S).
//
// Constants from rwkvx/cu/loss/ops.py (derived per element type): CE_THREADS, CE_QUADS, CE_CLUSTER,
// CE_MIN_BLOCKS (CTAs per SM the register budget is cut for: the row data is 32 registers per thread).

#include "common.cuh"
#include "cluster.cuh"
#include "ptx.cuh"
#if !defined(CE_THREADS) || !defined(CE_QUADS) || !defined(CE_CLUSTER) || !defined(CE_MIN_BLOCKS)
#error "loss/loss.cu: CE_THREADS, CE_QUADS, CE_CLUSTER and CE_MIN_BLOCKS come from rwkvx/cu/loss/ops.py"
#endif
#define CE_WARPS (CE_THREADS / 32)
#define CE_SPAN (CE_CLUSTER * CE_THREADS)   // threads sharing one row
#define CE_CHUNK (CE_SPAN * CE_QUADS)       // quads of a row the cluster holds in registers
static_assert(CE_THREADS % 32 == 0 && (CE_WARPS & (CE_WARPS - 1)) == 0 && CE_WARPS <= 32, "CE_THREADS");
static_assert((CE_CLUSTER & (CE_CLUSTER - 1)) == 0 && CE_CLUSTER <= 8 && CE_CLUSTER <= CE_WARPS,
              "CE_CLUSTER: a power of 2, at most 8 (portable cluster size) and at most CE_WARPS");

#define CE_L 1.4426950408889634f          // log2(e), rounded to float: L in the notes above
#define CE_NEG_INF __int_as_float(0xff800000)

// Row data is held as loaded (common.cuh's quadX); padding reads as -inf.
#if FLOATX_BF16
static __device__ __forceinline__ quadX ce_pad() { return make_uint2(0xff80ff80u, 0xff80ff80u); }  // -inf x4
static __device__ __forceinline__ unsigned ce_bits(const floatX* p) { return __bfloat16_as_ushort(*p); }
#else
static __device__ __forceinline__ quadX ce_pad() { return make_float4(CE_NEG_INF, CE_NEG_INF, CE_NEG_INF, CE_NEG_INF); }
#endif

// Max of a chunk: packed bf16x2 max (no widening; ptxas fuses it to about one VHMNMX per quad) or FMNMX.
static __device__ __forceinline__ float ce_max(const quadX (&b)[CE_QUADS]) {
#if FLOATX_BF16
    __nv_bfloat162 m = *reinterpret_cast<const __nv_bfloat162*>(&b[0].x);
#pragma unroll
    for (int k = 0; k < CE_QUADS; ++k) {
        if (k) m = __hmax2(m, *reinterpret_cast<const __nv_bfloat162*>(&b[k].x));
        m = __hmax2(m, *reinterpret_cast<const __nv_bfloat162*>(&b[k].y));
    }
    return fmaxf(__low2float(m), __high2float(m));
#else
    float m0 = CE_NEG_INF, m1 = CE_NEG_INF;
#pragma unroll
    for (int k = 0; k < CE_QUADS; ++k) {
        m0 = fmaxf(m0, fmaxf(b[k].x, b[k].y));
        m1 = fmaxf(m1, fmaxf(b[k].z, b[k].w));
    }
    return fmaxf(m0, m1);
#endif
}

// The quads q0, q0 + SPAN, ... of a row; quads at or past nq are -inf. vec: one aligned vector load per
// quad (V % 4 == 0); otherwise element loads (any V, any alignment), elements at or past V are -inf.
static __device__ __forceinline__ void ce_load(quadX (&b)[CE_QUADS], const floatX* row, int q0, int nq,
                                               int V, bool vec)
{
    if (vec && q0 + (CE_QUADS - 1) * CE_SPAN < nq) {   // all in range (V = 65536): no tests, no padding
#pragma unroll
        for (int k = 0; k < CE_QUADS; ++k) b[k] = load_quad(row + 4 * (q0 + k * CE_SPAN));
    } else if (vec) {
#pragma unroll
        for (int k = 0; k < CE_QUADS; ++k) {
            const int q = q0 + k * CE_SPAN;
            b[k] = q < nq ? load_quad(row + 4 * q) : ce_pad();
        }
    } else {
#pragma unroll
        for (int k = 0; k < CE_QUADS; ++k) {
            const int j = 4 * (q0 + k * CE_SPAN);
#if FLOATX_BF16
            unsigned e[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) e[i] = j + i < V ? ce_bits(row + j + i) : 0xff80u;
            b[k] = make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
#else
            float e[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) e[i] = j + i < V ? row[j + i] : CE_NEG_INF;
            b[k] = make_float4(e[0], e[1], e[2], e[3]);
#endif
        }
    }
}

static __device__ __forceinline__ float ce_ex2(float x) { return ex2_approx(x); }   // one MUFU.EX2; ex2(-inf) = 0

// Element i of quad k of a chunk set to -inf: the target's term left out of the sum (no dynamic register
// index: each quad is compared and selected, so the chunk stays in registers).
static __device__ __forceinline__ void ce_mask(quadX (&b)[CE_QUADS], int k, int i) {
#pragma unroll
    for (int m = 0; m < CE_QUADS; ++m) {
        if (m != k) continue;
#if FLOATX_BF16
        const unsigned half = (i & 1) ? 0xffff0000u : 0x0000ffffu;      // element 2j is the low half
        const unsigned ninf = 0xff80ff80u & half;
        if (i < 2) b[m].x = (b[m].x & ~half) | ninf;
        else b[m].y = (b[m].y & ~half) | ninf;
#else
        b[m].x = i == 0 ? CE_NEG_INF : b[m].x;
        b[m].y = i == 1 ? CE_NEG_INF : b[m].y;
        b[m].z = i == 2 ? CE_NEG_INF : b[m].z;
        b[m].w = i == 3 ? CE_NEG_INF : b[m].w;
#endif
    }
}

static __device__ __forceinline__ void ce_store(floatX* drow, int q, int V, bool vec, const f4& o) {
    if (vec) {
        store4(drow + 4 * q, o);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (4 * q + i < V) drow[4 * q + i] = from_f32(o.v[i]);
    }
}

// dlogits of a chunk: 2^(x L - B) * scale. FULL: all quads in range and aligned (every chunk of a
// vector row of V = 65536): no per-quad test, so the compiler interleaves the quads.
template <bool FULL>
static __device__ __forceinline__ void ce_write(const quadX (&b)[CE_QUADS], floatX* drow, int q0, int nq,
                                                int V, float B, float scale, bool vec = true) {
#pragma unroll
    for (int k = 0; k < CE_QUADS; ++k) {
        const int q = q0 + k * CE_SPAN;
        if (FULL || q < nq) {
            const f4 x = widen(b[k]);
            f4 o;
#pragma unroll
            for (int i = 0; i < 4; ++i) o.v[i] = ce_ex2(fmaf(x.v[i], CE_L, -B)) * scale;
            ce_store(drow, q, V, FULL || vec, o);
        }
    }
}

// s * 2^B = sum of 2^(x * L) over the elements seen; B = -inf, s = 0: none (or all -inf).
struct ce_acc { float B; double s; };

// Add a chunk: new reference from the chunk max, rescale the old sum once, then the chunk's terms in
// fp32 (bounded count, see the notes) added to the float64 sum.
static __device__ __forceinline__ void ce_accumulate(ce_acc& a, const quadX (&b)[CE_QUADS]) {
    const float B = fmaxf(a.B, ce_max(b) * CE_L);
    if (B == CE_NEG_INF) return;
    if (B > a.B) {
        a.s *= (double)ce_ex2(a.B - B);      // a.B = -inf: s was 0 and stays 0
        a.B = B;
    }
    float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
#pragma unroll
    for (int k = 0; k < CE_QUADS; ++k) {
        const f4 x = widen(b[k]);
        p0 += ce_ex2(fmaf(x.v[0], CE_L, -B));
        p1 += ce_ex2(fmaf(x.v[1], CE_L, -B));
        p2 += ce_ex2(fmaf(x.v[2], CE_L, -B));
        p3 += ce_ex2(fmaf(x.v[3], CE_L, -B));
    }
    a.s += (double)((p0 + p1) + (p2 + p3));
}

// Merge two sums. Symmetric bit for bit (merge(a, b) == merge(b, a)): the larger reference is kept and
// only the other sum is scaled; on a tie the factor is exactly 1 and hi + lo is commutative. So a
// butterfly leaves the same value in every lane.
static __device__ __forceinline__ ce_acc ce_merge(const ce_acc& a, const ce_acc& b) {
    const bool a_hi = a.B >= b.B;
    const float B = a_hi ? a.B : b.B, Blo = a_hi ? b.B : a.B;
    const double hi = a_hi ? a.s : b.s, lo = a_hi ? b.s : a.s;
    const float f = Blo == B ? 1.f : ce_ex2(Blo - B);   // both -inf: 1 (0 + 0); Blo = -inf: 0
    ce_acc r;
    r.B = B;
    r.s = hi + lo * (double)f;
    return r;
}

// Butterfly merge over groups of W lanes: every lane of a group ends with the merge of its group.
template <int W>
static __device__ __forceinline__ ce_acc ce_warp_merge(ce_acc a) {
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) {
        ce_acc b;
        b.B = __shfl_xor_sync(0xffffffffu, a.B, o);
        b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
        a = ce_merge(a, b);
    }
    return a;
}

// Cluster exchange. Each CTA pushes its (B, s) into slot [its rank] of every CTA of the cluster with
// st.async, which counts the bytes on the receiver's mbarrier; a CTA goes on when its barrier has seen all
// CE_CLUSTER messages, then merges the slots in rank order, so every CTA gets the same bits. Unlike
// barrier.cluster.arrive.release (which compiles to MEMBAR.ALL.GPU), this needs no fence on the critical
// path, and no CTA can exit while a message to it is in flight (it waits for them all). The cluster
// barrier is used once, split around pass 1, only to know every CTA has initialised its mbarrier.
static __device__ __forceinline__ void ce_mbar_init(unsigned long long* bar, unsigned bytes) {   // one thread
    mbarrier_init<1>(bar);
    mbarrier_arrive_expect_tx(bar, bytes);
    fence_mbarrier_init();
}
static __device__ __forceinline__ void ce_push(unsigned addr_B, unsigned addr_s, unsigned bar, const ce_acc& a) {
    st_async_b32(addr_B, __float_as_uint(a.B), bar);
    st_async_b64(addr_s, __double_as_longlong(a.s), bar);
}

// The cluster shape is a compile-time attribute of the kernel, so the launch needs no launch attribute.
// It is on a declaration of its own (it reaches the cubin: EIATTR_CTA_PER_CLUSTER), which keeps the
// definition in the one prototype form tests/test_kernel_declarations.py parses.
extern "C" {
__global__ void __cluster_dims__(1, CE_CLUSTER, 1)
cross_entropy_loss(const floatX* logits, floatX* dlogits, const int* __restrict__ targets,
                   double* __restrict__ loss, const double* __restrict__ inv_count,
                   int R, int V, int ignore_index);
}

extern "C" __global__ void __launch_bounds__(CE_THREADS, CE_MIN_BLOCKS)
cross_entropy_loss(const floatX* logits, floatX* dlogits, const int* __restrict__ targets,
                   double* __restrict__ loss, const double* __restrict__ inv_count,
                   int R, int V, int ignore_index)
{
    __shared__ float sh_B[CE_WARPS];
    __shared__ double sh_s[CE_WARPS];
    __shared__ float cl_B[CE_CLUSTER];      // (B, s) of every CTA of the cluster, by rank (st.async)
    __shared__ double cl_s[CE_CLUSTER];
    __shared__ __align__(8) unsigned long long cl_bar;

    const int r = blockIdx.x;                        // the cluster: the CE_CLUSTER CTAs (r, 0..CE_CLUSTER-1)
    if (r >= R) return;                              // uniform over the cluster
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = blockIdx.y * CE_THREADS + tid;
    const int t = targets[r];
    const long long base = (long long)r * V;
    const floatX* row = logits + base;
    const bool vec = ((V & 3) == 0) && aligned4(logits) && aligned4(dlogits);
    const int nq = (V + 3) >> 2;

    if (t == ignore_index) {                         // uniform over the cluster: no barrier needed
        if (g == 0) loss[r] = 0.0;
        if (dlogits) {
            f4 z = f4_zero();
            for (int q = g; q < nq; q += CE_SPAN) ce_store(dlogits + base, q, V, vec, z);
        }
        return;
    }
    // The thread that owns element t (quad t/4) leaves it out of its sum, writes the loss and corrects
    // dlogits[t]; with a bad target thread 0 writes loss NaN. Every thread reads x[t] (one broadcast load
    // per warp) here, before any write of the row: the cluster's first write comes after every CTA's pass 1.
    const bool t_ok = (unsigned)t < (unsigned)V;
    const bool owner = t_ok ? g == (t >> 2) % CE_SPAN : g == 0;
    const int t_own = owner && t_ok ? t : -1;        // one register to the end (the fix-up of dlogits[t])
    const float xt = t_ok ? to_f32(row[t]) : __int_as_float(0x7fc00000);
    const int c_t = t_own >= 0 ? (t >> 2) / CE_CHUNK : -1;                 // t's chunk, quad and element
    const int k_t = t_own >= 0 ? ((t >> 2) - c_t * CE_CHUNK - g) / CE_SPAN : -1;

    if (tid == 0) ce_mbar_init(&cl_bar, CE_CLUSTER * (sizeof(float) + sizeof(double)));
    cluster_arrive_relaxed();

    // pass 1: (B, s') of this thread's quads, the target's term left out; a row of one chunk stays in buf
    // for the gradient (with x[t] as -inf: its own term is written last, from xt)
    quadX buf[CE_QUADS];
    const int nchunk = (nq + CE_CHUNK - 1) / CE_CHUNK;
    ce_acc acc;
    acc.B = t_ok ? xt * CE_L : CE_NEG_INF;
    acc.s = 0.0;
    for (int c = 0; c < nchunk; ++c) {
        ce_load(buf, row, c * CE_CHUNK + g, nq, V, vec);
        if (c == c_t) ce_mask(buf, k_t, t & 3);
        ce_accumulate(acc, buf);
    }

    // merge: lanes, then the warps (warp 0), then the CTAs of the cluster (every thread, rank order)
    acc = ce_warp_merge<32>(acc);
    if (lane == 0) { sh_B[warp] = acc.B; sh_s[warp] = acc.s; }
    __syncthreads();
    cluster_wait();                          // every CTA's cl_bar is initialised (arrived before pass 1)
    if (warp == 0) {
        ce_acc a;
        a.B = lane < CE_WARPS ? sh_B[lane] : CE_NEG_INF;
        a.s = lane < CE_WARPS ? sh_s[lane] : 0.0;
        a = ce_warp_merge<CE_WARPS>(a);      // the same value in every lane
        if (lane < CE_CLUSTER) {             // lane k sends to CTA k
            const unsigned me = cluster_ctarank();
            ce_push(cluster_map(&cl_B[me], lane), cluster_map(&cl_s[me], lane), cluster_map(&cl_bar, lane), a);
        }
    }
    mbarrier_wait_parity<0>(&cl_bar);     // phase 0: one exchange per CTA
    acc.B = cl_B[0];
    acc.s = cl_s[0];
#pragma unroll
    for (int k = 1; k < CE_CLUSTER; ++k) {
        ce_acc b;
        b.B = cl_B[k];
        b.s = cl_s[k];
        acc = ce_merge(acc, b);
    }
    const float B = acc.B;
    const double S = acc.s + (t_ok ? (double)ce_ex2(fmaf(xt, CE_L, -B)) : 0.0);

    // pass 2: dlogits = 2^(x L - B) * (inv_count / S), last chunk from registers first
    if (dlogits) {
        const double ic = *inv_count;
        const float scale = (float)(ic / S);
        floatX* drow = dlogits + base;
        for (int c = nchunk - 1; c >= 0; --c) {
            const int q0 = c * CE_CHUNK + g;
            if (c != nchunk - 1) ce_load(buf, row, q0, nq, V, vec);
            if (vec && q0 + (CE_QUADS - 1) * CE_SPAN < nq) ce_write<true>(buf, drow, q0, nq, V, B, scale);
            else ce_write<false>(buf, drow, q0, nq, V, B, scale, vec);
        }
        // the target's own term, overwriting what this thread stored above (same thread: program order)
        if (t_own >= 0) drow[t_own] = from_f32((float)(-(acc.s / S) * ic));
    }
    // last: log() needs many registers, which are free once the row data is dead
    if (owner) loss[r] = log(S) + (double)B / (double)CE_L - (double)xt;
}
