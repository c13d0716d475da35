// rwkvx/cu/timemix/timemix.cu -- element-wise parts of the RWKV-7 (x070) TimeMix block, forward and backward.
//
// docs/SPEC.md §2.3. The GEMMs (receptance/key/value/output and the LoRA products) run in cuBLAS, the WKV
// recurrence in wkv7/; this file holds everything in between:
//
//   tm_shift_fwd / tm_shift_bwd        token shift + 6-way mix (x_r, x_w, x_k, x_v, x_a, x_g)
//   tm_tanh_fwd / tm_tanh_bwd          LoRA activation of the decay branch   (on [R, Dw])
//   tm_sigmoid_fwd / tm_sigmoid_bwd    LoRA activation of the gate branch    (on [R, Dg])
//   tm_prep_fwd / tm_prep_bwd          decay, in-context rate, value residual, kk normalisation, k'
//   tm_gn_fwd / tm_gn_bwd              GroupNorm(ln_x) + bonus + gate
// (the per-tile partials of the parameter gradients are reduced by reduce.cu's reduce_partials)
//
// Conventions (docs/DESIGN.md): activations floatX, row-major [R, C] with R = B*T rows (row = b*T + t)
// and channel c = h*N + n, every [R, C] pointer aligned to 4 elements (C % 4 == 0 always holds since
// N >= 4); parameter vectors [C] and partials are float32, the vectors read with scalar loads (4-byte
// alignment). All math in fp32.
// No floating-point atomics; every reduction runs in a fixed order, so results are bit-identical
// from run to run.
//
// Thread layout of the row kernels (shift, prep, gn): each thread owns 4 consecutive channels (one
// float4 "quad") of a row. A block is (QX, RY) threads: QX quads of one row range (QX divides C/4 and
// is a multiple of N/4, so a head's N/4 lanes are consecutive lanes of one warp and never straddle a
// row), RY row streams. grid = (C/4/QX, P). Block y-index p owns rows [p*rpt, min((p+1)*rpt, R)),
// split into RY contiguous sub-ranges of ceil(rpt/RY) rows, one per threadIdx.y. Per-head sums use
// xor-butterfly shuffles over N/4 lanes (bitwise identical in every lane). The backward kernels write
// per-thread-row-stream partial sums for parameter gradients to partials[(p*RY + ty), j, c]
// (Pp = P*RY partial rows), reduced afterwards by tm_reduce_partials.
//
// HEAD_SIZE (N, one of 4..128) and the model constants TM_DECAY_SCALE (exp(-0.5)), TM_GN_EPS, TM_L2_EPS
// come from the declaration in rwkvx/cu/timemix/ops.py.

#include "common.cuh"
#include "ptx.cuh"
#if !defined(HEAD_SIZE) || !defined(TM_DECAY_SCALE) || !defined(TM_GN_EPS) || !defined(TM_L2_EPS)
#error "timemix/timemix.cu: HEAD_SIZE and the TM_* constants come from rwkvx/cu/timemix/ops.py"
#endif

#define TM_N HEAD_SIZE
#define TM_G (HEAD_SIZE / 4)           // lanes per head (4 channels per lane)
// the defines are double literals: every use is in fp32, so round them to float once here
#define TM_EXP_M05 ((float)TM_DECAY_SCALE)
#define TM_GN_EPS_F ((float)TM_GN_EPS)
#define TM_L2_EPS_F ((float)TM_L2_EPS)

static_assert(TM_N == 4 || TM_N == 8 || TM_N == 16 || TM_N == 32 || TM_N == 64 || TM_N == 128,
              "HEAD_SIZE must be one of 4, 8, 16, 32, 64, 128");

typedef unsigned long long tm_size;

// ---------------------------------------------------------------------------------------------
// small helpers
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float tm_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Lanes of this thread's head group: N/4 consecutive lanes, aligned (the block's linear thread
// index is ty*QX + tx with QX a multiple of N/4, so a group never straddles a row or a warp).
// Only the group is named in the mask, so a partial last warp of a block is fine.
__device__ __forceinline__ unsigned tm_group_mask() {
    const unsigned lane = (threadIdx.y * blockDim.x + threadIdx.x) & 31u;
    return TM_G >= 32 ? 0xffffffffu : (((1u << TM_G) - 1u) << (lane & ~(unsigned)(TM_G - 1)));
}

