// rwkvx/cu/decode/decode.cu -- the single-token step of generation: the parts of a block that look at earlier
// tokens, with what they need of them carried in device memory between steps (rwkvx/decoder.py).
//
//   dec_shift   token shift + mixes from the carried previous row:  o_j = x + (prev - x) * m_j, prev = x
//   dec_ln_shift  a LayerNorm whose output goes straight into dec_shift, both in one kernel
//   dec_wkv7    one WKV7 token from the carried state                (state [B,H,N,N] fp32, in place)
//   dec_moba    MoBA attention of the new query: appends its key and value to the cache, completes the
//               block mean when the token ends a block, selects the past blocks by gate, attends
//
// The other parts of a block (LayerNorm, GEMMs, the time-mix prep and GroupNorm, the squared ReLU) are
// the forward's own kernels on B rows. Activations are floatX [B, C] (one row per sequence; c = h*N + n);
// the arithmetic is the forward's: dec_shift is tm_shift_fwd / cm_shift_mix's expression, dec_wkv7 runs
// wkv7_state.cuh's token_sa / token_update (the same functions as wkv7_forward), dec_moba computes the
// block mean with moba_kmean's partition and order and the gate with moba_select's fmaf chain (ties: the
// lower block). Only the softmax's summation order differs from the flash-style forward.
// HEAD_SIZE, WKV_Q and DEC_MOBA_THREADS (= moba_kmean's thread count) come from rwkvx/cu/decode/ops.py.

#include "common.cuh"
#if !defined(HEAD_SIZE) || !defined(WKV_Q) || !defined(DEC_MOBA_THREADS)
#error "decode/decode.cu: HEAD_SIZE, WKV_Q and DEC_MOBA_THREADS come from rwkvx/cu/decode/ops.py"
#endif
#include "wkv7/state.cuh"

// ---------------------------------------------------------------------------------------------
// 1. token shift.  x, prev fp32 [B, C] (a LayerNorm's output, fp32 in every precision); o0..o5 floatX [B, C];
//    m0..m5 fp32 [C] (unused ones NULL).
//    o_j = x + (prev - x) * m_j for j < nmix, then prev = x.  Grid-stride over the B*C/4 quads.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
dec_shift(const float* __restrict__ x, float* __restrict__ prev,
          const float* m0, const float* m1, const float* m2, const float* m3, const float* m4, const float* m5,
          floatX* o0, floatX* o1, floatX* o2, floatX* o3, floatX* o4, floatX* o5, int B, int C, int nmix)
{
    const float* mp[6] = {m0, m1, m2, m3, m4, m5};
    floatX* op[6] = {o0, o1, o2, o3, o4, o5};
    for_each_quad(B, C, [&](long long i, int r, int c4) {
        const f4 cur = load4(x + 4 * i), p = load4(prev + 4 * i);
#pragma unroll
        for (int j = 0; j < 6; ++j) {
            if (j >= nmix) break;
            const f4 m = load4_scalar(mp[j] + 4 * c4);
            f4 o;
#pragma unroll
            for (int e = 0; e < 4; ++e) o.v[e] = cur.v[e] + (p.v[e] - cur.v[e]) * m.v[e];
            store4(op[j] + 4 * i, o);
        }
        store4(prev + 4 * i, cur);
    });
}

