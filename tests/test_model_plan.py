"""The GPU step's op list, built on the CPU (no device; plans assume an H200): every config of the
parity suite plans, buffers fit the arena, pointers are typed, and memory grows linearly in T."""
import numpy as np
import pytest

from rwkvx import Config, arena
from rwkvx.arena import (CHANNEL_MIX_STATE, FORWARD_STATE, FP32_ALWAYS, KF_PRE, LN_OUTPUTS, Layout,
                         head_chunk_rows)
from rwkvx.precision import DEFAULT_PRECISION, resolve_precision
from rwkvx.step import StepBuilder
from rwkvx.cu import moba, wkv7
from rwkvx.runtime.device import H200
from rwkvx.runtime.dtypes import from_storage, storage_dtype
from rwkvx.runtime.kernel import KernelFile
from rwkvx.runtime.ops import Copy, CopyDtoH, CopyHtoD, Gemm, GemmPrecision, Launch, Memset, flatten_ops

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


def host_buffers(B, T):
    """Pinned host addresses of the per-step inputs (distinct, outside the arena)."""
    return {name: (1 << 41) + i * (1 << 30) for i, name in enumerate([*Layout.host_inputs(B * T), "loss_t"])}


def build(kwargs, B, T, precision="fp32"):
    layout = Layout(Config(**kwargs), B, T, H200, precision, recompute=True)
    return layout, StepBuilder(layout, BASE, host_buffers(B, T)).build()


@pytest.mark.parametrize("kwargs, B, T", CONFIGS)
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_step_plan_builds_inside_the_arena(kwargs, B, T, precision):
    layout, ops = build(kwargs, B, T, precision)
    step = flatten_ops(ops.step)
    end = BASE + layout.total
    pointers = []
    for op in step:
        if isinstance(op, Launch):
            pointers += [v for kind, v in op.args if kind == "p" and v]
        elif isinstance(op, Gemm):
            pointers += [op.A, op.B, op.C, op.D]
        elif isinstance(op, (CopyHtoD, CopyDtoH)):
            pointers.append(op.dst if isinstance(op, CopyHtoD) else op.src)
    assert pointers and all(BASE <= p < end for p in pointers)
    n_blocks = Config(**kwargs).n_blocks
    # each block appears once in the forward and is recomputed once in the backward
    assert sum(isinstance(op, Gemm) for op in flatten_ops(ops.backward)) > n_blocks * 6
    gemms = [op for op in step if isinstance(op, Gemm)]
    if precision != "bf16":
        assert {op.precision for op in gemms} == {GemmPrecision(compute=precision)}
        return
    # bf16: bf16 operands, fp32 accumulation; every output into the gradients or into a buffer that is
    # fp32 in every precision (the residual stream, LayerNorm gradients) is fp32, the rest bf16
    assert {(op.precision.a, op.precision.b, op.precision.compute) for op in gemms} == {("bf16", "bf16", "fp32")}
    grads = (BASE + layout.offsets["grads"], BASE + layout.offsets["grads"] + layout.nbytes("grads"))
    bf16_starts = {BASE + off for n, off in layout.offsets.items() if layout.elems[n] == "bf16"}
    fp32_starts = {BASE + off for n, off in layout.offsets.items()
                   if n.split("@")[0].split(".")[0] in FP32_ALWAYS} - bf16_starts   # not where shared buffers meet
    into_fp32 = 0
    for op in gemms:
        under = [n for n, off in layout.offsets.items() if BASE + off <= op.D < BASE + off + layout.nbytes(n)]
        assert op.precision.c in {layout.elems[n] for n in under}, under     # the type of a buffer it writes
        if grads[0] <= op.D < grads[1] or op.D in fp32_starts:
            assert op.precision.c == "f32", under
            into_fp32 += op.D in fp32_starts
    assert into_fp32 >= 2 * n_blocks       # the residual adds (x1, the block outputs), dlnout, attention's dh1
    weights = BASE + layout.offsets["params_x"], BASE + layout.offsets["params_x"] + layout.nbytes("params_x")
    assert all(weights[0] <= op.A < weights[1] or weights[0] <= op.B < weights[1]
               for op in gemms if not grads[0] <= op.D < grads[1])      # forward and dx GEMMs read the bf16 copy