// Sum over the N/4 lanes of one head (every lane of the group must call; the xor butterfly gives a
// bitwise identical result in each lane).
__device__ __forceinline__ float tm_head_sum(float x, unsigned mask) {
#pragma unroll
    for (int o = TM_G / 2; o > 0; o >>= 1) x += __shfl_xor_sync(mask, x, o);
    return x;
}

// Row range of this thread's stream (see layout above).
struct tm_rows { int beg, end, sub; };
__device__ __forceinline__ tm_rows tm_my_rows(int R, int rpt) {
    tm_rows r;
    const int tile0 = blockIdx.y * rpt;
    const int tile_end = min(tile0 + rpt, R);
    r.sub = (rpt + (int)blockDim.y - 1) / (int)blockDim.y;
    r.beg = tile0 + (int)threadIdx.y * r.sub;
    r.end = min(r.beg + r.sub, tile_end);
    return r;
}

// ---------------------------------------------------------------------------------------------
// 1. token shift + 6-way mix
// ---------------------------------------------------------------------------------------------
// Forward: xx = shift(x) - x (shift zero at t = r % T == 0); o_j = x + xx * m_j, j = r,w,k,v,a,g.
// x [R,C] fp32 (the LayerNorm's output, fp32 in every precision: docs/SPEC.md §4); m0..m5 [C];
// o0..o5 [R,C] floatX (GEMM operands).
extern "C" __global__ void tm_shift_fwd(const float* x,
                                        const float* m0, const float* m1, const float* m2,
                                        const float* m3, const float* m4, const float* m5,
                                        floatX* o0, floatX* o1, floatX* o2, floatX* o3, floatX* o4, floatX* o5,
                                        int R, int C, int T, int rpt)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    if (rr.beg >= rr.end) return;
    const float* mp[6] = {m0, m1, m2, m3, m4, m5};
    floatX* op[6] = {o0, o1, o2, o3, o4, o5};
    f4 m[6];
#pragma unroll
    for (int j = 0; j < 6; ++j) m[j] = load4_scalar(mp[j] + c0);

    f4 prev = (rr.beg > 0) ? load4(x + (tm_size)(rr.beg - 1) * C + c0) : f4_zero();
    for (int row = rr.beg; row < rr.end; ++row) {
        const tm_size off = (tm_size)row * C + c0;
        const f4 cur = load4(x + off);
        const bool first = (row % T) == 0;
        f4 xx;
#pragma unroll
        for (int e = 0; e < 4; ++e) xx.v[e] = (first ? 0.f : prev.v[e]) - cur.v[e];
#pragma unroll
        for (int j = 0; j < 6; ++j) {
            f4 o;
#pragma unroll
            for (int e = 0; e < 4; ++e) o.v[e] = cur.v[e] + xx.v[e] * m[j].v[e];
            store4(op[j] + off, o);
        }
        prev = cur;
    }
}

// Backward: given d0..d5 = dL/do_j [R,C] (floatX; x and dx fp32):
//   dx[t]  = sum_j d_j[t] * (1 - m_j) + sum_j d_j[t+1] * m_j      (second sum only if t+1 is in the
//            same sequence);  dx = or += (acc != 0)
//   dm_j  += d_j[t] * (shift(x)[t] - x[t])   -> partials[Pp, 6, C]
// dx must not alias x or any d_j (neighbouring rows are read across thread boundaries).
//
// Each thread walks its rows backwards in steps of SR rows and issues every load of a step
// before using any: 16 bytes of each array per thread in flight (bf16: 2 rows of 8 bytes; f32: 1 row).
// Loads stay as loaded (quadX) until used; x[row] and d_j[row + 1] are carried, as loaded, from the step
// before, so each element is loaded once. The sums run in the order of a row-at-a-time walk.
// (Before, bf16 went one row per step re-reading d_j[row + 1] from L1, and ptxas, at 128 registers,
// issued a row's loads in three rounds: 0.236 ms at B8 T4096 C768 on the H200, 40% of copy.)
// <= 128 registers in both element types; shift_backward_layout (ops/timemix.py) launches 64-thread
// blocks where C allows, so 8 blocks (16 warps) fit an SM.

