"""rwkvx.Model (GPU) against rwkvx.oracle.Oracle (CPU, float64): selection, logits, loss, grads.

docs/SPEC.md §4 tolerances: fp32, any parameters: loss <= 1e-5, logits and every gradient <= 1e-4 (relative,
per tensor). Reduced precisions on a training-like model (init_params with its zero matrices filled with
N(0, 0.02^2)): every gradient (and the logits) tf32 <= 3e-2, bf16 <= 5e-2; loss tf32 <= 1e-4, bf16 <= 1e-3.
Random-parameter models in tf32 are also held to 5e-3 (the kernels' own tf32 limit).
Fresh random parameters and inputs every run (the seeds are in a failure's report), except the tf32
random-parameter cases, which run over fixed seeds; the device outputs are poisoned before every check.
"""
import numpy as np
import pytest

from rwkvx import Config
from rwkvx.model import Model
from rwkvx.oracle import Oracle, rel_err

from model_cases import MODEL_CASES as CASES
from seeding import seeded_rng

# A MoBA gate margin below which the GPU may legitimately pick another block: docs/SPEC.md §4's 1e-4 for fp32
# gates; with tf32 projections q and k themselves carry ~1e-3 relative error (10-bit mantissa), so
# gates of magnitude ~1-10 move by ~1e-2 and the margin that separates a real mismatch is 1e-2.
# bf16 rounds q and k themselves (8-bit mantissa, ~4e-3 relative) and the stream before them: 1e-1.
NEAR_TIE = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 1e-1}

TOLERANCES = {"fp32": (1e-5, 1e-4), "tf32": (5e-3, 5e-3)}
TRAINING_LIKE_TOLERANCES = {"tf32": (1e-4, 3e-2), "bf16": (1e-3, 5e-2)}   # (loss, logits and gradients)


# test_model_matches_oracle in tf32 runs these cases over fixed seeds, so that a miss can be replayed.
TF32_CASES = ("sparse_hybrid", "C256_N64")
TF32_SEEDS = range(8)
# The (case, seed) pairs of those whose worst tf32 gradient is over docs/SPEC.md's 5e-3, each with the error
# measured; each is a strict xfail, so it must keep failing, and every other pair must pass.
TF32_OVER_LIMIT: dict[tuple[str, int], str] = {
    ("C256_N64", 2): "rwkv.blocks.0.att.x_r 9.8e-3",
    ("C256_N64", 3): "rwkv.blocks.1.att.x_k 5.5e-3",
    ("C256_N64", 5): "rwkv.blocks.0.att.x_k 9.4e-3",
}


def _parity_params():
    """The parameters of test_model_matches_oracle: every case in fp32 with fresh seeds, the tf32 cases
    over TF32_SEEDS (seed None: fresh)."""
    out = [pytest.param(c, "fp32", None, id=f"{c}-fp32") for c in CASES]
    for c in TF32_CASES:
        for seed in TF32_SEEDS:
            reason = TF32_OVER_LIMIT.get((c, seed))
            marks = [pytest.mark.xfail(reason=f"tf32 gradient over 5e-3: {reason}", strict=True)] if reason \
                else []
            out.append(pytest.param(c, "tf32", seed, marks=marks, id=f"{c}-tf32-seed{seed}"))
    return out


@pytest.mark.parametrize("name, precision, seed", _parity_params())
def test_model_matches_oracle(name, precision, seed, random_params, record_property):
    kwargs, B, T = CASES[name]
    cfg = Config(**kwargs)
    rng = seeded_rng(seed)
    params = {k: v.astype(np.float32) for k, v in random_params(cfg, int(rng.integers(1 << 31))).items()}
    _check_against_oracle(cfg, params, B, T, precision, *TOLERANCES[precision], rng, record_property,
                          ignore_some=name in ("batch_3", "odd_T", "rwkv_only"))


@pytest.mark.parametrize("name, precision", [(c, p) for c in ("sparse_hybrid", "C256_N64", "T1024")
                                             for p in ("tf32", "bf16")])
