"""Per-kernel timings at the 0.22B config's shapes (B=8, T=4096, C=768, H=12, N=64, F=3072, V=65536, MoBA
chunk 512, top-3), as llm.c's dev/cuda does for its kernels: every kernel family, in fp32 and bf16
activations, with the achieved bandwidth or FLOP rate against the measured H200 ceilings.

Report, don't assert. Each row is timed with CUDA events around repeated runs of its plan (after a
warm-up run) on random data (never zeros); ``extra_info`` holds ms per call, GB/s (the fewest bytes the
op must move: every input read once, every output written once), TFLOP/s where the op is arithmetic,
and the share of the ceiling. scripts/gpu_check.sh prints the table. Skipped without a GPU.
"""
from __future__ import annotations


import numpy as np
import pytest

from rwkvx.config import DECAY_SCALE
from rwkvx.cu import adamw, channelmix, embedding, layernorm, loss, moba, timemix, wkv7
from rwkvx.runtime import gemm as G
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES, to_storage

B, T, C, H, N, F, V = 8, 4096, 768, 12, 64, 3072, 65536
R = B * T
CHUNK, TOP_K = 512, 3
COPY_GBS = 4300.0                                             # measured device-to-device copy (KINDS.md)
GEMM_TFLOPS = {"fp32": 51.0, "tf32": 401.0, "bf16": 790.0}     # measured 8192^3 GEMMs (KERNEL_NOTES.md)


class Buffers:
    """Random device buffers for one benchmark (freed with it)."""

    _pool = np.random.default_rng(0).standard_normal(1 << 22)

    def __init__(self, dev, xtype: str):
        self.dev, self.xtype, self.keep = dev, xtype, []

    def __call__(self, count: int, elem: str = "x", scale: float = 1.0, offset: float = 0.0, values=None):
        elem = self.xtype if elem == "x" else elem
        buf = self.dev.alloc(max(count * ELEM_BYTES[elem], 256))
        self.keep.append(buf)
        ptr = buf.typed(elem)
        if values is not None:
            self.dev.upload(ptr, to_storage(elem, values))
            return ptr
        block = to_storage(elem, self._pool * scale + offset)   # a random block repeated: not zeros, and
        for start in range(0, count, block.size):               # cheap to make for GB-sized buffers
            self.dev.upload(ptr.offset(start), block[:count - start])
        return ptr


def record(benchmark, dev, ops, nbytes: float = 0.0, flops: float = 0.0, ceiling: str = "copy") -> None:
    """Time ``ops`` (CUDA events) and store ms, GB/s, TFLOP/s and the roofline share in extra_info."""
    from rwkvx._core import Plan
    from rwkvx.runtime import EventTimer
    plan = Plan(dev, ops)
    plan.run()
    dev.synchronize()
    timer = EventTimer(dev)
    ms = timer.time_ms(plan.run, 1)
    reps = max(3, min(200, int(50.0 / max(ms, 1e-3))))          # about 50 ms of device time
    ms = timer.time_ms(plan.run, reps)
    timer.close()

    def once():
        plan.run()
        dev.synchronize()

    store(benchmark, dev, ms, once, nbytes, flops, ceiling)


def time_alone(dev, op, runs: int = 20) -> float:
    """ms of one op run alone (CUDA events, after a warm-up run): scripts/*_launches.py's unit."""
    from rwkvx._core import Plan
    from rwkvx.runtime import EventTimer
    plan = Plan(dev, [op])
    plan.run()
    dev.synchronize()
    timer = EventTimer(dev)
    ms = timer.time_ms(plan.run, runs)
    timer.close()
    return ms


def store(benchmark, dev, ms: float, once, nbytes: float = 0.0, flops: float = 0.0, ceiling: str = "copy") -> None:
    """ms (timed by the caller) with its GB/s, TFLOP/s and roofline share into extra_info; ``once`` runs
    the work for pytest-benchmark's own rounds."""
    gbs = nbytes / ms / 1e6
    tflops = flops / ms / 1e9
    share = tflops / GEMM_TFLOPS[ceiling] if ceiling in GEMM_TFLOPS else gbs / COPY_GBS
    benchmark.extra_info.update({"ms": round(ms, 4), "GB/s": round(gbs, 1), "TFLOP/s": round(tflops, 2),
                                 "roofline_%": round(100 * share, 1),
                                 # data that fits in L2 twice over is re-read from L2, not HBM, between calls
                                 "ceiling": ceiling + (" (L2-resident)" if nbytes and nbytes < 2 * dev.info.l2_bytes
                                                       else "")})
    benchmark.pedantic(once, rounds=3, iterations=1)


