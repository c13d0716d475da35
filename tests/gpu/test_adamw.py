"""GPU tests of rwkvx/cu/adamw.cu through rwkvx.ops.adamw: the fused, graph-replayable AdamW.

Several steps with fresh random gradients against a float64 numpy reference of the formulas in
rwkvx/ops/adamw.py (= rwkvx/optim.py): warm-up, cosine, lr_min after total_steps, weight decay only on
2-D *.weight tensors, 2x lr for att.w0, global-norm clipping (active and inactive), tensors split across
several chunks and unaligned (scalar path) offsets. Also: the numpy twin rwkvx.optim.AdamW agrees, a
captured CUDA graph replays the same steps (step count / lr in device memory), and reruns are
bit-identical.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from rwkvx.ops import adamw as aw
from gpu_harness import rel

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


def lr_at(t, lr_max, lr_min, warmup, total):
    if t < warmup:
        return lr_max * t / warmup
    if total is None:
        return lr_max
    if t > total:
        return lr_min
    progress = (t - warmup) / max(1, total - warmup)
    return lr_min + 0.5 * (lr_max - lr_min) * (1 + math.cos(math.pi * progress))


class RefAdamW:
    """float64 reference of the documented update (independent of the kernel and of rwkvx.optim)."""

    def __init__(self, params, lr_max, lr_min, warmup, total, wd, clip):
        self.p = {k: v.astype(np.float64) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.sched = (lr_max, lr_min, warmup, total)
        self.wd, self.clip, self.t = wd, clip, 0

    def step(self, grads):
        self.t += 1
        t = self.t
        lr = lr_at(t, *self.sched)
        norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
        scale = min(1.0, self.clip / (norm + 1e-6)) if self.clip else 1.0
        b1, b2, eps = 0.9, 0.99, 1e-18
        for k in self.p:
            g = grads[k].astype(np.float64) * scale
            lr_p = lr * (2.0 if k.endswith("att.w0") else 1.0)
            if k.endswith(".weight") and len(SHAPES[k]) == 2:
                self.p[k] *= 1 - lr_p * self.wd
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            denom = np.sqrt(self.v[k]) / math.sqrt(1 - b2 ** t) + eps
            self.p[k] -= lr_p / (1 - b1 ** t) * self.m[k] / denom
        return lr, norm, scale


def flat(segs, total, arrays):
    out = np.full(total, np.nan, np.float32)     # padding stays NaN: never read or written
    for name, off, size, _, _ in segs:
        out[off:off + size] = arrays[name].reshape(-1)
    return out


def unflat(segs, buf):
    return {name: buf[off:off + size].reshape(SHAPES[name]) for name, off, size, _, _ in segs}


def setup(gpu, align, chunk, seed, lr_max, lr_min, warmup, total, clip, wd):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    segs, total_len = aw.flat_layout(SHAPES, align=align)
    table, lrmul = aw.build_table(segs, chunk)
    n_chunks = len(table)
    b = dict(p=gpu.buf(flat(segs, total_len, params)),
             g=gpu.buf(np.zeros(total_len, np.float32)),
             m=gpu.buf(flat(segs, total_len, {k: np.zeros(s, np.float32) for k, s in SHAPES.items()})),
             v=gpu.buf(flat(segs, total_len, {k: np.zeros(s, np.float32) for k, s in SHAPES.items()})),
             table=gpu.buf(table), lrmul=gpu.buf(lrmul),
             st=gpu.buf(aw.state_array(lr_max, lr_min, warmup, total, clip)),
             part=gpu.buf(np.full(n_chunks, np.nan, np.float64)))
    ops = aw.step(b["p"], b["g"], b["m"], b["v"], b["table"], b["lrmul"], b["st"], n_chunks,
                  partials=b["part"], weight_decay=wd, clip=True)
    return params, segs, total_len, b, ops


def grads_for(step, seed, big):
    rng = np.random.default_rng(seed * 100 + step)
    return {k: (rng.standard_normal(s) * (3.0 if big else 0.01)).astype(np.float32) for k, s in SHAPES.items()}


# (align, chunk, clip, big grads): clipping active with big grads, inactive with small ones, off
CONFIGS = [(4, 1024, 1.0, True), (4, 8192, 1.0, False), (1, 1024, 0.5, True), (1, 64, None, True),
           (4, 4, None, False)]


@pytest.mark.parametrize("align,chunk,clip,big", CONFIGS)
def test_adamw_steps(gpu, align, chunk, clip, big):
    lr_max, lr_min, warmup, total, wd = 0.05, 0.005, 3, 6, 0.1
    params, segs, n, b, ops = setup(gpu, align, chunk, 1, lr_max, lr_min, warmup, total, clip, wd)
    from rwkvx.runtime import Plan
    plan = Plan(gpu.dev, ops, precision="fp32")
    ref = RefAdamW(params, lr_max, lr_min, warmup, total, wd, clip)
    p0 = {k: v.astype(np.float64) for k, v in params.items()}
    for t in range(1, NSTEPS + 1):                 # t = 1,2 warm-up, 3..6 cosine, 7 after total
        g = grads_for(t, 1, big)
        gpu.set(b["g"], flat(segs, n, g))
        plan.run()
        gpu.dev.synchronize()
        lr, norm, scale = ref.step(g)
        st = gpu.get(b["st"], aw.STATE_DOUBLES, np.float64)
        assert st[aw.ST_STEP] == t
        assert st[aw.ST_LR] == pytest.approx(lr, rel=1e-12)
        assert st[aw.ST_NORM] == pytest.approx(norm, rel=1e-10)
        assert st[aw.ST_SCALE] == pytest.approx(scale, rel=1e-10)
        if clip and big:
            assert scale < 1.0
        gp = unflat(segs, gpu.get(b["p"], n))
        gm = unflat(segs, gpu.get(b["m"], n))
        gv = unflat(segs, gpu.get(b["v"], n))
        for k in SHAPES:
            assert rel(gp[k], ref.p[k]) <= TOL, k
            assert rel(gp[k] - p0[k], ref.p[k] - p0[k]) <= 1e-4, k        # the accumulated update itself
            assert rel(gm[k], ref.m[k]) <= TOL, k
            assert rel(gv[k], ref.v[k]) <= TOL, k
    assert lr == lr_min
    pad = np.ones(n, bool)
    for _, off, size, _, _ in segs:
        pad[off:off + size] = False
    assert np.isnan(gpu.get(b["p"], n)[pad]).all()                   # padding untouched


def run_sequence(gpu, use_graph):
    lr_max, lr_min, warmup, total, wd = 0.02, 0.001, 2, 5, 0.05
    params, segs, n, b, ops = setup(gpu, 4, 512, 5, lr_max, lr_min, warmup, total, 0.7, wd)
    from rwkvx.runtime import Graph, Plan
    plan = Plan(gpu.dev, ops, precision="fp32")
    graph = None
    for t in range(1, 6):
        gpu.set(b["g"], flat(segs, n, grads_for(t, 5, True)))
        if use_graph and t > 1:
            if graph is None:
                graph = Graph.capture(gpu.dev, plan.run)
            graph.launch()
        else:
            plan.run()
        gpu.dev.synchronize()
    return [gpu.get(b[k], n) for k in ("p", "m", "v")] + [gpu.get(b["st"], aw.STATE_DOUBLES, np.float64)]


def test_adamw_deterministic_and_graph_replay(gpu):
    a = run_sequence(gpu, use_graph=False)
    b = run_sequence(gpu, use_graph=False)
    c = run_sequence(gpu, use_graph=True)
    for x, y, z in zip(a, b, c):
        assert np.array_equal(x, y, equal_nan=True)
        assert np.array_equal(x, z, equal_nan=True)
    assert a[3][aw.ST_STEP] == 5


def test_adamw_matches_optim_twin(gpu):
    """The numpy twin rwkvx.optim.AdamW implements the same formulas."""
    optim = pytest.importorskip("rwkvx.optim")
    lr_max, lr_min, warmup, total, wd, clip = 0.03, 0.003, 2, 4, 0.1, 1.0
    params, segs, n, b, ops = setup(gpu, 4, 256, 9, lr_max, lr_min, warmup, total, clip, wd)
    from rwkvx.runtime import Plan
    plan = Plan(gpu.dev, ops, precision="fp32")
    twin_params = {k: v.copy() for k, v in params.items()}
    twin = optim.AdamW(twin_params, optim.Schedule(lr_max=lr_max, lr_min=lr_min, warmup=warmup,
                                                    total_steps=total), weight_decay=wd, grad_clip=clip)
    for t in range(1, 6):
        g = grads_for(t, 9, True)
        gpu.set(b["g"], flat(segs, n, g))
        plan.run()
        gpu.dev.synchronize()
        stats = twin.step(g)
        st = gpu.get(b["st"], aw.STATE_DOUBLES, np.float64)
        assert st[aw.ST_LR] == pytest.approx(stats["lr"], rel=1e-12)
        assert st[aw.ST_SCALE] == pytest.approx(stats["clip"], rel=1e-10)
        gp = unflat(segs, gpu.get(b["p"], n))
        for k in SHAPES:
            assert rel(gp[k], twin_params[k]) <= TOL, k


def test_table_and_state_helpers():
    segs, total = aw.flat_layout(SHAPES, align=4)
    assert all(off % 4 == 0 for _, off, _, _, _ in segs)
    names = [s[0] for s in segs]
    wd = dict(zip(names, [s[4] for s in segs]))
    assert wd["rwkv.emb.weight"] == 1 and wd["rwkv.blocks.0.ln1.weight"] == 0 and wd["rwkv.blocks.0.att.r_k"] == 0
    mult = dict(zip(names, [s[3] for s in segs]))
    assert mult["rwkv.blocks.0.att.w0"] == 2.0 and mult["rwkv.emb.weight"] == 1.0
    table, lrmul = aw.build_table(segs, 1024)
    assert table.dtype == np.int32 and table.shape[1] == 4 and lrmul.dtype == np.float32
    assert int(table[:, 2].sum()) == sum(s[2] for s in segs)
    assert (table[:, 2] <= 1024).all()
    big, _ = aw.build_table([(3 << 32, 10, 1.0, 1)], 8)
    assert big.tolist() == [[0, 3, 8, 1], [8, 3, 2, 1]]
    st = aw.state_array(1e-3, 1e-4, 10, None, None)
    assert st[aw.ST_TOTAL] == -1 and st[aw.ST_CLIP] == 0