def test_kernel_methods_of_each_precision():
    """Head sizes 32 / 64: the chunked WKV7 (3xTF32 in fp32), other head sizes the sequential one; MoBA's
    mma kernels (N 32 .. 128) in tf32 / bf16 only. The step's launches follow the choice."""
    for N in (16, 32, 64, 128):
        cfg = Config(vocab_size=64, n_embd=2 * N, head_size=N, n_rwkv_layer=1, n_attn_layer=1,
                     moba_chunk_size=16, moba_top_k=2)
        chunked = N in wkv7.CHUNKED_HEAD_SIZES
        assert resolve_precision("fp32").kernel_methods(cfg)["wkv7"] == ("chunked_exact" if chunked else "sequential")
        for precision in ("tf32", "bf16"):
            assert resolve_precision(precision).kernel_methods(cfg)["wkv7"] == ("chunked" if chunked else "sequential")
            assert resolve_precision(precision).kernel_methods(cfg)["moba"] == ("mma" if N in moba.MMA_HEAD_SIZES else "exact")
        assert resolve_precision("fp32").kernel_methods(cfg)["moba"] == "exact"
    for precision, exact in (("fp32", "1"), ("tf32", "0"), ("bf16", "0")):
        _, ops = build(dict(vocab_size=67, n_embd=128, head_size=64, n_rwkv_layer=2), 1, 40, precision)
        wkv = [op for op in flatten_ops(ops.step) if isinstance(op, Launch) and op.name.startswith("wkv7")]
        # per RWKV block: the forward, the recompute's forward (2 launches each) and the backward (2: the
        # recompute's forward writes the backward's chunk records too, intra mode 2)
        assert len(wkv) == 2 * (2 + 2 + 2) and all(dict(op.defines)["WKV_EXACT"] == exact for op in wkv)
        modes = [op.args[-1][1] for op in wkv if op.name == "wkv7c_intra"]
        assert modes == [wkv7.INTRA_FORWARD] * 2 + [wkv7.INTRA_BOTH] * 2


def test_bf16_optimizer_refreshes_the_weights_copy():
    kwargs, B, T = CONFIGS[1]
    layout, _ = build(kwargs, B, T, "bf16")
    host = {name: 1 << 41 for name in [*Layout.host_inputs(B * T), "loss_t"]}
    ops = StepBuilder(layout, BASE, host).optimizer(weight_decay=0.1, clip=True)
    update = [op for op in flatten_ops(ops) if op.name == "adamw_update"]
    assert len(update) == 1 and update[0].args[-1] == ("p", BASE + layout.offsets["params_x"])
    assert dict(update[0].defines)["FLOATX_BF16"] == "1"


def test_memory_is_linear_in_tokens():
    kwargs = CONFIGS[3][0]
    # from T = 32768 on the WKV work buffer outgrows the logits chunk it shares a region with
    per_token = [Layout(Config(**kwargs), 1, T, H200, DEFAULT_PRECISION, recompute=True).total
                 for T in (32768, 65536, 131072)]
    d1, d2 = per_token[1] - per_token[0], per_token[2] - per_token[1]
    assert d2 == pytest.approx(2 * d1, rel=1e-3)       # no T^2 term


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_layernorm_outputs_only_where_asked(precision):
    """A training layout has no LN2 output h2 and LN1's h1 only as the attention blocks' GEMM operand h1_x
    where that is fp32 (fp32, tf32; in bf16 h1_x is a bf16 buffer of its own and h1 is absent); with
    ln_outputs both are fp32 [B*T, C], and the arena grows by exactly the bytes of the ones added."""
    kwargs, B, T = CONFIGS[1]
    cfg = Config(**kwargs)
    R, C = B * T, cfg.n_embd
    train = Layout(cfg, B, T, H200, precision, recompute=True)
    full = Layout(cfg, B, T, H200, precision, recompute=True, ln_outputs=True)
    assert "h2" not in train.offsets
    if precision == "bf16":
        assert "h1" not in train.offsets and (train.elems["h1_x"], train.counts["h1_x"]) == ("bf16", R * C)
    else:
        assert train.offsets["h1_x"] == train.offsets["h1"] and train.elems["h1"] == "f32"
    assert all((full.elems[name], full.counts[name]) == ("f32", R * C) for name in LN_OUTPUTS)
    added = [name for name in LN_OUTPUTS if name not in train.offsets]
    assert (R * C * 4) % 256 == 0 and full.total - train.total == len(added) * R * C * 4


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("ln_outputs", [False, True])
def test_attention_operand_copy_only_with_attention_blocks(monkeypatch, precision, ln_outputs):
    """Only attention blocks read LN1's output as a GEMM operand: a pure RWKV-7 layout has no h1_x (nor h1
    unless it stores the LayerNorm outputs) and its arena is smaller than with the copy by exactly the
    copy's bytes (bf16: h1_x's; fp32, tf32: h1's where nothing else stores it); a hybrid has h1_x
    [B*T, C]. The residual gradient's copy dx_x is in both."""
    kwargs, B, T = CONFIGS[0]
    cfg = Config(**kwargs)
    assert not cfg.n_attn_layer
    pure = Layout(cfg, B, T, H200, precision, recompute=True, ln_outputs=ln_outputs)
    assert "h1_x" not in pure.offsets and "dx_x" in pure.offsets
    assert ("h1" in pure.offsets) == ln_outputs
    with monkeypatch.context() as m:
        m.setattr(arena, "ATTENTION_OPERANDS", ())
        copied = Layout(cfg, B, T, H200, precision, recompute=True, ln_outputs=ln_outputs)
    x_bytes = 2 if precision == "bf16" else 4
    added = 0 if ln_outputs and precision != "bf16" else B * T * cfg.n_embd * x_bytes
    assert added % 256 == 0 and copied.total - pure.total == added
    kwargs, B, T = CONFIGS[1]
    hybrid = Layout(Config(**kwargs), B, T, H200, precision, recompute=True, ln_outputs=ln_outputs)
    assert hybrid.counts["h1_x"] == B * T * hybrid.cfg.n_embd and hybrid.elems["h1_x"] == hybrid.xtype
    assert "dx_x" in hybrid.offsets


