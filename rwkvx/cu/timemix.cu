// rwkvx/cu/timemix.cu -- element-wise parts of the RWKV-7 (x070) TimeMix block, forward and backward.
//
// SPEC §2.3. The GEMMs (receptance/key/value/output and the LoRA products) run in cuBLAS, the WKV
// recurrence in wkv7.cu; this file holds everything in between:
//
//   tm_shift_fwd / tm_shift_bwd        token shift + 6-way mix (x_r, x_w, x_k, x_v, x_a, x_g)
//   tm_tanh_fwd / tm_tanh_bwd          LoRA activation of the decay branch   (on [R, Dw])
//   tm_sigmoid_fwd / tm_sigmoid_bwd    LoRA activation of the gate branch    (on [R, Dg])
//   tm_prep_fwd / tm_prep_bwd          decay, in-context rate, value residual, kk normalisation, k'
//   tm_gn_fwd / tm_gn_bwd              GroupNorm(ln_x) + bonus + gate
//   tm_reduce_partials                 fixed-order column reduction of the per-tile partials
//
// Conventions (docs/DESIGN.md): float32, row-major [R, C] with R = B*T rows (row = b*T + t) and
// channel c = h*N + n. Every [R, C] pointer must be 16-byte aligned (C % 4 == 0 always holds since
// N >= 4); parameter vectors [C] are read with scalar loads and need only 4-byte alignment.
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
// HEAD_SIZE (N) is a compile-time define, N in {4, 8, 16, 32, 64, 128}.

#ifndef HEAD_SIZE
#define HEAD_SIZE 64
#endif

#define TM_N HEAD_SIZE
#define TM_G (HEAD_SIZE / 4)           // lanes per head (4 channels per lane)

static_assert(TM_N == 4 || TM_N == 8 || TM_N == 16 || TM_N == 32 || TM_N == 64 || TM_N == 128,
              "HEAD_SIZE must be one of 4, 8, 16, 32, 64, 128");

#define TM_EXP_M05 0.60653065971263342f   // exp(-0.5)
#define TM_GN_EPS 64e-5f
#define TM_L2_EPS 1e-12f

typedef unsigned long long tm_size;

// ---------------------------------------------------------------------------------------------
// small helpers
// ---------------------------------------------------------------------------------------------
struct tm_f4 { float v[4]; };

__device__ __forceinline__ tm_f4 tm_ld(const float* p) {
    float4 a = *reinterpret_cast<const float4*>(p);
    tm_f4 r; r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w; return r;
}
__device__ __forceinline__ void tm_st(float* p, const tm_f4& r) {
    *reinterpret_cast<float4*>(p) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
}
__device__ __forceinline__ tm_f4 tm_ldp(const float* p) {     // parameter vector, scalar loads
    tm_f4 r; r.v[0] = p[0]; r.v[1] = p[1]; r.v[2] = p[2]; r.v[3] = p[3]; return r;
}
__device__ __forceinline__ tm_f4 tm_zero() {
    tm_f4 r; r.v[0] = 0.f; r.v[1] = 0.f; r.v[2] = 0.f; r.v[3] = 0.f; return r;
}
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
// x [R,C]; m0..m5 [C]; o0..o5 [R,C] (must not alias x).
extern "C" __global__ void tm_shift_fwd(const float* x,
                                        const float* m0, const float* m1, const float* m2,
                                        const float* m3, const float* m4, const float* m5,
                                        float* o0, float* o1, float* o2, float* o3, float* o4, float* o5,
                                        int R, int C, int T, int rpt)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    if (rr.beg >= rr.end) return;
    const float* mp[6] = {m0, m1, m2, m3, m4, m5};
    float* op[6] = {o0, o1, o2, o3, o4, o5};
    tm_f4 m[6];
