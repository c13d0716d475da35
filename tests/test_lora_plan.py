"""The GPU step of LoRA, built on the CPU (no device; plans assume an H200): the factors, their gradients
and AdamW moments are regions of their own (the parameters get no moments), every adapted projection adds
its two factor GEMMs in the forward (and in the recompute) and its five in the backward, AdamW updates
the factors alone (the frozen parameters: tests/test_frozen_plan.py). Executed by
tests/emulator.py, the fp32 step gives the oracle's logits, loss and factor gradients; so does the bf16 step
with its stores' roundings taken out (its data flow), and with them its factor gradients move by what
each draw's conditioning says."""
import numpy as np
import pytest

from emulator import arena_memory, run
from rwkvx import Config
from rwkvx.arena import Layout
from rwkvx.cu import adamw
from rwkvx.lora import TARGETS, LoraSettings, factor_names, lora_shapes, settings_of
from rwkvx.oracle import Oracle, rel_err
from rwkvx.runtime.device import H200
from rwkvx.runtime.dtypes import ELEM_BYTES
from rwkvx.runtime.ops import Gemm, flatten_ops
from rwkvx.step import StepBuilder

from seeding import seeded_rng
from test_model_plan import BASE, CONFIGS, host_buffers
from test_wkv7_ops import launch_args
from tuned_models import CFG64, GRADIENT_LORA, T, adapter_factors, random_batch



def gemms_on(ops, addr: int, operands: str) -> list:
    """The GEMMs of ``ops`` with one of ``operands`` (of A, B, D) at ``addr``."""
    return [op for op in flatten_ops(ops) if isinstance(op, Gemm) and addr in (getattr(op, o) for o in operands)]


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_lora_step_plan(precision, recompute):
    cfg = Config(**CONFIGS[1][0])                        # RWKV and attention blocks interleaved
    B, T = 2, CONFIGS[1][2]
    L = Layout(cfg, B, T, H200, precision, recompute, lora=GRADIENT_LORA)
    assert L.trains == "lora" and L.counts["adam_m"] == L.counts["adam_v"] == 0
    shapes = lora_shapes(cfg, GRADIENT_LORA)
    assert list(L.lora_offsets) == list(shapes) and len(shapes) == 2 * 6 * cfg.n_blocks
    n = sum(s[1] for s in L.lora_offsets.values())
    assert all(L.counts[r] >= n and L.elems[r] == "f32" for r in ("lora", "lora_grads", "lora_m", "lora_v"))
    assert L.counts["lora_x"] == (L.counts["lora"] if precision == "bf16" else 0)
    assert L.counts["lora_h"] == B * T * GRADIENT_LORA.rank and L.elems["lora_h"] == L.xtype
    _, table_lrmul = adamw.build_table(adamw.flat_layout(shapes)[0])
    assert L.adam_chunks == len(table_lrmul)

    builder = StepBuilder(L, BASE, host_buffers(B, T))
    ops = builder.build()
    step = flatten_ops(ops.step)
    end = BASE + L.total
    assert all(BASE <= p < end for op in step if isinstance(op, Gemm) for p in (op.A, op.B, op.C, op.D))
    operand = "lora_x" if precision == "bf16" else "lora"
    at = lambda region, name: (BASE + L.offsets[region]                              # noqa: E731
                               + ELEM_BYTES[L.elems[region]] * L.lora_offsets[name][0])
    for weight in {n.removesuffix(".lora_A") + ".weight" for n in shapes if n.endswith(".lora_A")}:
        a, b = factor_names(weight)
        # forward: h = x·A and y += s·h·B (again in the recompute, but for the last FFN value nothing
        # reads); backward: h again, dB, dh, dA, dx
        again = recompute and not weight.endswith("ffn.value.weight")
        uses_a = gemms_on(step, at(operand, a), "AB")
        assert len(uses_a) == 2 + again + 1, weight
        uses_b = gemms_on(step, at(operand, b), "AB")
        assert len(uses_b) == 1 + again + 1 and uses_b[0].alpha == GRADIENT_LORA.scale and uses_b[0].beta == 1.0, weight
        assert len(gemms_on(step, at("lora_grads", a), "D")) == 1 == len(gemms_on(step, at("lora_grads", b), "D"))
        assert gemms_on(step, at("lora_grads", b), "D")[0].alpha == GRADIENT_LORA.scale
    if precision == "bf16":     # bf16 operands (the factors' copy), fp32 accumulation and factor gradients
        gemms = [op for op in step if isinstance(op, Gemm)]
        assert {(op.precision.a, op.precision.b, op.precision.compute) for op in gemms} == {("bf16", "bf16", "fp32")}
        grads = BASE + L.offsets["lora_grads"]
        assert all(op.precision.c == "f32" for op in gemms if grads <= op.D < grads + L.nbytes("lora_grads"))
        assert all(op.precision.c == L.xtype for op in gemms if op.D == BASE + L.offsets["lora_h"])
    update = [launch_args(op) for op in flatten_ops(builder.optimizer(0.1, True)) if op.name == "adamw_update"]
    copy = BASE + L.offsets["lora_x"] if precision == "bf16" else 0
    assert [(u["p"], u["g"], u["m"], u["v"], u["px"]) for u in update] == [
        tuple(BASE + L.offsets[r] for r in ("lora", "lora_grads", "lora_m", "lora_v")) + (copy,)]

    grads = BASE + L.offsets["lora_grads"]
    gemms = [op for op in step if isinstance(op, Gemm)]
    assert sum(grads <= op.D < grads + L.nbytes("lora_grads") for op in gemms) == len(shapes)

