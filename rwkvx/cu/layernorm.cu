// layernorm.cu — LayerNorm over the last dimension C, with weight and bias (rwkvx).
//
//   y = (x - mean) * rstd * w + b,   mean = sum(x)/C,  rstd = 1/sqrt(sum((x-mean)^2)/C + eps)
//
// Buffers: x, y, dy, dx float32 [R, C] row-major; w, b float32 [C]; mean, rstd float32 [R].
// Requires C % 4 == 0 and 16-byte aligned row buffers (ops/layernorm.py checks).
//
// Kernels (one warp per row for the row-wise ones; block = (LN_WARPS*32), grid = ceil(R / LN_WARPS)):
//   ln_forward(x, w, b, y, mean, rstd, R, C, eps)
//       y may be NULL (statistics only); mean / rstd may be NULL (not saved). y may alias x.
//   ln_backward_dx(x, w, dy, mean, rstd, dx, R, C, accumulate)
//       dx = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)),  g = dy * w,  xhat = (x - mean) * rstd
//       accumulate = 0: dx = ...; 1: dx += ... . mean / rstd are required (from ln_forward).
//       dx may alias dy when accumulate == 0 (each element is read and written by the same thread).
//   ln_backward_dwdb(x, dy, mean, rstd, part, R, C, rows_per_tile)
//       grid (ceil(C/128), n_tiles), block (32, LN_BY):
//       part[t, c]           = sum over rows r of tile t of dy[r,c] * xhat[r,c]   (dweight partials)
//       part[n_tiles*C + t*C + c] = sum over rows r of tile t of dy[r,c]          (dbias partials)
//       followed by reduce_cols (reduce.cu) on each half.

#define LN_WARPS 8
#define LN_BY 8

static __device__ __forceinline__ float ln_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void __launch_bounds__(LN_WARPS * 32)
ln_forward(const float* x, const float* __restrict__ w, const float* __restrict__ b,
           float* y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
           int R, int C, float eps)
{
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
    if (r >= R) return;
    const int C4 = C >> 2;
    const float4* xr = reinterpret_cast<const float4*>(x + (long long)r * C);
    float s = 0.0f;
    for (int i = lane; i < C4; i += 32) {
        const float4 v = xr[i];
        s += (v.x + v.y) + (v.z + v.w);
    }
    const float mu = ln_warp_sum(s) / (float)C;
    float q = 0.0f;
    for (int i = lane; i < C4; i += 32) {
        const float4 v = xr[i];
        const float a = v.x - mu, bb = v.y - mu, c = v.z - mu, d = v.w - mu;
        q += (a * a + bb * bb) + (c * c + d * d);
    }
    const float rs = 1.0f / sqrtf(ln_warp_sum(q) / (float)C + eps);
    if (lane == 0) {
        if (mean_out) mean_out[r] = mu;
        if (rstd_out) rstd_out[r] = rs;
    }
    if (y) {
        const float4* w4 = reinterpret_cast<const float4*>(w);
        const float4* b4 = reinterpret_cast<const float4*>(b);
        float4* yr = reinterpret_cast<float4*>(y + (long long)r * C);
        for (int i = lane; i < C4; i += 32) {
            const float4 v = xr[i], ww = w4[i], bv = b4[i];
            float4 o;
            o.x = (v.x - mu) * rs * ww.x + bv.x;
            o.y = (v.y - mu) * rs * ww.y + bv.y;
            o.z = (v.z - mu) * rs * ww.z + bv.z;
            o.w = (v.w - mu) * rs * ww.w + bv.w;
            yr[i] = o;
        }
    }
}