#pragma unroll
    for (int j = 0; j < 6; ++j) m[j] = tm_ldp(mp[j] + c0);

    tm_f4 prev = (rr.beg > 0) ? tm_ld(x + (tm_size)(rr.beg - 1) * C + c0) : tm_zero();
    for (int row = rr.beg; row < rr.end; ++row) {
        const tm_size off = (tm_size)row * C + c0;
        const tm_f4 cur = tm_ld(x + off);
        const bool first = (row % T) == 0;
        tm_f4 xx;
#pragma unroll
        for (int e = 0; e < 4; ++e) xx.v[e] = (first ? 0.f : prev.v[e]) - cur.v[e];
#pragma unroll
        for (int j = 0; j < 6; ++j) {
            tm_f4 o;
#pragma unroll
            for (int e = 0; e < 4; ++e) o.v[e] = cur.v[e] + xx.v[e] * m[j].v[e];
            tm_st(op[j] + off, o);
        }
        prev = cur;
    }
}

// Backward: given d0..d5 = dL/do_j [R,C]:
//   dx[t]  = sum_j d_j[t] * (1 - m_j) + sum_j d_j[t+1] * m_j      (second sum only if t+1 is in the
//            same sequence);  dx = or += (acc != 0)
//   dm_j  += d_j[t] * (shift(x)[t] - x[t])   -> partials[Pp, 6, C]
// dx must not alias x or any d_j (neighbouring rows are read across thread boundaries).
extern "C" __global__ void tm_shift_bwd(const float* x,
                                        const float* m0, const float* m1, const float* m2,
                                        const float* m3, const float* m4, const float* m5,
                                        const float* d0, const float* d1, const float* d2,
                                        const float* d3, const float* d4, const float* d5,
                                        float* dx, float* partials,
                                        int R, int C, int T, int rpt, int acc)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const float* mp[6] = {m0, m1, m2, m3, m4, m5};
    const float* dp[6] = {d0, d1, d2, d3, d4, d5};
    tm_f4 m[6], part[6];
#pragma unroll
    for (int j = 0; j < 6; ++j) { m[j] = tm_ldp(mp[j] + c0); part[j] = tm_zero(); }

    if (rr.beg < rr.end) {
        // walk the rows backwards carrying x[row]; d_j[row+1] was read by this thread one step
        // earlier (except at the range end), so re-reading it hits L1.
        tm_f4 xcur = tm_ld(x + (tm_size)(rr.end - 1) * C + c0);
        for (int row = rr.end - 1; row >= rr.beg; --row) {
            const tm_size off = (tm_size)row * C + c0;
            const int t = row % T;
            const tm_f4 xm1 = (row > 0) ? tm_ld(x + off - C) : tm_zero();
            const bool has_next = (t != T - 1);      // then row + 1 < R
            tm_f4 g;
            if (acc) g = tm_ld(dx + off); else g = tm_zero();
            float xx[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) xx[e] = (t == 0 ? 0.f : xm1.v[e]) - xcur.v[e];
#pragma unroll
            for (int j = 0; j < 6; ++j) {
                const tm_f4 dc = tm_ld(dp[j] + off);
                const tm_f4 dn = has_next ? tm_ld(dp[j] + off + C) : tm_zero();
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    g.v[e] += dc.v[e] * (1.f - m[j].v[e]) + dn.v[e] * m[j].v[e];
                    part[j].v[e] += dc.v[e] * xx[e];
                }
            }
            tm_st(dx + off, g);
            xcur = xm1;
        }
    }
    const tm_size pr = (tm_size)blockIdx.y * blockDim.y + threadIdx.y;
#pragma unroll
    for (int j = 0; j < 6; ++j) tm_st(partials + (pr * 6 + j) * C + c0, part[j]);
}

// ---------------------------------------------------------------------------------------------
// 2. LoRA activations (element-wise over n floats; in place allowed). The backward takes the
//    ACTIVATION (the forward output), which the integrator keeps anyway for the second LoRA GEMM.
// ---------------------------------------------------------------------------------------------
#define TM_ELEMENTWISE(NAME, EXPR_IN, EXPR_OUT)                                                  \
extern "C" __global__ void NAME(const float* a, const float* b, float* out, long long n)        \
{                                                                                                \
    const long long stride = (long long)gridDim.x * blockDim.x;                                  \
    const long long n4 = n / 4;                                                                  \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {  \
        tm_f4 A = tm_ld(a + 4 * i); tm_f4 B; if (b) B = tm_ld(b + 4 * i); else B = tm_zero();    \
        tm_f4 O;                                                                                 \
        for (int e = 0; e < 4; ++e) { const float x = A.v[e];                                    \
            const float y = B.v[e]; (void)y; O.v[e] = (EXPR_IN); }                               \
        tm_st(out + 4 * i, O);                                                                   \
    }                                                                                            \
    for (long long i = 4 * n4 + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;         \
         i += stride) {                                                                          \
        const float x = a[i]; const float y = b ? b[i] : 0.f; (void)y; out[i] = (EXPR_OUT);     \
    }                                                                                            \
}