extern "C" __global__ void tm_shift_bwd(const float* x,
                                        const float* m0, const float* m1, const float* m2,
                                        const float* m3, const float* m4, const float* m5,
                                        const floatX* d0, const floatX* d1, const floatX* d2,
                                        const floatX* d3, const floatX* d4, const floatX* d5,
                                        float* dx, float* partials,
                                        int R, int C, int T, int rpt, int acc)
{
    constexpr int SR = 16 / (4 * (int)sizeof(floatX));            // rows per step
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const float* mp[6] = {m0, m1, m2, m3, m4, m5};
    const floatX* dp[6] = {d0, d1, d2, d3, d4, d5};
    f4 m[6], part[6];
#pragma unroll
    for (int j = 0; j < 6; ++j) { m[j] = load4_scalar(mp[j] + c0); part[j] = f4_zero(); }

    if (rr.beg < rr.end) {
        int row = rr.end - 1;                                      // the step's first (highest) row
        float4 xtop = load_quad(x + (tm_size)row * C + c0);        // x[row]
        quadX dnext[6];                                            // d_j[row + 1]
        const bool end_has_next = row % T != T - 1;                // then row + 1 < R
#pragma unroll
        for (int j = 0; j < 6; ++j)
            dnext[j] = end_has_next ? load_quad(dp[j] + (tm_size)(row + 1) * C + c0) : quadX{};
        for (; row >= rr.beg; row -= SR) {
            float4 xm1[SR], gin[SR];                               // x[r - 1], dx[r] of r = row - k
            quadX dc[SR][6];                                       // d_j[r]
#pragma unroll
            for (int k = 0; k < SR; ++k) {
                const int r = row - k;
                const bool ok = k == 0 || r >= rr.beg;
                const tm_size off = (tm_size)r * C + c0;
                xm1[k] = (ok && r > 0) ? load_quad(x + off - C) : float4{};
#pragma unroll
                for (int j = 0; j < 6; ++j) dc[k][j] = ok ? load_quad(dp[j] + off) : quadX{};
                gin[k] = (ok && acc) ? load_quad(dx + off) : float4{};
            }
            // m opaque to the compiler once per step: else it keeps 1 - m in 24 more registers (159 in all)
#pragma unroll
            for (int j = 0; j < 6; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) opaque(m[j].v[e]);
            const int t0 = row % T;
#pragma unroll
            for (int k = 0; k < SR; ++k) {
                const int r = row - k;
                if (k > 0 && r < rr.beg) break;
                const int t = t0 - k < 0 ? t0 - k + T : t0 - k;
                const bool has_next = t != T - 1;                  // then row + 1 < R
                const f4 xc = widen(k == 0 ? xtop : xm1[k - 1]);
                const f4 xp = widen(xm1[k]);
                f4 g = widen(gin[k]);
                float xx[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) xx[e] = (t == 0 ? 0.f : xp.v[e]) - xc.v[e];
#pragma unroll
                for (int j = 0; j < 6; ++j) {
                    const f4 dcur = widen(dc[k][j]);
                    const f4 dn = widen(has_next ? (k == 0 ? dnext[j] : dc[k - 1][j]) : quadX{});
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        g.v[e] += dcur.v[e] * (1.f - m[j].v[e]) + dn.v[e] * m[j].v[e];
                        part[j].v[e] += dcur.v[e] * xx[e];
                    }
                }
                store4(dx + (tm_size)r * C + c0, g);
            }
            xtop = xm1[SR - 1];
#pragma unroll
            for (int j = 0; j < 6; ++j) dnext[j] = dc[SR - 1][j];
        }
    }
    const tm_size pr = (tm_size)blockIdx.y * blockDim.y + threadIdx.y;
