// rwkvx/cu/decode/decode.cu -- the single-token step of generation: the parts of a block that look at earlier
// tokens, with what they need of them carried in device memory between steps (rwkvx/decoder.py).
//
//   dec_shift   token shift + mixes from the carried previous row:  o_j = x + (prev - x) * m_j, prev = x
//   dec_ln_shift  a LayerNorm whose output goes straight into dec_shift, both in one kernel
//   dec_wkv7    one WKV7 token from the carried state                (state [B,H,N,N] fp32, in place)
//   dec_tmix    an RWKV block's time mix from the LoRA hidden rows to the GroupNorm's output, per (head, row):
//               the LoRA second layers, the prep, dec_wkv7's token, the GroupNorm with bonus and gate
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
#if !defined(HEAD_SIZE) || !defined(WKV_Q) || !defined(DEC_MOBA_THREADS) || !defined(TM_DECAY_SCALE) || \
    !defined(TM_GN_EPS) || !defined(TM_L2_EPS)
#error "decode/decode.cu: HEAD_SIZE, WKV_Q, DEC_MOBA_THREADS and the TM_* constants come from rwkvx/cu/decode/ops.py"
#endif
#include "wkv7/state.cuh"

// ---------------------------------------------------------------------------------------------
// 1. token shift.  x, prev fp32 [B, C] (a LayerNorm's output, fp32 in every precision); o0..o5 floatX [B, C];
//    m0..m5 fp32 [C] (unused ones NULL).
//    o_j = x + (prev - x) * m_j for j < nmix, then prev = x.  Grid-stride over the B*C/4 quads.
// ---------------------------------------------------------------------------------------------
// the mixes of one quad of channels (quad c4, elements at i of the outputs): o_j = cur + (prev - cur) * m_j
__device__ __forceinline__ void mix_quad(const f4& cur, const f4& prev, const float* const (&mp)[6],
                                         floatX* const (&op)[6], int nmix, long long i, int c4)
{
#pragma unroll
    for (int j = 0; j < 6; ++j) {
        if (j >= nmix) break;
        const f4 m = load4_scalar(mp[j] + 4 * c4);
        f4 o;
#pragma unroll
        for (int e = 0; e < 4; ++e) o.v[e] = cur.v[e] + (prev.v[e] - cur.v[e]) * m.v[e];
        store4(op[j] + i, o);
    }
}

extern "C" __global__ void __launch_bounds__(256)
dec_shift(const float* __restrict__ x, float* __restrict__ prev,
          const float* m0, const float* m1, const float* m2, const float* m3, const float* m4, const float* m5,
          floatX* o0, floatX* o1, floatX* o2, floatX* o3, floatX* o4, floatX* o5, int B, int C, int nmix)
{
    const float* mp[6] = {m0, m1, m2, m3, m4, m5};
    floatX* op[6] = {o0, o1, o2, o3, o4, o5};
    for_each_quad(B, C, [&](long long i, int r, int c4) {
        const f4 cur = load4(x + 4 * i);
        mix_quad(cur, load4(prev + 4 * i), mp, op, nmix, 4 * i, c4);
        store4(prev + 4 * i, cur);
    });
}

