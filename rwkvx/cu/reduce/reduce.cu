// reduce.cu — the deterministic reduction of per-tile partial sums into parameter gradients (rwkvx).
//
// The backward kernels of layernorm, channelmix and timemix write per-row-tile partial sums of their
// parameter gradients; this kernel adds them up in a fixed order. No atomics: the order depends only
// on the sizes and the launch shape (fixed at plan build time), so replays are bit-identical.
//
//   reduce_partials(part, P, C, nout, o0..o5, accumulate)
//       part float32 [P, nout, C];  o_j[c] (= or +=) sum_p part[p, j, c]   for j < nout <= 6
//       grid (ceil(nout*C / 32)), block (32, BY) with BY <= RD_MAX_BY: thread (x, y) sums p = y, y+BY, ...
//       in order, then the BY sums are added in y order. BY is part of the summation order.
//   RD_MAX_BY comes from rwkvx/cu/reduce/ops.py.

#include "common.cuh"
#ifndef RD_MAX_BY
#error "reduce/reduce.cu: RD_MAX_BY comes from rwkvx/cu/reduce/ops.py"
#endif

extern "C" __global__ void __launch_bounds__(32 * RD_MAX_BY)
reduce_partials(const float* __restrict__ part, int P, int C, int nout,
                float* o0, float* o1, float* o2, float* o3, float* o4, float* o5, int accumulate)
{
    __shared__ float sh[RD_MAX_BY][33];
    const int tx = threadIdx.x, ty = threadIdx.y, by = blockDim.y;
    const int width = nout * C;
    const int col = blockIdx.x * 32 + tx;
    float s = 0.f;
    if (col < width)
        for (int p = ty; p < P; p += by) s += part[(long long)p * width + col];
    sh[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && col < width) {
        float t = sh[0][tx];
        for (int y = 1; y < by; ++y) t += sh[y][tx];
        const int j = col / C, c = col - j * C;
        float* o = j == 0 ? o0 : j == 1 ? o1 : j == 2 ? o2 : j == 3 ? o3 : j == 4 ? o4 : o5;
        o[c] = accumulate ? o[c] + t : t;
    }
}
