// rwkvx/cu/moba/select.cu — MoBA's block selection (block means, gate and top-K1, the query lists) and the
// backward's delta: the kernels both attention methods share (docs and buffers: moba.cuh).

#include "moba/moba.cuh"
#if !defined(MOBA_SEL_Q) || !defined(MOBA_SEL_J) || !defined(MOBA_SEL_ILP) || !defined(MOBA_KM_THREADS) \
    || !defined(MOBA_FILL_THREADS) || !defined(MOBA_SM_SEL_KM) || !defined(MOBA_SM_SEL_TOP)
#error "moba/select.cu: the selection's block sizes and shared-memory layout come from rwkvx/cu/moba/ops.py"
#endif

#define SEL_Q MOBA_SEL_Q           // threads (= queries) per moba_select block
static_assert(MOBA_SEL_J % MOBA_SEL_ILP == 0 && SEL_Q % 32 == 0,
              "moba_select: whole groups of gate chains per staged step, whole warps");
#define KM_THREADS MOBA_KM_THREADS
#define FILL_THREADS MOBA_FILL_THREADS

// ------------------------------------------------------------------------------------------------
// (1) block means of k; also zeroes cnt (the selection counts)
//     grid (nblk, H, B), block KM_THREADS
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(KM_THREADS)
moba_kmean(const floatX* __restrict__ k, float* __restrict__ kmean, int* __restrict__ cnt,
           int T, int H, int chunk, int nblk)
{
    constexpr int NP = KM_THREADS / HS;       // partial sums per channel (>= 1)
    __shared__ float red[KM_THREADS];
    const int j = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int bh = b * H + h;
    const int u0 = j * chunk, u1 = min(u0 + chunk, T);
    const int part = threadIdx.x / HS, n = threadIdx.x - part * HS;
    float s = 0.f;
    if (part < NP) {
        const floatX* base = k + ((size_t)b * T * H + h) * HS + n;
        for (int u = u0 + part; u < u1; u += NP) s += to_f32(base[(size_t)u * H * HS]);
    }
    red[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x < HS) {
        float tot = 0.f;
#pragma unroll
        for (int p = 0; p < NP; ++p) tot += red[p * HS + threadIdx.x];
        kmean[((size_t)bh * nblk + j) * HS + threadIdx.x] = tot / (float)(u1 - u0);
    }
    if (threadIdx.x == 0) cnt[(size_t)bh * nblk + j] = 0;
}