def test_lora_layout_refuses_what_it_cannot_hold():
    cfg = Config(**CONFIGS[0][0])
    with pytest.raises(ValueError, match="choose one"):
        Layout(cfg, 1, 16, H200, "fp32", True, tune_states=True, lora=GRADIENT_LORA._replace(targets=("att.key",)))
    with pytest.raises(TypeError, match="LoraSettings"):
        Layout(cfg, 1, 16, H200, "fp32", True, lora={"rank": 4})


def test_settings_of_factors():
    cfg = Config(**CONFIGS[1][0])
    settings = LoraSettings(2, 6.0, ("att.key", "moba.output", "ffn.value"))
    factors = {n: np.zeros(s, np.float32) for n, s in lora_shapes(cfg, settings).items()}
    got = settings_of(cfg, factors, 3.0)
    assert got.rank == 2 and got.scale == 3.0 and set(got.targets) == set(settings.targets)
    partial = {n: f for n, f in factors.items() if not n.startswith("rwkv.blocks.0.att.key")}
    with pytest.raises(ValueError, match="every matrix of the targets"):
        settings_of(cfg, partial, 3.0)


def emulated_step(cfg: Config, params: dict, factors: dict, settings: LoraSettings, tokens, targets, precision: str,
                  recompute: bool, methods: dict, exact: bool = False):
    """The LoRA step of ``precision`` for (``tokens``, ``targets``) [B, T], as tests/emulator.py runs it
    (``exact``: its :class:`emulator.Memory`'s): (memory, layout, host buffers, op lists), the inputs staged
    in the host buffers, no op run yet."""
    B, T = tokens.shape
    L = Layout(cfg, B, T, H200, precision, recompute, methods=methods, lora=settings)
    host = host_buffers(B, T)
    mem = arena_memory(L, BASE, host, {"params": params, "lora": factors}, exact=exact)
    mem.write(host["tokens"], tokens, "i32")
    mem.write(host["targets"], targets, "i32")
    mem.write(host["inv_count"], [1.0 / targets.size], "f64")
    return mem, L, host, StepBuilder(L, BASE, host).build()


def step_loss_and_grads(mem, L: Layout, host: dict, ops) -> tuple[float, dict[str, np.ndarray]]:
    """Run what is left of the step (the loss and the backward) on ``mem``: the loss and every factor's gradient."""
    run(mem, ops.stage_targets + ops.loss + ops.backward)
    loss = mem.read(host["loss_t"], L.B * L.T, elem="f64").sum() / (L.B * L.T)
    shapes = lora_shapes(L.cfg, L.lora)
    return loss, {n: mem.read(BASE + L.offsets["lora_grads"] + 4 * off, size, shapes[n])
                  for n, (off, size) in L.lora_offsets.items()}


