// rwkvx/cu/wkv7/sequential.cu -- RWKV-7 ("x070") WKV recurrence, forward and backward.
//
// Per sequence bb and head h (N = HEAD_SIZE), S is N x N (row i = value index, column j = key index),
// S = s_init[h] before t = 0 (the initial state, shared by the B sequences; 0 when s_init is NULL):
//     sa_t = S_{t-1} a_t
//     S_t  = S_{t-1} diag(w_t) + sa_t b_t^T + v_t k_t^T
//     y_t  = S_t r_t
// r, k, v, a, b, y and their gradients are floatX [B,T,H,N] (= row-major [B*T, C], c = h*N + n); the
// decay w, the state, its checkpoints and every accumulation are fp32.
//
// Thread mapping (Q = WKV_Q lanes per row, M = N/Q elements per lane, lanes of a row adjacent in a warp):
//   "row role":    thread (ri, rq) owns S[row, rq*M .. rq*M+M-1] (row = i0 + ri) -- row reductions
//                  (sa, y, dv, dsa) are M-term partial sums + shuffle-xor over the Q lanes.
//   "column role"  (backward only): thread (cj, cq) owns S and dS[i0 + cq*M .. +M-1, cj] -- column reductions
//                  (dr, dk, db, dw, da) over the block's rows, shuffle-xor over CQ = Q/P lanes.
// Row split P = gridDim.x: block p owns rows i0 = p*N/P .. i0 + N/P - 1 (blockDim.x = (N/P)*Q).
//   Forward: rows are independent, any P dividing N works.
//   Backward: P <= Q; the column reductions then cover only the block's rows -> per-split fp32
//   partials in scratch, added in split order by wkv7_backward_reduce into dr/dw/dk/da/db.
//
// Inputs are staged through shared memory in stages of LS tokens with cp.async double buffering.
// For the backward, the forward saves sa_t for every token (fp32 [B,T,H,N]) and the state after the
// last token of every chunk of CHUNK tokens (ckpt [B,H,nC,N,N], nC = ceil(T/CHUNK)).
// Backward walks the tokens in reverse and steps the state back instead of recomputing it:
//     S_{t-1} = (S_t - sa_t b_t^T - v_t k_t^T) diag(1/w_t)
// per column of S, from the exact checkpoint at each chunk's end; at each chunk's first token S_{t-1}
// is the previous checkpoint itself. So at most CHUNK-1 steps are taken back from an exact state:
// each multiplies the rounding error by at most 1/w <= 1/exp(-e^-0.5) = 1.83 (the model's decay clamp),
// which is why CHUNK is 8 (at 16, w near its lower end costs ~2e-4 relative error in dw, da, dr).
// Deterministic: no atomics, fixed reduction orders. All accumulation in fp32.
//
// Gradients, with G_t = dL/dS_t (carried in registers twice: row copy and column copy):
//   G_t      += dy_t r_t^T                     (y_t = S_t r_t)
//   dr_t      = S_t^T dy_t
//   dv_t      = G_t k_t            dk_t = G_t^T v_t
//   dsa       = G_t b_t            db_t = G_t^T sa_t
//   dw_t[j]   = sum_i G_t[i,j] S_{t-1}[i,j]
//   da_t      = S_{t-1}^T dsa                  (sa_t = S_{t-1} a_t)
//   G_{t-1}   = G_t diag(w_t) + dsa a_t^T      (+ dy_{t-1} r_{t-1}^T at the next step)
// and G_{-1}, the gradient of the initial state: per sequence into ds_part [B,H,N,N] (the row role's
// copy), summed over the sequences in order bb = 0..B-1 by wkv7_state_reduce.
// With NULL s_init / ds_part the kernels read no initial state and write no G_{-1}: one pointer test per
// block (and per chunk boundary for the backward's checkpoint loads), nothing in the per-token work.

