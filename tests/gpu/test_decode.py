"""GPU tests of stateful generation: the single-token kernels of rwkvx/cu/decode/decode.cu and gemv.cu against
their twins (rwkvx.oracle.decode_shift / decode_wkv7 / decode_time_mix / decode_moba / decode_gemv; dec_ln_shift
against the LayerNorm twin then decode_shift) in fp32 and bf16 (harness.KernelCase), the
device sampler dec_sample (rwkvx/cu/decode/sample.cu) against the sampling contract's numpy
implementation token for token (rwkvx.oracle.decode_sample) and its frequencies against the contract's
probabilities, then the whole rwkvx.decoder.Decoder against the GPU model's own forward: the prompt in
parallel plus one graph replay per token gives the forward's logits at every position from the prefill's
on, up to a MoBA near-tie that the two break differently (fp32: <= 1e-5 relative; up to 8 sequences the
fused step, 9 the step with the forward's GEMMs; also the benchmarked presets' sizes with fewer blocks, as
dec_gemv is at their products' sizes), greedy rwkvx.generate on the GPU is the argmax of a full
forward re-run, and a second generate reuses the decoder kept on the model (same tokens, nothing rebuilt,
new weights seen); a state-tuned model's decoder starts from its initial states, a LoRA model's applies its
factors (and its step's graph gives what its plan run op by op gives).
"""
from __future__ import annotations

import numpy as np
import pytest

from harness import KernelCase, check, tolerance
from rwkvx import Config
from rwkvx.config import DECAY_SCALE
from rwkvx.config import LN_EPS
from rwkvx.presets import get_preset
from rwkvx.oracle.decode import GEMV_EPILOGUES
from rwkvx.oracle import (Oracle, decode_gemv, decode_moba, decode_sample, decode_shift, decode_time_mix, decode_wkv7,
                          layernorm_forward, moba_block_means, rel_err)
from rwkvx.cu import decode as D
from rwkvx.runtime.dtypes import round_to
from rwkvx.sampling import WEIGHT_BITS, WEIGHT_CUTOFF, Sampling, contract_exp, sample_rows

from seeding import seeded_rng
from test_model_parity import NEAR_TIE
from tuned_models import LORA_ALPHA, tuned_model

FWD_TOL = 1e-5


# ------------------------------------------------------------------ kernels

@pytest.mark.parametrize("B, C, nmix", [(1, 64, 6), (3, 256, 6), (2, 768, 1), (1, 4, 1)])
def test_dec_shift(case, dev, B, C, nmix):
    rng = seeded_rng()
    x = case.input("x", rng.standard_normal((B, C)), "f32")          # a LayerNorm output: f32 in every precision
    prev = case.inout("prev", rng.standard_normal((B, C)), "f32")
    mixes = [case.input(f"m{j}", rng.uniform(size=C), "f32") for j in range(nmix)]
    outs = [case.output(f"o{j}", (B, C)) for j in range(nmix)]
    out = case.run(D.shift(x, prev, mixes, outs, B, C, dev.info))
    seen = case.seen
    want, new_prev = decode_shift(seen["x"], seen["prev"], np.stack([seen[f"m{j}"] for j in range(nmix)]))
    for j in range(nmix):
        check(f"o{j}", out[f"o{j}"], want[j], tolerance(case.xtype, 1e-6))
    assert np.array_equal(out["prev"], new_prev), "prev must become x exactly"


@pytest.mark.parametrize("B, C, nmix", [(1, 768, 6), (3, 64, 6), (8, 256, 1), (2, 4, 1)])
def test_dec_ln_shift(case, B, C, nmix):
    """The LayerNorm's twin, then dec_shift's on its output."""
    rng = seeded_rng()
    x = case.input("x", 2 + 3 * rng.standard_normal((B, C)), "f32")      # the residual stream: f32
    w, b = (case.input(n, rng.standard_normal(C), "f32") for n in ("w", "b"))
    y = case.output("y", (B, C), "f32")
    mean, rstd = case.output("mean", B, "f32"), case.output("rstd", B, "f32")
    prev = case.inout("prev", rng.standard_normal((B, C)), "f32")
    mixes = [case.input(f"m{j}", rng.uniform(size=C), "f32") for j in range(nmix)]
    outs = [case.output(f"o{j}", (B, C)) for j in range(nmix)]
    out = case.run(D.ln_shift(x, w, b, y, mean, rstd, prev, mixes, outs, B, C, LN_EPS))
    seen = case.seen
    want_y, want_mean, want_rstd = layernorm_forward(seen["x"], seen["w"], seen["b"], LN_EPS, return_stats=True)
    check("y", out["y"], want_y, FWD_TOL)
    check("mean", out["mean"], want_mean, FWD_TOL)
    check("rstd", out["rstd"], want_rstd, FWD_TOL)
    want, _ = decode_shift(out["y"], seen["prev"], np.stack([seen[f"m{j}"] for j in range(nmix)]))
    for j in range(nmix):
        check(f"o{j}", out[f"o{j}"], want[j], tolerance(case.xtype, 1e-6))
    assert np.array_equal(out["prev"], out["y"]), "prev must become y exactly"