#pragma unroll
    for (int j = 0; j < 6; ++j) store4(partials + (pr * 6 + j) * C + c0, part[j]);
}

// ---------------------------------------------------------------------------------------------
// 2. LoRA activations (element-wise over n floats; in place allowed). The backward takes the
//    ACTIVATION (the forward output), which the integrator keeps anyway for the second LoRA GEMM.
// ---------------------------------------------------------------------------------------------
template <class F>
__device__ __forceinline__ void tm_map(const floatX* a, const floatX* b, floatX* out, long long n, F f)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long n4 = n / 4;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const f4 A = load4(a + 4 * i);
        const f4 B = b ? load4(b + 4 * i) : f4_zero();
        f4 O;
#pragma unroll
        for (int e = 0; e < 4; ++e) O.v[e] = f(A.v[e], B.v[e]);
        store4(out + 4 * i, O);
    }
    for (long long i = 4 * n4 + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = from_f32(f(to_f32(a[i]), b ? to_f32(b[i]) : 0.f));
}

// (x = a, y = b) -> out, each the same expression in the vector body and the tail
struct tm_tanh_f { __device__ float operator()(float x, float) const { return tanhf(x); } };
struct tm_tanh_b { __device__ float operator()(float x, float y) const { return y * (1.f - x * x); } };
struct tm_sigmoid_f { __device__ float operator()(float x, float) const { return tm_sigmoid(x); } };
struct tm_sigmoid_b { __device__ float operator()(float x, float y) const { return y * x * (1.f - x); } };

// y = tanh(x)                        (a = x, b unused)
extern "C" __global__ void tm_tanh_fwd(const floatX* a, const floatX* b, floatX* out, long long n)
{ tm_map(a, b, out, n, tm_tanh_f()); }
// dx = dy * (1 - y^2), y = tanh(x)   (a = y, b = dy)
extern "C" __global__ void tm_tanh_bwd(const floatX* a, const floatX* b, floatX* out, long long n)
{ tm_map(a, b, out, n, tm_tanh_b()); }
// y = sigmoid(x)                     (a = x, b unused)
extern "C" __global__ void tm_sigmoid_fwd(const floatX* a, const floatX* b, floatX* out, long long n)
{ tm_map(a, b, out, n, tm_sigmoid_f()); }
// dx = dy * y * (1 - y), y = sigmoid (a = y, b = dy)
extern "C" __global__ void tm_sigmoid_bwd(const floatX* a, const floatX* b, floatX* out, long long n)
{ tm_map(a, b, out, n, tm_sigmoid_b()); }

