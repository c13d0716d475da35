// rwkvx/cu/decode/gemv.cu -- the decode step's matrix products: up to GEMV_JOBS independent products of
// B <= GEMV_ROWS rows in one launch (rwkvx/decoder.py groups the step's GEMMs into launches of this kernel).
//
//   dec_gemv   job j:  acc[b, n] = sum_k x_j[b, k] * W_j(k, n)     b < B, n < n_j, k < k_j
//              then y_j[b, n] = epi_j(acc)  (floatX)   or   r_j[b, n] = a_j[b, n] + acc  (fp32 residual,
//              y_j NULL; the addend a_j may be r_j itself)
//
// x_j floatX [B, k_j]; W_j floatX (the GEMM operand type: bf16 in bf16, fp32 otherwise), stored
// [n_j, k_j] (a Linear's weight: mode_j & GEMV_KN clear) or [k_j, n_j] (a LoRA matrix: GEMV_KN set);
// rows 16-byte aligned, k_j a multiple of 16 bytes of floatX. epi_j = mode_j & 7: none, GEMV_TANH,
// GEMV_SIGMOID, GEMV_RELU_SQ. An activation reads the product rounded to floatX, as the forward's
// activation kernel reads the GEMM's output buffer; a residual adds the unrounded fp32 sum. With the
// variant GEMV_TF32 = 1 (the tf32 precision) both operands are rounded to TF32 as the forward's tensor-core
// GEMMs round them (cvt.rna), so the decode step multiplies what the forward multiplies.
//
// The grid is the jobs' tiles one after another. A [n_j, k_j] job is split in S = 2^(mode_j >>
// GEMV_KS_SHIFT) contiguous k-slices (long rows: more blocks, more loads in flight): a tile has
// GEMV_WARPS / S column groups of GEMV_CPW columns, each group's S warps one slice each; a [k_j, n_j]
// job has tiles of 32 columns, one per lane, the warps splitting k into contiguous ranges. Summation
// order is fixed (deterministic, bitwise reproducible): [n, k] jobs add a lane's 16-byte vectors in k
// order, the lanes by an xor butterfly, then the slices in order; [k, n] jobs add a warp's k range in
// order and then the warps in order.
// Constants (GEMV_*) come from rwkvx/cu/decode/ops.py.

#include "common.cuh"
#include "mma.cuh"
#if !defined(GEMV_TF32) || !defined(GEMV_JOBS) || !defined(GEMV_ROWS) || !defined(GEMV_WARPS) || !defined(GEMV_CPW) || \
    !defined(GEMV_KN) || !defined(GEMV_KS_SHIFT) || !defined(GEMV_TANH) || !defined(GEMV_SIGMOID) || !defined(GEMV_RELU_SQ)
#error "decode/gemv.cu: the GEMV_* constants come from rwkvx/cu/decode/ops.py"
#endif
static_assert(GEMV_JOBS == 8, "dec_gemv's prototype names eight job slots");
static_assert(GEMV_ROWS * GEMV_CPW <= 32, "a warp's lanes hold its columns' sums, one (column, row) each");

namespace gemv {
constexpr int ROWS = GEMV_ROWS, WARPS = GEMV_WARPS, CPW = GEMV_CPW;
constexpr int THREADS = 32 * WARPS;
constexpr int VW = 16 / (int)sizeof(floatX);      // floatX elements per 16-byte vector
constexpr int LIN_COLS = WARPS * CPW;              // columns of a [n, k] tile
constexpr int KN_COLS = 32;                        // columns of a [k, n] tile

// an operand as the product takes it: TF32-rounded in the tf32 precision, else as stored
__device__ __forceinline__ float operand(float v) { return GEMV_TF32 ? round_tf32(v) : v; }

// the 16-byte vector at p, widened to fp32 (p 16-byte aligned); weights are streamed (read once a step)
template <bool STREAM>
__device__ __forceinline__ void load_vec(const floatX* p, float* out) {
    const uint4 u = STREAM ? __ldcs(reinterpret_cast<const uint4*>(p)) : __ldg(reinterpret_cast<const uint4*>(p));
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if FLOATX_BF16
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
#else
        out[i] = operand(__uint_as_float(w[i]));
#endif
    }
}