def test_block_scratch_shares_the_logits_region():
    """The logits chunk, the WKV work buffer, MoBA's partials and the channel mix's backward gradients
    and fp32 key product (each live inside the head or one part of one block's forward or backward only)
    from one offset, the
    WKV7 backward's kept records (live through the channel mix) leading the WKV7 and channel mix sets; none
    of them is forward state kept for a backward."""
    kwargs, B, T = CONFIGS[3]
    layout = Layout(Config(**kwargs), B, T, H200, "bf16", recompute=True)
    start = layout.offsets["logits"]
    sets = (("logits",), ("wkv_records", "wkv_partials"), ("moba_part", "moba_lpart"),
            ("wkv_records", "dkf", "dxk2"), ("wkv_records", KF_PRE))
    assert {layout.offsets[names[0]] for names in sets} == {start}
    kept_end = start + layout.nbytes("wkv_records")
    assert all(layout.offsets[n] >= kept_end for n in ("wkv_partials", "dkf", KF_PRE))
    names = [n for group in sets for n in group]
    ends = [layout.offsets[n] + layout.nbytes(n) for n in names]
    assert min(o for o in layout.offsets.values() if o > max(layout.offsets[n] for n in names)) >= max(ends)
    assert not set(names) & {n for kind in FORWARD_STATE.values() for n in kind + CHANNEL_MIX_STATE}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_poison_image_reads_as_poison_in_every_buffer(precision):
    """Where the shared region's buffers overlap, each still reads as NaN in its own element type."""
    kwargs, B, T = CONFIGS[1]
    layout = Layout(Config(**kwargs), B, T, H200, precision, recompute=True)
    assert layout.offsets["logits"] == layout.offsets["moba_part"] and layout.nbytes("logits") > 0
    image, start = layout.poison_image(), layout.offsets["tokens"]
    for name in list(layout.offsets)[list(layout.offsets).index("tokens"):]:
        elem, count = layout.elems[name], layout.counts[name]
        raw = image[layout.offsets[name] - start:][:layout.nbytes(name)].view(storage_dtype(elem))[:count]
        values = from_storage(elem, raw)
        assert (values == -0x5EADBEEF).all() if elem == "i32" else np.isnan(values).all(), name


