// layernorm.cu — LayerNorm over the last dimension C, with weight and bias (rwkvx).
//
//   y = (x - mean) * rstd * w + b,   mean = sum(x)/C,  rstd = 1/sqrt(sum((x-mean)^2)/C + eps)
//
// Buffers: x, dy, dx float32 [R, C] row-major (a LayerNorm reads the residual stream and returns its
// gradient, fp32 in every precision: docs/SPEC.md §4); y and dx_copy floatX [R, C]; w, b float32 [C]; mean,
// rstd float32 [R]; part float32. Requires C % 4 == 0 and row buffers aligned to 4 elements
// (layernorm/ops.py checks). fp32 math.
// LN_WARPS, LN_BY, LN_NQ come from the declaration in rwkvx/cu/layernorm/ops.py.
//
// Kernels (one warp per row for the row-wise ones; block = (LN_WARPS*32), grid = ceil(R / LN_WARPS)):
//   ln_forward(x, w, b, y, mean, rstd, R, C, eps)
//       y may be NULL (statistics only); mean / rstd may be NULL (not saved). y may alias x (fp32).
//   ln_backward_dx(x, w, dy, mean, rstd, dx, dx_copy, R, C, accumulate)
//       dx = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)),  g = dy * w,  xhat = (x - mean) * rstd
//       accumulate = 0: dx = ...; 1: dx += ... . mean / rstd are required (from ln_forward).
//       dx_copy (may be NULL) gets dx rounded to floatX: the operand of the GEMMs that read the
//       gradient next, written here because this pass holds it (bf16; in fp32 the GEMMs read dx).
//       dx may alias dy when accumulate == 0 (each element is read and written by the same thread).
//   ln_backward_dwdb(x, dy, mean, rstd, part, R, C, rows_per_tile)
//       grid (ceil(C/128), n_tiles), block (32, LN_BY):
//       part[t, c]           = sum over rows r of tile t of dy[r,c] * xhat[r,c]   (dweight partials)
//       part[n_tiles*C + t*C + c] = sum over rows r of tile t of dy[r,c]          (dbias partials)
//       followed by reduce_cols (reduce.cu) on each half.

#include "common.cuh"
#if !defined(LN_WARPS) || !defined(LN_BY) || !defined(LN_NQ)
#error "layernorm/layernorm.cu: LN_WARPS, LN_BY and LN_NQ come from rwkvx/cu/layernorm/ops.py"
#endif
#include "layernorm/ln_row.cuh"

// The row kernels keep a row's first 32*LN_NQ quads (quad i = lane + 32k, k < LN_NQ) in registers:
// their loads are issued together, one memory round trip per row, and the later passes read the
// registers (ln_row.cuh). (A loop loading, using, then storing one quad at a time waited for each load
// in turn: bf16 forward 0.0367 ms at R*C = 32768*768 on the H200, 64% of copy.)
// No __launch_bounds__: with one, ptxas squeezed some LN_NQ builds to 32 registers and spilled.
extern "C" __global__ void
ln_forward(const float* x, const float* __restrict__ w, const float* __restrict__ b,
           floatX* y, float* __restrict__ mean_out,
           float* __restrict__ rstd_out, int R, int C, float eps)
{
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
    if (r >= R) return;
    const int C4 = C >> 2;
    const float* xr = x + (long long)r * C;
    float4 v[LN_NQ];
    float mu, rs;
    ln_row_stats(xr, v, lane, C, eps, mu, rs);
    if (lane == 0) {
        if (mean_out) mean_out[r] = mu;
        if (rstd_out) rstd_out[r] = rs;
    }
    if (y) {      // y may alias x: a quad is read before it is written
        floatX* yr = y + (long long)r * C;
#pragma unroll
        for (int k = 0; k < LN_NQ; ++k)
            if (lane + 32 * k < C4)
                store4(yr + 4 * (lane + 32 * k), ln_quad(widen(v[k]), mu, rs, w, b, lane + 32 * k));
        for (int i = lane + 32 * LN_NQ; i < C4; i += 32) store4(yr + 4 * i, ln_quad(load4(xr + 4 * i), mu, rs, w, b, i));
    }
}

