// loss.cu — fused log-softmax cross-entropy, forward and backward in one kernel (rwkvx).
//
//   cross_entropy_loss(logits, dlogits, targets, loss, inv_count, R, V, ignore_index)
//     logits   floatX  [R, V]   row-major
//     dlogits  floatX  [R, V]   may be NULL (loss only) and may equal logits (in place: every element
//                               is read and then written by the same thread; the target logit is read
//                               before the block barrier that precedes any write)
//     targets  int32   [R]
//     loss     float64 [R]      loss[r] = logsumexp(logits[r]) - logits[r, t]; 0 where t == ignore_index
//     inv_count float64 [1]     device scalar, 1 / (number of rows with t != ignore_index), written by
//                               the host with the targets every step (the graph never changes)
//     dlogits[r, j] = (softmax(logits[r])_j - [j == t]) * inv_count;  rows with t == ignore_index: 0
//   grid (R), block (CE_THREADS). Max and sum of exp are kept per thread as (max float, sum double),
//   sum terms exp(x - max) evaluated in float and accumulated in double, merged in a fixed tree.
//   A target outside [0, V) that is not ignore_index (the host validates: never expected) gives loss NaN.
//   CE_THREADS comes from rwkvx/ops/loss.py.

#include "common.cuh"
#ifndef CE_THREADS
#error "loss.cu: CE_THREADS comes from rwkvx/ops/loss.py"
#endif
#define CE_WARPS (CE_THREADS / 32)

// (m, s) represents s * exp(m) = sum exp(x). Merge (m2, s2) into it.
static __device__ __forceinline__ void ce_merge(float& m, double& s, float m2, double s2)
{
    if (m2 > m) {
        s = s2 + (s != 0.0 ? s * exp((double)m - (double)m2) : 0.0);
        m = m2;
    } else if (s2 != 0.0) {
        s += s2 * exp((double)m2 - (double)m);
    }
}

static __device__ __forceinline__ void ce_add4(float& m, double& s, const f4& v)
{
    const float m4 = fmaxf(fmaxf(v.v[0], v.v[1]), fmaxf(v.v[2], v.v[3]));
    if (m4 > m) {
        if (s != 0.0) s *= exp((double)m - (double)m4);
        m = m4;
    }
    s += ((double)expf(v.v[0] - m) + (double)expf(v.v[1] - m)) + ((double)expf(v.v[2] - m) + (double)expf(v.v[3] - m));
}

static __device__ __forceinline__ void ce_add1(float& m, double& s, float v)
{
    if (v > m) {
        if (s != 0.0) s *= exp((double)m - (double)v);
        m = v;
    }
    s += (double)expf(v - m);
}

extern "C" __global__ void __launch_bounds__(CE_THREADS)
cross_entropy_loss(const floatX* logits, floatX* dlogits, const int* __restrict__ targets,
                   double* __restrict__ loss, const double* __restrict__ inv_count,
                   int R, int V, int ignore_index)
{
    __shared__ float shm[CE_WARPS];
    __shared__ double shs[CE_WARPS];
    __shared__ float fin_m;
    __shared__ double fin_s;

    const int r = blockIdx.x;
    if (r >= R) return;
    const int tid = threadIdx.x;
    const int t = targets[r];
    const long long base = (long long)r * V;
    const floatX* row = logits + base;
    const bool vec = ((V & 3) == 0) && aligned4(logits) && aligned4(dlogits);
    const int V4 = V >> 2;

    if (t == ignore_index) {
        if (tid == 0) loss[r] = 0.0;
        if (dlogits) {
            floatX* drow = dlogits + base;
            if (vec) {
                for (int i = tid; i < V4; i += CE_THREADS) store4(drow + 4 * i, f4_zero());
            } else {
                for (int i = tid; i < V; i += CE_THREADS) drow[i] = from_f32(0.0f);
            }
        }
        return;
    }
    const bool t_ok = (unsigned)t < (unsigned)V;
    float xt = 0.0f;
    if (tid == 0) xt = t_ok ? to_f32(row[t]) : __int_as_float(0x7fc00000);

    // pass 1: running max and sum of exp
    float m = __int_as_float(0xff800000);  // -inf
    double s = 0.0;
    if (vec) {
        int i = tid;
        for (; i + 3 * CE_THREADS < V4; i += 4 * CE_THREADS) {  // 4 loads in flight
            const f4 a = load4(row + 4 * i), b = load4(row + 4 * (i + CE_THREADS));
            const f4 c = load4(row + 4 * (i + 2 * CE_THREADS)), d = load4(row + 4 * (i + 3 * CE_THREADS));
            ce_add4(m, s, a);
            ce_add4(m, s, b);
            ce_add4(m, s, c);
            ce_add4(m, s, d);
        }
        for (; i < V4; i += CE_THREADS) ce_add4(m, s, load4(row + 4 * i));
    } else {
        for (int i = tid; i < V; i += CE_THREADS) ce_add1(m, s, to_f32(row[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const double s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ce_merge(m, s, m2, s2);
    }
    if ((tid & 31) == 0) { shm[tid >> 5] = m; shs[tid >> 5] = s; }
    __syncthreads();
    if (tid == 0) {
        float M = shm[0];
        double S = shs[0];
        for (int w = 1; w < CE_WARPS; ++w) ce_merge(M, S, shm[w], shs[w]);
        fin_m = M;
        fin_s = S;
        loss[r] = log(S) + (double)M - (double)xt;
    }
    __syncthreads();
    if (!dlogits) return;

    // pass 2: dlogits = (softmax - onehot) * inv_count
    const float M = fin_m;
    const float inv_s = (float)(1.0 / fin_s);
    const float ic = (float)(*inv_count);
    floatX* drow = dlogits + base;
    if (vec) {
        for (int i = tid; i < V4; i += CE_THREADS) {
            const f4 v = load4(row + 4 * i);
            f4 o;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                o.v[e] = expf(v.v[e] - M) * inv_s;
                if (t == 4 * i + e) o.v[e] -= 1.0f;
                o.v[e] *= ic;
            }
            store4(drow + 4 * i, o);
        }
    } else {
        for (int i = tid; i < V; i += CE_THREADS) {
            float p = expf(to_f32(row[i]) - M) * inv_s;
            if (i == t) p -= 1.0f;
            drow[i] = from_f32(p * ic);
        }
    }
}