#include "common.cuh"
#include "cp_async.cuh"
#if !defined(HEAD_SIZE) || !defined(WKV_Q) || !defined(WKV_CHUNK) || !defined(WKV_BWD_MAXT)
#error "wkv7/sequential.cu: HEAD_SIZE, WKV_Q, WKV_CHUNK and WKV_BWD_MAXT come from rwkvx/cu/wkv7/ops.py"
#endif
#include "wkv7/state.cuh"

namespace wkv7 {

constexpr int CHUNK = WKV_CHUNK;                            // checkpoint interval (tokens)
constexpr int LS = HN >= 128 ? 4 : (HN >= 64 ? 8 : 16);     // tokens per staged block
constexpr int FWD_MAXT = HN * Q;                            // forward block size with P = 1
constexpr int BWD_MAXT = (HN * Q < WKV_BWD_MAXT) ? HN * Q : WKV_BWD_MAXT;   // N = 128 needs P >= 2
constexpr int BWD_MINB = HN >= 128 ? 1 : 2;                 // 2 blocks/SM (<= 128 regs) for N <= 64

// ---- small helpers ---------------------------------------------------------------------------

// copy 4 elements (16 bytes of float, 8 of bf16) global -> shared, asynchronously
__device__ __forceinline__ void cp_async4(float* dst_smem, const float* src_gmem) { cp16(dst_smem, src_gmem); }
__device__ __forceinline__ void cp_async4(__nv_bfloat16* dst_smem, const __nv_bfloat16* src_gmem) {
    cp8(dst_smem, src_gmem);
}

// Stage `cnt` tokens (from token tstart) of one [B,T,H,N] tensor into dst [LS][HN] with cp.async.
// src points at X + h*HN; token t of sequence bb lives at src + ((bb*T + t)*H)*HN.
template <class E>
__device__ __forceinline__ void stage_vec(E* dst, const E* src, long long tokbase, int tstart, int cnt,
                                          int H, int tid, int nt) {
    constexpr int R4 = HN / 4;
    for (int e = tid; e < cnt * R4; e += nt) {
        const int sl = e / R4, n4 = e - sl * R4;
        cp_async4(dst + sl * HN + n4 * 4, src + (tokbase + tstart + sl) * (long long)H * HN + n4 * 4);
    }
}

// body(g) for the stages g = 0..G-1 of a walk while the inputs of stage g+1 are being copied in:
// issue(g) starts stage g's copies into buffer g & 1 (double buffering, one commit group per stage).
template <class Issue, class Body>
__device__ __forceinline__ void staged_walk(int G, Issue issue, Body body) {
    issue(0);
    cp_commit();
    for (int g = 0; g < G; ++g) {
        if (g + 1 < G) { issue(g + 1); cp_commit(); cp_wait<1>(); }
        else { cp_wait<0>(); }
        __syncthreads();
        body(g);
        __syncthreads();
    }
}

// The staged inputs of one forward / backward stage, double-buffered: the NV floatX tensors and the
// decay w (fp32 in every precision), LS tokens x HN each.
template <int NV>
struct Staging { floatX v[2][NV][LS][HN]; float w[2][LS][HN]; };

// Issue the cp.async copies of the `NV` floatX tensors `src` and the decay `w` for tokens ts .. ts+cnt-1
// into buffer `g` of `stg`.
template <int NV>
__device__ __forceinline__ void stage_all(Staging<NV>& stg, int g, const floatX* const (&src)[NV], const float* w,
                                          long long hoff, long long tokbase, int ts, int cnt, int H, int tid, int nt) {
#pragma unroll
    for (int i = 0; i < NV; ++i) stage_vec(&stg.v[g][i][0][0], src[i] + hoff, tokbase, ts, cnt, H, tid, nt);
    stage_vec(&stg.w[g][0][0], w + hoff, tokbase, ts, cnt, H, tid, nt);
}

}  // namespace wkv7

using namespace wkv7;

