"""The GPU step of LoRA, built on the CPU (no device; plans assume an H200): the factors, their gradients
and AdamW moments are regions of their own (the parameters get no moments), every adapted projection adds
its two factor GEMMs in the forward (and in the recompute) and its five in the backward, AdamW updates
the factors alone (the frozen parameters: tests/test_frozen_plan.py). Executed by
tests/emulator.py, the fp32 step gives the oracle's logits, loss and factor gradients."""
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

ALL = LoraSettings(4, 8.0, tuple(TARGETS))          # every target: each projection of both block kinds


def gemms_on(ops, addr: int, operands: str) -> list:
    """The GEMMs of ``ops`` with one of ``operands`` (of A, B, D) at ``addr``."""
    return [op for op in flatten_ops(ops) if isinstance(op, Gemm) and addr in (getattr(op, o) for o in operands)]


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_lora_step_plan(precision, recompute):
    cfg = Config(**CONFIGS[1][0])                        # RWKV and attention blocks interleaved
    B, T = 2, CONFIGS[1][2]
    L = Layout(cfg, B, T, H200, precision, recompute, lora=ALL)
    assert L.trains == "lora" and L.counts["adam_m"] == L.counts["adam_v"] == 0
    shapes = lora_shapes(cfg, ALL)
    assert list(L.lora_offsets) == list(shapes) and len(shapes) == 2 * 6 * cfg.n_blocks
    n = sum(s[1] for s in L.lora_offsets.values())
    assert all(L.counts[r] >= n and L.elems[r] == "f32" for r in ("lora", "lora_grads", "lora_m", "lora_v"))
    assert L.counts["lora_x"] == (L.counts["lora"] if precision == "bf16" else 0)
    assert L.counts["lora_h"] == B * T * ALL.rank and L.elems["lora_h"] == L.xtype
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
        assert len(uses_b) == 1 + again + 1 and uses_b[0].alpha == ALL.scale and uses_b[0].beta == 1.0, weight
        assert len(gemms_on(step, at("lora_grads", a), "D")) == 1 == len(gemms_on(step, at("lora_grads", b), "D"))
        assert gemms_on(step, at("lora_grads", b), "D")[0].alpha == ALL.scale
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
        Layout(cfg, 1, 16, H200, "fp32", True, tune_states=True, lora=ALL._replace(targets=("att.key",)))
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
    L = Layout(cfg, B, T, H200, "fp32", recompute, methods={"wkv7": "sequential"}, lora=settings)
    host = host_buffers(B, T)
    ops = StepBuilder(L, BASE, host).build()
    mem = arena_memory(L, BASE, host, {"params": params, "lora": factors})
    mem.write(host["tokens"], tokens, "i32")
    mem.write(host["targets"], targets, "i32")
    mem.write(host["inv_count"], [1.0 / targets.size], "f64")
    oracle = Oracle(cfg, params, dtype=np.float64, lora=factors, lora_scale=settings.scale)

    run(mem, ops.stage_tokens + ops.forward + ops.head[0])
    assert L.head_rows == B * T
    V = cfg.vocab_size
    logits = mem.read(BASE + L.offsets["logits"], B * T * V, (B, T, V))
    assert rel_err(logits, oracle.forward(tokens)) <= 1e-5
    assert rel_err(Oracle(cfg, params, dtype=np.float64).forward(tokens), logits) > 1e-2   # factors were read

    run(mem, ops.stage_targets + ops.loss + ops.backward)
    ref_loss, ref = oracle.loss_and_grads(tokens, targets)
    loss = mem.read(host["loss_t"], B * T, elem="f64").sum() / targets.size
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    # the step stores fp32: a factor's gradient is held to 1e-5, or to 10x what the float32 oracle itself
    # misses on it where the draw makes that gradient ill-conditioned (a few draws in a hundred reach 1e-4)
    _, ref32 = Oracle(cfg, params, dtype=np.float32, lora=factors, lora_scale=settings.scale).loss_and_grads(
        tokens, targets)
    for n, (off, size) in L.lora_offsets.items():
        got = mem.read(BASE + L.offsets["lora_grads"] + 4 * off, size, ref[n].shape)
        bound = max(1e-5, 10 * rel_err(ref32[n], ref[n]))
        assert np.abs(ref[n]).max() > 0 and rel_err(got, ref[n]) <= bound, (n, rel_err(got, ref[n]), bound)