// y = tanh(x)                        (a = x, b unused)
TM_ELEMENTWISE(tm_tanh_fwd, tanhf(x), tanhf(x))
// dx = dy * (1 - y^2), y = tanh(x)   (a = y, b = dy)
TM_ELEMENTWISE(tm_tanh_bwd, y * (1.f - x * x), y * (1.f - x * x))
// y = sigmoid(x)                     (a = x, b unused)
TM_ELEMENTWISE(tm_sigmoid_fwd, tm_sigmoid(x), tm_sigmoid(x))
// dx = dy * y * (1 - y), y = sigmoid (a = y, b = dy)
TM_ELEMENTWISE(tm_sigmoid_bwd, y * x * (1.f - x), y * x * (1.f - x))

// ---------------------------------------------------------------------------------------------
// 3. prep: decay, in-context rate, value residual, kk, k'
// ---------------------------------------------------------------------------------------------
// Forward, per row, per head:
//   decay = exp(-exp(-0.5) * sigmoid(w0 + wl));  a = sigmoid(a0 + al)
//   layer > 0: v' = v + (vf - v) * sigmoid(v0 + vl)     -> vp           (vf read)
//   layer = 0: v' = v (vp untouched; use v);  vf := v                    (vf written)
//   kk = (k*k_k) / max(||k*k_k||_head, 1e-12);  k' = k * (1 + (a - 1) * k_a)
//   wa = -kk;  wb = kk * a
// Inputs k, v, wl, al, vl, vf [R,C]; params w0, a0, v0, k_k, k_a [C]; outputs decay, kp, vp, wa, wb.
// Outputs may alias inputs element-wise, but the backward needs k, v, wl, al, vl, vf unchanged.
extern "C" __global__ void tm_prep_fwd(const float* k, const float* v, const float* wl, const float* al,
                                       const float* vl, float* vf,
                                       const float* w0, const float* a0, const float* v0,
                                       const float* k_k, const float* k_a,
                                       float* decay, float* kp, float* vp, float* wa, float* wb,
                                       int R, int C, int rpt, int layer)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const unsigned gm = tm_group_mask();
    const tm_f4 pw0 = tm_ldp(w0 + c0), pa0 = tm_ldp(a0 + c0), pkk = tm_ldp(k_k + c0), pka = tm_ldp(k_a + c0);
    const tm_f4 pv0 = layer > 0 ? tm_ldp(v0 + c0) : tm_zero();

    for (int i = 0; i < rr.sub; ++i) {              // uniform trip count: shuffles below
        const int row = rr.beg + i;
        const bool ok = row < rr.end;
        const tm_size off = (tm_size)row * C + c0;
        tm_f4 K = ok ? tm_ld(k + off) : tm_zero();
        float kr[4], ss = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) { kr[e] = K.v[e] * pkk.v[e]; ss += kr[e] * kr[e]; }
        ss = tm_head_sum(ss, gm);
        if (!ok) continue;
        const float inv = 1.0f / fmaxf(sqrtf(ss), TM_L2_EPS);
        const tm_f4 WL = tm_ld(wl + off), AL = tm_ld(al + off), V = tm_ld(v + off);
        tm_f4 D, KP, A_, B_, VP;
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
            const tm_f4 VL = tm_ld(vl + off), VF = tm_ld(vf + off);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sv = tm_sigmoid(pv0.v[e] + VL.v[e]);
                VP.v[e] = V.v[e] + (VF.v[e] - V.v[e]) * sv;
            }
            tm_st(vp + off, VP);
        } else {
            tm_st(vf + off, V);
        }
        tm_st(decay + off, D);
        tm_st(kp + off, KP);
        tm_st(wa + off, A_);
        tm_st(wb + off, B_);
    }
}