def test_reduced_precision_matches_oracle(name, precision, training_like, record_property):
    kwargs, B, T = CASES[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    params = training_like(cfg, int(rng.integers(1 << 31)))
    _check_against_oracle(cfg, params, B, T, precision, *TRAINING_LIKE_TOLERANCES[precision], rng,
                          record_property, ignore_some=True)


def _check_against_oracle(cfg, params, B, T, precision, loss_tol, tol, rng, record_property, ignore_some,
                          **model_options):
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    if ignore_some:
        targets[rng.random((B, T)) < 0.2] = -100     # ignore_index
    model = Model(cfg, params, B, T, precision=precision, **model_options)
    oracle = Oracle(cfg, params, dtype=np.float64)
    print(f"\n{len(model.ops.head)} head chunk(s) of {model.layout.head_rows} rows", end="")

    model.poison()
    loss, grads = model.loss_and_grads(tokens, targets)
    selection = model.moba_selection()
    # MoBA selection first; near-ties go to the oracle as the GPU chose them
    forced = None
    if cfg.n_attn_layer and cfg.moba_top_k > 1:
        ref_sel = oracle.moba_selection(tokens)
        gaps = oracle.moba_gate_gaps(tokens)
        for j, (g, r, gap) in enumerate(zip(selection, ref_sel, gaps)):
            clear = gap >= NEAR_TIE[precision]
            differs = (g != r).any(axis=-1)
            assert not (differs & clear).any(), (
                f"attention block {j}: selection differs at {int((differs & clear).sum())} queries "
                f"with gate margins >= {NEAR_TIE[precision]} (smallest {gap[differs & clear].min():.3g})")
        forced = selection
    ref_loss, ref_grads = oracle.loss_and_grads(tokens, targets, selection=forced)
    errors = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for name, ref in ref_grads.items():
        assert np.isfinite(grads[name]).all(), f"{name}: non-finite gradient (unwritten?)"
        errors[name] = rel_err(grads[name], ref)

    model.poison()
    logits = model.forward(tokens)
    errors["logits"] = rel_err(logits, oracle.forward(tokens, selection=forced))

    worst = max((e, n) for n, e in errors.items() if n != "loss")
    record_property("errors", {"loss": errors["loss"], "worst": worst})
    print(f"\n{precision}: loss rel err {errors['loss']:.2e}, worst {worst[1]} {worst[0]:.2e}")
    assert errors["loss"] <= loss_tol, errors["loss"]
    bad = {n: e for n, e in errors.items() if n != "loss" and e > tol}
    assert not bad, bad


@pytest.mark.parametrize("name", ["odd_T", "T1024"])
def test_head_in_row_chunks_matches_oracle(name, random_params, record_property):
    """Logits in 64-row chunks (the last one partial): the head gradient accumulated over chunks and
    the logits read back chunk by chunk still meet the fp32 limits."""
    kwargs, B, T = CASES[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    params = {k: v.astype(np.float32) for k, v in random_params(cfg, int(rng.integers(1 << 31))).items()}
    _check_against_oracle(cfg, params, B, T, "fp32", *TOLERANCES["fp32"], rng, record_property, ignore_some=True,
                          head_chunk_bytes=64 * cfg.vocab_size * 4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["sparse_hybrid", "leftover_blocks", "C256_N64"])
def test_no_recompute_is_bit_identical(name, precision, random_params):
    """recompute=False reads each block's kept transients instead of recomputing them: the same
    arithmetic, so the same loss and gradients bit for bit."""
    kwargs, B, T = CASES[name]
    assert_steps_bit_identical(Config(**kwargs), B, T, precision, random_params, [(None, True), (None, False)])


def assert_steps_bit_identical(cfg: Config, B: int, T: int, precision: str, random_params, runs) -> None:
    """The step's loss and gradients (seeded fp32 random parameters and tokens) are the same bits in every
    run of ``runs``: (a setup called before the model is built, or None; recompute)."""
    rng = seeded_rng()
    params = {k: v.astype(np.float32) for k, v in random_params(cfg, int(rng.integers(1 << 31))).items()}
    tokens, targets = rng.integers(0, cfg.vocab_size, (2, B, T))
    results = []
    for setup, recompute in runs:
        if setup is not None:
            setup()
        model = Model(cfg, params, B, T, precision=precision, recompute=recompute)
        model.poison()
        results.append(model.loss_and_grads(tokens, targets))
    loss_a, grads_a = results[0]
    for loss_b, grads_b in results[1:]:
        assert loss_a == loss_b
        assert all(np.array_equal(grads_a[n], grads_b[n]) for n in grads_a), \
            [n for n in grads_a if not np.array_equal(grads_a[n], grads_b[n])]