@pytest.mark.parametrize("B, H, N", [(1, 12, 64), (2, 3, 16), (3, 2, 128), (2, 4, 4), (1, 2, 32), (2, 2, 8)])
def test_dec_wkv7(case, dev, B, H, N):
    rng = seeded_rng()
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))     # noqa: E731
    shp = (B, H, N)
    kk = rng.standard_normal(shp)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    x = dict(r=0.5 * rng.standard_normal(shp), w=np.exp(-DECAY_SCALE * sig(rng.standard_normal(shp))),
             k=0.5 * rng.standard_normal(shp), v=0.5 * rng.standard_normal(shp), a=-kk,
             b=kk * sig(rng.standard_normal(shp)))
    inp = {n: case.input(n, x[n], "f32" if n == "w" else "x") for n in "rwkvab"}     # the decay: f32
    state = case.inout("state", rng.standard_normal((B, H, N, N)), "f32")
    y = case.output("y", shp)
    out = case.run(D.wkv7_step(*inp.values(), state, y, B, H, N))
    want_y, want_state = decode_wkv7(*(case.seen[n] for n in "rwkvab"), case.seen["state"])
    check("y", out["y"], want_y, tolerance(case.xtype, FWD_TOL))
    check("state", out["state"], want_state, FWD_TOL)       # fp32 in both element types


# (B, H, N, layer, ranks w, a, v, g): the 0.1B shapes, ranks that do not split in four, layer 0 (no value LoRA)
TMIX = [(1, 12, 64, 1, (64, 64, 32, 128)), (3, 2, 16, 0, (10, 6, 0, 7)), (2, 2, 128, 1, (8, 12, 5, 16)),
        (2, 4, 4, 1, (4, 4, 4, 4)), (8, 3, 32, 0, (16, 16, 0, 32)), (1, 2, 8, 1, (3, 9, 2, 1))]


@pytest.mark.parametrize("B, H, N, layer, ranks", TMIX)
def test_dec_tmix(case, B, H, N, layer, ranks):
    """z, the new state and v_first against the composed twins (LoRA products, prep, WKV7 token, GroupNorm),
    with the intermediates rounded to floatX where the kernel rounds them: in bf16 the exact twin's z
    differs from the kernel's by those roundings alone, over the limit on 0.3-0.4% of draws at N 4 and 8."""
    rng = seeded_rng()
    C = H * N
    paths = [p for p, d in zip(D.LORA2, ranks) if d]
    dims = dict(zip(D.LORA2, ranks))
    hidden = {p: case.input(f"h{p}", np.tanh(rng.standard_normal((B, dims[p])))) for p in paths}
    second = {p: case.input(f"{p}2", rng.standard_normal((dims[p], C)) / np.sqrt(dims[p])) for p in paths}
    rows = {n: case.input(n, rng.standard_normal((B, C))) for n in ("r", "k", "v")}
    vf = case.inout("vf", rng.standard_normal((B, C)))
    vec = {n: case.input(n, lo + (hi - lo) * rng.uniform(size=C), "f32") for n, lo, hi in
           (("w0", -6, -1), ("a0", -1, 1), ("v0", 0, 2), ("k_k", 0.5, 1), ("k_a", 0.5, 1.5), ("lnw", 0.5, 1.5),
            ("lnb", -0.2, 0.2), ("rk", -0.3, 0.3)) if n != "v0" or layer}
    state = case.inout("state", 0.3 * rng.standard_normal((B, H, N, N)), "f32")
    z = case.output("z", (B, C))
    out = case.run(D.tmix_step(hidden, second, dims, rows["r"], rows["k"], rows["v"], vf, vec["w0"], vec["a0"],
                               vec.get("v0"), vec["k_k"], vec["k_a"], state, vec["lnw"], vec["lnb"], vec["rk"], z,
                               B, H, N))
    seen = case.seen
    want_z, want_state, want_vf = decode_time_mix(
        {p: seen[f"h{p}"] for p in paths}, {p: seen[f"{p}2"] for p in paths}, seen["r"], seen["k"], seen["v"],
        seen["vf"], seen["w0"], seen["a0"], seen.get("v0"), seen["k_k"], seen["k_a"], seen["state"], seen["lnw"],
        seen["lnb"], seen["rk"], N, case.xtype)
    check("z", out["z"], want_z, tolerance(case.xtype, FWD_TOL))
    check("state", out["state"], want_state, tolerance(case.xtype, FWD_TOL))  # from floatX intermediates
    if layer:
        assert np.array_equal(out["vf"], seen["vf"]), "v_first is only read after the first layer"
    else:
        assert np.array_equal(out["vf"], seen["v"]), "the first layer's v becomes v_first"