__device__ __forceinline__ float epilogue(float acc, int epi) {
    if (epi == 0) return acc;
    const float v = to_f32(from_f32(acc));     // the forward's activation reads the GEMM's floatX output
    if (epi == GEMV_TANH) return tanhf(v);
    if (epi == GEMV_SIGMOID) return 1.0f / (1.0f + expf(-v));
    const float r = fmaxf(v, 0.0f);            // GEMV_RELU_SQ
    return r * r;
}

// (res, add): the residual's output and addend, NULL for a floatX output y
struct Out { floatX* y; float* res; const float* add; };

__device__ __forceinline__ void store(const Out& o, long long i, float acc, int epi) {
    if (o.res) o.res[i] = o.add[i] + acc;
    else o.y[i] = from_f32(epilogue(acc, epi));
}

// columns [c0, c0 + cols) of a [n, k] job split in S = 1 << ks k-slices: warp w owns columns
// c0 + (w >> ks)*CPW ... over slice w & (S-1) of the 16-byte vectors; the slices' sums add in order
__device__ __forceinline__ void tile_nk(const floatX* __restrict__ x, const floatX* __restrict__ W, const Out& o,
                                        int n, int K, int epi, int B, int c0, int ks, float* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, S = 1 << ks, slice = warp & (S - 1);
    const int cw = c0 + (warp >> ks) * CPW;
    const int nv = K / VW, v0 = slice * nv / S, v1 = (slice + 1) * nv / S;
    float acc[CPW][ROWS];
#pragma unroll
    for (int c = 0; c < CPW; ++c)
#pragma unroll
        for (int b = 0; b < ROWS; ++b) acc[c][b] = 0.f;
#pragma unroll 4
    for (int v = v0 + lane; v < v1; v += 32) {       // unrolled: several vectors' loads in flight
        float wv[CPW][VW];
#pragma unroll
        for (int c = 0; c < CPW; ++c) {
            if (cw + c < n) load_vec<true>(W + (long long)(cw + c) * K + v * VW, wv[c]);
            else
#pragma unroll
                for (int e = 0; e < VW; ++e) wv[c][e] = 0.f;
        }
#pragma unroll
        for (int b = 0; b < ROWS; ++b) {
            if (b >= B) break;
            float xv[VW];
            load_vec<false>(x + (long long)b * K + v * VW, xv);
#pragma unroll
            for (int c = 0; c < CPW; ++c)
#pragma unroll
                for (int e = 0; e < VW; ++e) acc[c][b] = fmaf(wv[c][e], xv[e], acc[c][b]);
        }
    }
#pragma unroll
    for (int c = 0; c < CPW; ++c)
#pragma unroll
        for (int b = 0; b < ROWS; ++b)
            if (b < B)                          // B is uniform: whole warps shuffle
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) acc[c][b] += __shfl_xor_sync(0xffffffffu, acc[c][b], o);
    // every lane holds every sum: lane c*ROWS + b keeps (column cw + c, row b)
    float mine = 0.f;
#pragma unroll
    for (int c = 0; c < CPW; ++c)
#pragma unroll
        for (int b = 0; b < ROWS; ++b)
            if (lane == c * ROWS + b) mine = acc[c][b];
    const int c = lane / ROWS, b = lane % ROWS;
    if (S == 1) {
        if (lane < CPW * ROWS && b < B && cw + c < n) store(o, (long long)b * n + cw + c, mine, epi);
        return;
    }
    if (lane < CPW * ROWS) part[warp * CPW * ROWS + lane] = mine;
    __syncthreads();
    if (slice == 0 && lane < CPW * ROWS && b < B && cw + c < n) {
        float sum = 0.f;
        for (int sl = 0; sl < S; ++sl) sum += part[(warp + sl) * CPW * ROWS + lane];
        store(o, (long long)b * n + cw + c, sum, epi);
    }
}

