// rng.cu — the counter-based draws of the device initialisation (rwkvx/cu/init/README.md).
//
// Every value is a function of (seed, tensor key, element index) alone: Philox-4x32-10 (Salmon et al.,
// SC'11) with key = the seed's two 32-bit halves and counter = (block index lo, hi, tensor key lo, hi)
// gives four 32-bit words per block. The integer words and every float operation after them are the same
// on the host (oracle/init.py computes them with numpy): the float64 arithmetic is written with
// explicit round-to-nearest intrinsics (no FMA contraction) and its log / sin / cos are fixed polynomials,
// not the library's, so the device and the host give the same bits.
//
//   init_normal(out, count, key0, key1, id0, id1)
//       out float64 [count]: standard Gaussians; block j gives elements 2j and 2j+1 (Box-Muller)
//   init_uniform(out, count, key0, key1, id0, id1, lo, width)
//       out float32 [count]: lo + width * u, u uniform in [0, 1) with 24 bits; block j gives elements
//       4j .. 4j+3, one word each
//
// The constants (Philox multipliers and Weyl increments, the polynomial coefficients, ln 2, pi/4, sqrt(1/2))
// come from rwkvx/cu/init/ops.py.

#include "common.cuh"
#if !defined(RNG_THREADS) || !defined(RNG_ROUNDS) || !defined(RNG_M0) || !defined(RNG_M1) || \
    !defined(RNG_W0) || !defined(RNG_W1) || !defined(RNG_LOG_C) || !defined(RNG_SIN_C) || \
    !defined(RNG_COS_C) || !defined(RNG_LN2) || !defined(RNG_PI_4) || !defined(RNG_SQRT_HALF)
#error "init/rng.cu: its constants come from rwkvx/cu/init/ops.py"
#endif

static __device__ const double LOG_C[] = {RNG_LOG_C};
static __device__ const double SIN_C[] = {RNG_SIN_C};
static __device__ const double COS_C[] = {RNG_COS_C};

struct u4 { unsigned int x, y, z, w; };

// Philox-4x32 with RNG_ROUNDS rounds of counter c under key (k0, k1).
__device__ __forceinline__ u4 philox(u4 c, unsigned int k0, unsigned int k1)
{
#pragma unroll
    for (int r = 0; r < RNG_ROUNDS; ++r) {
        const unsigned long long p0 = (unsigned long long)RNG_M0 * c.x;
        const unsigned long long p1 = (unsigned long long)RNG_M1 * c.z;
        c = u4{(unsigned int)(p1 >> 32) ^ c.y ^ k0, (unsigned int)p1,
               (unsigned int)(p0 >> 32) ^ c.w ^ k1, (unsigned int)p0};
        k0 += RNG_W0;
        k1 += RNG_W1;
    }
    return c;
}

__device__ __forceinline__ u4 block_words(long long j, long long key0, long long key1, long long id0,
                                          long long id1)
{
    const u4 c{(unsigned int)j, (unsigned int)((unsigned long long)j >> 32), (unsigned int)id0,
               (unsigned int)id1};
    return philox(c, (unsigned int)key0, (unsigned int)key1);
}

// p(z) = c[0] + z (c[1] + z (c[2] + ...)), every product and sum rounded on its own.
template <int N>
__device__ __forceinline__ double horner(const double (&c)[N], double z)
{
    double p = c[N - 1];
#pragma unroll
    for (int k = N - 2; k >= 0; --k) p = __dadd_rn(__dmul_rn(p, z), c[k]);
    return p;
}

// ln x for x in (0, 1): x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s), s = (m-1)/(m+1).
__device__ __forceinline__ double fixed_log(double x)
{
    int e;
    double m = frexp(x, &e);
    if (m < RNG_SQRT_HALF) { m = 2.0 * m; --e; }
    const double s = __ddiv_rn(m - 1.0, __dadd_rn(m, 1.0));      // m - 1 is exact here
    const double z = __dmul_rn(s, s);
    return __dadd_rn(__dmul_rn((double)e, RNG_LN2), __dmul_rn(2.0 * s, horner(LOG_C, z)));
}

// Two standard Gaussians from one block of words: r = sqrt(-2 ln u1), angle = 2 pi u2 taken by octant.
__device__ __forceinline__ void box_muller(u4 w, double& z0, double& z1)
{
    const unsigned long long a = (((unsigned long long)w.x << 32) | w.y) >> 12;        // 52 bits
    const unsigned long long b = (((unsigned long long)w.z << 32) | w.w) >> 11;        // 53 bits
    const double u1 = (double)(2 * a + 1) * 0x1p-53;                                   // (0, 1)
    const double r = __dsqrt_rn(-2.0 * fixed_log(u1));
    const int oct = (int)(b >> 50);
    const double f = (double)(b & ((1ull << 50) - 1)) * 0x1p-50;                      // [0, 1)
    const double t = (oct & 1) ? 1.0 - f : f;                                          // exact
    const double phi = __dmul_rn(t, RNG_PI_4);
    const double zz = __dmul_rn(phi, phi);
    const double sa = __dmul_rn(phi, horner(SIN_C, zz));
    const double ca = horner(COS_C, zz);
    const bool swap = ((oct + 1) & 2) != 0;
    double sn = swap ? ca : sa, cs = swap ? sa : ca;
    if (oct & 4) sn = -sn;
    if ((oct + 2) & 4) cs = -cs;
    z0 = __dmul_rn(r, cs);
    z1 = __dmul_rn(r, sn);
}

extern "C" __global__ void __launch_bounds__(RNG_THREADS)
init_normal(double* __restrict__ out, long long count, long long key0, long long key1, long long id0,
            long long id1)
{
    const long long blocks = (count + 1) / 2;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < blocks;
         j += (long long)gridDim.x * blockDim.x) {
        double z0, z1;
        box_muller(block_words(j, key0, key1, id0, id1), z0, z1);
        out[2 * j] = z0;
        if (2 * j + 1 < count) out[2 * j + 1] = z1;
    }
}

extern "C" __global__ void __launch_bounds__(RNG_THREADS)
init_uniform(float* __restrict__ out, long long count, long long key0, long long key1, long long id0,
             long long id1, double lo, double width)
{
    const long long blocks = (count + 3) / 4;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < blocks;
         j += (long long)gridDim.x * blockDim.x) {
        const u4 w = block_words(j, key0, key1, id0, id1);
        const unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (4 * j + q < count) {
                const double u = (double)(words[q] >> 8) * 0x1p-24;
                out[4 * j + q] = (float)__dadd_rn(__dmul_rn(u, width), lo);
            }
    }
}