// =============================================================================================
// Forward.  grid (P, H, B), block (N/P * Q).  y [B,T,H,N]; for the backward (both or neither NULL):
// sa [B,T,H,N] fp32 and ckpt [B,H,nC,N,N] (slot c = the state after chunk c's last token).
// s_init [H,N,N] fp32: the state before t = 0, or NULL for 0.
// =============================================================================================
extern "C" __global__ void __launch_bounds__(FWD_MAXT)
wkv7_forward(const floatX* __restrict__ r, const float* __restrict__ w, const floatX* __restrict__ k,
             const floatX* __restrict__ v, const floatX* __restrict__ a, const floatX* __restrict__ b,
             floatX* __restrict__ y, float* __restrict__ sa_out, float* __restrict__ ckpt,
             const float* __restrict__ s_init, int T, int H)
{
    constexpr int NV = 5;                                        // r k v a b (and w)
    __shared__ __align__(16) Staging<NV> stg;
    const floatX* const src[NV] = {r, k, v, a, b};

    const int P = gridDim.x, p = blockIdx.x, h = blockIdx.y, bb = blockIdx.z;
    const int NR = HN / P, nt = NR * Q, tid = threadIdx.x;
    const int ri = tid / Q, rq = tid % Q, row = p * NR + ri, j0 = rq * M;
    const int nC = (T + CHUNK - 1) / CHUNK;
    const long long tokbase = (long long)bb * T;
    const long long hoff = (long long)h * HN;
    const bool save = ckpt != nullptr;
    float* ck = save ? ckpt + ((long long)(bb * H + h) * nC) * HN * HN + (long long)row * HN + j0 : nullptr;

    float S[M];
#pragma unroll
    for (int m = 0; m < M; ++m) S[m] = 0.f;
    if (s_init != nullptr) {
        const float* src = s_init + ((long long)h * HN + row) * HN + j0;
#pragma unroll
        for (int m = 0; m < M; m += VW) ldv(src + m, S + m);
    }

    const int G = (T + LS - 1) / LS;
    auto issue = [&](int g) {
        const int ts = g * LS;
        stage_all<NV>(stg, g & 1, src, w, hoff, tokbase, ts, min(LS, T - ts), H, tid, nt);
    };

    staged_walk(G, issue, [&](int g) {
        const floatX(*sb)[LS][HN] = stg.v[g & 1];
        const float(*sw)[HN] = stg.w[g & 1];
        const int ts = g * LS, cnt = min(LS, T - ts);
        for (int sl = 0; sl < cnt; ++sl) {
            const int t = ts + sl;
            const long long gout = (tokbase + t) * (long long)H * HN + hoff;
            const float sa = token_sa(S, &sb[3][sl][j0]);
            if (save && rq == 0) sa_out[gout + row] = sa;
            const float yy = token_update(S, &sb[0][sl][j0], &sw[sl][j0], &sb[1][sl][j0], to_f32(sb[2][sl][row]),
                                          &sb[4][sl][j0], sa);
            if (rq == 0) y[gout + row] = from_f32(yy);
            if (save && (t % CHUNK == CHUNK - 1 || t == T - 1)) {
                float* dst = ck + (long long)(t / CHUNK) * HN * HN;
#pragma unroll
                for (int m = 0; m < M; m += VW) stv(dst + m, S + m);
            }
        }
    });
}