// Backward. Gradient inputs (all [R,C]):
//   dd (d decay), dkp (d k'), dvp (d v'), dwa (d wa), dwb (d wb)      -- from the WKV backward
//   dkp2, dvp2 (extra d k', d v' from tm_gn_bwd's bonus term; 0 = none)
//   dr, dr2: if dr2 != 0, dr_out = dr + dr2 (total d r for the receptance GEMM; dr_out may alias dr)
// Outputs: dk (d of the key GEMM output), dv (d of the value GEMM output), dwl, dal, dvl (layer>0),
//   dvf: layer > 0: dvf = (vf_acc ? dvf : 0) + dv' * sigmoid(v0+vl)
//        layer = 0: v_first IS this layer's v, so dv += dvf (the gradient accumulated by the later
//                   layers) when dvf != 0; dvf is only read.
//   partials [Pp, NP, C] with NP = 5 (layer > 0) or 4 (layer 0): slots w0, a0, k_k, k_a, (v0).
// Outputs may alias gradient inputs element-wise (each thread reads all its elements before writing).
extern "C" __global__ void tm_prep_bwd(const float* k, const float* v, const float* wl, const float* al,
                                       const float* vl, const float* vf,
                                       const float* w0, const float* a0, const float* v0,
                                       const float* k_k, const float* k_a,
                                       const float* dd, const float* dkp, const float* dvp,
                                       const float* dwa, const float* dwb,
                                       const float* dkp2, const float* dvp2,
                                       const float* dr, const float* dr2, float* dr_out,
                                       float* dk, float* dv, float* dwl, float* dal, float* dvl,
                                       float* dvf, float* partials,
                                       int R, int C, int rpt, int layer, int vf_acc)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const unsigned gm = tm_group_mask();
    const tm_f4 pw0 = tm_ldp(w0 + c0), pa0 = tm_ldp(a0 + c0), pkk = tm_ldp(k_k + c0), pka = tm_ldp(k_a + c0);
    const tm_f4 pv0 = layer > 0 ? tm_ldp(v0 + c0) : tm_zero();
    tm_f4 gw0 = tm_zero(), ga0 = tm_zero(), gkk = tm_zero(), gka = tm_zero(), gv0 = tm_zero();

    for (int i = 0; i < rr.sub; ++i) {              // uniform trip count: shuffles below
        const int row = rr.beg + i;
        const bool ok = row < rr.end;
        const tm_size off = (tm_size)row * C + c0;
        float kr[4], a[4], dkk[4], ss = 0.f, sdot = 0.f;
        tm_f4 K = tm_zero(), DKP = tm_zero();
        if (ok) {
            K = tm_ld(k + off);
            const tm_f4 AL = tm_ld(al + off), DWA = tm_ld(dwa + off), DWB = tm_ld(dwb + off);
            DKP = tm_ld(dkp + off);
            if (dkp2) { const tm_f4 X = tm_ld(dkp2 + off);
#pragma unroll
                for (int e = 0; e < 4; ++e) DKP.v[e] += X.v[e]; }
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
        const bool big = nrm > TM_L2_EPS;
        const float inv = 1.0f / fmaxf(nrm, TM_L2_EPS);
        float kk[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) { kk[e] = kr[e] * inv; sdot += dkk[e] * kk[e]; }
        sdot = tm_head_sum(sdot, gm);
        if (!ok) continue;

        const tm_f4 DWB = tm_ld(dwb + off), WL = tm_ld(wl + off), DD = tm_ld(dd + off);
        tm_f4 DK, DWL, DAL;
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
        tm_f4 DVP = tm_ld(dvp + off);
        if (dvp2) { const tm_f4 X = tm_ld(dvp2 + off);
#pragma unroll
            for (int e = 0; e < 4; ++e) DVP.v[e] += X.v[e]; }
        tm_f4 DV;
        if (layer > 0) {
            const tm_f4 V = tm_ld(v + off), VL = tm_ld(vl + off), VF = tm_ld(vf + off);
            tm_f4 G; if (vf_acc) G = tm_ld(dvf + off); else G = tm_zero();
            tm_f4 DVL;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sv = tm_sigmoid(pv0.v[e] + VL.v[e]);
                DV.v[e] = DVP.v[e] * (1.f - sv);
                G.v[e] += DVP.v[e] * sv;
                DVL.v[e] = DVP.v[e] * (VF.v[e] - V.v[e]) * sv * (1.f - sv);
                gv0.v[e] += DVL.v[e];
            }
            tm_st(dvl + off, DVL);
            tm_st(dvf + off, G);
        } else {
            DV = DVP;
            if (dvf) { const tm_f4 G = tm_ld(dvf + off);
#pragma unroll
                for (int e = 0; e < 4; ++e) DV.v[e] += G.v[e]; }
        }
        if (dr2) {
            tm_f4 A = tm_ld(dr + off); const tm_f4 B = tm_ld(dr2 + off);
#pragma unroll
            for (int e = 0; e < 4; ++e) A.v[e] += B.v[e];
            tm_st(dr_out + off, A);
        }
        tm_st(dk + off, DK);
        tm_st(dv + off, DV);
        tm_st(dwl + off, DWL);
        tm_st(dal + off, DAL);
    }
    const int NP = layer > 0 ? 5 : 4;
    const tm_size pr = (tm_size)blockIdx.y * blockDim.y + threadIdx.y;
    float* P = partials + pr * NP * C + c0;
    tm_st(P + 0 * C, gw0);
    tm_st(P + 1 * C, ga0);
    tm_st(P + 2 * C, gkk);
    tm_st(P + 3 * C, gka);
    if (layer > 0) tm_st(P + 4 * C, gv0);
}

