"""GPU tests of rwkvx/cu/adamw/adamw.cu through rwkvx.cu.adamw: the fused, graph-replayable AdamW, against its
twin rwkvx.oracle.adamw (same formulas, same float32 operation order), as the CPU optimizer rwkvx.optim.AdamW
runs it.

Several steps with fresh random gradients: warm-up, cosine, lr_min after total_steps, weight decay only on
2-D *.weight tensors, 2x lr for att.w0, global-norm clipping (active, inactive, off), tensors split across
several chunks and unaligned (scalar path) offsets; float32 moments and the lean bf16 ones (stochastically
rounded by a hash of the flat index: the kernel's float32 moments are the twin's bits, no operation
contracted, and the twin rounds them with the same bits, so the stored moments are the twin's bits, every
step, also where the test feeds the kernel's moments back). Every step runs twice from the same state and must be
bit-identical (harness.KernelCase); a captured CUDA graph replays the same steps (step count / lr in
device memory). The optimizer has no activation type: these tests run once, in fp32.
"""
from __future__ import annotations

import numpy as np
import pytest

from harness import KernelCase, check
from rwkvx import optim
from rwkvx.cu import adamw as aw
from rwkvx.runtime.dtypes import bf16_bits_to_f32

from seeding import seeded_rng

TOL = 1e-5          # parameters (and their change), m, v after several steps
NSTEPS = 7

SHAPES = {
    "rwkv.emb.weight": (97, 64),                  # 2-D weight: decayed, several chunks
    "rwkv.blocks.0.ln1.weight": (64,),            # 1-D weight: not decayed
    "rwkv.blocks.0.att.w0": (1, 1, 64),           # 2x lr
    "rwkv.blocks.0.att.r_k": (3, 5),              # 2-D but not *.weight; odd size
    "rwkv.blocks.0.att.key.weight": (64, 64),
    "rwkv.blocks.0.att.w1": (64, 7),
    "rwkv.head.weight": (33, 64),
    "rwkv.blocks.0.ffn.x_k": (1, 1, 13),
}


def flat(segs, total, arrays):
    out = np.full(total, np.nan, np.float32)     # padding stays NaN: never read or written
    for name, off, size, _, _ in segs:
        out[off:off + size] = arrays[name].reshape(-1)
    return out


def unflat(segs, buf):
    return {name: buf[off:off + size].reshape(SHAPES[name]) for name, off, size, _, _ in segs}


def grads_for(rng, big):
    return {k: (rng.standard_normal(s) * (3.0 if big else 0.01)).astype(np.float32) for k, s in SHAPES.items()}


def setup(dev, rng, align, chunk, schedule, clip, wd, moments="f32"):
    """A KernelCase holding the flat buffers, the step's ops, and the numpy twin at the same start
    (``moments``: the element type of m and v)."""
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    segs, n = aw.flat_layout(SHAPES, align=align)
    table, lrmul = aw.build_table(segs, chunk)
    case = KernelCase(dev)
    zeros = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    b = dict(p=case.inout("p", flat(segs, n, params), "f32"), g=case.input("g", np.zeros(n), "f32"),
             m=case.inout("m", flat(segs, n, zeros), moments), v=case.inout("v", flat(segs, n, zeros), moments),
             table=case.input("table", table, "i32"), lrmul=case.input("lrmul", lrmul, "f32"),
             st=case.inout("st", aw.state_from_schedule(schedule, clip), "f64"),
             part=case.scratch("part", aw.scratch_elems(len(table)), "f64"))
    ops = aw.step(b["p"], b["g"], b["m"], b["v"], b["table"], b["lrmul"], b["st"], len(table),
                  partials=b["part"], weight_decay=wd, clip=True)
    twin = optim.AdamW({k: v.copy() for k, v in params.items()}, schedule, weight_decay=wd, grad_clip=clip,
                       moments=moments)
    return case, segs, n, b, ops, twin


# (align, chunk, clip, big grads): clipping active with big grads, inactive with small ones, off
CONFIGS = [(4, 1024, 1.0, True), (4, 8192, 1.0, False), (1, 1024, 0.5, True), (1, 64, None, True),
           (4, 4, None, False)]