# dec_gemv jobs (n, k, kn, epilogue, residual): column counts that leave partial tiles, a k range the
# warps split unevenly, every epilogue, a residual add, a wide and a long product
GEMV_JOBS = [(96, 64, False, "none", False), (40, 32, False, "tanh", False), (48, 64, True, "sigmoid", False),
             (64, 20, True, "relu_sq", False), (64, 128, False, "none", True), (33, 96, True, "none", True),
             (1000, 768, False, "none", False), (23, 3072, False, "relu_sq", False)]
# a LoRA model's step: each adapted projection's product beside its first factor x·A ([k, n] with n the
# rank r, most lanes of the tile idle; k the model width or the FFN's), an output's residual add, and
# (LoRA scale 1) the update h·B added in place ([k, n] with k = r: most warps' k range empty)
LORA_GEMV_JOBS = [(64, 64, False, "none", False), (2, 64, True, "none", False), (256, 64, False, "none", False),
                  (2, 1024, True, "none", False), (1, 256, True, "none", False), (3, 20, True, "none", False),
                  (64, 256, False, "none", True), (64, 2, True, "none", True)]

# the products of the benchmarked presets' steps at their sizes: rwkv7-0.1b / the 0.22B RWKV-X (C 768, F 3072:
# the head over V = 65536, the FFN's key and value, the gate's LoRA first layer) and rwkv7-1.5b (C 2048, F
# 8192: the FFN's key and value, whose rows dec_gemv splits in the most k-slices, the decay's LoRA first
# layer of rank 96, a projection)
PRESET_GEMV_JOBS = [(65536, 768, False, "none", False), (3072, 768, False, "relu_sq", False),
                    (768, 3072, False, "none", True), (128, 768, True, "sigmoid", False),
                    (8192, 2048, False, "relu_sq", False), (2048, 8192, False, "none", True),
                    (96, 2048, True, "tanh", False), (2048, 2048, False, "none", False)]
GEMV_SPECS = {"shapes": GEMV_JOBS, "lora": LORA_GEMV_JOBS, "presets": PRESET_GEMV_JOBS}


@pytest.mark.parametrize("specs", GEMV_SPECS.values(), ids=GEMV_SPECS.keys())
@pytest.mark.parametrize("B", [1, 3, 8])
def test_dec_gemv(case, B, specs):
    """All eight jobs in one launch, each against its twin (a residual: its addend plus the product; the
    first residual job adds another buffer, left as it was, the second adds to its output in place)."""
    rng = seeded_rng()
    jobs, addends = [], {}
    for j, (n, k, kn, epi, res) in enumerate(specs):
        # a job of one or two outputs has no other output to set the check's scale: a draw whose dot cancels
        # would be its whole relative error, so its operands are drawn non-negative (condition number 1)
        sign = np.abs if n * B <= 2 else np.asarray
        x = case.input(f"x{j}", sign(rng.standard_normal((B, k))))
        w = case.input(f"w{j}", sign(rng.standard_normal((k, n) if kn else (n, k))) / np.sqrt(k))
        if not res:
            jobs.append(D.GemvJob(x, w, case.output(f"o{j}", (B, n)), n, k, kn, epi))
        elif not addends:
            addends[j] = f"a{j}"
            addend = case.input(f"a{j}", rng.standard_normal((B, n)), "f32")
            jobs.append(D.GemvJob(x, w, case.output(f"o{j}", (B, n), "f32"), n, k, kn, residual=True, addend=addend))
        else:
            addends[j] = f"o{j}"
            jobs.append(D.GemvJob(x, w, case.inout(f"o{j}", rng.standard_normal((B, n)), "f32"), n, k, kn,
                                  residual=True))
    out = case.run(D.gemv(jobs, B))
    for j, (n, k, kn, epi, res) in enumerate(specs):
        # an activation reads the product rounded to floatX (as the step's GEMM output buffer holds it)
        want = decode_gemv(case.seen[f"x{j}"], case.seen[f"w{j}"], kn)
        want = GEMV_EPILOGUES[epi](round_to(case.xtype, want)) if epi != "none" else want
        if res:                  # fp32 out in every precision: the products of the rounded inputs, summed in fp32
            check(f"o{j}", out[f"o{j}"], case.seen[addends[j]] + want, FWD_TOL)
        else:
            check(f"o{j}", out[f"o{j}"], want, tolerance(case.xtype, FWD_TOL))