def _accesses(op) -> tuple[list[int], list[int]]:
    """(read, written) device pointers of one op, from the kernel declarations (const pointers are read)."""
    if isinstance(op, Launch):
        params = KernelFile.registry[op.module].kernels[op.name].params
        ptrs = [(arg.const, v) for (_, arg), (_, v) in zip(params, op.args) if arg.kind == "ptr" and v]
        return [v for const, v in ptrs if const], [v for const, v in ptrs if not const]
    if isinstance(op, Gemm):
        return [op.A, op.B] + ([op.C] if op.beta else []), [op.D]
    if isinstance(op, Copy):
        return [op.src], [op.dst]
    if isinstance(op, CopyDtoH):
        return [op.src], []
    return [], [op.ptr if isinstance(op, Memset) else op.dst]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_shared_scratch_lifetimes_never_overlap(monkeypatch, precision, recompute):
    """Planned with the shared region's buffers apart, the step never reads one of them after a buffer of
    another set was written (which, sharing the region, would have overwritten it)."""
    kwargs, B, T = CONFIGS[3]
    sets = {}

    def apart(self, shared):
        for buffers in shared.values():
            for name, (count, elem) in buffers.items():
                if name not in sets:
                    self._add(name, count, elem)
                sets[name] = sets.get(name, set()) | set(buffers)     # compatible with every set naming it
    monkeypatch.setattr(Layout, "_add_shared", apart)
    layout = Layout(Config(**kwargs), B, T, H200, precision, recompute=recompute)
    spans = {n: (BASE + layout.offsets[n], BASE + layout.offsets[n] + layout.nbytes(n)) for n in sets}

    def names(pointers):
        return {n for p in pointers for n, (lo, hi) in spans.items() if lo <= p < hi}
    valid, checked = set(), set()
    for op in flatten_ops(StepBuilder(layout, BASE, host_buffers(B, T)).build().step):
        read, written = _accesses(op)
        for name in names(read):
            assert name in valid, f"{op.name if isinstance(op, Launch) else op} reads {name}, overwritten"
            checked.add(name)
        for name in names(written):
            valid = (valid & sets[name]) | {name}
    used = {n for n in sets if layout.nbytes(n)}       # fp32 at this shape: the WKV7 backward needs no partials
    assert checked == used and used >= {"logits", "moba_part", "moba_lpart"}


def test_head_and_loss_run_in_row_chunks():
    """0.22B config, B8 T4096: no [B*T, V] logits buffer; every row's loss is computed exactly once."""
    kwargs, B, T = CONFIGS[3]
    for precision in ("tf32", "bf16"):
        layout, ops = build(kwargs, B, T, precision)
        R, V = B * T, kwargs["vocab_size"]
        rows = layout.head_rows
        assert rows < R and layout.nbytes("logits") == rows * V * (2 if precision == "bf16" else 4) <= 512 << 20
        ce = [op for op in flatten_ops(ops.loss) if isinstance(op, Launch) and op.name == "cross_entropy_loss"]
        loss_ptr = BASE + layout.offsets["loss_t"]
        assert [op.grid[0] for op in ce] == [min(rows, R - r0) for r0 in range(0, R, rows)]
        firsts = sorted(v for op in ce for k, v in op.args if k == "p" and loss_ptr <= v < loss_ptr + 8 * R)
        assert firsts == [loss_ptr + 8 * r0 for r0 in range(0, R, rows)]
        head_dw = [op for op in flatten_ops(ops.loss) if isinstance(op, Gemm)
                   and op.D == BASE + layout.offsets["grads"] + 4 * layout.param_offsets["rwkv.head.weight"][0]]
        assert [op.beta for op in head_dw] == [0.0] + [1.0] * (len(ce) - 1)   # accumulated in a fixed order


def test_head_chunk_bytes_sets_the_row_chunks():
    """``head_chunk_bytes`` caps the logits of one chunk: room for 64 rows (or less) gives 64-row chunks, the
    last one partial, for the head and the cross entropy alike; the default holds this config's rows at once."""
    kwargs, B, T = CONFIGS[2]                  # 135 rows
    cfg = Config(**kwargs)
    V = cfg.vocab_size
    for chunk_bytes in (64 * V * 4, 1):
        layout = Layout(cfg, B, T, H200, "fp32", recompute=True, head_chunk_bytes=chunk_bytes)
        assert layout.head_rows == 64 and layout.counts["logits"] == 64 * V
        ops = StepBuilder(layout, BASE, host_buffers(B, T)).build()
        ce = [op for op in flatten_ops(ops.loss) if isinstance(op, Launch) and op.name == "cross_entropy_loss"]
        assert len(ops.head) == 3 and [op.grid[0] for op in ce] == [64, 64, 7]
    assert Layout(cfg, B, T, H200, "fp32", recompute=True).head_rows == B * T
    assert head_chunk_rows(1000, 100, "bf16", 3 * 64 * 100 * 2 + 1) == 192
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            Layout(cfg, B, T, H200, "fp32", recompute=True, head_chunk_bytes=bad)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_keeps_each_attention_blocks_moba_output(precision):
    """With recompute, the backward recomputes an attention block without its MoBA forward: each block's
    attention output, log-sum-exp and query lists are its own buffers, written once by the forward and
    read by its backward."""
    kwargs, B, T = CONFIGS[1]
    cfg = Config(**kwargs)
    layout, ops = build(kwargs, B, T, precision)
    attn = [pos for pos, (kind, _) in enumerate(cfg.block_order()) if kind == "attn"]
    assert attn
    moba_fwd = {"moba_select", "moba_fwd_past", "moba_fwd_own", "moba_fwd_past_mma", "moba_fwd_own_mma"}

    def launches(op_list, names):
        return [op for op in flatten_ops(op_list) if isinstance(op, Launch) and op.name in names]
    assert len(launches(ops.forward, {"moba_select"})) == len(attn)
    assert not launches(ops.backward, moba_fwd)
    bwd_args = {v for op in flatten_ops(ops.backward) if isinstance(op, Launch) for _, v in op.args}
    own_out = launches(ops.forward, {"moba_fwd_own", "moba_fwd_own_mma"})
    assert len(own_out) == len(attn)
    for pos, op in zip(attn, own_out):
        for name in ("y", "moba_lse"):
            ptr = BASE + layout.offsets[f"{name}@{pos}"]
            assert ptr in {v for _, v in op.args} and ptr in bwd_args, (pos, name)
    assert len({layout.offsets[f"y@{pos}"] for pos in attn}) == len(attn)


