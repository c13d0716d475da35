"""The data-parallel GPU step's program, built on the CPU: the plain step's ops in the plain order, one
all-reduce per block at the point its gradients are final, and nothing after that point touching them."""
import dataclasses

import pytest

from rwkvx.dist.step import AllReduce, GatherLoss, Join, build_program, grad_buckets
from rwkvx.step import StepBuilder
from rwkvx.runtime.ops import Copy, CopyDtoH, CopyHtoD, Gemm, Launch, Memset, flatten_ops
from test_model_plan import BASE, CONFIGS, build

SEND, RECV, FLAG, GATHERED = 1 << 44, 1 << 45, 1 << 46, 1 << 47


def program_for(kwargs, B, T, world_size=2):
    layout, ops = build(kwargs, B, T)
    builder = StepBuilder(layout, BASE, {})
    optimizer = builder.optimizer(0.1, True)
    program = build_program(ops, layout, builder.buf("grads"), optimizer, builder.buf("loss_t"),
                            SEND, RECV, FLAG, GATHERED, world_size)
    return layout, ops, optimizer, program


def touched(op):
    """(address, bytes or None) of every pointer an op is given (None: extent unknown, a kernel's)."""
    if isinstance(op, Launch):
        return [(v, None) for kind, v in op.args if kind == "p" and v]
    if isinstance(op, Gemm):
        return [(op.A, None), (op.B, None), (op.C, None), (op.D, None)]
    if isinstance(op, Memset):
        return [(op.ptr, op.nbytes)]
    if isinstance(op, Copy):
        return [(op.dst, op.nbytes), (op.src, op.nbytes)]
    if isinstance(op, CopyHtoD):
        return [(op.dst, op.nbytes)]
    return [(op.src, op.nbytes)]


def hits(op, lo, hi):
    return any(lo <= p < hi or (n and p < hi and p + n > lo) for p, n in touched(op))


@pytest.mark.parametrize("kwargs, B, T", CONFIGS)
def test_program_is_the_plain_step_with_collectives(kwargs, B, T):
    layout, ops, optimizer, program = program_for(kwargs, B, T)
    plain = flatten_ops(ops.step + optimizer)
    extra = (Copy(SEND, ops.loss[-1].src, 8 * B * T), CopyHtoD(SEND + 8 * B * T, FLAG, 8),
             CopyDtoH(GATHERED, RECV, 8 * 2 * (B * T + 1)))
    flat = [op for item in program if isinstance(item, list) for op in item]
    assert [op for op in flat if op not in extra] == plain      # same ops, same order
    assert all(op in flat for op in extra)
    kinds = [type(item) for item in program if not isinstance(item, list)]
    n_blocks = len(layout.cfg.block_order())
    assert kinds == [GatherLoss] + [AllReduce] * (n_blocks + 2) + [Join]
    # the loss is gathered right after it is computed; AdamW (and clipping) only after the join
    head = program[0]
    assert head[-2:] == list(extra[:2]) and flatten_ops(ops.loss)[-1] in head
    assert program[1] == GatherLoss(SEND, RECV, B * T + 1)
    assert isinstance(program[-2], Join) and program[-1][:len(optimizer)] == flatten_ops(optimizer)


@pytest.mark.parametrize("kwargs, B, T", CONFIGS)
def test_each_gradient_is_reduced_once_after_it_is_final(kwargs, B, T):
    layout, ops, _, program = program_for(kwargs, B, T)
    grads = BASE + layout.offsets["grads"]
    reduced = [item for item in program if isinstance(item, AllReduce)]
    names = [n for item in reduced for n in item.names]
    assert sorted(names) == sorted(layout.param_offsets)        # every parameter exactly once
    spans = sorted((item.ptr, item.ptr + 4 * item.count) for item in reduced)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    backward = flatten_ops(ops.backward)
    # position of each all-reduce in the backward op sequence
    pos, where = 0, []
    for item in program[2:]:
        if isinstance(item, list):
            pos += len(item)
        elif isinstance(item, AllReduce):
            where.append((pos, item))
    for k, item in where:
        for n in item.names:
            off, size = layout.param_offsets[n]
            lo = grads + 4 * off
            assert lo >= item.ptr and lo + 4 * size <= item.ptr + 4 * item.count
            # the gradient was written before its reduction (the head's by the chunked loss) ...
            assert any(hits(op, lo, lo + 4 * size) for op in flatten_ops(ops.loss) + backward[:k]), n
        # ... and nothing later in the backward touches the reduced range (no race with the comm stream)
        assert not any(hits(op, item.ptr, item.ptr + 4 * item.count) for op in backward[k:]), item.names


def test_program_rejects_what_it_cannot_reduce():
    layout, ops = build(*CONFIGS[0])
    builder = StepBuilder(layout, BASE, {})
    args = (builder.buf("grads"), [], builder.buf("loss_t"), SEND, RECV, FLAG, GATHERED, 2)
    missing = dataclasses.replace(ops, grad_ready=ops.grad_ready[:-1])
    with pytest.raises(ValueError, match="no gradient-ready point for rwkv.emb.weight"):
        build_program(missing, layout, *args)
    twice = dataclasses.replace(ops, grad_ready=ops.grad_ready + ops.grad_ready[-1:])
    with pytest.raises(ValueError, match="marked ready twice"):
        build_program(twice, layout, *args)
    k, names = ops.grad_ready[0]
    apart = dataclasses.replace(ops, grad_ready=[(k, names + ("rwkv.emb.weight",))] + [
        (kk, tuple(n for n in nn if n != "rwkv.emb.weight")) for kk, nn in ops.grad_ready[1:]])
    with pytest.raises(ValueError, match="not contiguous"):
        build_program(apart, layout, *args)
    layout.elems["grads"] = "bf16"
    with pytest.raises(ValueError, match="reduces float32 gradients only"):
        build_program(ops, layout, *args)


def block_of(name):
    parts = name.split(".")
    return ".".join(parts[:3] if parts[1] == "blocks" else parts[:2])


@pytest.mark.parametrize("kwargs, B, T", CONFIGS[1:3])
def test_buckets_follow_the_backward(kwargs, B, T):
    layout, ops = build(kwargs, B, T)
    blocks = [{block_of(n) for n in names} for _, _, _, names in grad_buckets(layout, ops.grad_ready)]
    order = [("rwkv.blocks." if kind == "rwkv" else "moba.") + str(i)
             for kind, i in reversed(layout.cfg.block_order())]
    assert blocks[0] == {"rwkv.ln_out", "rwkv.head"}
    assert blocks[1:-1] == [{b} for b in order]               # one per block, in backward order
    assert blocks[-1] == ({"rwkv.emb", "rwkv.blocks.0"} if layout.cfg.ln0 else {"rwkv.emb"})