@pytest.mark.parametrize("specs", GEMV_SPECS.values(), ids=GEMV_SPECS.keys())
@pytest.mark.parametrize("B", [1, 8])
def test_dec_gemv_rounds_operands_to_tf32(dev, B, specs):
    """The tf32 variant multiplies the operands rounded to TF32 (as the forward's tensor-core GEMMs): it
    equals the twin on the rounded operands to fp32 accumulation, far closer than the ~5e-4 of the
    rounding itself."""
    from harness import KernelCase
    from rwkvx.runtime.dtypes import round_tf32
    case, rng, jobs = KernelCase(dev, "f32"), seeded_rng(), []
    shapes = [job[:4] for job in specs if not job[4]]
    for j, (n, k, kn, epi) in enumerate(shapes):
        x = case.input(f"x{j}", rng.standard_normal((B, k)))
        w = case.input(f"w{j}", rng.standard_normal((k, n) if kn else (n, k)) / np.sqrt(k))
        jobs.append(D.GemvJob(x, w, case.output(f"o{j}", (B, n)), n, k, kn, epi, tf32=True))
    out = case.run(D.gemv(jobs, B))
    for j, (n, k, kn, epi) in enumerate(shapes):
        x, w = (round_tf32(case.seen[f"{p}{j}"].astype(np.float32)).astype(np.float64) for p in "xw")
        check(f"o{j}", out[f"o{j}"], decode_gemv(x, w, kn, epi), FWD_TOL)


# (B, H, N, chunk, top_k, positions): first / middle / last token of a block, fewer and more past blocks
# than top_k - 1, top_k = 1
MOBA = [(2, 2, 64, 8, 3, (0, 7, 8, 13, 23, 40, 63)), (1, 12, 64, 512, 3, (0, 511, 1023, 1500)),
        (3, 2, 16, 4, 6, (3, 9, 30)), (2, 3, 32, 16, 1, (0, 17, 40)), (1, 2, 128, 5, 2, (4, 12, 29)),
        (2, 2, 4, 1, 3, (0, 1, 5))]


def _clear_gaps(q, kmean, t, chunk, top_k, margin=1e-4):
    """True when the float64 gates of the query at position t leave no near-tie at the selection edge."""
    K1, bt = top_k - 1, t // chunk
    if K1 == 0 or bt <= K1:
        return True
    g = np.sort(np.einsum("bhn,bhjn->bhj", q, kmean[:, :, :bt]), axis=-1)[..., ::-1]
    return bool((g[..., K1 - 1] - g[..., K1] >= margin).all())


