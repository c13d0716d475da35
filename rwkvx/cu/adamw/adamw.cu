// adamw.cu — fused AdamW over all parameters in one flat float32 buffer, graph-replayable (rwkvx).
// The formulas, the state layout and the chunk table are documented in rwkvx/cu/adamw/ops.py.
//
// Per step, in this order (all on the stream, nothing changes between graph replays):
//   adamw_step_begin(st, b1, b2)                     <<<1, 1>>>
//   [adamw_sumsq_partial(g, table, part, n_chunks)  <<<n_chunks, ADAMW_THREADS>>>   only with clipping
//    adamw_clip_finalize(part, n_chunks, st)         <<<1, ADAMW_FIN_THREADS>>>]
//   adamw_update(p, g, m, v, table, lrmul, st, b1, b2, eps, wd, n_chunks, px)   <<<n_chunks, ADAMW_THREADS>>>
//     or adamw_update_lean(...): the same with m and v stored as bf16 (bits), stochastically rounded
//
// px (may be NULL): a floatX copy of p at the same offsets, rewritten with the updated weights (the bf16
// operands of the GEMMs in bf16 mode).
//
// st: float64 [STATE_DOUBLES] device state (indices ST_*). table: int32 [n_chunks, 4] = (offset low 32 bits,
// offset high 32 bits, length, weight-decay flag); lrmul: float32 [n_chunks]. Every chunk lies inside
// one tensor. part: float64 [n_chunks] scratch.

#include "common.cuh"
#if !defined(ST_STEP) || !defined(ST_NORM) || !defined(ADAMW_THREADS) || !defined(ADAMW_FIN_THREADS) || \
    !defined(ADAMW_CLIP_EPS)
#error "adamw/adamw.cu: the state indices ST_* and the block sizes come from rwkvx/cu/adamw/ops.py"
#endif

extern "C" __global__ void adamw_step_begin(double* st, double b1, double b2)
{
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const double t = st[ST_STEP] + 1.0;
    st[ST_STEP] = t;
    const double lr_max = st[ST_LR_MAX], lr_min = st[ST_LR_MIN];
    const double warm = st[ST_WARMUP], total = st[ST_TOTAL];
    double lr;
    if (t < warm) {
        lr = lr_max * t / warm;
    } else if (total < 0.0) {          // total_steps None (encoded as -1): constant after warm-up
        lr = lr_max;
    } else if (t > total) {
        lr = lr_min;
    } else {
        const double progress = (t - warm) / fmax(1.0, total - warm);
        lr = lr_min + 0.5 * (lr_max - lr_min) * (1.0 + cos(3.14159265358979323846 * progress));
    }
    st[ST_LR] = lr;
    st[ST_BC1] = 1.0 - pow(b1, t);
    st[ST_BC2] = 1.0 - pow(b2, t);
    st[ST_SCALE] = 1.0;
    st[ST_NORM] = -1.0;  // not computed this step (no clipping launches)
}

static __device__ __forceinline__ void adamw_chunk(const int* table, int c, long long& off, int& len, int& wd)
{
    const int* e = table + 4 * (long long)c;
    off = (long long)(unsigned int)e[0] | ((long long)e[1] << 32);
    len = e[2];
    wd = e[3];
}

// deterministic block sum of one double per thread; result valid in thread 0
template <int NT>
static __device__ __forceinline__ double adamw_block_sum(double v, double* sh)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < NT / 32; ++w) s += sh[w];
    }
    return s;
}

extern "C" __global__ void __launch_bounds__(ADAMW_THREADS)
adamw_sumsq_partial(const float* __restrict__ g, const int* __restrict__ table, double* __restrict__ part,
                    int n_chunks)
{
    __shared__ double sh[ADAMW_THREADS / 32];
    const int c = blockIdx.x;
    if (c >= n_chunks) return;
    long long off; int len, wd;
    adamw_chunk(table, c, off, len, wd);
    const float* gc = g + off;
    double s = 0.0;
    int done = 0;
    if ((((unsigned long long)gc) & 15ull) == 0) {
        const int n4 = len >> 2;
        const float4* g4 = reinterpret_cast<const float4*>(gc);
        for (int i = threadIdx.x; i < n4; i += ADAMW_THREADS) {
            const float4 u = g4[i];
            s += ((double)u.x * u.x + (double)u.y * u.y) + ((double)u.z * u.z + (double)u.w * u.w);
        }
        done = n4 << 2;
    }
    for (int i = done + threadIdx.x; i < len; i += ADAMW_THREADS) s += (double)gc[i] * gc[i];
    s = adamw_block_sum<ADAMW_THREADS>(s, sh);
    if (threadIdx.x == 0) part[c] = s;
}

