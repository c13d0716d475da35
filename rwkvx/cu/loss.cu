// loss.cu — fused log-softmax cross-entropy, forward and backward in one kernel (rwkvx).
//
//   cross_entropy_loss(logits, dlogits, targets, loss, inv_count, R, V, ignore_index)
//     logits   float32 [R, V]   row-major
//     dlogits  float32 [R, V]   may be NULL (loss only) and may equal logits (in place: every element
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

#define CE_THREADS 512
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

static __device__ __forceinline__ void ce_add4(float& m, double& s, float4 v)
{
    const float m4 = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
    if (m4 > m) {
        if (s != 0.0) s *= exp((double)m - (double)m4);
        m = m4;
    }
    s += ((double)expf(v.x - m) + (double)expf(v.y - m)) + ((double)expf(v.z - m) + (double)expf(v.w - m));
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
cross_entropy_loss(const float* logits, float* dlogits, const int* __restrict__ targets,
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
    const float* row = logits + base;
    const bool vec = ((V & 3) == 0) &&
                     ((((unsigned long long)logits) | ((unsigned long long)dlogits)) & 15ull) == 0;
    const int V4 = V >> 2;

    if (t == ignore_index) {
        if (tid == 0) loss[r] = 0.0;
        if (dlogits) {
            float* drow = dlogits + base;
            if (vec) {
                float4* d4 = reinterpret_cast<float4*>(drow);
                for (int i = tid; i < V4; i += CE_THREADS) d4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            } else {
                for (int i = tid; i < V; i += CE_THREADS) drow[i] = 0.0f;
            }
        }
        return;
    }
    const bool t_ok = (unsigned)t < (unsigned)V;
    float xt = 0.0f;
    if (tid == 0) xt = t_ok ? row[t] : __int_as_float(0x7fc00000);

    // pass 1: running max and sum of exp
    float m = __int_as_float(0xff800000);  // -inf
    double s = 0.0;
    if (vec) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        int i = tid;
        for (; i + 3 * CE_THREADS < V4; i += 4 * CE_THREADS) {  // 4 loads in flight
            const float4 a = r4[i], b = r4[i + CE_THREADS], c = r4[i + 2 * CE_THREADS], d = r4[i + 3 * CE_THREADS];
            ce_add4(m, s, a);
            ce_add4(m, s, b);
            ce_add4(m, s, c);
            ce_add4(m, s, d);
        }
        for (; i < V4; i += CE_THREADS) ce_add4(m, s, r4[i]);
    } else {
        for (int i = tid; i < V; i += CE_THREADS) ce_add1(m, s, row[i]);
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
    float* drow = dlogits + base;
    if (vec) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        float4* d4 = reinterpret_cast<float4*>(drow);
        for (int i = tid; i < V4; i += CE_THREADS) {
            const float4 v = r4[i];
            float4 o;
            o.x = expf(v.x - M) * inv_s;
            o.y = expf(v.y - M) * inv_s;
            o.z = expf(v.z - M) * inv_s;
            o.w = expf(v.w - M) * inv_s;
            const int j = 4 * i;
            if (t >= j && t < j + 4) {
                const int k = t - j;
                if (k == 0) o.x -= 1.0f; else if (k == 1) o.y -= 1.0f; else if (k == 2) o.z -= 1.0f; else o.w -= 1.0f;
            }
            o.x *= ic; o.y *= ic; o.z *= ic; o.w *= ic;
            d4[i] = o;
        }
    } else {
        for (int i = tid; i < V; i += CE_THREADS) {
            float p = expf(row[i] - M) * inv_s;
            if (i == t) p -= 1.0f;
            drow[i] = p * ic;
        }
    }
}