extern "C" __global__ void __launch_bounds__(LN_WARPS * 32)
ln_backward_dx(const float* __restrict__ x, const float* __restrict__ w, const float* dy,
               const float* __restrict__ mean, const float* __restrict__ rstd, float* dx,
               int R, int C, int accumulate)
{
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
    if (r >= R) return;
    const int C4 = C >> 2;
    const float mu = mean[r], rs = rstd[r];
    const float4* xr = reinterpret_cast<const float4*>(x + (long long)r * C);
    const float4* dyr = reinterpret_cast<const float4*>(dy + (long long)r * C);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float sg = 0.0f, sgx = 0.0f;
    for (int i = lane; i < C4; i += 32) {
        const float4 v = xr[i], d = dyr[i], ww = w4[i];
        const float g0 = d.x * ww.x, g1 = d.y * ww.y, g2 = d.z * ww.z, g3 = d.w * ww.w;
        sg += (g0 + g1) + (g2 + g3);
        sgx += (g0 * ((v.x - mu) * rs) + g1 * ((v.y - mu) * rs)) + (g2 * ((v.z - mu) * rs) + g3 * ((v.w - mu) * rs));
    }
    const float invC = 1.0f / (float)C;
    const float mg = ln_warp_sum(sg) * invC;
    const float mgx = ln_warp_sum(sgx) * invC;
    float4* dxr = reinterpret_cast<float4*>(dx + (long long)r * C);
    for (int i = lane; i < C4; i += 32) {
        const float4 v = xr[i], d = dyr[i], ww = w4[i];
        float4 o;
        o.x = rs * (d.x * ww.x - mg - ((v.x - mu) * rs) * mgx);
        o.y = rs * (d.y * ww.y - mg - ((v.y - mu) * rs) * mgx);
        o.z = rs * (d.z * ww.z - mg - ((v.z - mu) * rs) * mgx);
        o.w = rs * (d.w * ww.w - mg - ((v.w - mu) * rs) * mgx);
        if (accumulate) {
            const float4 p = dxr[i];
            o.x += p.x; o.y += p.y; o.z += p.z; o.w += p.w;
        }
        dxr[i] = o;
    }
}

extern "C" __global__ void __launch_bounds__(32 * LN_BY)
ln_backward_dwdb(const float* __restrict__ x, const float* __restrict__ dy,
                 const float* __restrict__ mean, const float* __restrict__ rstd,
                 float* __restrict__ part, int R, int C, int rows_per_tile)
{
    __shared__ float4 shw[LN_BY][32];
    __shared__ float4 shb[LN_BY][32];
    const int C4 = C >> 2;
    const int c4 = blockIdx.x * 32 + threadIdx.x;
    const int r0 = blockIdx.y * rows_per_tile;
    const int r1 = min(R, r0 + rows_per_tile);
    float4 sw = make_float4(0.f, 0.f, 0.f, 0.f), sb = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c4 < C4) {
        const float4* x4 = reinterpret_cast<const float4*>(x) + c4;
        const float4* d4 = reinterpret_cast<const float4*>(dy) + c4;
#pragma unroll 4
        for (int r = r0 + threadIdx.y; r < r1; r += LN_BY) {
            const float mu = mean[r], rs = rstd[r];
            const float4 v = x4[(long long)r * C4], d = d4[(long long)r * C4];
            sw.x += d.x * ((v.x - mu) * rs); sw.y += d.y * ((v.y - mu) * rs);
            sw.z += d.z * ((v.z - mu) * rs); sw.w += d.w * ((v.w - mu) * rs);
            sb.x += d.x; sb.y += d.y; sb.z += d.z; sb.w += d.w;
        }
    }
    shw[threadIdx.y][threadIdx.x] = sw;
    shb[threadIdx.y][threadIdx.x] = sb;
    __syncthreads();
    if (threadIdx.y == 0 && c4 < C4) {
        float4 tw = shw[0][threadIdx.x], tb = shb[0][threadIdx.x];
#pragma unroll
        for (int y = 1; y < LN_BY; ++y) {
            const float4 u = shw[y][threadIdx.x], v = shb[y][threadIdx.x];
            tw.x += u.x; tw.y += u.y; tw.z += u.z; tw.w += u.w;
            tb.x += v.x; tb.y += v.y; tb.z += v.z; tb.w += v.w;
        }
        const long long n_tiles = gridDim.y;
        reinterpret_cast<float4*>(part + (long long)blockIdx.y * C)[c4] = tw;
        reinterpret_cast<float4*>(part + (n_tiles + blockIdx.y) * (long long)C)[c4] = tb;
    }
}
