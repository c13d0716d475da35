"""The GPU step's op list, built on the CPU (no device; plans assume an H200): every config of the
parity suite plans, buffers fit the arena, pointers are typed, and memory grows linearly in T."""
import pytest

from rwkvx import Config
from rwkvx.model import Layout, StepBuilder
from rwkvx.runtime.device import H200
from rwkvx.runtime.ops import CopyDtoH, CopyHtoD, Gemm, Launch, flatten_ops

BASE = 1 << 40

CONFIGS = [
    (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=3), 2, 40),
    (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=5, n_attn_layer=2, moba_chunk_size=8,
          moba_top_k=2), 1, 48),
    (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1, moba_chunk_size=12,
          moba_top_k=1, ln0=False), 3, 45),
    (dict(vocab_size=65536, n_embd=768, head_size=64, n_rwkv_layer=12, n_attn_layer=4,
          moba_chunk_size=512, moba_top_k=3), 8, 4096),
]


def build(kwargs, B, T, precision="fp32"):
    layout = Layout(Config(**kwargs), B, T, H200)
    host = {name: (1 << 41) + i * (1 << 30) for i, name in enumerate([*Layout.host_inputs(B * T), "loss_t"])}
    return layout, StepBuilder(layout, BASE, host, precision).build()


@pytest.mark.parametrize("kwargs, B, T", CONFIGS)
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_step_plan_builds_inside_the_arena(kwargs, B, T, precision):
    layout, ops = build(kwargs, B, T, precision)
    step = flatten_ops(ops.step)
    end = BASE + layout.total
    pointers = []
    for op in step:
        if isinstance(op, Launch):
            pointers += [v for kind, v in op.args if kind == "p" and v]
        elif isinstance(op, Gemm):
            pointers += [op.A, op.B, op.C]
        elif isinstance(op, (CopyHtoD, CopyDtoH)):
            pointers.append(op.dst if isinstance(op, CopyHtoD) else op.src)
    assert pointers and all(BASE <= p < end for p in pointers)
    n_blocks = Config(**kwargs).n_blocks
    # each block appears once in the forward and is recomputed once in the backward
    assert sum(isinstance(op, Gemm) for op in flatten_ops(ops.backward)) > n_blocks * 6
    assert {op.precision.compute for op in step if isinstance(op, Gemm)} == {precision}


def test_memory_is_linear_in_tokens():
    kwargs = CONFIGS[3][0]
    per_token = [Layout(Config(**kwargs), 1, T, H200).total for T in (4096, 8192, 16384)]
    d1, d2 = per_token[1] - per_token[0], per_token[2] - per_token[1]
    assert d2 == pytest.approx(2 * d1, rel=1e-3)       # no T^2 term