// ---------------------------------------------------------------------------------------------
// 3. prep: decay, in-context rate, value residual, kk, k'
// ---------------------------------------------------------------------------------------------
// Forward, per row, per head:
//   decay = exp(-exp(-0.5) * sigmoid(w0 + wl));  a = sigmoid(a0 + al)
//   layer > 0: v' = v + (vf - v) * sigmoid(v0 + vl)     -> vp           (vf read)
//   layer = 0: v' = v (vp untouched; use v);  vf := v                    (vf written)
//   kk = (k*k_k) / max(||k*k_k||_head, 1e-12);  k' = k * (1 + (a - 1) * k_a)
//   wa = -kk;  wb = kk * a
// Inputs k, v, wl, al, vl, vf [R,C]; params w0, a0, v0, k_k, k_a [C]; outputs decay (fp32 in every
// precision: near 1, a bf16 decay would move 1 - decay, the state's per-token forgetting, by up to half its
// size), kp, vp, wa, wb.
// Outputs may alias inputs element-wise, but the backward needs k, v, wl, al, vl, vf unchanged.
extern "C" __global__ void tm_prep_fwd(const floatX* k, const floatX* v, const floatX* wl, const floatX* al,
                                       const floatX* vl, floatX* vf,
                                       const float* w0, const float* a0, const float* v0,
                                       const float* k_k, const float* k_a,
                                       float* decay, floatX* kp, floatX* vp, floatX* wa, floatX* wb,
                                       int R, int C, int rpt, int layer)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const unsigned gm = tm_group_mask();
    const f4 pw0 = load4_scalar(w0 + c0), pa0 = load4_scalar(a0 + c0), pkk = load4_scalar(k_k + c0), pka = load4_scalar(k_a + c0);
    const f4 pv0 = layer > 0 ? load4_scalar(v0 + c0) : f4_zero();

    for (int i = 0; i < rr.sub; ++i) {              // uniform trip count: shuffles below
        const int row = rr.beg + i;
        const bool ok = row < rr.end;
        const tm_size off = (tm_size)row * C + c0;
        // every input of the row is loaded before the head sum: one memory round trip per row
        f4 K = f4_zero(), WL = f4_zero(), AL = f4_zero(), V = f4_zero(), VL = f4_zero(), VF = f4_zero();
        if (ok) {
            K = load4(k + off); WL = load4(wl + off); AL = load4(al + off); V = load4(v + off);
            if (layer > 0) { VL = load4(vl + off); VF = load4(vf + off); }
        }
        float kr[4], ss = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) { kr[e] = K.v[e] * pkk.v[e]; ss += kr[e] * kr[e]; }
        ss = tm_head_sum(ss, gm);
        if (!ok) continue;
        const float inv = 1.0f / fmaxf(sqrtf(ss), TM_L2_EPS_F);
        f4 D, KP, A_, B_, VP;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float sw = tm_sigmoid(pw0.v[e] + WL.v[e]);
            D.v[e] = expf(-TM_EXP_M05 * sw);
            const float a = tm_sigmoid(pa0.v[e] + AL.v[e]);
            const float kk = kr[e] * inv;
            A_.v[e] = -kk;
            B_.v[e] = kk * a;
            KP.v[e] = K.v[e] * (1.f + (a - 1.f) * pka.v[e]);
        }
        if (layer > 0) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sv = tm_sigmoid(pv0.v[e] + VL.v[e]);
                VP.v[e] = V.v[e] + (VF.v[e] - V.v[e]) * sv;
            }
            store4(vp + off, VP);
        } else {
            store4(vf + off, V);
        }
        store4(decay + off, D);
        store4(kp + off, KP);
        store4(wa + off, A_);
        store4(wb + off, B_);
    }
}