extern "C" __global__ void __launch_bounds__(ADAMW_FIN_THREADS)
adamw_clip_finalize(const double* __restrict__ part, int n_parts, double* __restrict__ st)
{
    __shared__ double sh[ADAMW_FIN_THREADS / 32];
    double s = 0.0;
    for (int i = threadIdx.x; i < n_parts; i += ADAMW_FIN_THREADS) s += part[i];
    s = adamw_block_sum<ADAMW_FIN_THREADS>(s, sh);
    if (threadIdx.x == 0) {
        const double norm = sqrt(s);
        const double max_norm = st[ST_CLIP];
        double scale = 1.0;
        if (max_norm > 0.0) {
            scale = max_norm / (norm + ADAMW_CLIP_EPS);
            if (scale > 1.0) scale = 1.0;  // NaN/inf norm: scale NaN/0, as torch.nn.utils.clip_grad_norm_
        }
        st[ST_SCALE] = scale;
        st[ST_NORM] = norm;
    }
}

struct AdamwK {
    float gs, decay, b1, omb1, b2, omb2, sbc2, eps, step;
};

static __device__ __forceinline__ void adamw_elem(float& p, float g, float& m, float& v, const AdamwK& k)
{
    // the formulas of the twin oracle/adamw.py in its float32 operation order, every operation rounded
    // (__fmul_rn / __fadd_rn are never contracted into an FMA): the twin's bits. Contracted,
    // m * b1 + omb1 * g keeps m * b1 unrounded: where the two terms cancel, the rounding of m * b1 that
    // the twin keeps is most of the new m (a relative difference far beyond a bf16 place), and elsewhere a
    // float32 ulp now and then moves the lean moments' stochastic rounding by a bf16 place.
    g = __fmul_rn(g, k.gs);
    p = __fmul_rn(p, k.decay);
    m = __fadd_rn(__fmul_rn(m, k.b1), __fmul_rn(k.omb1, g));
    v = __fadd_rn(__fmul_rn(v, k.b2), __fmul_rn(k.omb2, __fmul_rn(g, g)));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.sbc2), k.eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(k.step, m), denom));
}

// Stochastic rounding of the bf16 moments (adamw_update_lean): the bits below bf16's are replaced by the
// carry of adding 16 pseudo-random bits, a hash of (step, flat element index, m or v), so that E[stored] =
// the fp32 value and a rerun stores the same bits. Rounding to nearest would drop every update of v
// smaller than half a bf16 step: (1 - b2) = 0.01 of v's value is below it whenever g*g is within 20% of v.
static __device__ __forceinline__ unsigned int adamw_fmix32(unsigned int h)
{
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    return h;
}

static __device__ __forceinline__ unsigned int adamw_round_bits(unsigned int t, unsigned long long i, unsigned int which)
{
    unsigned int h = adamw_fmix32(2u * t + which);
    h = adamw_fmix32(h ^ (unsigned int)(i >> 32));
    return adamw_fmix32(h ^ (unsigned int)i);
}

static __device__ __forceinline__ unsigned short adamw_bf16_bits(float x, unsigned int r)
{
    const unsigned int u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u)              // inf stays inf, NaN becomes the quiet NaN
        return (u & 0x007fffffu) ? (unsigned short)0x7fc0u : (unsigned short)(u >> 16);
    return (unsigned short)((u + (r & 0xffffu)) >> 16);  // a carry out of the low 16 bits rounds the magnitude up
}

// The moments as stored: float (adamw_update) or stochastically rounded bf16 (adamw_update_lean).
struct MomentsF32 {
    float* m; float* v;
    __device__ float4 load_m4(long long i) const { return reinterpret_cast<const float4*>(m)[i]; }
    __device__ float4 load_v4(long long i) const { return reinterpret_cast<const float4*>(v)[i]; }
    __device__ float load_m(long long i) const { return m[i]; }
    __device__ float load_v(long long i) const { return v[i]; }
    __device__ void store4(long long i, const float4& mm, const float4& vv, unsigned int, unsigned long long) const {
        reinterpret_cast<float4*>(m)[i] = mm; reinterpret_cast<float4*>(v)[i] = vv;
    }
    __device__ void store(long long i, float mm, float vv, unsigned int, unsigned long long) const { m[i] = mm; v[i] = vv; }
    __device__ bool aligned() const { return ((((unsigned long long)m) | ((unsigned long long)v)) & 15ull) == 0; }
};

struct MomentsBF16 {
    unsigned short* m; unsigned short* v;    // bf16 bits
    static __device__ float4 widen4(const unsigned short* a, long long i) {
        const uint2 u = reinterpret_cast<const uint2*>(a)[i];
        return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                           __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
    }
    __device__ float4 load_m4(long long i) const { return widen4(m, i); }
    __device__ float4 load_v4(long long i) const { return widen4(v, i); }
    __device__ float load_m(long long i) const { return __uint_as_float((unsigned int)m[i] << 16); }
    __device__ float load_v(long long i) const { return __uint_as_float((unsigned int)v[i] << 16); }
    // t: the step; e: the flat index of element i (the hash's input)
    __device__ void store(long long i, float mm, float vv, unsigned int t, unsigned long long e) const {
        m[i] = adamw_bf16_bits(mm, adamw_round_bits(t, e, 0u));
        v[i] = adamw_bf16_bits(vv, adamw_round_bits(t, e, 1u));
    }
    __device__ void store4(long long i, const float4& mm, const float4& vv, unsigned int t, unsigned long long e) const {
        store(4 * i, mm.x, vv.x, t, e); store(4 * i + 1, mm.y, vv.y, t, e + 1);
        store(4 * i + 2, mm.z, vv.z, t, e + 2); store(4 * i + 3, mm.w, vv.w, t, e + 3);
    }
    __device__ bool aligned() const { return ((((unsigned long long)m) | ((unsigned long long)v)) & 7ull) == 0; }
};