def _x(xtype: str) -> int:
    return ELEM_BYTES[xtype]


# ------------------------------------------------------------------------------------------------ layernorm
@pytest.mark.parametrize("xtype", XTYPES)
def test_layernorm_forward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    ops = layernorm.forward(b(R * C), b(C, "f32"), b(C, "f32"), b(R * C), b(R, "f32"), b(R, "f32"), R, C)
    record(benchmark, dev, ops, nbytes=2 * R * C * _x(xtype) + 8 * R)


@pytest.mark.parametrize("xtype", XTYPES)
def test_layernorm_backward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    ops = layernorm.backward(b(R * C), b(C, "f32"), b(R * C), b(R * C), b(C, "f32"), b(C, "f32"), b(R, "f32", 0.1, 0),
                             b(R, "f32", 0.1, 1.0), b(layernorm.scratch_elems(R, C, dev.info), "f32"), R, C,
                             dev.info, accumulate_dx=True)
    record(benchmark, dev, ops, nbytes=4 * R * C * _x(xtype) + 8 * R)     # x, dy, dx read; dx written


# ------------------------------------------------------------------------------------------------ embedding
@pytest.mark.parametrize("xtype", XTYPES)
def test_embedding_forward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    tok = np.random.default_rng(1).integers(0, V, R)
    ops = embedding.forward(b(R, "i32", values=tok), b(V * C, "f32"), b(R * C), R, C, V, dev.info)
    record(benchmark, dev, ops, nbytes=R * C * (4 + _x(xtype)) + 4 * R)


@pytest.mark.parametrize("xtype", XTYPES)
def test_embedding_backward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    tok = np.random.default_rng(1).integers(0, V, R)
    order, seg, nseg = embedding.sort_tokens(tok)
    ops = embedding.backward(b(R * C), b(R, "i32", values=tok), b(R, "i32", values=order),
                             b(R + 1, "i32", values=seg), b(1, "i32", values=nseg), b(V * C, "f32"), R, C, V)
    record(benchmark, dev, ops, nbytes=R * C * _x(xtype) + V * C * 4)    # dx read, demb zeroed / written