// ---------------------------------------------------------------------------------------------
// 4. GroupNorm (ln_x) + bonus + gate
// ---------------------------------------------------------------------------------------------
// Forward, per row, per head (N channels):
//   yn = (y - mean) / sqrt(var + 64e-5) * lnw + lnb     (biased variance, two-pass)
//   s  = sum_head(r * kp * rk);  z = (yn + s * vp) * g
// y, r, kp, vp, g [R,C]; lnw, lnb, rk [C]; z [R,C] (may alias any input element-wise).
extern "C" __global__ void tm_gn_fwd(const float* y, const float* r, const float* kp, const float* vp,
                                     const float* g, const float* lnw, const float* lnb, const float* rk,
                                     float* z, int R, int C, int rpt)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const unsigned gm = tm_group_mask();
    const tm_f4 W = tm_ldp(lnw + c0), Bb = tm_ldp(lnb + c0), RK = tm_ldp(rk + c0);
    const float invN = 1.0f / (float)TM_N;
    for (int i = 0; i < rr.sub; ++i) {
        const int row = rr.beg + i;
        const bool ok = row < rr.end;
        const tm_size off = (tm_size)row * C + c0;
        tm_f4 Y = tm_zero(), Rr = tm_zero(), KP = tm_zero();
        if (ok) { Y = tm_ld(y + off); Rr = tm_ld(r + off); KP = tm_ld(kp + off); }
        float s1 = 0.f, sb = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) { s1 += Y.v[e]; sb += Rr.v[e] * KP.v[e] * RK.v[e]; }
        const float mean = tm_head_sum(s1, gm) * invN;
        sb = tm_head_sum(sb, gm);
        float d[4], s2 = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) { d[e] = Y.v[e] - mean; s2 += d[e] * d[e]; }
        const float var = tm_head_sum(s2, gm) * invN;
        if (!ok) continue;
        const float rstd = 1.0f / sqrtf(var + TM_GN_EPS);
        const tm_f4 VP = tm_ld(vp + off), G = tm_ld(g + off);
        tm_f4 Z;
#pragma unroll
        for (int e = 0; e < 4; ++e) Z.v[e] = (d[e] * rstd * W.v[e] + Bb.v[e] + sb * VP.v[e]) * G.v[e];
        tm_st(z + off, Z);
    }
}

