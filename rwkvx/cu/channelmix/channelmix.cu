// channelmix.cu — the element-wise parts of the RWKV channel mix (FFN) (rwkvx).
//
//   xk = x + (shift(x) - x) * x_k ;  h = xk @ key^T (cuBLAS) ;  k = relu(h)^2 ;  out = k @ value^T (cuBLAS)
//   shift(x)[r] = x[r-1] if r % T != 0 else 0   (R = B*T rows, B sequences of length T stacked)
//
// Buffers row-major: x, dx float32 [R, C] (LN2's output and its gradient, fp32 in every precision:
// docs/SPEC.md §4); xk, dxk floatX [R, C]; x_k, dx_k float32 [C]; h, k, dk, dh floatX [R, F]
// (any n); part float32. Row-wise kernels need C % 4 == 0 and buffers aligned to 4 elements
// (ops/channelmix.py checks). fp32 math. CM_BY comes from rwkvx/cu/channelmix/ops.py.
//
//   cm_shift_mix(x, mix, xk, R, T, C)                      xk = x + (shift(x) - x) * mix.  xk must not alias x.
//       grid-stride over R*C/4 float4 elements, block (256).
//   cm_relu_sq_forward(h, k, n)                            k = max(h, 0)^2 from fp32 h (the key GEMM's
//       fp32 output: the square of the unrounded product, rounded once into k). k may alias h (fp32).
//   cm_relu_sq_backward(dk, src, dh, n, src_is_k)          dh = dk * 2 * relu(h), relu(h) = max(src, 0) when
//       src is h (src_is_k = 0) or sqrt(src) when src is k = relu(h)^2 (src_is_k = 1). dh may alias dk.
//       n is int64 (arg kind "l"); 4-element vectors when all pointers are aligned, scalar tail.
//   cm_mix_backward(dxk, x, mix, dx, part, R, T, C, rows_per_tile, accumulate)
//       dx[r] (= or +=) dxk[r] * (1 - mix) + dxk[r+1] * mix   (second term only if r+1 is in r's sequence)
//       part[t, c] = sum over rows r of tile t of dxk[r, c] * (shift(x)[r, c] - x[r, c])
//       -> reduce_cols(part, dx_k) gives dmix. grid (ceil(C/128), n_tiles), block (32, CM_BY).
//       Each thread walks CEIL(rows_per_tile / CM_BY) consecutive rows of one float4 column.
//       dx must not alias dxk or x.

#include "common.cuh"
#ifndef CM_BY
#error "channelmix/channelmix.cu: CM_BY comes from rwkvx/cu/channelmix/ops.py"
#endif

extern "C" __global__ void __launch_bounds__(256)
cm_shift_mix(const float* __restrict__ x, const float* __restrict__ mix, floatX* __restrict__ xk,
             int R, int T, int C)
{
    for_each_quad(R, C, [&](long long i, int r, int c4) {
        const f4 v = load4(x + 4 * i), m = load4(mix + 4 * c4);
        f4 p = f4_zero();
        if (r % T != 0) p = load4(x + 4 * i - C);
        f4 o;
#pragma unroll
        for (int e = 0; e < 4; ++e) o.v[e] = v.v[e] + (p.v[e] - v.v[e]) * m.v[e];
        store4(xk + 4 * i, o);
    });
}

static __device__ __forceinline__ float cm_relu_sq(float h)
{
    const float r = fmaxf(h, 0.0f);
    return r * r;
}

extern "C" __global__ void __launch_bounds__(256)
cm_relu_sq_forward(const float* h, floatX* k, long long n)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (aligned4(h) && aligned4(k)) {
        const long long n4 = n >> 2;
        for (long long i = gid; i < n4; i += stride) {
            f4 v = load4(h + 4 * i);
#pragma unroll
            for (int e = 0; e < 4; ++e) v.v[e] = cm_relu_sq(v.v[e]);
            store4(k + 4 * i, v);
        }
        done = n4 << 2;
    }
    for (long long i = done + gid; i < n; i += stride) k[i] = from_f32(cm_relu_sq(to_f32(h[i])));
}