# ------------------------------------------------------------------------------------------------ loss
@pytest.mark.parametrize("xtype", XTYPES)
def test_cross_entropy(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    logits = b(R * V, scale=3.0)
    targets = np.random.default_rng(2).integers(0, V, R)
    ops = loss.cross_entropy(logits, b(R, "i32", values=targets), b(R, "f64"), logits,
                             b(1, "f64", values=[1.0 / R]), R, V)
    record(benchmark, dev, ops, nbytes=2 * R * V * _x(xtype) + 12 * R)   # logits read, dlogits written in place


# ------------------------------------------------------------------------------------------------ channel mix
@pytest.mark.parametrize("xtype", XTYPES)
def test_channelmix_shift_mix(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    record(benchmark, dev, channelmix.shift_mix(b(R * C), b(C, "f32", 0.2, 0.5), b(R * C), R, T, C, dev.info),
           nbytes=2 * R * C * _x(xtype))


@pytest.mark.parametrize("xtype", XTYPES)
def test_channelmix_relu_sq(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    h = b(R * F)
    record(benchmark, dev, channelmix.relu_sq(h, h, R * F, dev.info), nbytes=2 * R * F * _x(xtype))


@pytest.mark.parametrize("xtype", XTYPES)
def test_channelmix_relu_sq_backward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    dk = b(R * F)
    record(benchmark, dev, channelmix.relu_sq_backward(dk, b(R * F, offset=1.0), dk, R * F, dev.info,
                                                       src_is_k=True),
           nbytes=3 * R * F * _x(xtype))


@pytest.mark.parametrize("xtype", XTYPES)
def test_channelmix_mix_backward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    ops = channelmix.mix_backward(b(R * C), b(R * C), b(C, "f32", 0.2, 0.5), b(R * C), b(C, "f32"),
                                  b(channelmix.scratch_elems(R, C, dev.info), "f32"), R, T, C, dev.info)
    record(benchmark, dev, ops, nbytes=3 * R * C * _x(xtype))


# ------------------------------------------------------------------------------------------------ time mix
def _mixes(b):
    return [b(C, "f32", 0.2, 0.5) for _ in range(6)]


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_shift_forward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    ops = timemix.shift_forward(b(R * C), _mixes(b), [b(R * C) for _ in range(6)], R, C, T, dev.info)
    record(benchmark, dev, ops, nbytes=7 * R * C * _x(xtype))


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_shift_backward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    ops = timemix.shift_backward(b(R * C), _mixes(b), [b(R * C) for _ in range(6)], b(R * C),
                                 [b(C, "f32") for _ in range(6)], b(timemix.scratch_elems(R, C, N, dev.info), "f32"),
                                 R, C, T, dev.info)
    record(benchmark, dev, ops, nbytes=8 * R * C * _x(xtype))


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("kind", ["tanh_forward", "sigmoid_backward"])
def test_timemix_lora_activation(benchmark, dev, xtype, kind):
    b = Buffers(dev, xtype)
    n = R * 128                     # the gate LoRA's hidden layer (dim_g = 128 at C = 768)
    x = b(n)
    ops = (timemix.tanh_forward(x, x, n, dev.info) if kind == "tanh_forward"
           else timemix.sigmoid_backward(b(n, scale=0.2, offset=0.5), x, x, n, dev.info))
    record(benchmark, dev, ops, nbytes=(2 if kind == "tanh_forward" else 3) * n * _x(xtype))


def _prep(b, layer):
    return dict(k=b(R * C), v=b(R * C), wl=b(R * C), al=b(R * C), vl=b(R * C) if layer else None,
                v_first=b(R * C), w0=b(C, "f32", 1.0, -2.0), a0=b(C, "f32"), v0=b(C, "f32") if layer else None,
                k_k=b(C, "f32", 0.1, 0.7), k_a=b(C, "f32", 0.1, 1.0), R=R, C=C, N=N, layer=layer)


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_prep_forward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    ops = timemix.prep_forward(**_prep(b, 1), decay=b(R * C), kp=b(R * C), vp=b(R * C), wa=b(R * C), wb=b(R * C),
                               dev=dev.info)
    record(benchmark, dev, ops, nbytes=11 * R * C * _x(xtype))


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_prep_backward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    g = {n: b(R * C, "f32" if n in ("d_decay", "dkp", "dvp", "dwa", "dwb") else "x")     # WKV7's f32 grads
         for n in ("d_decay", "dkp", "dvp", "dwa", "dwb", "dkp2", "dvp2", "dr", "dr2", "dk", "dv", "dwl", "dal",
                   "dvl", "dv_first")}
    ops = timemix.prep_backward(**_prep(b, 1), **g, dr_out=g["dr"], partials=b(timemix.scratch_elems(R, C, N, dev.info),
                                                                              "f32"),
                                dparams=[b(C, "f32") for _ in range(5)], dev=dev.info)
    record(benchmark, dev, ops, nbytes=(18 * _x(xtype) + 5 * 4) * R * C)   # 16 read (5 of them f32), 7 written


def _gn(b):
    return dict(y=b(R * C), r=b(R * C), kp=b(R * C), vp=b(R * C), g=b(R * C), ln_w=b(C, "f32", 0.1, 1.0),
                ln_b=b(C, "f32", 0.1), r_k=b(C, "f32", 0.1), R=R, C=C, N=N, dev=b.dev.info)


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_gn_forward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    record(benchmark, dev, timemix.gn_forward(**_gn(b), z=b(R * C)), nbytes=6 * R * C * _x(xtype))


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_gn_backward(benchmark, dev, xtype):
    b = Buffers(dev, xtype)
    ops = timemix.gn_backward(**_gn(b), dz=b(R * C), dy=b(R * C), dg=b(R * C), dr2=b(R * C), dkp2=b(R * C),
                              dvp2=b(R * C), partials=b(timemix.scratch_elems(R, C, N, dev.info), "f32"),
                              dparams=[b(C, "f32") for _ in range(3)])
    record(benchmark, dev, ops, nbytes=11 * R * C * _x(xtype))


# ------------------------------------------------------------------------------------------------ WKV7
WKV_SHAPES = {"B8_T4096_H12": (8, 4096, 12), "B16_T512_H12": (16, 512, 12), "B1_T16384_H12": (1, 16384, 12),
              "B8_T4096_H64": (8, 4096, 64)}


def _wkv_inputs(b, Bw, Tw, Hw):
    n = Bw * Tw * Hw * N
    rng = np.random.default_rng(3)
    kk = rng.standard_normal((n // N, N))
    kk = (kk / np.linalg.norm(kk, axis=1, keepdims=True)).reshape(-1)
    rate = 1 / (1 + np.exp(-rng.standard_normal(n)))
    w = np.exp(-DECAY_SCALE / (1 + np.exp(-rng.standard_normal(n))))
    return [b(n, scale=0.5), b(n, values=w), b(n, scale=0.5), b(n, scale=0.5), b(n, values=-kk),
            b(n, values=kk * rate)], n


def _wkv_flops(n: int) -> float:
    return 8.0 * n * N          # per token and state row: sa, update (3 FMA), y: ~4 multiply-adds per element


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("shape", list(WKV_SHAPES))
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("method", wkv7.METHODS)
def test_wkv7(benchmark, dev, xtype, shape, direction, method):
    """One row per method x element type x shape x direction. The roofline is the copy rate over the
    bytes the op must move (inputs, outputs, what the forward saves for the backward): the chunked
    method's work buffer (chunk records, dS) is traffic on top of that floor, so it lowers the share."""
    from rwkvx._core import Plan
    if method == "chunked_exact" and xtype != "f32":
        pytest.skip("chunked_exact takes f32 inputs (the fp32 precision's path)")
    Bw, Tw, Hw = WKV_SHAPES[shape]
    b = Buffers(dev, xtype)
    inp, n = _wkv_inputs(b, Bw, Tw, Hw)
    sizes = wkv7.scratch_elems(Bw, Tw, Hw, N, dev.info, method=method)
    sa, ckpt = b(sizes["sa"], "f32"), b(sizes["ckpt"], "f32")
    part = b(sizes["partials"], "f32") if sizes["partials"] else None
    extra = {"method": method, "partials": part} if method in wkv7.CHUNKED_METHODS else {}
    fwd = wkv7.forward(*inp, b(n), Bw, Tw, Hw, N, dev.info, sa=sa, ckpt=ckpt, **extra)
    saved_bytes = 4 * (sizes["sa"] + sizes["ckpt"])
    if direction == "forward":
        record(benchmark, dev, fwd, nbytes=7 * n * _x(xtype) + saved_bytes, flops=_wkv_flops(n))
        return
    Plan(dev, fwd).run()                          # real checkpoints of these inputs
    ops = wkv7.backward(*inp, b(n), sa, ckpt, b(n), *[b(n, "f32") for _ in range(5)], Bw, Tw, Hw, N, dev.info,
                        partials=part, method=method)
    record(benchmark, dev, ops, nbytes=(8 * _x(xtype) + 5 * 4) * n + saved_bytes, flops=2 * _wkv_flops(n))


# ------------------------------------------------------------------------------------------------ MoBA
MOBA_SHAPES = {"B8-T4096": (B, T, CHUNK), "B1-T65536": (1, 65536, 4096)}   # (batch, tokens, chunk); top-3
MOBA_CEILING = {("exact", "f32"): "fp32", ("exact", "bf16"): "fp32", ("mma", "f32"): "tf32",
                ("mma", "bf16"): "bf16"}


def _visible_keys(Tm: int, chunk: int) -> float:
    """Keys each query attends to, summed over one (sequence, head): own block up to t + top-2 full blocks."""
    total = 0
    for t in range(Tm):
        blk = t // chunk
        total += (t - blk * chunk + 1) + min(TOP_K - 1, blk) * chunk
    return float(total)


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("method", moba.METHODS)
@pytest.mark.parametrize("shape", list(MOBA_SHAPES))
@pytest.mark.parametrize("direction", ["select", "forward", "backward"])
def test_moba(benchmark, dev, xtype, method, shape, direction):
    """One attention block. select: the gate, top-k and query lists alone (kmean, select, scan, fill;
    the same kernels for both methods); forward: all of the forward (selection included); backward.
    TFLOP/s count the visible (selected) keys only: 4 N flops per (query, key) forward, 10 N backward."""
    Bm, Tm, chunk = MOBA_SHAPES[shape]
    if direction == "select" and method != "exact":
        pytest.skip("the selection kernels are the same for both methods")
    b = Buffers(dev, xtype)
    rc = Bm * Tm * C
    q, k, v, o = b(rc), b(rc), b(rc), b(rc)
    scratch = {name: (b(count, elem) if count else None)
               for name, (count, elem) in moba.scratch_sizes(Bm, Tm, H, N, chunk, TOP_K).items()}
    fwd = moba.forward(q, k, v, o, scratch, Bm, Tm, H, N, chunk, TOP_K, dev.info, method=method)
    visible = Bm * H * _visible_keys(Tm, chunk)
    ceiling = MOBA_CEILING[method, xtype]
    if direction == "select":
        sel_ops = [op for op in fwd if op.name in ("moba_kmean", "moba_select", "moba_scan", "moba_fill")]
        record(benchmark, dev, sel_ops, nbytes=2 * rc * _x(xtype))
    elif direction == "forward":
        record(benchmark, dev, fwd, nbytes=4 * rc * _x(xtype), flops=4 * N * visible, ceiling=ceiling)
    else:
        from rwkvx._core import Plan
        Plan(dev, fwd).run()                       # the selection and lse the backward reads
        ops = moba.backward(q, k, v, o, b(rc), b(rc), b(rc), b(rc), scratch, Bm, Tm, H, N, chunk, TOP_K,
                            dev.info, method=method)
        record(benchmark, dev, ops, nbytes=8 * rc * _x(xtype), flops=10 * N * visible, ceiling=ceiling)


def sdpa_dense(Bm: int, Tm: int, chunk: int, backend: str, runs: int = 20) -> tuple[float, float, object]:
    """torch's SDPA (bf16; backend "flash" or "cudnn") on one MoBA block's work in dense pieces -- the own
    blocks as causal attention over sequences of one chunk, each past selection of a block as non-causal
    attention of its chunk of queries over the chunk of keys (the same visible keys as _visible_keys):
    ms of the forward and of forward + backward (CUDA events), and a function running the latter once."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    nblk = Tm // chunk
    pieces = ((Bm * nblk, True), (Bm * sum(min(TOP_K - 1, j) for j in range(nblk)), False))
    tensors = []
    for n, causal in pieces:
        q, k, v = (torch.randn(n, H, chunk, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        tensors.append((q, k, v, torch.randn_like(q), causal))

    def forward():
        with sdpa_kernel(kind):
            return [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c)
                    for q, k, v, _, c in tensors]

    def both():
        for out, (*_, do, _c) in zip(forward(), tensors):
            out.backward(do)

    times = []
    for fn in (forward, both):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(runs):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / runs)
    return times[0], times[1], lambda: (both(), torch.cuda.synchronize())


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("shape", list(MOBA_SHAPES))
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_moba_sdpa_peer(benchmark, dev, backend, shape, direction):
    """The FlashAttention-class peer: torch's SDPA (outside reference, bf16) on test_moba's visible keys in
    dense pieces (sdpa_dense); TFLOP/s counted as there. It has no gate, no selection, no gather."""
    pytest.importorskip("torch", reason="torch (an outside reference only) is not installed")
    Bm, Tm, chunk = MOBA_SHAPES[shape]
    fwd_ms, both_ms, once = sdpa_dense(Bm, Tm, chunk, backend)
    visible = Bm * H * _visible_keys(Tm, chunk)
    ms, flops = (fwd_ms, 4 * N * visible) if direction == "forward" else (both_ms - fwd_ms, 10 * N * visible)
    store(benchmark, dev, ms, once, flops=flops, ceiling="bf16")


# ------------------------------------------------------------------------------------------------ AdamW
def test_adamw(benchmark, dev):
    from rwkvx import Config, param_shapes
    from rwkvx.optim import Schedule
    shapes = param_shapes(Config(vocab_size=V, n_embd=C, n_rwkv_layer=12, n_attn_layer=4,
                                 moba_chunk_size=CHUNK, moba_top_k=TOP_K))
    segs, n = adamw.flat_layout(shapes)
    table, lrmul = adamw.build_table(segs)
    b = Buffers(dev, "f32")
    ops = adamw.step(b(n, "f32"), b(n, "f32", 1e-3), b(n, "f32", 1e-3), b(n, "f32", 1e-4, 1e-3),
                     b(table.size, "i32", values=table.reshape(-1)), b(lrmul.size, "f32", values=lrmul),
                     b(adamw.STATE_DOUBLES, "f64", values=adamw.state_from_schedule(Schedule(), 1.0)), len(table),
                     b(adamw.scratch_elems(len(table)), "f64"), weight_decay=0.1, clip=True)
    record(benchmark, dev, ops, nbytes=8 * 4 * n)     # p, g, m, v read (g twice: norm, update); p, m, v written


# ------------------------------------------------------------------------------------------------ GEMMs
GEMMS = {"proj_CxC": (R, C, C), "ffn_key_CxF": (R, C, F), "head_CxV": (R, C, V)}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("name", list(GEMMS))
def test_gemm(benchmark, dev, precision, name):
    rows, n_in, n_out = GEMMS[name]
    prec = G.PRESETS[precision]
    b = Buffers(dev, prec.a)
    op = G.linear(b(rows * n_in, prec.b), b(n_out * n_in, prec.a, 0.03), b(rows * n_out, prec.c), rows, n_in, n_out,
                  precision=prec)
    record(benchmark, dev, [op], flops=2.0 * rows * n_in * n_out, ceiling=precision)