// dx: x, dy and (accumulate) the old dx of the row's first 32*LN_NQ quads are loaded together into
// registers, as in ln_forward.
extern "C" __global__ void
ln_backward_dx(const float* __restrict__ x, const float* __restrict__ w, const float* dy,
               const float* __restrict__ mean, const float* __restrict__ rstd, float* dx,
               floatX* __restrict__ dx_copy, int R, int C, int accumulate)
{
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
    if (r >= R) return;
    const int C4 = C >> 2;
    const float* xr = x + (long long)r * C;
    const float* dyr = dy + (long long)r * C;
    float* dxr = dx + (long long)r * C;
    floatX* dcr = dx_copy ? dx_copy + (long long)r * C : nullptr;
    float4 v[LN_NQ], d[LN_NQ], p[LN_NQ];
#pragma unroll
    for (int k = 0; k < LN_NQ; ++k) {
        const int i = lane + 32 * k;
        v[k] = i < C4 ? load_quad(xr + 4 * i) : float4{};
        d[k] = i < C4 ? load_quad(dyr + 4 * i) : float4{};
        p[k] = accumulate && i < C4 ? load_quad(dxr + 4 * i) : float4{};
    }
    const float mu = mean[r], rs = rstd[r];
    float sg = 0.0f, sgx = 0.0f;
    auto add = [&](const f4& xv, const f4& dv, const f4& ww) {
        float qg, qgx;
        ln_bwd_quad_sums(xv, dv, ww, mu, rs, qg, qgx);
        sg += qg;
        sgx += qgx;
    };
#pragma unroll
    for (int k = 0; k < LN_NQ; ++k) {
        const int i = lane + 32 * k;
        if (i < C4) add(widen(v[k]), widen(d[k]), load4(w + 4 * i));
    }
    for (int i = lane + 32 * LN_NQ; i < C4; i += 32) add(load4(xr + 4 * i), load4(dyr + 4 * i), load4(w + 4 * i));
    const float invC = 1.0f / (float)C;
    const float mg = ln_warp_sum(sg) * invC;
    const float mgx = ln_warp_sum(sgx) * invC;
    auto out = [&](int i, const f4& xv, const f4& dv, const f4& old) {
        f4 o = ln_bwd_quad_dx(xv, dv, load4(w + 4 * i), mu, rs, mg, mgx);
        if (accumulate) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o.v[e] += old.v[e];
        }
        store4(dxr + 4 * i, o);
        if (dcr) store4(dcr + 4 * i, o);
    };
#pragma unroll
    for (int k = 0; k < LN_NQ; ++k)
        if (lane + 32 * k < C4) out(lane + 32 * k, widen(v[k]), widen(d[k]), widen(p[k]));
    for (int i = lane + 32 * LN_NQ; i < C4; i += 32)        // dx may alias dy: a quad is read before it is written
        out(i, load4(xr + 4 * i), load4(dyr + 4 * i), accumulate ? load4(dxr + 4 * i) : f4_zero());
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
#pragma unroll 4
        for (int r = r0 + threadIdx.y; r < r1; r += LN_BY) {
            const float mu = mean[r], rs = rstd[r];
            const f4 v = load4(x + (long long)r * C + 4 * c4), d = load4(dy + (long long)r * C + 4 * c4);
            sw.x += d.v[0] * ((v.v[0] - mu) * rs); sw.y += d.v[1] * ((v.v[1] - mu) * rs);
            sw.z += d.v[2] * ((v.v[2] - mu) * rs); sw.w += d.v[3] * ((v.v[3] - mu) * rs);
            sb.x += d.v[0]; sb.y += d.v[1]; sb.z += d.v[2]; sb.w += d.v[3];
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