# the lean moments' twin lays the tensors out as the arena does (aligned to 4 floats): its hash reads
# the flat index
RUNS = [(*c, "f32") for c in CONFIGS] + [(*c, "bf16") for c in CONFIGS if c[0] == 4]


def check_bf16_moment(name, got, want_bits):
    """The lean moment ``got`` (float64 values) is the twin's, bit for bit (see the module docstring)."""
    differ = got != bf16_bits_to_f32(want_bits).astype(np.float64)
    assert not differ.any(), f"{name}: {int(differ.sum())} values differ from the twin's"


@pytest.mark.parametrize("align,chunk,clip,big,moments", RUNS)
def test_adamw_steps(dev, align, chunk, clip, big, moments):
    from rwkvx._core import Plan
    rng = seeded_rng()
    schedule = optim.Schedule(lr_max=0.05, lr_min=0.005, warmup=3, total_steps=6)
    case, segs, n, b, ops, twin = setup(dev, rng, align, chunk, schedule, clip, 0.1, moments)
    plan = Plan(dev, ops)
    p0 = {k: v.astype(np.float64) for k, v in twin.params.items()}
    for t in range(1, NSTEPS + 1):                 # t = 1,2 warm-up, 3..6 cosine, 7 after total
        g = grads_for(rng, big)
        case.set("g", flat(segs, n, g))
        out = case.run(plan=plan)
        stats = twin.step(g)
        st = out["st"]
        assert st[aw.ST_STEP] == t
        assert st[aw.ST_LR] == pytest.approx(stats["lr"], rel=1e-12)
        assert st[aw.ST_NORM] == pytest.approx(stats["grad_norm"], rel=1e-10)
        assert st[aw.ST_SCALE] == pytest.approx(stats["clip"], rel=1e-10)
        if clip and big:
            assert st[aw.ST_SCALE] < 1.0
        got = {name: unflat(segs, out[name]) for name in ("p", "m", "v")}
        for k in SHAPES:
            check(f"{k} p", got["p"][k], twin.params[k], TOL)
            check(f"{k} update", got["p"][k] - p0[k], twin.params[k] - p0[k], 1e-4)   # the update itself
            if moments == "bf16":
                check_bf16_moment(f"{k} m", got["m"][k], twin.m[k])
                check_bf16_moment(f"{k} v", got["v"][k], twin.v[k])
            else:
                check(f"{k} m", got["m"][k], twin.m[k], TOL)
                check(f"{k} v", got["v"][k], twin.v[k], TOL)
        for name in ("p", "m", "v", "st"):           # the next step starts from this one's result
            case.set(name, out[name])
    assert stats["lr"] == schedule.lr_min
    pad = np.ones(n, bool)
    for _, off, size, _, _ in segs:
        pad[off:off + size] = False
    assert np.isnan(out["p"][pad]).all()            # padding untouched


def test_adamw_graph_replay_equals_eager(dev):
    """Five steps eagerly and five as replays of one captured graph give the same bits."""
    from rwkvx._core import Plan
    from rwkvx.runtime import Graph
    grads = [grads_for(seeded_rng(s), True) for s in range(5)]
    seed = int(seeded_rng().integers(1 << 30))
    results = []
    for use_graph in (False, True):
        schedule = optim.Schedule(lr_max=0.02, lr_min=0.001, warmup=2, total_steps=5)
        case, segs, n, b, ops, _ = setup(dev, seeded_rng(seed), 4, 512, schedule, 0.7, 0.05)
        plan = Plan(dev, ops)
        case.run(plan=plan)               # uploads the initial state (and checks one step twice)
        case.reset()
        graph = Graph.capture(dev, plan.run) if use_graph else None
        for g in grads:
            dev.upload(b["g"], flat(segs, n, g))
            (graph.launch if graph else plan.run)()
        dev.synchronize()
        results.append([dev.download(b[k], (n,), np.float32) for k in ("p", "m", "v")]
                       + [dev.download(b["st"], (aw.STATE_DOUBLES,), np.float64)])
        if graph:
            graph.close()
    for x, y in zip(*results):
        assert np.array_equal(x, y, equal_nan=True)
    assert results[0][3][aw.ST_STEP] == 5