// =============================================================================================
// Backward.  grid (P, H, B) with P in {1,2,4} (P <= Q), block (N/P * Q) <= BWD_MAXT.
//   sa [B,T,H,N] and ckpt [B,H,nC,N,N] from wkv7_forward on the same inputs and s_init.
//   ds_part [B,H,N,N] fp32: each sequence's G_{-1} (NULL: not written).
//   dv [B,T,H,N] (complete).  dr, dw, dk, da, db [B,T,H,N]: written directly when P = 1; with P > 1
//   split p writes its fp32 partial sums to part [5][P][n] (dr dw dk da db; n = B*T*H*N) and
//   wkv7_backward_reduce adds them in order p = 0..P-1 (P = 1: part unused, may be NULL).
// =============================================================================================
extern "C" __global__ void __launch_bounds__(BWD_MAXT, BWD_MINB)
wkv7_backward(const floatX* __restrict__ r, const float* __restrict__ w, const floatX* __restrict__ k,
              const floatX* __restrict__ v, const floatX* __restrict__ a, const floatX* __restrict__ b,
              const floatX* __restrict__ dy, const float* __restrict__ sa, const float* __restrict__ ckpt,
              floatX* __restrict__ dr, float* __restrict__ dw, float* __restrict__ dk,
              float* __restrict__ dv, float* __restrict__ da, float* __restrict__ db,
              float* __restrict__ part, const float* __restrict__ s_init, float* __restrict__ ds_part,
              int T, int H, long long n)
{
    constexpr int NV = 6;                                        // r k v a b dy (and w)
    __shared__ __align__(16) Staging<NV> stg;
    __shared__ __align__(16) float sa_st[2][LS][HN];             // staged sa (fp32), same stages
    __shared__ __align__(16) float dsa_sm[2][HN];                // dsa of the step (by parity), local rows
    const floatX* const src[NV] = {r, k, v, a, b, dy};

    const int P = gridDim.x, p = blockIdx.x, h = blockIdx.y, bb = blockIdx.z;
    const int NR = HN / P, nt = NR * Q, tid = threadIdx.x, i0 = p * NR;
    // row role
    const int ri = tid / Q, rq = tid % Q, row = i0 + ri, j0 = rq * M;
    // column role
    const int CQ = Q / P, cj = tid / CQ, cq = tid % CQ, ic0 = cq * M;   // local rows ic0 .. ic0+M-1

    const int nC = (T + CHUNK - 1) / CHUNK;
    const int G = (T + LS - 1) / LS;
    const long long tokbase = (long long)bb * T;
    const long long hoff = (long long)h * HN;
    const long long HC = (long long)H * HN;
    // column cj, rows i0+ic0 .. +M-1 of checkpoint slot c: ckc[c*HN*HN + m*HN]
    const float* ckc = ckpt + ((long long)(bb * H + h) * nC) * HN * HN + (long long)(i0 + ic0) * HN + cj;
    // this split's fp32 partial sums (P > 1): part[q][p] for q = dr dw dk da db
    float* const pbase = part + (long long)p * n;
    const long long xs = (long long)P * n;                      // stride between the 5 tensors

    float dSr[M];    // G[row, j0 + m]
    float dSc[M];    // G[i0 + ic0 + m, cj]
    float sv[M];     // S_t[i0 + ic0 + m, cj]  (stepped back token by token)
    float s0[M];     // the same column of the state entering the current chunk (exact, from ckpt)
#pragma unroll
    for (int m = 0; m < M; ++m) { dSr[m] = 0.f; dSc[m] = 0.f; }
    auto load_col = [&](float* dst, int c) {                    // c < 0: the initial state (NULL: 0)
        const float* src = c >= 0 ? ckc + (long long)c * HN * HN
                                  : (s_init != nullptr ? s_init + ((long long)h * HN + i0 + ic0) * HN + cj : nullptr);
#pragma unroll
        for (int m = 0; m < M; ++m) dst[m] = src != nullptr ? src[(long long)m * HN] : 0.f;
    };

    auto issue = [&](int g) {                                    // stages in reverse token order
        const int ts = (G - 1 - g) * LS, cnt = min(LS, T - ts);
        stage_all<NV>(stg, g & 1, src, w, hoff, tokbase, ts, cnt, H, tid, nt);
        stage_vec(&sa_st[g & 1][0][0], sa + hoff, tokbase, ts, cnt, H, tid, nt);
    };

    staged_walk(G, issue, [&](int g) {
        const floatX(*sb)[LS][HN] = stg.v[g & 1];
        const float(*sw)[HN] = stg.w[g & 1];
        const float(*sab)[HN] = sa_st[g & 1];
        const int ts = (G - 1 - g) * LS, cnt = min(LS, T - ts);
        for (int sl = cnt - 1; sl >= 0; --sl) {
            const int t = ts + sl;
            const long long gout = (tokbase + t) * HC + hoff;   // [b,t,h,0]
            // entering chunk c (walking backwards): S_t is exact (ckpt slot c, or the previous chunk's
            // s0 already in sv); fetch this chunk's entering state, first used at its first token
            const int c = t / CHUNK;
            if (t == T - 1) { load_col(sv, c); load_col(s0, c - 1); }
            else if (t % CHUNK == CHUNK - 1) load_col(s0, c - 1);
            const bool first = t % CHUNK == 0;                   // S_{t-1} is s0
            // ---- row role: G[row,:] ; dv_row, dsa_row ; G <- G diag(w) + dsa a^T
            {
                const float dyi = to_f32(sb[5][sl][row]);
                float dva[VW], dsaa[VW];
#pragma unroll
                for (int u = 0; u < VW; ++u) { dva[u] = 0.f; dsaa[u] = 0.f; }
#pragma unroll
                for (int m = 0; m < M; m += VW) {
                    float rv[VW], kv[VW], bv[VW];
                    ldv(&sb[0][sl][j0 + m], rv);
                    ldv(&sb[1][sl][j0 + m], kv);
                    ldv(&sb[4][sl][j0 + m], bv);
#pragma unroll
                    for (int u = 0; u < VW; ++u) {
                        const float gg = fmaf(dyi, rv[u], dSr[m + u]);   // G_t += dy r^T
                        dSr[m + u] = gg;
                        dva[u] = fmaf(gg, kv[u], dva[u]);                // dv = G k
                        dsaa[u] = fmaf(gg, bv[u], dsaa[u]);              // dsa = G b
                    }
                }
                const float dvp = group_sum(vw_sum(dva), Q);
                const float dsap = group_sum(vw_sum(dsaa), Q);
#pragma unroll
                for (int m = 0; m < M; m += VW) {
                    float wv[VW], av[VW];
                    ldv(&sw[sl][j0 + m], wv);
                    ldv(&sb[3][sl][j0 + m], av);
#pragma unroll
                    for (int u = 0; u < VW; ++u)
                        dSr[m + u] = fmaf(dSr[m + u], wv[u], dsap * av[u]);  // G_{t-1}
                }
                if (rq == 0) {
                    dsa_sm[t & 1][ri] = dsap;
                    dv[gout + row] = dvp;
                }
            }
            __syncthreads();   // dsa of this step visible to the column role
            // ---- column role: G[:,cj] over the block's rows; S_t[:,cj] stepped back to S_{t-1}[:,cj]
            {
                const float rj = to_f32(sb[0][sl][cj]), wj = sw[sl][cj], kj = to_f32(sb[1][sl][cj]);
                const float aj = to_f32(sb[3][sl][cj]), bj = to_f32(sb[4][sl][cj]);
                const float inv_wj = 1.f / wj;                   // <= 1/w_min: bounded by the decay clamp
                float pr = 0.f, pw = 0.f, pk = 0.f, pa = 0.f, pb = 0.f;
#pragma unroll
                for (int m = 0; m < M; m += VW) {
                    float dyv[VW], vv[VW], sav[VW], dsav[VW];
                    ldv(&sb[5][sl][i0 + ic0 + m], dyv);
                    ldv(&sb[2][sl][i0 + ic0 + m], vv);
                    ldv(&sab[sl][i0 + ic0 + m], sav);
                    ldv(&dsa_sm[t & 1][ic0 + m], dsav);
#pragma unroll
                    for (int u = 0; u < VW; ++u) {
                        const float st = sv[m + u];                                   // S_t[i,j]
                        const float gg = fmaf(dyv[u], rj, dSc[m + u]);                // G_t[i,j]
                        // S_{t-1} = (S_t - sa b^T - v k^T) diag(1/w): the forward's update undone
                        const float sp = first ? s0[m + u]
                                               : (st - state_add(sav[u], bj, vv[u], kj)) * inv_wj;
                        pr = fmaf(st, dyv[u], pr);                                    // dr = S_t^T dy
                        pk = fmaf(gg, vv[u], pk);                                     // dk = G^T v
                        pb = fmaf(gg, sav[u], pb);                                    // db = G^T sa
                        pw = fmaf(gg, sp, pw);                                        // dw = sum G .* S_{t-1}
                        pa = fmaf(sp, dsav[u], pa);                                   // da = S_{t-1}^T dsa
                        dSc[m + u] = fmaf(gg, wj, dsav[u] * aj);                      // G_{t-1}
                        sv[m + u] = sp;
                    }
                }
                pr = group_sum(pr, CQ);
                pw = group_sum(pw, CQ);
                pk = group_sum(pk, CQ);
                pa = group_sum(pa, CQ);
                pb = group_sum(pb, CQ);
                if (cq == 0) {
                    const long long o = gout + cj;
                    if (P == 1) {
                        dr[o] = from_f32(pr); dw[o] = pw; dk[o] = pk; da[o] = pa; db[o] = pb;
                    } else {
                        pbase[o] = pr; pbase[xs + o] = pw; pbase[2 * xs + o] = pk;
                        pbase[3 * xs + o] = pa; pbase[4 * xs + o] = pb;
                    }
                }
            }
            // no second barrier: the next step writes dsa_sm[(t-1)&1]; the staged inputs are read-only here
        }
    });
    if (ds_part != nullptr) {                                    // G_{-1}, the row role's copy
        float* dst = ds_part + ((long long)(bb * H + h) * HN + row) * HN + j0;
#pragma unroll
        for (int m = 0; m < M; m += VW) stv(dst + m, dSr + m);
    }
}