static __device__ __forceinline__ float cm_drelu_sq(float d, float s, int src_is_k)
{
    const float r = src_is_k ? sqrtf(fmaxf(s, 0.0f)) : fmaxf(s, 0.0f);
    return d * (2.0f * r);
}

extern "C" __global__ void __launch_bounds__(256)
cm_relu_sq_backward(const floatX* dk, const floatX* src, floatX* dh, long long n, int src_is_k)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (aligned4(dk) && aligned4(src) && aligned4(dh)) {
        const long long n4 = n >> 2;
        for (long long i = gid; i < n4; i += stride) {
            const f4 d = load4(dk + 4 * i), s = load4(src + 4 * i);
            f4 o;
#pragma unroll
            for (int e = 0; e < 4; ++e) o.v[e] = cm_drelu_sq(d.v[e], s.v[e], src_is_k);
            store4(dh + 4 * i, o);
        }
        done = n4 << 2;
    }
    for (long long i = done + gid; i < n; i += stride)
        dh[i] = from_f32(cm_drelu_sq(to_f32(dk[i]), to_f32(src[i]), src_is_k));
}

extern "C" __global__ void __launch_bounds__(32 * CM_BY, 4)
cm_mix_backward(const floatX* __restrict__ dxk, const float* __restrict__ x, const float* __restrict__ mix,
                float* __restrict__ dx, float* __restrict__ part,
                int R, int T, int C, int rows_per_tile, int accumulate)
{
    __shared__ float4 sh[CM_BY][32];
    const int C4 = C >> 2;
    const int c4 = blockIdx.x * 32 + threadIdx.x;
    const int r1 = min(R, (int)blockIdx.y * rows_per_tile + rows_per_tile);
    const int sub = (rows_per_tile + CM_BY - 1) / CM_BY;
    const int a = blockIdx.y * rows_per_tile + threadIdx.y * sub;
    const int b = min(r1, a + sub);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c4 < C4 && a < b) {
        const f4 m = load4(mix + 4 * c4);
        f4 om;
#pragma unroll
        for (int e = 0; e < 4; ++e) om.v[e] = 1.0f - m.v[e];
        const float* X = x + 4 * c4;
        const floatX* D = dxk + 4 * c4;
        float* DX = dx + 4 * c4;
        int tpos = a % T;                                   // position of row r in its sequence
        f4 xprev = tpos ? load4(X + (long long)(a - 1) * C) : f4_zero();  // shift(x)[a]
        f4 dcur = load4(D + (long long)a * C);
#pragma unroll 4
        for (int r = a; r < b; ++r) {
            const f4 xc = load4(X + (long long)r * C);
            int tn = tpos + 1;
            if (tn == T) tn = 0;
            const bool next_same_seq = (tn != 0) && (r + 1 < R);
            f4 dn = f4_zero();
            if (r + 1 < b || next_same_seq) dn = load4(D + (long long)(r + 1) * C);
            acc.x += dcur.v[0] * (xprev.v[0] - xc.v[0]);
            acc.y += dcur.v[1] * (xprev.v[1] - xc.v[1]);
            acc.z += dcur.v[2] * (xprev.v[2] - xc.v[2]);
            acc.w += dcur.v[3] * (xprev.v[3] - xc.v[3]);
            f4 o;
#pragma unroll
            for (int e = 0; e < 4; ++e) o.v[e] = dcur.v[e] * om.v[e];
            if (next_same_seq) {
#pragma unroll
                for (int e = 0; e < 4; ++e) o.v[e] += dn.v[e] * m.v[e];
            }
            if (accumulate) {
                const f4 p = load4(DX + (long long)r * C);
#pragma unroll
                for (int e = 0; e < 4; ++e) o.v[e] += p.v[e];
            }
            store4(DX + (long long)r * C, o);
            xprev = (tn != 0) ? xc : f4_zero();
            dcur = dn;
            tpos = tn;
        }
    }
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c4 < C4) {
        float4 t = sh[0][threadIdx.x];
#pragma unroll
        for (int y = 1; y < CM_BY; ++y) {
            const float4 u = sh[y][threadIdx.x];
            t.x += u.x; t.y += u.y; t.z += u.z; t.w += u.w;
        }
        reinterpret_cast<float4*>(part + (long long)blockIdx.y * C)[c4] = t;
    }
}