// Backward. Gradient inputs (all [R,C]):
//   dd (d decay), dkp (d k'), dvp (d v'), dwa (d wa), dwb (d wb)      -- from the WKV backward
//   dkp2, dvp2 (extra d k', d v' from tm_gn_bwd's bonus term; 0 = none)
//   dr, dr2: if dr2 != 0, dr_out = dr + dr2 (total d r for the receptance GEMM; dr_out may alias dr)
// Outputs: dk (d of the key GEMM output), dv (d of the value GEMM output), dwl, dal, dvl (layer>0),
//   dvf (fp32: the gradient of v_first, summed over the layers): layer > 0: dvf = (vf_acc ? dvf : 0) + dv' * sigmoid(v0+vl)
//        layer = 0: v_first IS this layer's v, so dv += dvf (the gradient accumulated by the later
//                   layers) when dvf != 0; dvf is only read.
//   partials [Pp, NP, C] with NP = 5 (layer > 0) or 4 (layer 0): slots w0, a0, k_k, k_a, (v0).
// Outputs may alias gradient inputs element-wise (each thread reads all its elements before writing).
extern "C" __global__ void tm_prep_bwd(const floatX* k, const floatX* v, const floatX* wl, const floatX* al,
                                       const floatX* vl, const floatX* vf,
                                       const float* w0, const float* a0, const float* v0,
                                       const float* k_k, const float* k_a,
                                       const float* dd, const float* dkp, const float* dvp,
                                       const float* dwa, const float* dwb,
                                       const floatX* dkp2, const floatX* dvp2,
                                       const floatX* dr, const floatX* dr2, floatX* dr_out,
                                       floatX* dk, floatX* dv, floatX* dwl, floatX* dal, floatX* dvl,
                                       float* dvf, float* partials,
                                       int R, int C, int rpt, int layer, int vf_acc)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const unsigned gm = tm_group_mask();
    const f4 pw0 = load4_scalar(w0 + c0), pa0 = load4_scalar(a0 + c0), pkk = load4_scalar(k_k + c0), pka = load4_scalar(k_a + c0);
    const f4 pv0 = layer > 0 ? load4_scalar(v0 + c0) : f4_zero();
    f4 gw0 = f4_zero(), ga0 = f4_zero(), gkk = f4_zero(), gka = f4_zero(), gv0 = f4_zero();

    for (int i = 0; i < rr.sub; ++i) {              // uniform trip count: shuffles below
        const int row = rr.beg + i;
        const bool ok = row < rr.end;
        const tm_size off = (tm_size)row * C + c0;
        float kr[4], a[4], dkk[4], ss = 0.f, sdot = 0.f;
        // every input of the row is loaded before the two head sums: one memory round trip per row
        f4 K = f4_zero(), DKP = f4_zero(), DWB = f4_zero(), WL = f4_zero(), DD = f4_zero(), DVP = f4_zero();
        f4 V = f4_zero(), VL = f4_zero(), VF = f4_zero(), G = f4_zero(), DR = f4_zero();
        if (ok) {
            K = load4(k + off);
            const f4 AL = load4(al + off), DWA = load4(dwa + off);
            DWB = load4(dwb + off); WL = load4(wl + off); DD = load4(dd + off);
            DKP = load4(dkp + off);
            DVP = load4(dvp + off);
            if (dkp2) { const f4 X = load4(dkp2 + off);
#pragma unroll
                for (int e = 0; e < 4; ++e) DKP.v[e] += X.v[e]; }
            if (dvp2) { const f4 X = load4(dvp2 + off);
#pragma unroll
                for (int e = 0; e < 4; ++e) DVP.v[e] += X.v[e]; }
            if (layer > 0) { V = load4(v + off); VL = load4(vl + off); VF = load4(vf + off); }
            if ((layer > 0 && vf_acc) || (layer == 0 && dvf)) G = load4(dvf + off);
            if (dr2) { const f4 X = load4(dr2 + off); DR = load4(dr + off);
#pragma unroll
                for (int e = 0; e < 4; ++e) DR.v[e] += X.v[e]; }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                kr[e] = K.v[e] * pkk.v[e];
                a[e] = tm_sigmoid(pa0.v[e] + AL.v[e]);
                dkk[e] = DWB.v[e] * a[e] - DWA.v[e];
                ss += kr[e] * kr[e];
            }
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) { kr[e] = 0.f; a[e] = 0.f; dkk[e] = 0.f; }
        }
        ss = tm_head_sum(ss, gm);
        const float nrm = sqrtf(ss);
        const bool big = nrm > TM_L2_EPS_F;
        const float inv = 1.0f / fmaxf(nrm, TM_L2_EPS_F);
        float kk[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) { kk[e] = kr[e] * inv; sdot += dkk[e] * kk[e]; }
        sdot = tm_head_sum(sdot, gm);
        if (!ok) continue;

        f4 DK, DWL, DAL;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            // kk = kr / max(||kr||, eps)
            const float dkr = big ? (dkk[e] - kk[e] * sdot) * inv : dkk[e] * inv;
            gkk.v[e] += dkr * K.v[e];
            // k' = k * (1 + (a - 1) * k_a)
            const float dka_term = DKP.v[e] * K.v[e];
            gka.v[e] += dka_term * (a[e] - 1.f);
            DK.v[e] = DKP.v[e] * (1.f + (a[e] - 1.f) * pka.v[e]) + dkr * pkk.v[e];
            // a = sigmoid(a0 + al); a enters wb = kk*a and k'
            const float da = DWB.v[e] * kk[e] + dka_term * pka.v[e];
            DAL.v[e] = da * a[e] * (1.f - a[e]);
            ga0.v[e] += DAL.v[e];
            // decay = exp(-e^-0.5 * sigmoid(w0 + wl))
            const float sw = tm_sigmoid(pw0.v[e] + WL.v[e]);
            const float dec = expf(-TM_EXP_M05 * sw);
            DWL.v[e] = DD.v[e] * dec * (-TM_EXP_M05) * sw * (1.f - sw);
            gw0.v[e] += DWL.v[e];
        }
        f4 DV;
        if (layer > 0) {
            f4 DVL;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sv = tm_sigmoid(pv0.v[e] + VL.v[e]);
                DV.v[e] = DVP.v[e] * (1.f - sv);
                G.v[e] += DVP.v[e] * sv;
                DVL.v[e] = DVP.v[e] * (VF.v[e] - V.v[e]) * sv * (1.f - sv);
                gv0.v[e] += DVL.v[e];
            }
            store4(dvl + off, DVL);
            store4(dvf + off, G);
        } else {
            DV = DVP;
            if (dvf) {
#pragma unroll
                for (int e = 0; e < 4; ++e) DV.v[e] += G.v[e];
            }
        }
        if (dr2) store4(dr_out + off, DR);
        store4(dk + off, DK);
        store4(dv + off, DV);
        store4(dwl + off, DWL);
        store4(dal + off, DAL);
    }
    const int NP = layer > 0 ? 5 : 4;
    const tm_size pr = (tm_size)blockIdx.y * blockDim.y + threadIdx.y;
    float* P = partials + pr * NP * C + c0;
    store4(P + 0 * C, gw0);
    store4(P + 1 * C, ga0);
    store4(P + 2 * C, gkk);
    store4(P + 3 * C, gka);
    if (layer > 0) store4(P + 4 * C, gv0);
}