// Add the splits' partials (part [5][P][n]: dr, dw, dk, da, db) into the outputs:
// out = ((part_0 + part_1) + part_2) + ...  -- a fixed order. n % 4 == 0 (n = B*T*H*N); grid-stride.
namespace wkv7 {
template <class O>
__device__ __forceinline__ void add_parts(O* out, const float* src, long long e, long long n4, int P) {
    const float4* s = reinterpret_cast<const float4*>(src) + e;
    float4 acc = s[0];
    for (int q = 1; q < P; ++q) {
        const float4 u = s[(long long)q * n4];
        acc.x += u.x; acc.y += u.y; acc.z += u.z; acc.w += u.w;
    }
    f4 o; o.v[0] = acc.x; o.v[1] = acc.y; o.v[2] = acc.z; o.v[3] = acc.w;
    store4(out + 4 * e, o);
}
}  // namespace wkv7

extern "C" __global__ void __launch_bounds__(256)
wkv7_backward_reduce(const float* __restrict__ part, floatX* __restrict__ dr, float* __restrict__ dw,
                     float* __restrict__ dk, float* __restrict__ da, float* __restrict__ db,
                     long long n, int P)
{
    const long long n4 = n / 4, xs = (long long)P * n;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n4;
         e += (long long)gridDim.x * blockDim.x) {
        add_parts(dr, part + 0 * xs, e, n4, P);
        add_parts(dw, part + 1 * xs, e, n4, P);
        add_parts(dk, part + 2 * xs, e, n4, P);
        add_parts(da, part + 3 * xs, e, n4, P);
        add_parts(db, part + 4 * xs, e, n4, P);
    }
}

// The gradient of the shared initial state: ds0 = ((part_0 + part_1) + part_2) + ... over the B
// sequences' G_{-1} (part [B][n], n = H*N*N, n % 4 == 0) -- a fixed order. Grid-stride.
extern "C" __global__ void __launch_bounds__(256)
wkv7_state_reduce(const float* __restrict__ part, float* __restrict__ ds0, long long n, int B)
{
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n / 4;
         e += (long long)gridDim.x * blockDim.x)
        add_parts(ds0, part, e, n / 4, B);
}