// ------------------------------------------------------------------------------------------------
// (2) gate + top-(K1) selection, one thread per query
//     g_j = q_t . kmean_j (fp32, fmaf chain over n ascending) for j < t // chunk; the K1 largest,
//     ties -> lower j. Writes sel (ascending, -1 padded) and adds the selections to cnt (int atomics,
//     aggregated per warp).
//     grid (ceil(T/SEL_Q), H, B), block SEL_Q,
//     dynamic smem: qs [SEL_Q][HS+4] and kms [SEL_J][HS] (MOBA_SM_SEL_*), then topg, topj [K1][SEL_Q]
//     (qs rows 16-byte aligned and 4 banks apart: each thread reads its row four floats at a time without
//     conflicts, and every kms read is a broadcast)
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(SEL_Q)
moba_select(const floatX* __restrict__ q, const float* __restrict__ kmean, int* __restrict__ sel,
            int* __restrict__ cnt, int T, int H, int chunk, int K1, int nblk)
{
    float* qs = moba_smem_f(0);                                 // [SEL_Q][HS+4]
    float* kms = moba_smem_f(MOBA_SM_SEL_KM);                   // [SEL_J][HS]
    float* topg = moba_smem_f(MOBA_SM_SEL_TOP);                 // [K1][SEL_Q]
    int* topj = moba_smem_i(MOBA_SM_SEL_TOP + SEL_Q * K1);      // [K1][SEL_Q]

    const int h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    const int tid = threadIdx.x;
    const int t0 = blockIdx.x * SEL_Q;
    const int t = t0 + tid;
    const bool valid = t < T;
    const int bt = valid ? t / chunk : 0;
    const size_t tstride = (size_t)H * HS;
    const floatX* qbase = q + ((size_t)b * T * H + h) * HS;

    for (int idx = tid; idx < SEL_Q * HS4; idx += SEL_Q) {
        const int r = idx / HS4, c4 = idx - r * HS4;
        const bool valid_r = t0 + r < T;
        f4 qv = load4(qbase + (size_t)(valid_r ? t0 + r : t0) * tstride + 4 * c4);
#pragma unroll
        for (int i = 0; i < 4; ++i) qv.v[i] = valid_r ? qv.v[i] : 0.f;
        store4(qs + r * (HS + 4) + 4 * c4, qv);
    }
    const int jmax = (min(t0 + SEL_Q, T) - 1) / chunk;        // candidate blocks of this CTA: j < jmax
    int nf = 0;
    const float* kmb = kmean + (size_t)bh * nblk * HS;
    for (int j0 = 0; j0 < jmax; j0 += MOBA_SEL_J) {
        const int nj = min(MOBA_SEL_J, jmax - j0);
        __syncthreads();
        for (int idx = tid; idx < nj * HS; idx += SEL_Q) kms[idx] = kmb[(size_t)j0 * HS + idx];
        __syncthreads();
        // MOBA_SEL_ILP blocks' fmaf chains at a time (independent, each over n ascending); rows of kms past
        // nj hold stale values, never inserted
        for (int jj = 0; jj < nj; jj += MOBA_SEL_ILP) {
            float g[MOBA_SEL_ILP];
#pragma unroll
            for (int u = 0; u < MOBA_SEL_ILP; ++u) g[u] = 0.f;
            const float* qr = qs + tid * (HS + 4);
            const float* kr = kms + jj * HS;
#pragma unroll 2
            for (int n = 0; n < HS; n += 4) {
                const f4 a = load4(qr + n);
#pragma unroll
                for (int u = 0; u < MOBA_SEL_ILP; ++u) {
                    const f4 c = load4(kr + u * HS + n);
#pragma unroll
                    for (int i = 0; i < 4; ++i) g[u] = fmaf(a.v[i], c.v[i], g[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < MOBA_SEL_ILP; ++u) {
                const int j = j0 + jj + u;
                if (jj + u >= nj || j >= bt) continue;
                int pos;
                if (nf < K1) {
                    pos = nf++;
                } else if (g[u] > topg[(K1 - 1) * SEL_Q + tid]) {
                    pos = K1 - 1;
                } else {
                    continue;
                }
                while (pos > 0 && g[u] > topg[(pos - 1) * SEL_Q + tid]) {
                    topg[pos * SEL_Q + tid] = topg[(pos - 1) * SEL_Q + tid];
                    topj[pos * SEL_Q + tid] = topj[(pos - 1) * SEL_Q + tid];
                    --pos;
                }
                topg[pos * SEL_Q + tid] = g[u];
                topj[pos * SEL_Q + tid] = j;
            }
        }
    }
    // ascending block order (insertion sort of the nf <= K1 selected; nf = 0 past T)
    for (int i = 1; i < nf; ++i) {
        const int v = topj[i * SEL_Q + tid];
        int p = i;
        while (p > 0 && topj[(p - 1) * SEL_Q + tid] > v) {
            topj[p * SEL_Q + tid] = topj[(p - 1) * SEL_Q + tid];
            --p;
        }
        topj[p * SEL_Q + tid] = v;
    }
    int* srow = sel + ((size_t)bh * T + t) * K1;
    for (int s = 0; s < K1; ++s) {
        const int j = s < nf ? topj[s * SEL_Q + tid] : -1;
        if (valid) srow[s] = j;
        // one atomic per block chosen in this warp (the counters of a bh share a cache line): the lowest
        // lane of those that chose j adds their number
        const unsigned peers = __match_any_sync(FULL_MASK, j);
        if (j >= 0 && (tid & 31) == __ffs(peers) - 1) atomicAdd(cnt + (size_t)bh * nblk + j, __popc(peers));
    }
}

// ------------------------------------------------------------------------------------------------
// (3) offsets: per bh, exclusive prefix sums over j of cnt, ceil(cnt/FQ), ceil(cnt/DQ_Q)
//     grid (B*H), block 32
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(32)
moba_scan(const int* __restrict__ cnt, int* __restrict__ idx, int nblk)
{
    const int bh = blockIdx.x, lane = threadIdx.x;
    int* offs = idx + (size_t)bh * 3 * (nblk + 1);
    int* toff_f = offs + (nblk + 1);
    int* toff_d = offs + 2 * (nblk + 1);
    int ca = 0, cb = 0, cc = 0;
    for (int j0 = 0; j0 < nblk; j0 += 32) {
        const int j = j0 + lane;
        const int c = j < nblk ? cnt[(size_t)bh * nblk + j] : 0;
        const int va = c, vb = (c + MOBA_FQ - 1) / MOBA_FQ, vc = (c + MOBA_DQ_Q - 1) / MOBA_DQ_Q;
        int ia = va, ib = vb, ic = vc;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int xa = __shfl_up_sync(FULL_MASK, ia, o);
            const int xb = __shfl_up_sync(FULL_MASK, ib, o);
            const int xc = __shfl_up_sync(FULL_MASK, ic, o);
            if (lane >= o) { ia += xa; ib += xb; ic += xc; }
        }
        if (j < nblk) {
            offs[j] = ca + ia - va;
            toff_f[j] = cb + ib - vb;
            toff_d[j] = cc + ic - vc;
        }
        ca += __shfl_sync(FULL_MASK, ia, 31);
        cb += __shfl_sync(FULL_MASK, ib, 31);
        cc += __shfl_sync(FULL_MASK, ic, 31);
    }
    if (lane == 0) {
        offs[nblk] = ca;
        toff_f[nblk] = cb;
        toff_d[nblk] = cc;
    }
}

// ------------------------------------------------------------------------------------------------
// (4) inverse selection lists: for block j, the entries t*K1 + s with sel[t, s] == j, ascending t
//     grid (nblk, H, B), block FILL_THREADS
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(FILL_THREADS)
moba_fill(const int* __restrict__ sel, const int* __restrict__ idx, int* __restrict__ qlist,
          int T, int H, int chunk, int K1, int nblk, int Emax)
{
    constexpr int NW = FILL_THREADS / 32;
    __shared__ int wcount[NW];
    const int j = blockIdx.x, h = blockIdx.y, b = blockIdx.z, bh = b * H + h;
    const int start = (j + 1) * chunk;
    if (start >= T) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int* out = qlist + (size_t)bh * Emax + idx[(size_t)bh * 3 * (nblk + 1) + j];
    const int* selb = sel + (size_t)bh * T * K1;
    int running = 0;
    for (int base = start; base < T; base += FILL_THREADS) {
        const int t = base + threadIdx.x;
        int slot = -1;
        if (t < T) {
            const int* srow = selb + (size_t)t * K1;
            for (int s = 0; s < K1; ++s) {
                const int v = srow[s];
                if (v == j) { slot = s; break; }
                if (v > j || v < 0) break;
            }
        }
        const unsigned m = __ballot_sync(FULL_MASK, slot >= 0);
        if (lane == 0) wcount[warp] = __popc(m);
        __syncthreads();
        int wbase = 0, total = 0;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const int c = wcount[w];
            wbase += (w < warp) ? c : 0;
            total += c;
        }
        if (slot >= 0) out[running + wbase + __popc(m & ((1u << lane) - 1u))] = t * K1 + slot;
        running += total;
        __syncthreads();
    }
}

// ------------------------------------------------------------------------------------------------
// (7) backward: delta[bh, t] = sum_n do[b,t,h,n] * o[b,t,h,n] with the output as the forward computed it in
//     fp32 (bf16: o + olo, moba_store_out); one warp per (b, t, h). grid ceil(B*T*H / 4), block 128
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(128)
moba_bwd_delta(const floatX* __restrict__ o, const floatX* __restrict__ dout, float* __restrict__ delta,
               int B, int T, int H, const floatX* __restrict__ olo)
{
    const long long row = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (long long)B * T * H) return;
    const floatX* orow = o + row * HS;
    const floatX* drow = dout + row * HS;
    float s = 0.f;
#if FLOATX_BF16
    const floatX* lrow = olo + row * HS;
    for (int n = lane; n < HS; n += 32) s = fmaf(to_f32(orow[n]) + to_f32(lrow[n]), to_f32(drow[n]), s);
#else
    for (int n = lane; n < HS; n += 32) s = fmaf(to_f32(orow[n]), to_f32(drow[n]), s);
#endif
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
    if (lane == 0) {
        const int h = (int)(row % H);
        const long long bt = row / H;
        const int t = (int)(bt % T), b = (int)(bt / T);
        delta[((size_t)b * H + h) * T + t] = s;
    }
}