// ---------------------------------------------------------------------------------------------
// 1b. LayerNorm + token shift.  x, y, x_copy, prev fp32 [B, C]; w, b, m0..m5 fp32 [C]; mean, rstd fp32 [B];
//     o0..o5 floatX [B, C]. grid (B), one warp per row. y = LN(x) with ln_forward's arithmetic (sums over
//     the quads i = lane, lane + 32, ... then the xor butterfly), x_copy = x, mean / rstd saved when not
//     NULL; then dec_shift on y: o_j = y + (prev - y) * m_j (j < nmix), prev = y.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(32)
dec_ln_shift(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
             float* __restrict__ y, float* __restrict__ x_copy, float* __restrict__ mean_out,
             float* __restrict__ rstd_out, float* __restrict__ prev,
             const float* m0, const float* m1, const float* m2, const float* m3, const float* m4, const float* m5,
             floatX* o0, floatX* o1, floatX* o2, floatX* o3, floatX* o4, floatX* o5, int C, int nmix, float eps)
{
    const float* mp[6] = {m0, m1, m2, m3, m4, m5};
    floatX* op[6] = {o0, o1, o2, o3, o4, o5};
    const int lane = threadIdx.x, C4 = C >> 2;
    const long long row = (long long)blockIdx.x * C;
    float s = 0.f;
    for (int i = lane; i < C4; i += 32) {
        const f4 u = load4(x + row + 4 * i);
        if (x_copy) store4(x_copy + row + 4 * i, u);
        s += (u.v[0] + u.v[1]) + (u.v[2] + u.v[3]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float mu = s / (float)C;
    float q = 0.f;
    for (int i = lane; i < C4; i += 32) {
        const f4 u = load4(x + row + 4 * i);
        const float a = u.v[0] - mu, bb = u.v[1] - mu, c = u.v[2] - mu, d = u.v[3] - mu;
        q += (a * a + bb * bb) + (c * c + d * d);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
    const float rs = 1.0f / sqrtf(q / (float)C + eps);
    if (lane == 0) {
        if (mean_out) mean_out[blockIdx.x] = mu;
        if (rstd_out) rstd_out[blockIdx.x] = rs;
    }
    for (int i = lane; i < C4; i += 32) {
        const f4 u = load4(x + row + 4 * i), ww = load4(w + 4 * i), bv = load4(b + 4 * i), p = load4(prev + row + 4 * i);
        f4 h;
#pragma unroll
        for (int e = 0; e < 4; ++e) h.v[e] = (u.v[e] - mu) * rs * ww.v[e] + bv.v[e];
#pragma unroll
        for (int j = 0; j < 6; ++j) {
            if (j >= nmix) break;
            const f4 m = load4_scalar(mp[j] + 4 * i);
            f4 o;
#pragma unroll
            for (int e = 0; e < 4; ++e) o.v[e] = h.v[e] + (p.v[e] - h.v[e]) * m.v[e];
            store4(op[j] + row + 4 * i, o);
        }
        store4(y + row + 4 * i, h);
        store4(prev + row + 4 * i, h);
    }
}

// ---------------------------------------------------------------------------------------------
// 2. WKV7 step.  grid (H, B), block N*Q.  r, k, v, a, b, y floatX [B, H, N] (= [B, C]), the decay w fp32;
//    state fp32 [B, H, N, N] (S[i, j], row = value index), read and written.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(wkv7::HN * wkv7::Q)
dec_wkv7(const floatX* __restrict__ r, const float* __restrict__ w, const floatX* __restrict__ k,
         const floatX* __restrict__ v, const floatX* __restrict__ a, const floatX* __restrict__ b,
         float* __restrict__ state, floatX* __restrict__ y, int H)
{
    using namespace wkv7;
    const int h = blockIdx.x, bb = blockIdx.y;
    const int row = threadIdx.x / Q, rq = threadIdx.x % Q, j0 = rq * M;
    const long long off = ((long long)bb * H + h) * HN;
    float* Sg = state + off * HN + (long long)row * HN + j0;
    float S[M];
#pragma unroll
    for (int m = 0; m < M; m += VW) ldv(Sg + m, S + m);
    const float sa = token_sa(S, a + off + j0);
    const float yy = token_update(S, r + off + j0, w + off + j0, k + off + j0, to_f32(v[off + row]), b + off + j0, sa);
#pragma unroll
    for (int m = 0; m < M; m += VW) stv(Sg + m, S + m);
    if (rq == 0) y[off + row] = from_f32(yy);
}

// ---------------------------------------------------------------------------------------------
// 3. MoBA step of the query at position t = pos[b] (each sequence its own).  grid (H, B), block DEC_MOBA_THREADS.
//    q, k, v, o floatX [B, H, N]; kc, vc floatX [B, Tmax, H, N]: every key and value so far (this step
//    writes position t); kmean fp32 [B, H, maxblk, N]: the means of the complete blocks (this step writes
//    block t / chunk when t ends it); sel_out int [B, H, K1] (optional): the selected blocks, ascending,
//    -1 padded. K1 = top_k - 1; maxblk = Tmax / chunk (0 when K1 = 0; kmean may then be NULL).
//    Dynamic shared memory: its carve-up below, sized by rwkvx.ops.decode.moba_smem_bytes.
// ---------------------------------------------------------------------------------------------
namespace dec {
constexpr int HS = HEAD_SIZE;
constexpr int NT = DEC_MOBA_THREADS;
constexpr int NP = NT / HS;          // moba_kmean's partial sums per channel
constexpr int NG = NT / HS;          // key groups of the weighted value sum
static_assert(NT % HS == 0 && (NT & (NT - 1)) == 0, "DEC_MOBA_THREADS must be a power of 2, >= the head size");

// max / sum over the block (fixed tree: deterministic); red has NT floats, the result goes to every thread
template <bool MAX>
__device__ __forceinline__ float block_reduce(float x, float* red) {
    red[threadIdx.x] = x;
    __syncthreads();
    for (int s = NT / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = MAX ? fmaxf(red[threadIdx.x], red[threadIdx.x + s])
                                                    : red[threadIdx.x] + red[threadIdx.x + s];
        __syncthreads();
    }
    const float out = red[0];
    __syncthreads();
    return out;
}
}  // namespace dec

extern "C" __global__ void __launch_bounds__(DEC_MOBA_THREADS)
dec_moba(const floatX* __restrict__ q, const floatX* __restrict__ k, const floatX* __restrict__ v,
         floatX* __restrict__ kc, floatX* __restrict__ vc, float* __restrict__ kmean, const int* __restrict__ pos,
         int* __restrict__ sel_out, floatX* __restrict__ o, int H, int Tmax, int chunk, int K1, int maxblk,
         float scale)
{
    using namespace dec;
    extern __shared__ float4 dec_smem4[];
    float* qs = reinterpret_cast<float*>(dec_smem4);          // [HS]
    float* red = qs + HS;                                       // [NT]
    float* opart = red + NT;                                    // [NG][HS]
    float* gates = opart + NG * HS;                             // [maxblk]
    float* topg = gates + maxblk;                               // [K1]
    int* sel = reinterpret_cast<int*>(topg + K1);               // [K1]
    float* p = reinterpret_cast<float*>(sel + K1);              // [(K1 + 1) * chunk] scores, then weights

    const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
    const int bh = b * H + h;
    const int t = pos[b], bt = t / chunk;
    const size_t tstride = (size_t)H * HS;
    const size_t cbase = (size_t)b * Tmax * tstride + (size_t)h * HS;    // cache row u: cbase + u * tstride
    const size_t tok = (size_t)bh * HS;

    for (int n = tid; n < HS; n += NT) {
        kc[cbase + t * tstride + n] = k[tok + n];
        vc[cbase + t * tstride + n] = v[tok + n];
        qs[n] = to_f32(q[tok + n]);
    }
    __syncthreads();

    if (K1 > 0) {
        // the block t completes: its mean over its chunk keys, as moba_kmean adds them
        if (t % chunk == chunk - 1 && bt < maxblk) {
            const int part = tid / HS, n = tid - part * HS;
            float s = 0.f;
            if (part < NP)
                for (int u = bt * chunk + part; u < (bt + 1) * chunk; u += NP) s += to_f32(kc[cbase + u * tstride + n]);
            red[tid] = s;
            __syncthreads();
            if (tid < HS) {
                float tot = 0.f;
#pragma unroll
                for (int pp = 0; pp < NP; ++pp) tot += red[pp * HS + tid];
                kmean[((size_t)bh * maxblk + bt) * HS + tid] = tot / (float)chunk;
            }
            __syncthreads();
        }
        // gates of the complete past blocks j < bt, then the K1 largest (ties: the lower j), ascending
        const float* kmb = kmean + (size_t)bh * maxblk * HS;
        for (int j = tid; j < bt; j += NT) {
            float g = 0.f;
            for (int n = 0; n < HS; ++n) g = fmaf(qs[n], kmb[(size_t)j * HS + n], g);
            gates[j] = g;
        }
        __syncthreads();
        if (tid == 0) {
            int nf = 0;
            for (int j = 0; j < bt; ++j) {
                const float g = gates[j];
                int at;
                if (nf < K1) at = nf++;
                else if (g > topg[K1 - 1]) at = K1 - 1;
                else continue;
                while (at > 0 && g > topg[at - 1]) { topg[at] = topg[at - 1]; sel[at] = sel[at - 1]; --at; }
                topg[at] = g;
                sel[at] = j;
            }
            for (int i = 1; i < nf; ++i) {
                const int jv = sel[i];
                int at = i;
                while (at > 0 && sel[at - 1] > jv) { sel[at] = sel[at - 1]; --at; }
                sel[at] = jv;
            }
            for (int i = nf; i < K1; ++i) sel[i] = -1;
            if (sel_out)
                for (int i = 0; i < K1; ++i) sel_out[(size_t)bh * K1 + i] = sel[i];
        }
        __syncthreads();
    }
    // visible keys, ascending: the selected blocks, then bt*chunk .. t
    int ns = 0;
    while (ns < K1 && sel[ns] >= 0) ++ns;
    const int nv = ns * chunk + (t - bt * chunk + 1);
    auto key_pos = [&](int i) { return i < ns * chunk ? sel[i / chunk] * chunk + i % chunk : bt * chunk + (i - ns * chunk); };

    float mx = -__int_as_float(0x7f800000);
    for (int i = tid; i < nv; i += NT) {
        const floatX* kr = kc + cbase + (size_t)key_pos(i) * tstride;
        float s = 0.f;
#pragma unroll 4
        for (int n = 0; n < HS; n += 4) {
            const f4 kv = load4(kr + n);
            s = fmaf(qs[n], kv.v[0], s);
            s = fmaf(qs[n + 1], kv.v[1], s);
            s = fmaf(qs[n + 2], kv.v[2], s);
            s = fmaf(qs[n + 3], kv.v[3], s);
        }
        p[i] = s * scale;
        mx = fmaxf(mx, p[i]);
    }
    mx = block_reduce<true>(mx, red);
    float den = 0.f;
    for (int i = tid; i < nv; i += NT) {
        p[i] = expf(p[i] - mx);
        den += p[i];
    }
    den = block_reduce<false>(den, red);      // also orders the weights' writes before their reads
    const int g = tid / HS, n = tid - g * HS;
    float acc = 0.f;
    for (int i = g; i < nv; i += NG) acc = fmaf(p[i], to_f32(vc[cbase + (size_t)key_pos(i) * tstride + n]), acc);
    opart[g * HS + n] = acc;
    __syncthreads();
    if (tid < HS) {
        float tot = 0.f;
        for (int gg = 0; gg < NG; ++gg) tot += opart[gg * HS + tid];
        o[tok + tid] = from_f32(tot / den);
    }
}