// ---------------------------------------------------------------------------------------------
// 4. GroupNorm (ln_x) + bonus + gate
// ---------------------------------------------------------------------------------------------
// The per-head statistics of one row both kernels need: the centred values d = y - mean, the biased
// variance (two passes) and the bonus sum s = sum_head(r * kp * rk). Every lane of the group calls it.
struct tm_gn_row { float d[4]; float var; float bonus; };
__device__ __forceinline__ tm_gn_row tm_gn_stats(const f4& Y, const f4& Rr, const f4& KP, const f4& RK, unsigned gm)
{
    const float invN = 1.0f / (float)TM_N;
    tm_gn_row st;
    float s1 = 0.f, sb = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) { s1 += Y.v[e]; sb += Rr.v[e] * KP.v[e] * RK.v[e]; }
    const float mean = tm_head_sum(s1, gm) * invN;
    st.bonus = tm_head_sum(sb, gm);
    float s2 = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) { st.d[e] = Y.v[e] - mean; s2 += st.d[e] * st.d[e]; }
    st.var = tm_head_sum(s2, gm) * invN;
    return st;
}

// Forward, per row, per head (N channels):
//   yn = (y - mean) / sqrt(var + 64e-5) * lnw + lnb     (biased variance, two-pass)
//   s  = sum_head(r * kp * rk);  z = (yn + s * vp) * g
// y, r, kp, vp, g [R,C]; lnw, lnb, rk [C]; z [R,C] (may alias any input element-wise).
extern "C" __global__ void tm_gn_fwd(const floatX* y, const floatX* r, const floatX* kp, const floatX* vp,
                                     const floatX* g, const float* lnw, const float* lnb, const float* rk,
                                     floatX* z, int R, int C, int rpt)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const unsigned gm = tm_group_mask();
    const f4 W = load4_scalar(lnw + c0), Bb = load4_scalar(lnb + c0), RK = load4_scalar(rk + c0);
    for (int i = 0; i < rr.sub; ++i) {
        const int row = rr.beg + i;
        const bool ok = row < rr.end;
        const tm_size off = (tm_size)row * C + c0;
        f4 Y = f4_zero(), Rr = f4_zero(), KP = f4_zero();
        if (ok) { Y = load4(y + off); Rr = load4(r + off); KP = load4(kp + off); }
        const tm_gn_row st = tm_gn_stats(Y, Rr, KP, RK, gm);
        if (!ok) continue;
        const float rstd = 1.0f / sqrtf(st.var + TM_GN_EPS_F);
        const f4 VP = load4(vp + off), G = load4(g + off);
        f4 Z;
#pragma unroll
        for (int e = 0; e < 4; ++e) Z.v[e] = (st.d[e] * rstd * W.v[e] + Bb.v[e] + st.bonus * VP.v[e]) * G.v[e];
        store4(z + off, Z);
    }
}

