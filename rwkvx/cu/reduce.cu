// reduce.cu — deterministic reductions over rows (rwkvx).
//
// Layout: float32 row-major. No atomics: every sum runs in a fixed order that depends only on the
// sizes and the launch configuration (fixed at plan build time), so replays are bit-identical.
//
//   reduce_cols         part [P, C]  ->  out [C]           out = sum_p part[p, :]   (or out += ...)
//   reduce_rows_partial a [R, C] (, b [R, C])  ->  part [n_tiles, C]
//                       part[t, c] = sum over rows r of tile t of a[r, c] * b[r, c]   (b == NULL: a only)
//
// Launch shapes (ops/reduce.py builds them):
//   reduce_cols:         grid (ceil(C / 32), 1, 1),              block (32, RD_COLS_BY, 1)
//   reduce_rows_partial: grid (ceil(C / 128), n_tiles, 1),       block (32, RD_ROWS_BY, 1)
//                        requires C % 4 == 0 and 16-byte aligned a, b, part.

#define RD_COLS_BY 16
#define RD_ROWS_BY 8

extern "C" __global__ void __launch_bounds__(32 * RD_COLS_BY)
reduce_cols(const float* __restrict__ part, float* __restrict__ out, int P, int C, int accumulate)
{
    __shared__ float sh[RD_COLS_BY][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (c < C) {
        const float* p = part + c;
#pragma unroll 4
        for (int i = threadIdx.y; i < P; i += RD_COLS_BY) s += p[(long long)i * C];
    }
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float t = sh[0][threadIdx.x];
#pragma unroll
        for (int y = 1; y < RD_COLS_BY; ++y) t += sh[y][threadIdx.x];
        out[c] = accumulate ? out[c] + t : t;
    }
}

extern "C" __global__ void __launch_bounds__(32 * RD_ROWS_BY)
reduce_rows_partial(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ part,
                    int R, int C, int rows_per_tile)
{
    __shared__ float4 sh[RD_ROWS_BY][32];
    const int C4 = C >> 2;
    const int c4 = blockIdx.x * 32 + threadIdx.x;
    const int r0 = blockIdx.y * rows_per_tile;
    const int r1 = min(R, r0 + rows_per_tile);
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c4 < C4) {
        const float4* a4 = reinterpret_cast<const float4*>(a) + c4;
        if (b) {
            const float4* b4 = reinterpret_cast<const float4*>(b) + c4;
#pragma unroll 4
            for (int r = r0 + threadIdx.y; r < r1; r += RD_ROWS_BY) {
                const float4 u = a4[(long long)r * C4];
                const float4 w = b4[(long long)r * C4];
                s.x += u.x * w.x; s.y += u.y * w.y; s.z += u.z * w.z; s.w += u.w * w.w;
            }
        } else {
#pragma unroll 4
            for (int r = r0 + threadIdx.y; r < r1; r += RD_ROWS_BY) {
                const float4 u = a4[(long long)r * C4];
                s.x += u.x; s.y += u.y; s.z += u.z; s.w += u.w;
            }
        }
    }
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c4 < C4) {
        float4 t = sh[0][threadIdx.x];
#pragma unroll
        for (int y = 1; y < RD_ROWS_BY; ++y) {
            const float4 u = sh[y][threadIdx.x];
            t.x += u.x; t.y += u.y; t.z += u.z; t.w += u.w;
        }
        reinterpret_cast<float4*>(part + (long long)blockIdx.y * C)[c4] = t;
    }
}
