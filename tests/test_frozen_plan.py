"""The GPU step with frozen parameters (state tuning, LoRA), built on the CPU (no device; plans assume an
H200): the frozen weights are laid out compactly — where the GEMMs read bf16 operands, a GEMM weight
exists only as its bf16 copy — and the step forms no parameter gradient (no weight-gradient GEMM, no
embedding backward, no reduction of the vectors' partial sums), leaving every other op of the trained
step as it was."""
import pytest

from rwkvx import Config
from rwkvx.arena import Layout
from rwkvx.lora import DEFAULT_ALPHA, DEFAULT_RANK, DEFAULT_TARGETS, LoraSettings
from rwkvx.params import EMB_WEIGHT, gemm_weights, param_shapes
from rwkvx.presets import get_preset
from rwkvx.runtime.device import H200
from rwkvx.runtime.ops import Gemm, Launch, flatten_ops
from rwkvx.step import StepBuilder

from test_model_plan import BASE, CONFIGS, host_buffers

LORA = LoraSettings(DEFAULT_RANK, DEFAULT_ALPHA, DEFAULT_TARGETS)
TUNES = {"state": dict(tune_states=True), "lora": dict(lora=LORA)}
# the kernels that only form parameter gradients (the rest form them beside input gradients, into scratch)
PARAMETER_GRADIENT_KERNELS = {"embedding_backward", "ln_backward_dwdb", "reduce_partials"}


def within(L: Layout, region: str, addr: int) -> bool:
    return BASE + L.offsets[region] <= addr < BASE + L.offsets[region] + L.nbytes(region)


def shape_of(g: Gemm) -> tuple:
    return g.transa, g.transb, g.m, g.n, g.k, g.alpha, g.beta, g.precision


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("tune", sorted(TUNES))
def test_frozen_layout_and_step(tune, precision, recompute):
    kwargs, B, T = CONFIGS[1]                              # RWKV and attention blocks interleaved
    cfg = Config(**kwargs)
    trained = Layout(cfg, B, T, H200, precision, recompute)
    frozen = Layout(cfg, B, T, H200, precision, recompute, **TUNES[tune])
    names, gemm = list(param_shapes(cfg)), set(gemm_weights(cfg))
    bf16 = precision == "bf16"
    assert gemm and EMB_WEIGHT not in gemm and all(len(param_shapes(cfg)[n]) == 2 for n in gemm)
    regions = frozen.region_offsets
    assert list(regions["params_x"]) == ([n for n in names if n in gemm] if bf16 else [])
    assert list(regions["params"]) == [n for n in names if n not in gemm or not bf16]
    assert regions["grads"] == {} and frozen.counts["grads"] == 0
    for region, offsets in regions.items():                # packed in order, none overlapping
        spans = sorted(offsets.values())
        assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert frozen.counts[region] == (spans[-1][0] + spans[-1][1] if spans else 0)

    def build(L):
        return flatten_ops(StepBuilder(L, BASE, host_buffers(B, T)).build().step)

    step, full = build(frozen), build(trained)
    gemms = [op for op in step if isinstance(op, Gemm)]
    assert all(BASE <= p < BASE + frozen.total for g in gemms for p in (g.A, g.B, g.C, g.D))
    assert not any(within(frozen, "grads", g.D) for g in gemms)
    builder = StepBuilder(frozen, BASE, host_buffers(B, T))
    operands = {int(p) for g in gemms for p in (g.A, g.B)}
    for n in gemm:                                         # each weight read by a GEMM, from its copy
        assert int(builder.w(n)) in operands and within(frozen, "params_x" if bf16 else "params", int(builder.w(n)))
    launches = [op.name for op in step if isinstance(op, Launch)]
    assert not set(launches) & PARAMETER_GRADIENT_KERNELS
    full_launches = [op.name for op in full if isinstance(op, Launch) and op.name not in PARAMETER_GRADIENT_KERNELS]
    assert [n for n in launches if n != "wkv7_state_reduce"] == full_launches
    if tune == "state":      # the trained step's GEMMs less its weight gradients', one for one
        kept = [g for g in full if isinstance(g, Gemm) and not within(trained, "grads", g.D)]
        assert [shape_of(g) for g in gemms] == [shape_of(g) for g in kept]
        assert len(kept) < sum(isinstance(g, Gemm) for g in full)


@pytest.mark.parametrize("tune", sorted(TUNES))
def test_frozen_7b_fits_24_gb(tune):
    """Fine-tuning the 7.2B model's states or adapters, bf16, batch 1, ctx 1024, recompute: the arena
    (bf16 GEMM weights, fp32 embedding and vectors, activations, the logits chunk) fits a 24 GB card."""
    cfg = Config(**get_preset("rwkv7-7.2b")["model"])
    L = Layout(cfg, 1, 1024, H200, "bf16", True, **TUNES[tune])
    weights = sum(s[0] * s[1] for n, s in param_shapes(cfg).items() if n in set(gemm_weights(cfg)))
    assert L.nbytes("params_x") == 2 * weights
    assert L.total < 24e9 - (1 << 30)          # a GiB left for the context and cuBLASLt's workspace