@pytest.mark.parametrize("B, H, N, chunk, top_k, positions", MOBA)
def test_dec_moba(dev, xtype, B, H, N, chunk, top_k, positions):
    Tmax = positions[-1] + 1 + chunk
    for t in positions:
        rng = seeded_rng()
        for _ in range(20):       # draw until no near-tie of the fp32 gate at the selection edge
            cache = rng.standard_normal((2, B, Tmax, H, N))
            cache[:, :, t:] = np.nan                          # positions >= t: not written yet, never read
            q, k, v = (rng.standard_normal((B, H, N)) for _ in range(3))
            kc, vc = (round_to(xtype, c) for c in cache)
            kmean = np.full((B, H, Tmax // chunk, N), np.nan)
            if t // chunk:
                kmean[:, :, :t // chunk] = moba_block_means(kc[:, :(t // chunk) * chunk], chunk)
            kmean_seen = round_to("f32", kmean)
            if _clear_gaps(round_to(xtype, q), kmean_seen, t, chunk, top_k):
                break
        case = KernelCase(dev, xtype)
        bufs = dict(q=case.input("q", q), k=case.input("k", k), v=case.input("v", v),
                    kc=case.inout("kc", cache[0]), vc=case.inout("vc", cache[1]),
                    kmean=case.inout("kmean", kmean, "f32") if top_k > 1 else None,
                    pos=case.input("pos", np.full(B, t), "i32"))
        o = case.output("o", (B, H, N))
        sel = case.output("sel", (B, H, top_k - 1), "i32") if top_k > 1 else None
        out = case.run(D.moba_step(*bufs.values(), o, B, H, N, Tmax, chunk, top_k, dev.info, sel=sel))
        s = case.seen
        want = decode_moba(s["q"], s["k"], s["v"], s["kc"], s["vc"],
                           s["kmean"] if top_k > 1 else np.zeros((B, H, 0, N)), t, chunk, top_k)
        o_want, sel_want, kc_want, vc_want, kmean_want = want
        if top_k > 1:
            assert np.array_equal(out["sel"], sel_want), f"t={t}: selection differs"
        check(f"o (t={t})", out["o"], o_want, tolerance(xtype, FWD_TOL))
        assert np.array_equal(out["kc"][:, :t + 1], kc_want) and np.array_equal(out["vc"][:, :t + 1], vc_want)
        if top_k > 1 and (t + 1) % chunk == 0:               # the block t completes: its mean, written
            check(f"kmean block {t // chunk}", out["kmean"][:, :, t // chunk], kmean_want[:, :, -1], 1e-6)
        if top_k > 1:                                       # nothing else of the mean cache changes
            others = np.ones(Tmax // chunk, bool)
            others[t // chunk] = (t + 1) % chunk != 0
            np.testing.assert_array_equal(out["kmean"][:, :, others], s["kmean"][:, :, others])


# ------------------------------------------------------------------ sampling on the device

SAMPLE_OPTIONS = [   # (temperature, top_p, top_k), as dec_sample's opts
    (0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.95, 40), (2.0, 1.0, 1), (0.5, 1e-6, 3),
    (1.0, 1e-9, 0), (4.0, 0.5, 2), (0.8, 0.9, 100000), (3.0, 1.0, 7)]


def sample_logits(rng, B, V, kind):
    """Logits at a random scale; "ties": rounded to few values; "special": NaN, -inf and (in row 0) two
    +inf among them."""
    z = rng.standard_normal((B, V)) * rng.choice([0.5, 3.0, 20.0])
    if kind == "ties":
        z = np.round(z)
    elif kind == "special":
        z[rng.random((B, V)) < 0.05] = np.nan
        z[rng.random((B, V)) < 0.05] = -np.inf
        z[0, rng.choice(V, 2, replace=False)] = np.inf
    return z


@pytest.mark.parametrize("B, V", [(3, 65536), (2, 50277), (8, 1000), (16, 7)])
def test_dec_sample_is_the_contract(case, B, V):
    rng = seeded_rng()
    ptrs = (case.input("logits", np.zeros((B, V))), case.input("u", np.zeros(B), "f64"),
            case.input("opts", np.zeros(3), "f64"))
    out = case.output("out", B, "i32")
    plan = case.plan(D.sample(*ptrs, out, B, V))
    for trial in range(60):
        kind = ("plain", "ties", "special")[trial % 3]
        case.set("logits", sample_logits(rng, B, V, kind))
        case.set("u", rng.random(B))
        case.set("opts", SAMPLE_OPTIONS[trial % len(SAMPLE_OPTIONS)])
        got = case.run(plan=plan)["out"].astype(np.int64)
        want = decode_sample(case.seen["logits"].astype(np.float32), case.seen["u"], case.seen["opts"])
        assert np.array_equal(got, want), f"trial {trial} ({kind}, opts {SAMPLE_OPTIONS[trial % len(SAMPLE_OPTIONS)]}): " \
                                          f"device {got}, contract {want}"


@pytest.mark.parametrize("opts", [(1.0, 1.0, 0), (0.6, 0.8, 0), (1.5, 1.0, 4)])
def test_dec_sample_frequencies_are_the_contracts_probabilities(case, opts):
    """Many draws of u over one row: each token's frequency is its probability q_i / N (5 sigma)."""
    from rwkvx._core import Plan
    rng = seeded_rng()
    B, V = 20000, 12
    row = rng.standard_normal(V)
    logits = case.input("logits", np.broadcast_to(row, (B, V)))
    u = case.input("u", rng.random(B), "f64")
    opts_buf = case.input("opts", opts, "f64")
    out = case.output("out", B, "i32")
    got = case.run(plan=Plan(case.dev, D.sample(logits, u, opts_buf, out, B, V)))["out"].astype(np.int64)
    # the contract's probabilities, from its weights: the nucleus of the top-k, renormalised
    temperature, top_p, top_k = opts
    z = case.seen["logits"][0].astype(np.float32).astype(np.float64)
    order = np.lexsort((np.arange(V), -z))[:top_k or V]
    x = (z[order] - z.max()) / temperature
    q = np.where(x >= WEIGHT_CUTOFF, np.floor(np.ldexp(contract_exp(np.maximum(x, WEIGHT_CUTOFF)), WEIGHT_BITS)), 0)
    cum = np.cumsum(q)
    keep = int(np.searchsorted(cum, max(1, np.ceil(top_p * cum[-1])))) + 1
    p = np.zeros(V)
    p[order[:keep]] = q[:keep] / cum[keep - 1]
    freq = np.bincount(got, minlength=V) / B
    sigma = np.sqrt(p * (1 - p) / B)
    assert (np.abs(freq - p) <= 5 * sigma + 1e-12).all(), f"frequencies {freq} against {p}"
    assert (freq[p == 0] == 0).all()


# ------------------------------------------------------------------ the decoder against the forward

DECODE = {   # name: (config, B, T, prompt length)
    "moba": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=2, moba_chunk_size=8,
                  moba_top_k=3), 2, 64, 5),
    "moba_b1_long_prompt": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                                 moba_chunk_size=8, moba_top_k=2), 1, 72, 33),
    "top_k_1_no_ln0": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                            moba_chunk_size=8, moba_top_k=1, ln0=False), 2, 40, 8),
    "big_top_k": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                       moba_chunk_size=4, moba_top_k=6), 3, 48, 1),
    "rwkv_only": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=3), 2, 40, 7),
    # more sequences than dec_gemv takes: the step keeps the forward's GEMMs
    "moba_b9": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1, moba_chunk_size=8,
                     moba_top_k=2), 9, 40, 30),
    "C256_N64": (dict(vocab_size=300, n_embd=256, head_size=64, n_rwkv_layer=2, n_attn_layer=1,
                      moba_chunk_size=32, moba_top_k=3), 1, 160, 40),
    # the benchmarked presets with fewer blocks: every other size theirs (V 65536, C 768, the LoRA ranks,
    # MoBA's chunk of 512), a prompt of 64 tokens
    "preset_rwkv7_0.1b": (dict(get_preset("rwkv7-0.1b")["model"], n_rwkv_layer=2), 8, 72, 64),
    "preset_base": (dict(get_preset("base")["model"], n_rwkv_layer=2, n_attn_layer=1), 4, 72, 64),
}
LOGIT_TOL = {"fp32": 1e-5, "tf32": 5e-3}