// ---------------------------------------------------------------------------------------------
// 1b. LayerNorm + token shift.  x, y, prev fp32 [B, C]; w, b, m0..m5 fp32 [C]; mean, rstd fp32 [B];
//     o0..o5 floatX [B, C]. grid (B), one warp per row. y = LN(x) with ln_forward's arithmetic (sums over
//     the quads i = lane, lane + 32, ... then the xor butterfly), mean / rstd saved when not NULL; then
//     dec_shift on y: o_j = y + (prev - y) * m_j (j < nmix), prev = y.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(32)
dec_ln_shift(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
             float* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
             float* __restrict__ prev,
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
        mix_quad(h, p, mp, op, nmix, row + 4 * i, i);
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
// 2b. The time mix of one token, per (head h, row b): grid (H, B), block N*Q (dec_wkv7's).
//     hw, ha, hv, hg floatX [B, d_p]: the LoRA hidden rows (tanh and sigmoid applied); w2, a2, v2, g2
//     floatX [d_p, C] the second layers; r, k, v floatX [B, C]; vf floatX [B, C] v_first (layer 0, hv
//     NULL: written := v; else read); w0, a0, v0, k_k, k_a, lnw, lnb, rk fp32 [C]; state fp32
//     [B, H, N, N] in place; z floatX [B, C] out.
//       wl, al, vl, g = h_p @ W2_p (each rounded to floatX, as the GEMMs' outputs);
//       tm_prep_fwd's decay, kp, vp, wa, wb (floatX but decay); dec_wkv7's token; tm_gn_fwd's z.
//     The arithmetic of tm_prep_fwd and tm_gn_fwd (head sums over the N/4 lanes that own 4 channels
//     each, in their xor order) and of state.cuh's token; only the LoRA products' summation order is
//     this kernel's own (each of the Q = 4 thread groups adds a quarter of the rank in order, then the
//     quarters in order). Nothing but the state, z (and v_first in layer 0) leaves the chip.
// ---------------------------------------------------------------------------------------------
namespace tmx {
constexpr int G = HEAD_SIZE / 4;        // lanes of a head in tm_prep_fwd / tm_gn_fwd (4 channels each)
static_assert(wkv7::Q == 4, "dec_tmix's LoRA phase gives one of the 4 paths to each group of N threads");

__device__ __forceinline__ float round_x(float x) { return to_f32(from_f32(x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// tm_head_sum: the xor butterfly over lanes 0 .. G-1 (warp 0)
__device__ __forceinline__ float head_sum(float x) {
    const unsigned mask = G >= 32 ? 0xffffffffu : (1u << G) - 1u;
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) x += __shfl_xor_sync(mask, x, o);
    return x;
}
}  // namespace tmx

// (a minimum of 1 block an SM: without one ptxas held the fp32 build of N = 64 to 64 registers and spilled)
extern "C" __global__ void __launch_bounds__(wkv7::HN * wkv7::Q, 1)
dec_tmix(const floatX* __restrict__ hw, const floatX* __restrict__ ha, const floatX* __restrict__ hv,
         const floatX* __restrict__ hg, const floatX* __restrict__ w2, const floatX* __restrict__ a2,
         const floatX* __restrict__ v2, const floatX* __restrict__ g2, int dw, int da, int dv, int dg,
         const floatX* __restrict__ r, const floatX* __restrict__ k, const floatX* __restrict__ v,
         floatX* __restrict__ vf, const float* __restrict__ w0, const float* __restrict__ a0,
         const float* __restrict__ v0, const float* __restrict__ k_k, const float* __restrict__ k_a,
         float* __restrict__ state, const float* __restrict__ lnw, const float* __restrict__ lnb,
         const float* __restrict__ rk, floatX* __restrict__ z, int H)
{
    using namespace wkv7;
    using tmx::G;
    __shared__ float part[Q][4][HN];                   // LoRA partial sums [quarter][path][channel]
    __shared__ float lora[4][HN];                      // wl, al, vl, g
    __shared__ __align__(16) float decay[HN];
    __shared__ float vps[HN], ys[HN];
    __shared__ __align__(16) floatX kps[HN];            // state.cuh's vector loads: 16-byte aligned
    __shared__ __align__(16) floatX was[HN];
    __shared__ __align__(16) floatX wbs[HN];
    const int h = blockIdx.x, bb = blockIdx.y, t = threadIdx.x, C = H * HN;
    const long long off = ((long long)bb * H + h) * HN;        // this (row, head)'s channels in [B, C]

    // the thread's state row first: its loads overlap the LoRA products
    const int row = t / Q, rq = t % Q, j0 = rq * M;
    float* Sg = state + off * HN + (long long)row * HN + j0;
    float S[M];
#pragma unroll
    for (int m = 0; m < M; m += VW) ldv(Sg + m, S + m);

    // 1. LoRA second layers: thread (quarter s, channel c) adds its quarter of each path's rank
    {
        const floatX* hs[4] = {hw, ha, hv, hg};
        const floatX* ws[4] = {w2, a2, v2, g2};
        const int ds[4] = {dw, da, dv, dg};
        const int c = t % HN, s = t / HN;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            float acc = 0.f;
            if (hs[p]) {
                const int d = ds[p], i1 = (s + 1) * d / Q;
                const floatX* hp = hs[p] + (long long)bb * d;
                const floatX* wp = ws[p] + h * HN + c;
#pragma unroll 8
                for (int i = s * d / Q; i < i1; ++i) acc = fmaf(to_f32(hp[i]), to_f32(wp[(long long)i * C]), acc);
            }
            part[s][p][c] = acc;
        }
    }
    __syncthreads();
    {
        const int p = t / HN, c = t % HN;
        float acc = 0.f;
#pragma unroll
        for (int q = 0; q < Q; ++q) acc += part[q][p][c];
        lora[p][c] = tmx::round_x(acc);
    }
    __syncthreads();

    // 2. prep (tm_prep_fwd): lane t < G owns channels 4t .. 4t+3
    if (t < G) {
        const int c0 = 4 * t, pc = h * HN + c0;
        const long long o = off + c0;
        const f4 K = load4(k + o), V = load4(v + o);
        const f4 pw0 = load4_scalar(w0 + pc), pa0 = load4_scalar(a0 + pc), pkk = load4_scalar(k_k + pc),
                 pka = load4_scalar(k_a + pc);
        float kr[4], ss = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) { kr[e] = K.v[e] * pkk.v[e]; ss += kr[e] * kr[e]; }
        ss = tmx::head_sum(ss);
        const float inv = 1.0f / fmaxf(sqrtf(ss), (float)TM_L2_EPS);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float sw = tmx::sigmoid(pw0.v[e] + lora[0][c0 + e]);
            decay[c0 + e] = expf(-(float)TM_DECAY_SCALE * sw);
            const float a = tmx::sigmoid(pa0.v[e] + lora[1][c0 + e]);
            const float kk = kr[e] * inv;
            was[c0 + e] = from_f32(-kk);
            wbs[c0 + e] = from_f32(kk * a);
            kps[c0 + e] = from_f32(K.v[e] * (1.f + (a - 1.f) * pka.v[e]));
        }
        if (hv) {
            const f4 VF = load4(vf + o), pv0 = load4_scalar(v0 + pc);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sv = tmx::sigmoid(pv0.v[e] + lora[2][c0 + e]);
                vps[c0 + e] = tmx::round_x(V.v[e] + (VF.v[e] - V.v[e]) * sv);
            }
        } else {
            store4(vf + o, V);
#pragma unroll
            for (int e = 0; e < 4; ++e) vps[c0 + e] = V.v[e];
        }
    }
    __syncthreads();

    // 3. the WKV token (dec_wkv7)
    const float sa = token_sa(S, was + j0);
    const float yy = token_update(S, r + off + j0, decay + j0, kps + j0, vps[row], wbs + j0, sa);