// Backward: from dz produce
//   dy  (to the WKV backward), dg (to the gate GEMMs),
//   dr2 = ds * kp * rk, dkp2 = ds * r * rk, dvp2 = du * s   (bonus-term gradients of r, k', v';
//         with du = dz * g, ds = sum_head(du * vp)) -- passed on to tm_prep_bwd,
//   partials [Pp, 3, C]: slots ln_x.weight, ln_x.bias, r_k.
// Outputs may alias inputs element-wise.
extern "C" __global__ void tm_gn_bwd(const floatX* y, const floatX* r, const floatX* kp, const floatX* vp,
                                     const floatX* g, const floatX* dz,
                                     const float* lnw, const float* lnb, const float* rk,
                                     floatX* dy, floatX* dg, floatX* dr2, floatX* dkp2, floatX* dvp2,
                                     float* partials, int R, int C, int rpt)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const unsigned gm = tm_group_mask();
    const f4 W = load4_scalar(lnw + c0), Bb = load4_scalar(lnb + c0), RK = load4_scalar(rk + c0);
    const float invN = 1.0f / (float)TM_N;
    f4 gW = f4_zero(), gB = f4_zero(), gRK = f4_zero();
    for (int i = 0; i < rr.sub; ++i) {
        const int row = rr.beg + i;
        const bool ok = row < rr.end;
        const tm_size off = (tm_size)row * C + c0;
        f4 Y = f4_zero(), Rr = f4_zero(), KP = f4_zero(), VP = f4_zero(), G = f4_zero(), DZ = f4_zero();
        if (ok) {
            Y = load4(y + off); Rr = load4(r + off); KP = load4(kp + off);
            VP = load4(vp + off); G = load4(g + off); DZ = load4(dz + off);
        }
        const tm_gn_row st = tm_gn_stats(Y, Rr, KP, RK, gm);
        const float sb = st.bonus;
        const float rstd = 1.0f / sqrtf(st.var + TM_GN_EPS_F);
        float xh[4], du[4], dxh[4], m1 = 0.f, m2 = 0.f, sds = 0.f;
        f4 DG;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            xh[e] = st.d[e] * rstd;
            const float u = xh[e] * W.v[e] + Bb.v[e] + sb * VP.v[e];
            DG.v[e] = DZ.v[e] * u;
            du[e] = DZ.v[e] * G.v[e];
            dxh[e] = du[e] * W.v[e];
            m1 += dxh[e];
            m2 += dxh[e] * xh[e];
            sds += du[e] * VP.v[e];
        }
        m1 = tm_head_sum(m1, gm) * invN;
        m2 = tm_head_sum(m2, gm) * invN;
        sds = tm_head_sum(sds, gm);
        if (!ok) continue;
        f4 DY, DR, DK, DV;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            gW.v[e] += du[e] * xh[e];
            gB.v[e] += du[e];
            gRK.v[e] += sds * Rr.v[e] * KP.v[e];
            DY.v[e] = rstd * (dxh[e] - m1 - xh[e] * m2);
            DR.v[e] = sds * KP.v[e] * RK.v[e];
            DK.v[e] = sds * Rr.v[e] * RK.v[e];
            DV.v[e] = du[e] * sb;
        }
        store4(dy + off, DY);
        store4(dg + off, DG);
        store4(dr2 + off, DR);
        store4(dkp2 + off, DK);
        store4(dvp2 + off, DV);
    }
    const tm_size pr = (tm_size)blockIdx.y * blockDim.y + threadIdx.y;
    float* P = partials + pr * 3 * C + c0;
    store4(P + 0 * C, gW);
    store4(P + 1 * C, gB);
    store4(P + 2 * C, gRK);
}