def prompts_without_near_ties(cfg, params, B, T, prompt_lens, rng, margin, tuned=None):
    """Random tokens [B, T] whose MoBA gates have no near-tie (float64 gate gap >= margin, of the model
    with ``tuned``'s states or LoRA factors, Oracle keyword arguments) inside each sequence's prompt
    (``prompt_lens[b]`` tokens; its prefix goes through the prefill, whose selection the decoder does not
    report), and the float64 gate gaps of every position (per attention block, [B, H, T])."""
    oracle = Oracle(cfg, params, dtype=np.float64, **(tuned or {}))
    for _ in range(20):
        tokens = rng.integers(0, cfg.vocab_size, (B, T))
        gaps = oracle.moba_gate_gaps(tokens) if cfg.n_attn_layer else []
        if all((g[b, :, :n] >= margin).all() for g in gaps for b, n in enumerate(prompt_lens)):
            return tokens, gaps
    pytest.skip("no draw without a near-tie of the MoBA gate inside the prompts")


# tuned models: random initial WKV states (the decoder starts every sequence from them) or random LoRA
# factors (every adapted projection applies them); fused steps (B <= 8) and not, LoRA scale 1.5 and 1
# (tuned_models.LORA_ALPHA: at scale 1 the fused step adds the update in dec_gemv, else in a GEMM)
TUNED = [("moba", "fp32", "state"), ("rwkv_only", "fp32", "state"), ("moba_b1_long_prompt", "fp32", "state"),
         ("C256_N64", "tf32", "state"), ("moba", "fp32", "lora"), ("moba_b9", "fp32", "lora"),
         ("C256_N64", "tf32", "lora"), ("moba", "fp32", "lora_unit"), ("C256_N64", "tf32", "lora_unit")]


