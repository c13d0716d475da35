// embedding.cu — token embedding gather and its deterministic gradient (rwkvx).
//
// Buffers: tok int32 [R]; emb, demb float32 [V, C] (the fp32 weights and their gradient); x, dx floatX
// [R, C]. C % 4 == 0, aligned to 4 elements. EMB_BY comes from rwkvx/cu/embedding/ops.py.
//
//   embedding_forward(tok, emb, x, R, C, V)
//       x[r, :] = emb[tok[r], :]. A token outside [0, V) (the host validates, so never expected)
//       writes NaN into its row instead of reading out of bounds.
//       grid-stride over R*C/4 float4 elements; block (256), any grid.
//   embedding_backward(dx, tok, order, seg_start, n_seg, demb, C, V)
//       order int32 [R]: stable argsort of tok; seg_start int32 [R+1]: segment s covers
//       order[seg_start[s] .. seg_start[s+1]) (all the same token); n_seg int32 [1]: number of segments.
//       For s < n_seg: demb[tok[order[seg_start[s]]], :] = sum of dx[order[i], :] over the segment.
//       Rows of demb for tokens that do not occur are NOT written: zero demb first (Memset).
//       grid (max_segments, ceil(C / 128)), block (32, EMB_BY); blocks with s >= n_seg exit.
//       Sum order: thread row y adds segment entries y, y+EMB_BY, ... in order, then the EMB_BY
//       partial sums are added in order y = 0..EMB_BY-1 — fixed, so bit-reproducible.

#include "common.cuh"
#ifndef EMB_BY
#error "embedding/embedding.cu: EMB_BY comes from rwkvx/cu/embedding/ops.py"
#endif

extern "C" __global__ void __launch_bounds__(256)
embedding_forward(const int* __restrict__ tok, const float* __restrict__ emb, floatX* __restrict__ x,
                  int R, int C, int V)
{
    for_each_quad(R, C, [&](long long i, int r, int c4) {
        const int t = tok[r];
        f4 v;
        if ((unsigned)t < (unsigned)V) {
            v = load4(emb + (long long)t * C + 4 * c4);
        } else {
            const float nan = __int_as_float(0x7fc00000);
            v.v[0] = nan; v.v[1] = nan; v.v[2] = nan; v.v[3] = nan;
        }
        store4(x + 4 * i, v);
    });
}

extern "C" __global__ void __launch_bounds__(32 * EMB_BY)
embedding_backward(const floatX* __restrict__ dx, const int* __restrict__ tok,
                   const int* __restrict__ order, const int* __restrict__ seg_start,
                   const int* __restrict__ n_seg, float* __restrict__ demb, int C, int V)
{
    __shared__ float4 sh[EMB_BY][32];
    const int s = blockIdx.x;
    if (s >= *n_seg) return;  // uniform over the block
    const int C4 = C >> 2;
    const int c4 = blockIdx.y * 32 + threadIdx.x;
    const int i0 = seg_start[s], i1 = seg_start[s + 1];
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c4 < C4) {
#pragma unroll 4
        for (int i = i0 + threadIdx.y; i < i1; i += EMB_BY) {
            const f4 u = load4(dx + ((long long)order[i] * C4 + c4) * 4);
            acc.x += u.v[0]; acc.y += u.v[1]; acc.z += u.v[2]; acc.w += u.v[3];
        }
    }
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c4 < C4) {
        float4 t = sh[0][threadIdx.x];
#pragma unroll
        for (int y = 1; y < EMB_BY; ++y) {
            const float4 u = sh[y][threadIdx.x];
            t.x += u.x; t.y += u.y; t.z += u.z; t.w += u.w;
        }
        const int token = tok[order[i0]];
        if ((unsigned)token < (unsigned)V)  // host-validated; never write out of bounds
            reinterpret_cast<float4*>(demb)[(long long)token * C4 + c4] = t;
    }
}