template <typename Moments>
static __device__ __forceinline__ void adamw_update_chunk(
    float* __restrict__ p, const float* __restrict__ g, Moments mo, const int* __restrict__ table,
    const float* __restrict__ lrmul, const double* __restrict__ st, double b1, double b2, double eps, double wd,
    int n_chunks, floatX* __restrict__ px)
{
    const int c = blockIdx.x;
    if (c >= n_chunks) return;
    long long off; int len, wdf;
    adamw_chunk(table, c, off, len, wdf);
    const double lr = st[ST_LR] * (double)lrmul[c];
    const unsigned int t = (unsigned int)st[ST_STEP];
    AdamwK k;
    k.gs = (float)st[ST_SCALE];
    k.decay = wdf ? (float)(1.0 - lr * wd) : 1.0f;
    k.b1 = (float)b1;
    k.omb1 = (float)(1.0 - b1);
    k.b2 = (float)b2;
    k.omb2 = (float)(1.0 - b2);
    k.sbc2 = (float)sqrt(st[ST_BC2]);
    k.eps = (float)eps;
    k.step = (float)(lr / st[ST_BC1]);
    float* pc = p + off;
    const float* gc = g + off;
    mo.m += off;
    mo.v += off;
    floatX* pxc = px ? px + off : nullptr;  // the GEMMs' copy of the weights (bf16 mode), refreshed here
    int done = 0;
    if (((((unsigned long long)pc) | ((unsigned long long)gc)) & 15ull) == 0 && mo.aligned()
        && (((unsigned long long)pxc) & (4 * sizeof(floatX) - 1)) == 0) {
        const int n4 = len >> 2;
        float4* p4 = reinterpret_cast<float4*>(pc);
        const float4* g4 = reinterpret_cast<const float4*>(gc);
        for (int i = threadIdx.x; i < n4; i += ADAMW_THREADS) {
            float4 pp = p4[i], mm = mo.load_m4(i), vv = mo.load_v4(i);
            const float4 gg = g4[i];
            adamw_elem(pp.x, gg.x, mm.x, vv.x, k);
            adamw_elem(pp.y, gg.y, mm.y, vv.y, k);
            adamw_elem(pp.z, gg.z, mm.z, vv.z, k);
            adamw_elem(pp.w, gg.w, mm.w, vv.w, k);
            p4[i] = pp;
            mo.store4(i, mm, vv, t, (unsigned long long)(off + 4 * i));
            if (pxc) {
                f4 r; r.v[0] = pp.x; r.v[1] = pp.y; r.v[2] = pp.z; r.v[3] = pp.w;
                store4(pxc + 4 * i, r);
            }
        }
        done = n4 << 2;
    }
    for (int i = done + threadIdx.x; i < len; i += ADAMW_THREADS) {
        float pp = pc[i], mm = mo.load_m(i), vv = mo.load_v(i);
        adamw_elem(pp, gc[i], mm, vv, k);
        pc[i] = pp;
        mo.store(i, mm, vv, t, (unsigned long long)(off + i));
        if (pxc) pxc[i] = from_f32(pp);
    }
}

extern "C" __global__ void __launch_bounds__(ADAMW_THREADS)
adamw_update(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
             const int* __restrict__ table, const float* __restrict__ lrmul, const double* __restrict__ st,
             double b1, double b2, double eps, double wd, int n_chunks, floatX* __restrict__ px)
{
    adamw_update_chunk(p, g, MomentsF32{m, v}, table, lrmul, st, b1, b2, eps, wd, n_chunks, px);
}

extern "C" __global__ void __launch_bounds__(ADAMW_THREADS)
adamw_update_lean(float* __restrict__ p, const float* __restrict__ g, __nv_bfloat16* __restrict__ m,
                  __nv_bfloat16* __restrict__ v, const int* __restrict__ table, const float* __restrict__ lrmul,
                  const double* __restrict__ st, double b1, double b2, double eps, double wd, int n_chunks,
                  floatX* __restrict__ px)
{
    adamw_update_chunk(p, g, MomentsBF16{reinterpret_cast<unsigned short*>(m), reinterpret_cast<unsigned short*>(v)},
                       table, lrmul, st, b1, b2, eps, wd, n_chunks, px);
}
