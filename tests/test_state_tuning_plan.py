"""The GPU step of state tuning, built on the CPU (no device; plans assume an H200): the initial states
and their AdamW moments are regions of their own, every RWKV block's WKV7 forward starts from its state
and its backward writes that state's gradient, AdamW updates the states alone, and the step leaves out
the GEMMs of the frozen parameters' gradients."""
import pytest

from rwkvx import Config
from rwkvx.arena import Layout
from rwkvx.model import without_weight_gradients
from rwkvx.runtime.device import H200
from rwkvx.runtime.ops import Gemm, Launch, flatten_ops
from rwkvx.state_tuning import state_name, state_shapes
from rwkvx.step import StepBuilder

from test_model_plan import BASE, CONFIGS, host_buffers
from test_wkv7_ops import launch_args

FORWARDS, BACKWARDS = ("wkv7_forward", "wkv7c_forward_state"), ("wkv7_backward", "wkv7c_backward_state")


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_state_tuning_step_plan(precision, recompute, B):
    cfg = Config(**CONFIGS[1][0])                        # RWKV and attention blocks interleaved
    T = CONFIGS[1][2]
    L = Layout(cfg, B, T, H200, precision, recompute, tune_states=True)
    assert L.counts["adam_m"] == L.counts["adam_v"] == 0 and L.counts["params"] == L.counts["grads"] > 0
    shapes = state_shapes(cfg)
    assert list(L.state_offsets) == list(shapes)
    assert all(L.counts[r] >= sum(s[1] for s in L.state_offsets.values())
               for r in ("states", "state_grads", "state_m", "state_v"))
    assert L.adam_chunks == len(shapes)                   # one [H, N, N] state per chunk at this size
    ops = StepBuilder(L, BASE, host_buffers(B, T)).build()
    addr = lambda region, name: BASE + L.offsets[region] + 4 * L.state_offsets[name][0]   # noqa: E731
    rwkv = [idx for kind, idx in cfg.block_order() if kind == "rwkv"]
    step = flatten_ops(ops.step)
    forwards = [launch_args(op)["s_init"] for op in step if isinstance(op, Launch) and op.name in FORWARDS]
    recomputed = list(reversed(rwkv)) if recompute else []      # the backward's forwards, last block first
    assert forwards == [addr("states", state_name(i)) for i in rwkv + recomputed]
    written = [launch_args(op)["ds_part"] for op in step if isinstance(op, Launch) and op.name in BACKWARDS]
    reduced = [launch_args(op)["ds0"] for op in step if isinstance(op, Launch) and op.name == "wkv7_state_reduce"]
    grads = [addr("state_grads", state_name(i)) for i in reversed(rwkv)]
    if B == 1:
        assert written == grads and not reduced
    else:
        assert written == [BASE + L.offsets["wkv_ds0_partials"]] * len(rwkv) and reduced == grads
    update = [launch_args(op) for op in flatten_ops(StepBuilder(L, BASE, host_buffers(B, T)).optimizer(0.1, True))
              if op.name == "adamw_update"]
    assert [(u["p"], u["g"], u["m"], u["v"], u["px"]) for u in update] == [
        tuple(BASE + L.offsets[r] for r in ("states", "state_grads", "state_m", "state_v")) + (0,)]

    lo, hi = BASE + L.offsets["grads"], BASE + L.offsets["grads"] + L.nbytes("grads")
    frozen = without_weight_gradients(ops, (lo, hi))
    gemms = [op for op in flatten_ops(ops.step) if isinstance(op, Gemm)]
    kept = [op for op in flatten_ops(frozen.step) if isinstance(op, Gemm)]
    assert kept == [op for op in gemms if not lo <= op.C < hi] and len(kept) < len(gemms)
    assert [op for op in flatten_ops(frozen.step) if not isinstance(op, Gemm)] == \
        [op for op in flatten_ops(ops.step) if not isinstance(op, Gemm)]