@pytest.mark.parametrize("name, precision, tune", [c for c in TUNED if c[2] in LORA_ALPHA])
def test_lora_decoder_step_graph_is_its_plan_run_op_by_op(dev, name, precision, tune, training_like):
    """A LoRA model's step replayed as its CUDA graph gives the logits of its plan run op by op (eagerly:
    under CUDA_LAUNCH_BLOCKING=1 a failing op is named, where a graph's replay names none), bit for bit,
    token after token from the same prefill."""
    import types

    from rwkvx.decoder import Decoder
    from rwkvx.model import Model
    kwargs, B, T, P = DECODE[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    params = training_like(cfg, int(rng.integers(1 << 31)))
    model = Model(cfg, params, B, T, precision=precision, **tuned_model(cfg, tune, rng)["oracle"])
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    decoder = Decoder(model, B, P, T)
    graph = decoder._graph
    try:
        runs = []
        for replay in (types.SimpleNamespace(launch=decoder._step_plan.run), graph):
            decoder._graph = replay
            lengths, logits = decoder.prefill(tokens[:, :P], Sampling(temperature=0.0)), []
            for _ in range(4):
                decoder.step(tokens[np.arange(B), lengths], np.zeros(B))
                logits.append(decoder.logits())
                lengths += 1
            runs.append(np.stack(logits))
        assert np.array_equal(*runs), "the step's graph and its plan run op by op differ"
    finally:
        decoder._graph = graph
        decoder.free()


@pytest.mark.parametrize("name, precision, tune", [(n, "fp32", None) for n in DECODE]
                         + [(n, "tf32", None) for n in ("moba", "C256_N64", "preset_rwkv7_0.1b", "preset_base")]
                         + TUNED)
def test_decoder_logits_equal_the_forward_at_every_position(dev, name, precision, tune, training_like):
    """Sequence b's prompt has P - 3b tokens (at least 1), so the sequences run from different prefixes
    at different positions; every position a step sees gives the forward's logits and selection, and
    the token the step's sampler chose is the contract's on those logits. The forward and the decoder
    compute the MoBA gates apart: a selection may differ only where the float64 gate gap is a near-tie,
    and that sequence is compared no further (its later tokens legitimately diverge). Head size 64 runs
    the prefill on the chunked WKV7 (chunked_exact in fp32, the tensor-core kernel in tf32)."""
    from rwkvx.decoder import Decoder
    from rwkvx.model import Model
    kwargs, B, T, P = DECODE[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    seed = int(rng.integers(1 << 31))
    params = training_like(cfg, seed)
    tuned = tuned_model(cfg, tune, rng)["oracle"]
    prompt_lens = [max(1, P - 3 * b) for b in range(B)]
    margin = NEAR_TIE[precision]
    tokens, gaps = prompts_without_near_ties(cfg, params, B, T, prompt_lens, rng, margin, tuned)
    full_model = Model(cfg, params, B, T, precision=precision, **tuned)
    full = full_model.forward(tokens)
    selection = full_model.moba_selection()
    decoder = Decoder(full_model, B, P, T)          # reads the full model's weights
    sampling = Sampling(temperature=1.1, top_k=30, top_p=0.95)
    errs, diverged = [], {}
    try:
        lengths = decoder.prefill([tokens[b, :n] for b, n in enumerate(prompt_lens)], sampling)
        while (lengths < T).any():
            active, u = lengths < T, rng.random(B)
            new = decoder.step(tokens[np.arange(B), np.minimum(lengths, T - 1)], u, active)
            logits = decoder.logits()
            assert np.array_equal(new, sample_rows(logits, u, 1.1, 30, 0.95)), f"seed {seed}: device sampling"
            chosen = decoder.selection()
            for b in (int(b) for b in np.flatnonzero(active) if int(b) not in diverged):
                t = int(lengths[b])
                # block by block, up to the first near-tie that went the other way: the blocks above it
                # already see a different attention output, so their gaps no longer apply
                for j, (sel, ref, gap) in enumerate(zip(chosen, selection, gaps)):
                    differs = (sel[b] != ref[b, :, t]).any(axis=-1)
                    assert not (differs & (gap[b, :, t] >= margin)).any(), \
                        f"seed {seed}: block {j} selection differs at sequence {b}, t={t} (gate gaps {gap[b, :, t]})"
                    if differs.any():
                        diverged[b] = t
                        break
                if b not in diverged:
                    errs.append((rel_err(logits[b], full[b, t]), b, t))
            lengths += active
        with pytest.raises(ValueError, match="max_len"):
            decoder.step(tokens[:, 0], u)
    finally:
        decoder.free()
    assert errs, f"seed {seed}: every sequence met a near-tie selection at its first step"
    worst = max(errs)
    print(f"\n{name} {precision}: worst rel err {worst[0]:.2e} (sequence {worst[1]}, position {worst[2]}) over "
          f"{len(errs)} positions" + (f"; near-tie selections from {diverged}" if diverged else ""))
    assert worst[0] <= LOGIT_TOL[precision], f"seed {seed}: sequence {worst[1]} position {worst[2]}: {worst[0]:.2e}"


def test_decoder_prefill_again_starts_over(dev, training_like):
    from rwkvx.decoder import Decoder
    from rwkvx.model import Model
    kwargs, B, T, P = DECODE["moba"]
    cfg = Config(**kwargs)
    params = training_like(cfg, 1)
    rng = seeded_rng(1)
    a, b = rng.integers(0, cfg.vocab_size, (2, B, P + 3))
    decoder = Decoder(Model(cfg, params, B, P), B, P, P + 3)
    try:
        def run(tokens):
            fed = int(decoder.prefill(tokens[:, :P], Sampling(temperature=0.0))[0])
            out = []
            for t in range(fed, P + 3):
                decoder.step(tokens[:, t], np.zeros(B))
                out.append(decoder.logits())
            return np.stack(out, axis=1)
        first = run(a)
        run(b)
        assert np.array_equal(run(a), first), "a second prefill must not see the first sequence's state"
    finally:
        decoder.free()


def test_greedy_generate_on_gpu_is_the_argmax_of_forward_reruns(dev, training_like):
    import rwkvx
    from rwkvx.model import Model
    kwargs, _, _, _ = DECODE["moba"]
    cfg = Config(**kwargs)
    params = training_like(cfg, 2)
    prompt = seeded_rng(2).integers(0, cfg.vocab_size, (1, 9))
    n = 24
    model = Model(cfg, params, 1, prompt.shape[1] + n)
    new = rwkvx.generate(model, prompt, n, temperature=0)
    seq = np.concatenate([prompt, new], axis=1)
    logits = model.forward(seq)[0]
    for i in range(n):
        row = np.sort(logits[prompt.shape[1] - 1 + i])
        if row[-1] - row[-2] < 1e-3 * abs(row[-1]):             # an fp32 near-tie: the rest may diverge
            break
        assert new[0, i] == logits[prompt.shape[1] - 1 + i].argmax(), f"token {i}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_generate_twice_reuses_the_decoder(dev, training_like, precision):
    import rwkvx
    from rwkvx.model import Model
    kwargs, _, _, _ = DECODE["moba"]
    cfg = Config(**kwargs)
    rng = seeded_rng(3)
    model = Model(cfg, training_like(cfg, 3), 1, 4, precision=precision)
    prompt = rng.integers(0, cfg.vocab_size, 21)
    first = rwkvx.generate(model, prompt, 30, temperature=0.9, top_p=0.95, seed=5)
    (decoder,) = model._decoders.values()
    graph = decoder.graph
    assert np.array_equal(rwkvx.generate(model, prompt, 30, temperature=0.9, top_p=0.95, seed=5), first)
    rwkvx.generate(model, prompt[:3], 10, seed=1)       # a shorter prompt: the same decoder too
    assert list(model._decoders.values()) == [decoder] and decoder.graph is graph, "the decoder was rebuilt"
    # new weights are read by the kept decoder: the tokens of a model built with them
    other = training_like(cfg, 4)
    model.load_params(other)
    want = rwkvx.generate(Model(cfg, other, 1, 4, precision=precision), prompt, 30, temperature=0)
    assert np.array_equal(rwkvx.generate(model, prompt, 30, temperature=0), want)
    assert list(model._decoders.values()) == [decoder]


def test_generate_a_batch_of_256_prompts_of_different_lengths(dev, training_like):
    """B = 256 prompts of 1 to 40 tokens, greedy: each sequence is the argmax of a float64 forward re-run
    of its own tokens (up to an fp32 near-tie), and sequences stop at their end token."""
    import rwkvx
    from rwkvx.model import Model
    kwargs, _, _, _ = DECODE["moba"]
    cfg = Config(**kwargs)
    params = training_like(cfg, 5)
    rng = seeded_rng(5)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)) for n in rng.integers(1, 41, 256)]
    model = Model(cfg, params, 1, 8)
    n = 12
    out = rwkvx.generate(model, prompts, n, temperature=0)
    assert [len(o) for o in out] == [n] * 256
    oracle = Oracle(cfg, params, dtype=np.float64)
    for b in (0, 1, 77, 200, 255):
        logits = oracle.forward(np.concatenate([prompts[b], out[b]])[None])[0]
        for i in range(n):
            row = logits[len(prompts[b]) - 1 + i]
            top = np.sort(row)
            if top[-1] - top[-2] < 1e-3 * abs(top[-1]):         # a near-tie: the rest may diverge
                break
            assert out[b][i] == row.argmax(), f"sequence {b} token {i}"
    end = int(out[0][3])
    ended = rwkvx.generate(model, prompts, n, temperature=0, end_token=end)
    for full, got in zip(out, ended):
        stop = list(full).index(end) + 1 if end in full else n
        assert np.array_equal(got, full[:stop])