@pytest.mark.parametrize("recompute", [True, False])
def test_emulated_lora_step_matches_the_oracle(random_params, recompute):
    """The fp32 step's ops on the CPU (tests/emulator.py; the WKV7 twin for the sequential kernel) with
    random factors on every RWKV target: the logits, the loss and every factor's gradient are the
    oracle's."""
    cfg = Config(**CONFIGS[0][0])                        # RWKV blocks only: no MoBA selection near-ties
    B, T = 2, CONFIGS[0][2]
    rng = seeded_rng()
    params = {n: p.astype(np.float32) for n, p in random_params(cfg, int(rng.integers(1 << 31))).items()}
    settings = LoraSettings(4, 10.0, ("att.receptance", "att.key", "att.value", "att.output", "ffn.key",
                                      "ffn.value"))
    factors = {n: (0.3 * rng.standard_normal(s)).astype(np.float32) for n, s in lora_shapes(cfg, settings).items()}
    tokens, targets = rng.integers(0, cfg.vocab_size, (2, B, T))
    mem, L, _, ops = step = emulated_step(cfg, params, factors, settings, tokens, targets, "fp32", recompute,
                                          {"wkv7": "sequential"})
    oracle = Oracle(cfg, params, dtype=np.float64, lora=factors, lora_scale=settings.scale)

    run(mem, ops.stage_tokens + ops.forward + ops.head[0])
    assert L.head_rows == B * T
    V = cfg.vocab_size
    logits = mem.read(BASE + L.offsets["logits"], B * T * V, (B, T, V))
    assert rel_err(logits, oracle.forward(tokens)) <= 1e-5
    assert rel_err(Oracle(cfg, params, dtype=np.float64).forward(tokens), logits) > 1e-2   # factors were read

    loss, grads = step_loss_and_grads(*step)
    ref_loss, ref = oracle.loss_and_grads(tokens, targets)
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    # the step stores fp32: a factor's gradient is held to 1e-5, or to 10x what the float32 oracle itself
    # misses on it where the draw makes that gradient ill-conditioned (a few draws in a hundred reach 1e-4)
    _, ref32 = Oracle(cfg, params, dtype=np.float32, lora=factors, lora_scale=settings.scale).loss_and_grads(
        tokens, targets)
    for n, got in grads.items():
        bound = max(1e-5, 10 * rel_err(ref32[n], ref[n]))
        assert np.abs(ref[n]).max() > 0 and rel_err(got, ref[n]) <= bound, (n, rel_err(got, ref[n]), bound)


def random_draw(cfg: Config, settings: LoraSettings, B: int, T: int, rng) -> tuple[dict, np.ndarray, np.ndarray]:
    """The factors of a large adapter (tuned_models.adapter_factors) and tokens and targets [B, T]:
    tests/gpu/test_lora_gpu.py's draw."""
    factors = adapter_factors(cfg, settings, rng)
    return factors, *random_batch(cfg, rng, B, T)


def emulated_grads(cfg: Config, params: dict, factors: dict, settings: LoraSettings, tokens, targets,
                   exact: bool) -> dict[str, np.ndarray]:
    """Every factor's gradient from the whole bf16 step (recompute, the sequential WKV7) as tests/emulator.py
    runs it."""
    mem, L, host, ops = emulated_step(cfg, params, factors, settings, tokens, targets, "bf16", True,
                                      {"wkv7": "sequential"}, exact)
    run(mem, ops.stage_tokens + ops.forward)
    return step_loss_and_grads(mem, L, host, ops)[1]


@pytest.mark.parametrize("recompute", [True, False])
def test_emulated_bf16_lora_step_has_the_oracles_data_flow(random_params, recompute):
    """The bf16 step's ops with the roundings of their stores taken out (tests/emulator.py's exact memory:
    bf16 GEMM operands and outputs, the factors' and weights' bf16 copies, the fp32 transients and the
    shared regions as laid out) on RWKV and MoBA blocks interleaved, every target adapted: the logits, the
    loss and every factor's gradient are the float64 oracle's to float64 rounding. A buffer read after
    another op overwrote it (shared regions, per-block copies, the recompute) would read other bytes."""
    cfg = Config(**CONFIGS[1][0])
    B, T = CONFIGS[1][1:]
    rng = seeded_rng()
    params = {n: p.astype(np.float32) for n, p in random_params(cfg, int(rng.integers(1 << 31))).items()}
    factors, tokens, targets = random_draw(cfg, GRADIENT_LORA, B, T, rng)
    mem, L, _, ops = step = emulated_step(cfg, params, factors, GRADIENT_LORA, tokens, targets, "bf16", recompute,
                                          {"wkv7": "sequential"}, exact=True)
    assert L.elems["lora_h"] == L.elems["lora_x"] == L.elems["logits"] == "bf16"
    oracle = Oracle(cfg, params, dtype=np.float64, lora=factors, lora_scale=GRADIENT_LORA.scale)
    run(mem, ops.stage_tokens + ops.forward + ops.head[0])
    V = cfg.vocab_size
    logits = mem.read(BASE + L.offsets["logits"], B * T * V, (B, T, V), "bf16")
    assert rel_err(logits, oracle.forward(tokens)) <= 1e-12
    loss, grads = step_loss_and_grads(*step)
    ref_loss, ref = oracle.loss_and_grads(tokens, targets)
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    assert all(np.abs(ref[n]).max() > 0 and rel_err(g, ref[n]) <= 1e-12 for n, g in grads.items()), \
        {n: rel_err(g, ref[n]) for n, g in grads.items()}


