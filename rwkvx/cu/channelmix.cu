// channelmix.cu — the element-wise parts of the RWKV channel mix (FFN) (rwkvx).
//
//   xk = x + (shift(x) - x) * x_k ;  h = xk @ key^T (cuBLAS) ;  k = relu(h)^2 ;  out = k @ value^T (cuBLAS)
//   shift(x)[r] = x[r-1] if r % T != 0 else 0   (R = B*T rows, B sequences of length T stacked)
//
// Buffers float32 row-major: x, xk, dxk, dx [R, C]; x_k, dx_k [C]; h, k, dk, dh [R, F] (any n).
// Row-wise kernels need C % 4 == 0 and 16-byte aligned buffers (ops/channelmix.py checks).
//
//   cm_shift_mix(x, mix, xk, R, T, C)                      xk = x + (shift(x) - x) * mix.  xk must not alias x.
//       grid-stride over R*C/4 float4 elements, block (256).
//   cm_relu_sq_forward(h, k, n)                            k = max(h, 0)^2. k may alias h (in place).
//   cm_relu_sq_backward(dk, src, dh, n, src_is_k)          dh = dk * 2 * relu(h), relu(h) = max(src, 0) when
//       src is h (src_is_k = 0) or sqrt(src) when src is k = relu(h)^2 (src_is_k = 1). dh may alias dk.
//       n is int64 (arg kind "l"); float4 when all pointers are 16-byte aligned, scalar tail.
//   cm_mix_backward(dxk, x, mix, dx, part, R, T, C, rows_per_tile, accumulate)
//       dx[r] (= or +=) dxk[r] * (1 - mix) + dxk[r+1] * mix   (second term only if r+1 is in r's sequence)
//       part[t, c] = sum over rows r of tile t of dxk[r, c] * (shift(x)[r, c] - x[r, c])
//       -> reduce_cols(part, dx_k) gives dmix. grid (ceil(C/128), n_tiles), block (32, CM_BY).
//       Each thread walks CEIL(rows_per_tile / CM_BY) consecutive rows of one float4 column.
//       dx must not alias dxk or x.

#define CM_BY 8

extern "C" __global__ void __launch_bounds__(256)
cm_shift_mix(const float* __restrict__ x, const float* __restrict__ mix, float* __restrict__ xk,
             int R, int T, int C)
{
    const int C4 = C >> 2;
    const long long n4 = (long long)R * C4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* m4 = reinterpret_cast<const float4*>(mix);
    float4* o4 = reinterpret_cast<float4*>(xk);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / C4);
        const int c4 = (int)(i - (long long)r * C4);
        const float4 v = x4[i], m = m4[c4];
        float4 p = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r % T != 0) p = x4[i - C4];
        float4 o;
        o.x = v.x + (p.x - v.x) * m.x;
        o.y = v.y + (p.y - v.y) * m.y;
        o.z = v.z + (p.z - v.z) * m.z;
        o.w = v.w + (p.w - v.w) * m.w;
        o4[i] = o;
    }
}

static __device__ __forceinline__ float cm_relu_sq(float h)
{
    const float r = fmaxf(h, 0.0f);
    return r * r;
}

extern "C" __global__ void __launch_bounds__(256)
cm_relu_sq_forward(const float* h, float* k, long long n)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (((((unsigned long long)h) | ((unsigned long long)k)) & 15ull) == 0) {
        const long long n4 = n >> 2;
        const float4* h4 = reinterpret_cast<const float4*>(h);
        float4* k4 = reinterpret_cast<float4*>(k);
        for (long long i = gid; i < n4; i += stride) {
            const float4 v = h4[i];
            k4[i] = make_float4(cm_relu_sq(v.x), cm_relu_sq(v.y), cm_relu_sq(v.z), cm_relu_sq(v.w));
        }
        done = n4 << 2;
    }
    for (long long i = done + gid; i < n; i += stride) k[i] = cm_relu_sq(h[i]);
}

static __device__ __forceinline__ float cm_drelu_sq(float d, float s, int src_is_k)
{
    const float r = src_is_k ? sqrtf(fmaxf(s, 0.0f)) : fmaxf(s, 0.0f);
    return d * (2.0f * r);
}

extern "C" __global__ void __launch_bounds__(256)
cm_relu_sq_backward(const float* dk, const float* src, float* dh, long long n, int src_is_k)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (((((unsigned long long)dk) | ((unsigned long long)src) | ((unsigned long long)dh)) & 15ull) == 0) {
        const long long n4 = n >> 2;
        const float4* d4 = reinterpret_cast<const float4*>(dk);
        const float4* s4 = reinterpret_cast<const float4*>(src);
        float4* o4 = reinterpret_cast<float4*>(dh);
        for (long long i = gid; i < n4; i += stride) {
            const float4 d = d4[i], s = s4[i];
            o4[i] = make_float4(cm_drelu_sq(d.x, s.x, src_is_k), cm_drelu_sq(d.y, s.y, src_is_k),
                                cm_drelu_sq(d.z, s.z, src_is_k), cm_drelu_sq(d.w, s.w, src_is_k));
        }
        done = n4 << 2;
    }
    for (long long i = done + gid; i < n; i += stride) dh[i] = cm_drelu_sq(dk[i], src[i], src_is_k);
}

extern "C" __global__ void __launch_bounds__(32 * CM_BY, 4)
cm_mix_backward(const float* __restrict__ dxk, const float* __restrict__ x, const float* __restrict__ mix,
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
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 acc = zero;
    if (c4 < C4 && a < b) {
        const float4 m = reinterpret_cast<const float4*>(mix)[c4];
        const float4 om = make_float4(1.0f - m.x, 1.0f - m.y, 1.0f - m.z, 1.0f - m.w);
        const float4* X = reinterpret_cast<const float4*>(x) + c4;
        const float4* D = reinterpret_cast<const float4*>(dxk) + c4;
        float4* DX = reinterpret_cast<float4*>(dx) + c4;
        int tpos = a % T;                                   // position of row r in its sequence
        float4 xprev = tpos ? X[(long long)(a - 1) * C4] : zero;  // shift(x)[a]
        float4 dcur = D[(long long)a * C4];
#pragma unroll 4
        for (int r = a; r < b; ++r) {
            const float4 xc = X[(long long)r * C4];
            int tn = tpos + 1;
            if (tn == T) tn = 0;
            const bool next_same_seq = (tn != 0) && (r + 1 < R);
            float4 dn = zero;
            if (r + 1 < b || next_same_seq) dn = D[(long long)(r + 1) * C4];
            acc.x += dcur.x * (xprev.x - xc.x);
            acc.y += dcur.y * (xprev.y - xc.y);
            acc.z += dcur.z * (xprev.z - xc.z);
            acc.w += dcur.w * (xprev.w - xc.w);
            float4 o;
            o.x = dcur.x * om.x; o.y = dcur.y * om.y; o.z = dcur.z * om.z; o.w = dcur.w * om.w;
            if (next_same_seq) {
                o.x += dn.x * m.x; o.y += dn.y * m.y; o.z += dn.z * m.z; o.w += dn.w * m.w;
            }
            if (accumulate) {
                const float4 p = DX[(long long)r * C4];
                o.x += p.x; o.y += p.y; o.z += p.z; o.w += p.w;
            }
            DX[(long long)r * C4] = o;
            xprev = (tn != 0) ? xc : zero;
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