@pytest.mark.parametrize("kwargs, B, T", CONFIGS[:3])
def test_without_recompute_each_block_keeps_its_forward_state(kwargs, B, T):
    cfg = Config(**kwargs)
    host = {name: 1 << 41 for name in [*Layout.host_inputs(B * T), "loss_t"]}
    plans = {}
    for recompute in (True, False):
        layout = Layout(cfg, B, T, H200, "fp32", recompute=recompute)
        plans[recompute] = (layout, StepBuilder(layout, BASE, host).build())
    (lr, with_r), (ln, without) = plans[True], plans[False]
    n_launch = {k: sum(isinstance(op, Launch) for op in flatten_ops(v[1].backward)) for k, v in plans.items()}
    n_fwd = sum(isinstance(op, Launch) for op in flatten_ops(with_r.forward))
    assert n_launch[False] < n_launch[True] and ln.total > lr.total
    assert (sum(isinstance(op, Launch) for op in flatten_ops(without.forward)) == n_fwd)
    # the forward's outputs that the backward reads are the same buffers (block by block)
    written = {v for op in flatten_ops(without.forward) if isinstance(op, Launch) for _, v in op.args}
    read = {v for op in flatten_ops(without.backward) if isinstance(op, Launch) for _, v in op.args}
    for pos, (kind, _) in enumerate(cfg.block_order()):
        name = "y" if kind == "attn" else "decay"
        ptr = BASE + ln.offsets[f"{name}@{pos}" if pos else name]
        assert ptr in written and ptr in read, (pos, name)
    # the forward saves the WKV state itself (no recompute to do it)
    saves = [op for op in flatten_ops(without.forward) if isinstance(op, Launch) and op.name.startswith("wkv7_forward")]
    names = [n for n, _ in wkv7.WKV7_FORWARD.params]
    assert saves and all(dict(zip(names, (v for _, v in op.args)))["sa_out"] for op in saves)


def test_rebased_step_moves_only_the_host_copies():
    """A training step on another staging slot: the same ops, each host copy's pinned address moved to
    that slot's buffer of the same name, nothing else changed."""
    import dataclasses

    from rwkvx.model import rebased
    kwargs, B, T = CONFIGS[1]
    _, ops = build(kwargs, B, T)
    step = flatten_ops(ops.step)
    slot0 = host_buffers(B, T)
    slot1 = {name: addr + (1 << 29) for name, addr in slot0.items()}
    moved = rebased(ops.step, {slot0[n]: slot1[n] for n in slot0})
    copies = [(a, b) for a, b in zip(step, moved) if isinstance(a, (CopyHtoD, CopyDtoH))]
    assert len(moved) == len(step)
    assert all(a == b for a, b in zip(step, moved) if not isinstance(a, (CopyHtoD, CopyDtoH)))
    assert sorted(b.host_ptr for _, b in copies) == sorted(slot1.values())       # every input and loss_t
    name_at = {addr: name for name, addr in slot0.items()}
    for a, b in copies:
        assert b == dataclasses.replace(a, host_ptr=slot1[name_at[a.host_ptr]])