# The bf16 step's factor gradients against the float64 oracle's, each over 2^15 (bf16's unit roundoff 2^-9
# over float32's 2^-24) times the float32 oracle's own error on it: that error is what the draw's
# conditioning makes of one fp32 rounding of every stored value; the step rounds its stores to bf16 at
# about the same places. Measured on training-like models (48 draws: 31 of test_lora_step_bf16_error_is_the_draws'
# two cases, 17 of tests/gpu/test_lora_gpu.py's model): 0.26 to 4.6. A gradient the float32 oracle happens to get
# nearly right is held to the median over the factors instead (the ratio's small denominators).
BF16_RATIO = 16


def check_bf16_rounding_error(cfg: Config, params: dict, factors: dict, tokens, targets,
                              settings: LoraSettings = GRADIENT_LORA) -> dict[str, float]:
    """The bf16 step emulated with its stores rounded (tests/emulator.py: bf16 buffers as 2-byte values,
    rounded to nearest): every factor's gradient within BF16_RATIO x 2^15 x the float32 oracle's error on it.
    The relative errors against the float64 oracle, by factor."""
    ref, ref32 = (Oracle(cfg, params, dtype=dtype, lora=factors, lora_scale=settings.scale).loss_and_grads(
        tokens, targets)[1] for dtype in (np.float64, np.float32))
    errors = {n: rel_err(g, ref[n]) for n, g in emulated_grads(cfg, params, factors, settings, tokens, targets,
                                                                exact=False).items()}
    fp32 = {n: rel_err(ref32[n], ref[n]) for n in errors}
    floor = np.median(list(fp32.values()))
    ratios = {n: errors[n] / (2.0 ** 15 * max(fp32[n], floor)) for n in errors}
    print(f"\nbf16 / (2^15 fp32) {min(ratios.values()):.2f} to {max(ratios.values()):.2f}, worst "
          + ", ".join(f"{n} {e:.2e}" for n, e in sorted(errors.items(), key=lambda e: -e[1])[:3]))
    assert all(r <= BF16_RATIO for r in ratios.values()), ratios
    return errors


@pytest.mark.parametrize("case", [0, 2], ids=["rwkv", "hybrid-top1"])
def test_lora_step_bf16_error_is_the_draws(training_like, case):
    """The bf16 step's rounded stores alone (tests/emulator.py) move every factor's gradient of a
    training-like model by what the draw's conditioning says (check_bf16_rounding_error), the worst far over
    an fp32 error: the buffers are bf16. (MoBA with top_k 1: no block selection that a rounding could flip.)"""
    cfg = Config(**CONFIGS[case][0])
    B, T = CONFIGS[case][1:]
    rng = seeded_rng()
    params = training_like(cfg, int(rng.integers(1 << 31)))
    settings = GRADIENT_LORA._replace(targets=tuple(t for t in TARGETS
                                                    if cfg.n_attn_layer or not t.startswith("moba.")))
    errors = check_bf16_rounding_error(cfg, params, *random_draw(cfg, settings, B, T, rng), settings)
    assert max(errors.values()) > 1e-3


# A draw on which the H200's bf16 LoRA gradients missed tests/gpu/test_lora_gpu.py's limit of 5e-2
# (test_lora_gradients_match_oracle_reduced_precision[bf16]: block 0's receptance factors 2.19e-1 and 1.83e-1,
# its key factors 1.46e-1 and 1.34e-1): that test's model and draw
GPU_SEED = 2601034392035683061


def test_the_gpu_bf16_lora_miss_is_the_draws(training_like):
    """On the draw the H200 missed, the bf16 step's data flow is the oracle's (exact memory) and its rounded
    stores alone miss block 0's receptance factors by as much as the GPU did (2.2e-1), within the bound
    the float32 oracle's own error there sets: the miss is the draw's, not a defect of the step."""
    cfg, B = CFG64, 3
    params = training_like(cfg, 42)
    factors, tokens, targets = random_draw(cfg, GRADIENT_LORA, B, T, seeded_rng(GPU_SEED))
    oracle = Oracle(cfg, params, dtype=np.float64, lora=factors, lora_scale=GRADIENT_LORA.scale)
    _, ref = oracle.loss_and_grads(tokens, targets)
    exact = emulated_grads(cfg, params, factors, GRADIENT_LORA, tokens, targets, exact=True)
    assert all(rel_err(g, ref[n]) <= 1e-12 for n, g in exact.items())
    errors = check_bf16_rounding_error(cfg, params, factors, tokens, targets)
    assert errors["rwkv.blocks.0.att.receptance.lora_A"] > 0.15