// columns [c0, c0 + 32) of a [k, n] job: lane = column, warp w adds k in [w*ks, (w+1)*ks)
__device__ __forceinline__ void tile_kn(const floatX* __restrict__ x, const floatX* __restrict__ W, const Out& o,
                                        int n, int K, int epi, int B, int c0, float* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, col = c0 + lane;
    const int ks = (K + WARPS - 1) / WARPS, k0 = warp * ks, k1 = min(K, k0 + ks);
    float acc[ROWS];
#pragma unroll
    for (int b = 0; b < ROWS; ++b) acc[b] = 0.f;
    if (col < n) {
#pragma unroll 4
        for (int k = k0; k < k1; ++k) {
            const float w = operand(to_f32(W[(long long)k * n + col]));
#pragma unroll
            for (int b = 0; b < ROWS; ++b)
                if (b < B) acc[b] = fmaf(w, operand(to_f32(x[(long long)b * K + k])), acc[b]);
        }
    }
#pragma unroll
    for (int b = 0; b < ROWS; ++b) part[(warp * ROWS + b) * 32 + lane] = acc[b];
    __syncthreads();
    if (col < n)
        for (int b = warp; b < B; b += WARPS) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) s += part[(w * ROWS + b) * 32 + lane];
            store(o, (long long)b * n + col, s, epi);
        }
}

template <class T>
__device__ __forceinline__ T pick(int j, T a0, T a1, T a2, T a3, T a4, T a5, T a6, T a7) {
    return j == 0 ? a0 : j == 1 ? a1 : j == 2 ? a2 : j == 3 ? a3 : j == 4 ? a4 : j == 5 ? a5 : j == 6 ? a6 : a7;
}
}  // namespace gemv

#define GEMV_PICK(j, p) gemv::pick(j, p##0, p##1, p##2, p##3, p##4, p##5, p##6, p##7)

// at least 2 blocks an SM: without a minimum ptxas held the bf16 build to 64 registers and spilled
extern "C" __global__ void __launch_bounds__(gemv::THREADS, 2)
dec_gemv(const floatX* x0, const floatX* x1, const floatX* x2, const floatX* x3, const floatX* x4, const floatX* x5, const floatX* x6, const floatX* x7,
         const floatX* w0, const floatX* w1, const floatX* w2, const floatX* w3, const floatX* w4, const floatX* w5, const floatX* w6, const floatX* w7,
         floatX* y0, floatX* y1, floatX* y2, floatX* y3, floatX* y4, floatX* y5, floatX* y6, floatX* y7,
         float* r0, float* r1, float* r2, float* r3, float* r4, float* r5, float* r6, float* r7,
         const float* a0, const float* a1, const float* a2, const float* a3, const float* a4, const float* a5, const float* a6, const float* a7,
         int n0, int n1, int n2, int n3, int n4, int n5, int n6, int n7,
         int k0, int k1, int k2, int k3, int k4, int k5, int k6, int k7,
         int mode0, int mode1, int mode2, int mode3, int mode4, int mode5, int mode6, int mode7, int B)
{
    using namespace gemv;
    __shared__ float part[WARPS * ROWS * 32];
    int t = blockIdx.x, j = 0;
    for (; j < GEMV_JOBS; ++j) {        // this block's job: the tiles of the jobs before it come first
        const int nj = GEMV_PICK(j, n), md = GEMV_PICK(j, mode);
        const int cols = (md & GEMV_KN) ? KN_COLS : (LIN_COLS >> (md >> GEMV_KS_SHIFT));
        const int tiles = (nj + cols - 1) / cols;
        if (t < tiles) break;
        t -= tiles;
    }
    if (j == GEMV_JOBS) return;
    const int md = GEMV_PICK(j, mode), nj = GEMV_PICK(j, n), kj = GEMV_PICK(j, k), ks = md >> GEMV_KS_SHIFT;
    const floatX* xj = GEMV_PICK(j, x);
    const floatX* wj = GEMV_PICK(j, w);
    const Out o = {GEMV_PICK(j, y), GEMV_PICK(j, r), GEMV_PICK(j, a)};
    if (md & GEMV_KN) tile_kn(xj, wj, o, nj, kj, md & 7, B, t * KN_COLS, part);
    else tile_nk(xj, wj, o, nj, kj, md & 7, B, t * (LIN_COLS >> ks), ks, part);
}
