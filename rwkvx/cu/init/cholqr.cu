// cholqr.cu — the pieces of the device Cholesky QR that are not GEMMs (rwkvx/cu/init/README.md).
//
// A float64 [m, n] row-major draw A (m >= n) becomes Q = A L^-T with L L^T = A^T A: the Gram matrix and
// the blocked updates are cuBLASLt fp64 GEMMs; these kernels factor a diagonal block, solve rows against
// one, measure how far a Gram matrix is from I and store the result as float32.
//
//   chol_diag(g, ld, j0, jb, info)
//       the jb x jb (jb <= CQ_NB) diagonal block of g at (j0, j0), row-major with leading dimension ld,
//       becomes its lower Cholesky factor in place (one block of CQ_DIAG_THREADS); a pivot that is not
//       positive writes info = j0 + k + 1 and stops; a non-zero info on entry leaves g as it is
//   trsm_rows(b, ldb, rows, l, ldl, jb)
//       b [rows, jb] (leading dimension ldb) becomes b L^-T for the lower jb x jb L at l (leading
//       dimension ldl): one thread per row, forward substitution with the row in registers
//   gram_deviation(g, n, out)
//       out[0] = max(out[0], max |g - I|) over the n x n g (NaN counts as infinity); out zeroed before
//   store_f32(out, a, m, n, gain, transpose)
//       out float32 = gain * a ([m, n]) or gain * a^T ([n, m]), each product rounded once to float32
//
// CQ_NB, CQ_DIAG_THREADS, CQ_TRSM_THREADS and CQ_THREADS come from rwkvx/cu/init/ops.py.

#include "common.cuh"
#if !defined(CQ_NB) || !defined(CQ_DIAG_THREADS) || !defined(CQ_TRSM_THREADS) || !defined(CQ_THREADS)
#error "init/cholqr.cu: its constants come from rwkvx/cu/init/ops.py"
#endif

extern "C" __global__ void __launch_bounds__(CQ_DIAG_THREADS)
chol_diag(double* __restrict__ g, int ld, int j0, int jb, int* __restrict__ info)
{
    __shared__ double s[CQ_NB][CQ_NB + 1];
    if (*info != 0) return;             // an earlier block failed: the caller falls back
    double* d = g + (long long)j0 * ld + j0;
    for (int e = threadIdx.x; e < jb * jb; e += blockDim.x) {
        const int i = e / jb, j = e - i * jb;
        s[i][j] = d[(long long)i * ld + j];
    }
    __syncthreads();
    for (int k = 0; k < jb; ++k) {
        const double piv = s[k][k];     // every thread reads the same value: the exit below is uniform
        if (!(piv > 0.0)) {
            if (threadIdx.x == 0) *info = j0 + k + 1;
            return;
        }
        const double dk = sqrt(piv);
        __syncthreads();                // s[k][k] is read by all before it is overwritten
        if (threadIdx.x == 0) s[k][k] = dk;
        for (int i = k + 1 + threadIdx.x; i < jb; i += blockDim.x) s[i][k] /= dk;
        __syncthreads();
        const int t = jb - k - 1;
        for (int e = threadIdx.x; e < t * t; e += blockDim.x) {
            const int i = k + 1 + e / t, j = k + 1 + e % t;
            if (j <= i) s[i][j] -= s[i][k] * s[j][k];
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < jb * jb; e += blockDim.x) {
        const int i = e / jb, j = e - i * jb;
        if (j <= i) d[(long long)i * ld + j] = s[i][j];
    }
}

extern "C" __global__ void __launch_bounds__(CQ_TRSM_THREADS, 1)
trsm_rows(double* __restrict__ b, int ldb, int rows, const double* __restrict__ l, int ldl, int jb)
{
    // L padded to CQ_NB with the identity, so the unrolled loops need no bounds
    __shared__ double sl[CQ_NB][CQ_NB];
    for (int e = threadIdx.x; e < CQ_NB * CQ_NB; e += blockDim.x) {
        const int k = e / CQ_NB, i = e % CQ_NB;
        sl[k][i] = (k < jb && i <= k) ? l[(long long)k * ldl + i] : (k == i ? 1.0 : 0.0);
    }
    __syncthreads();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    double* row = b + (long long)r * ldb;
    double x[CQ_NB];
#pragma unroll
    for (int k = 0; k < CQ_NB; ++k) x[k] = k < jb ? row[k] : 0.0;
#pragma unroll
    for (int k = 0; k < CQ_NB; ++k) {
        double acc = x[k];
#pragma unroll
        for (int i = 0; i < k; ++i) acc -= x[i] * sl[k][i];
        x[k] = acc / sl[k][k];
    }
#pragma unroll
    for (int k = 0; k < CQ_NB; ++k)
        if (k < jb) row[k] = x[k];
}

extern "C" __global__ void __launch_bounds__(CQ_THREADS)
gram_deviation(const double* __restrict__ g, int n, double* __restrict__ out)
{
    __shared__ double warp_max[CQ_THREADS / 32];
    const long long total = (long long)n * n;
    double m = 0.0;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long i = e / n;
        double v = fabs(g[e] - (e - i * n == i ? 1.0 : 0.0));
        if (!(v <= 1.7976931348623157e308)) v = __longlong_as_double(0x7ff0000000000000ll);   // NaN: inf
        m = fmax(m, v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < CQ_THREADS / 32; ++w) m = fmax(m, warp_max[w]);
        // a maximum does not depend on the order: the bits of non-negative doubles order as integers
        atomicMax((unsigned long long*)out, (unsigned long long)__double_as_longlong(m));
    }
}

extern "C" __global__ void __launch_bounds__(CQ_THREADS)
store_f32(float* __restrict__ out, const double* __restrict__ a, int m, int n, double gain, int transpose)
{
    const long long total = (long long)m * n;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        long long src = e;
        if (transpose) {                // out [n, m]: out[i, j] = a[j, i]
            const long long i = e / m, j = e - i * m;
            src = j * n + i;
        }
        out[e] = (float)(gain * a[src]);
    }
}