#pragma unroll
    for (int m = 0; m < M; m += VW) stv(Sg + m, S + m);
    if (rq == 0) ys[row] = tmx::round_x(yy);
    __syncthreads();

    // 4. GroupNorm + bonus + gate (tm_gn_fwd)
    if (t < G) {
        const int c0 = 4 * t, pc = h * HN + c0;
        const long long o = off + c0;
        const f4 Rr = load4(r + o);
        const f4 W = load4_scalar(lnw + pc), Bb = load4_scalar(lnb + pc), RK = load4_scalar(rk + pc);
        const float invN = 1.0f / (float)HN;
        float s1 = 0.f, sb = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) { s1 += ys[c0 + e]; sb += Rr.v[e] * to_f32(kps[c0 + e]) * RK.v[e]; }
        const float mean = tmx::head_sum(s1) * invN;
        const float bonus = tmx::head_sum(sb);
        float d[4], s2 = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) { d[e] = ys[c0 + e] - mean; s2 += d[e] * d[e]; }
        const float rstd = 1.0f / sqrtf(tmx::head_sum(s2) * invN + (float)TM_GN_EPS);
        f4 Z;
#pragma unroll
        for (int e = 0; e < 4; ++e)
            Z.v[e] = (d[e] * rstd * W.v[e] + Bb.v[e] + bonus * vps[c0 + e]) * lora[3][c0 + e];
        store4(z + o, Z);
    }
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