// Backward: from dz produce
//   dy  (to the WKV backward), dg (to the gate GEMMs),
//   dr2 = ds * kp * rk, dkp2 = ds * r * rk, dvp2 = du * s   (bonus-term gradients of r, k', v';
//         with du = dz * g, ds = sum_head(du * vp)) -- passed on to tm_prep_bwd,
//   partials [Pp, 3, C]: slots ln_x.weight, ln_x.bias, r_k.
// Outputs may alias inputs element-wise.
extern "C" __global__ void tm_gn_bwd(const float* y, const float* r, const float* kp, const float* vp,
                                     const float* g, const float* dz,
                                     const float* lnw, const float* lnb, const float* rk,
                                     float* dy, float* dg, float* dr2, float* dkp2, float* dvp2,
                                     float* partials, int R, int C, int rpt)
{
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const tm_rows rr = tm_my_rows(R, rpt);
    const unsigned gm = tm_group_mask();
    const tm_f4 W = tm_ldp(lnw + c0), Bb = tm_ldp(lnb + c0), RK = tm_ldp(rk + c0);
    const float invN = 1.0f / (float)TM_N;
    tm_f4 gW = tm_zero(), gB = tm_zero(), gRK = tm_zero();
    for (int i = 0; i < rr.sub; ++i) {
        const int row = rr.beg + i;
        const bool ok = row < rr.end;
        const tm_size off = (tm_size)row * C + c0;
        tm_f4 Y = tm_zero(), Rr = tm_zero(), KP = tm_zero(), VP = tm_zero(), G = tm_zero(), DZ = tm_zero();
        if (ok) {
            Y = tm_ld(y + off); Rr = tm_ld(r + off); KP = tm_ld(kp + off);
            VP = tm_ld(vp + off); G = tm_ld(g + off); DZ = tm_ld(dz + off);
        }
        float s1 = 0.f, sb = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) { s1 += Y.v[e]; sb += Rr.v[e] * KP.v[e] * RK.v[e]; }
        const float mean = tm_head_sum(s1, gm) * invN;
        sb = tm_head_sum(sb, gm);
        float d[4], s2 = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) { d[e] = Y.v[e] - mean; s2 += d[e] * d[e]; }
        const float var = tm_head_sum(s2, gm) * invN;
        const float rstd = 1.0f / sqrtf(var + TM_GN_EPS);
        float xh[4], du[4], dxh[4], m1 = 0.f, m2 = 0.f, sds = 0.f;
        tm_f4 DG;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            xh[e] = d[e] * rstd;
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
        tm_f4 DY, DR, DK, DV;
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
        tm_st(dy + off, DY);
        tm_st(dg + off, DG);
        tm_st(dr2 + off, DR);
        tm_st(dkp2 + off, DK);
        tm_st(dvp2 + off, DV);
    }
    const tm_size pr = (tm_size)blockIdx.y * blockDim.y + threadIdx.y;
    float* P = partials + pr * 3 * C + c0;
    tm_st(P + 0 * C, gW);
    tm_st(P + 1 * C, gB);
    tm_st(P + 2 * C, gRK);
}

// ---------------------------------------------------------------------------------------------
// 5. fixed-order reduction of partials [Pp, nout, C] into nout (<= 6) vectors [C]:
//    o_j[c] = (acc ? o_j[c] : 0) + sum_p partials[p, j, c]
// block (32, 8), grid (ceil(nout*C / 32)). Thread (tx, ty) sums p = ty, ty+8, ... in order; the 8
// stream sums are then added in ty order. Deterministic.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void tm_reduce_partials(const float* partials, int Pp, int C, int nout,
                                              float* o0, float* o1, float* o2,
                                              float* o3, float* o4, float* o5, int acc)
{
    __shared__ float sh[8][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int width = nout * C;
    const int col = blockIdx.x * 32 + tx;
    float s = 0.f;
    if (col < width)
        for (int p = ty; p < Pp; p += 8) s += partials[(tm_size)p * width + col];
    sh[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && col < width) {
        float t = sh[0][tx];
#pragma unroll
        for (int i = 1; i < 8; ++i) t += sh[i][tx];
        const int j = col / C, c = col - j * C;
        float* o = j == 0 ? o0 : j == 1 ? o1 : j == 2 ? o2 : j == 3 ? o3 : j == 4 ? o4 : o5;
        o[c] = acc ? o[c] + t : t;
    }
}
