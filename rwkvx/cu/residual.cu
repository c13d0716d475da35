// residual.cu — y = a + b over n float32 elements (rwkvx). y may alias a or b (a += b: pass y = a).
//   residual_add(a, b, y, n): n int64 (arg kind "l"); grid-stride, block (256);
//   float4 when a, b, y are all 16-byte aligned, scalar tail.

extern "C" __global__ void __launch_bounds__(256)
residual_add(const float* a, const float* b, float* y, long long n)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (((((unsigned long long)a) | ((unsigned long long)b) | ((unsigned long long)y)) & 15ull) == 0) {
        const long long n4 = n >> 2;
        const float4* a4 = reinterpret_cast<const float4*>(a);
        const float4* b4 = reinterpret_cast<const float4*>(b);
        float4* y4 = reinterpret_cast<float4*>(y);
        for (long long i = gid; i < n4; i += stride) {
            const float4 u = a4[i], v = b4[i];
            y4[i] = make_float4(u.x + v.x, u.y + v.y, u.z + v.z, u.w + v.w);
        }
        done = n4 << 2;
    }
    for (long long i = done + gid; i < n; i += stride) y[i] = a[i] + b[i];
}
