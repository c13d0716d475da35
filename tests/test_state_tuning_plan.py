"""The GPU step of state tuning, built on the CPU (no device; plans assume an H200): the initial states
and their AdamW moments are regions of their own, every RWKV block's WKV7 forward starts from its state
and its backward writes that state's gradient, AdamW updates the states alone (the frozen parameters:
tests/test_frozen_plan.py); the forward's op list, executed by tests/emulator.py,
gives the oracle's logits from the states."""
import numpy as np
import pytest

from emulator import arena_memory, run
from rwkvx import Config
from rwkvx.arena import Layout
from rwkvx.oracle import Oracle, rel_err
from rwkvx.runtime.device import H200
from rwkvx.runtime.ops import Launch, flatten_ops
from rwkvx.state_tuning import state_name, state_shapes
from rwkvx.step import StepBuilder

from seeding import seeded_rng
from tuned_models import random_states
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
    assert L.counts["adam_m"] == L.counts["adam_v"] == 0
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


@pytest.mark.parametrize("B", [1, 3])
def test_state_tuned_forward_gives_the_oracles_logits(random_params, B):
    """The forward's ops (the emulator's WKV7 twin stands for the sequential kernel) read each RWKV
    block's state where the layout puts it: logits equal the oracle's from the same states."""
    cfg = Config(**CONFIGS[0][0])                        # RWKV blocks only: no MoBA selection near-ties
    T = CONFIGS[0][2]
    rng = seeded_rng()
    params = {n: p.astype(np.float32) for n, p in random_params(cfg, int(rng.integers(1 << 31))).items()}
    states = random_states(cfg, rng)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    L = Layout(cfg, B, T, H200, "fp32", recompute=True, methods={"wkv7": "sequential"}, tune_states=True)
    host = host_buffers(B, T)
    ops = StepBuilder(L, BASE, host).build()
    mem = arena_memory(L, BASE, host, {"params": params, "states": states})
    mem.write(host["tokens"], tokens, "i32")
    run(mem, ops.stage_tokens + ops.forward + ops.head[0])
    assert L.head_rows == B * T
    V = cfg.vocab_size
    logits = mem.read(BASE + L.offsets["logits"], B * T * V, (B, T, V))
    want = Oracle(cfg, params, dtype=np.float64, states=states).forward(tokens)
    assert rel_err(logits, want) <= 1e-5
    without = Oracle(cfg, params, dtype=np.float64).forward(tokens)
    assert rel_err(without, want) > 1e-2                 # the states change the logits: they were read
