"""The WKV7 recurrence (rwkvx/cu/wkv7), forward and backward, every method × element type × shape
(rwkvx.workloads.WKV7_SHAPES, head size N of the 0.22B model), and from a shared initial state s0 with its
gradient ds0 (state tuning) at the 0.22B step's shape, and the chunked methods' segmented state passes
against one walk per sequence where B*H leaves the device idle; conftest.py's ``record`` reports ms, GB/s,
TFLOP/s and the copy-rate share. Skipped without a GPU."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from rwkvx.cu import wkv7
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES, bf16_bits_to_f32, to_storage
from rwkvx.workloads import (BASE_SHAPES, WKV7_SHAPES, RandomBuffers, wkv7_decay_logit_grad, wkv7_decay_logits,
                             wkv7_inputs)

N = BASE_SHAPES.N


def wkv_flops(n: int) -> float:
    return 8.0 * n * N          # per token and state row: sa, update (3 FMA), y: ~4 multiply-adds per element


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("shape", list(WKV7_SHAPES))
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("method", wkv7.METHODS)
def test_wkv7(record, dev, xtype, shape, direction, method):
    """One row per method x element type x shape x direction. The roofline is the copy rate over the
    bytes the op must move (inputs, outputs, what the forward saves for the backward): the chunked
    method's work buffer (chunk records, dS) is traffic on top of that floor, so it lowers the share."""
    _bench(record, dev, xtype, WKV7_SHAPES[shape], direction, method, state=False)


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("method", wkv7.METHODS)
def test_wkv7_initial_state(record, dev, xtype, direction, method):
    """test_wkv7's rows at B8 T4096 H12 from an initial state s0 [H, N, N], the backward also writing
    ds0 (each sequence's share, then their ordered sum): the cost of state tuning's WKV7."""
    _bench(record, dev, xtype, WKV7_SHAPES["B8_T4096_H12"], direction, method, state=True)


SEGMENT_SHAPES = {"B1_T16384_H12": (1, 16384, 12), "B1_T4096_H32": (1, 4096, 32)}


@pytest.mark.parametrize("segments", ["chosen", 1])
@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("shape", list(SEGMENT_SHAPES))
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("method", wkv7.CHUNKED_METHODS)
def test_wkv7_segments(record, dev, xtype, shape, direction, method, segments):
    """The chunked methods where B*H leaves the device idle (B1 T16384 H12; B1 T4096 H32, state tuning and
    LoRA fine-tuning at B1): the state passes cut into the segments chunked_segments chooses, against one
    walk per sequence (segments = 1)."""
    _bench(record, dev, xtype, SEGMENT_SHAPES[shape], direction, method, state=False,
           segments=None if segments == "chosen" else segments)


def _bench(record, dev, xtype: str, shape: tuple[int, int, int], direction: str, method: str, state: bool,
           segments: int | None = None) -> None:
    from rwkvx._core import Plan
    if method == "chunked_exact" and xtype != "f32":
        pytest.skip("chunked_exact takes f32 inputs (the fp32 precision's path)")
    B, T, H = shape
    b = RandomBuffers(dev, xtype)
    inp, n = wkv7_inputs(b, B, T, H, N)
    seg = {"segments": segments} if method in wkv7.CHUNKED_METHODS else {}
    sizes = wkv7.scratch_elems(B, T, H, N, dev.info, method=method, ds0=state, **seg)
    sa, ckpt = b(sizes["sa"], "f32"), b(sizes["ckpt"], "f32")
    part = b(sizes["partials"], "f32") if sizes["partials"] else None
    s0 = {"s0": b(H * N * N, "f32", scale=0.5)} if state else {}
    fwd = wkv7.forward(*inp, b(n), B, T, H, N, dev.info, sa=sa, ckpt=ckpt, method=method, partials=part, **seg, **s0)
    saved_bytes = 4 * (sizes["sa"] + sizes["ckpt"])
    if direction == "forward":
        record(fwd, nbytes=floor_bytes(direction, xtype, n, saved_bytes), flops=wkv_flops(n))
        return
    Plan(dev, fwd).run()                          # real checkpoints of these inputs
    ds0 = {"ds0": b(H * N * N, "f32"), "ds0_partials": b(sizes["ds0_partials"], "f32")} if state else {}
    ops = wkv7.backward(*inp, b(n), sa, ckpt, b(n), *[b(n, "f32") for _ in range(5)], B, T, H, N, dev.info,
                        partials=part, method=method, **seg, **s0, **ds0)
    record(ops, nbytes=floor_bytes(direction, xtype, n, saved_bytes), flops=2 * wkv_flops(n))


def floor_bytes(direction: str, xtype: str, n: int, saved_bytes: int) -> int:
    """The fewest bytes a WKV7 forward or backward of ``n`` elements per tensor moves, each once: the
    inputs (the decay w f32), the outputs (the backward's dw, dk, dv, da, db f32) and what the forward
    saves for the backward (``saved_bytes``)."""
    x = ELEM_BYTES[xtype]
    return (6 * x + 4 if direction == "forward" else 7 * x + 4 + 5 * 4) * n + saved_bytes


# ---- RWKV-LM's training kernel, an outside reference ---------------------------------------------------

RWKV_LM_ENV = "RWKV_LM_DIR"         # the root of a BlinkDL/RWKV-LM checkout
RWKV_LM_SOURCES = tuple(f"RWKV-v7/train_temp/cuda/{name}"
                        for name in ("rwkv7_clampw_v3_for_h100.cu", "rwkv7_clampw_v3.cpp"))
RWKV_LM_CHUNK = 16      # train_temp's CHUNK_LEN: T a multiple of it, the state saved every 16 tokens
AGREEMENT = 1e-2        # docs/SPEC.md §4's limit for a bf16 kernel, here between the two bf16 kernels


def rwkv_lm_sources() -> list[Path]:
    """The clampw v3 sources (.cu, .cpp) under $RWKV_LM_DIR. Skips, saying why, where it is unset;
    FileNotFoundError where it is set and a source is missing."""
    root = os.environ.get(RWKV_LM_ENV)
    if not root:
        pytest.skip(f"{RWKV_LM_ENV} is not set (the RWKV-LM checkout whose clampw v3 kernel is the reference)")
    paths = [Path(root) / rel for rel in RWKV_LM_SOURCES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{RWKV_LM_ENV}={root}: no {', '.join(missing)}")
    return paths


@pytest.fixture(scope="module")
def rwkv_lm():
    """RWKV-LM's ``torch.ops.rwkv7_clampw_v3`` (forward, backward), built by torch.utils.cpp_extension.load
    from $RWKV_LM_DIR with the flags train_temp's model builds it with (head size N, chunk 16, fast
    math); skipped, with the reason, without RWKV_LM_DIR, torch with CUDA, or ninja (load needs it)."""
    sources = rwkv_lm_sources()
    torch = pytest.importorskip("torch", reason="torch (an outside reference only) is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from torch.utils import cpp_extension
    if not cpp_extension.is_ninja_available():
        pytest.skip("ninja is not installed (torch.utils.cpp_extension.load builds with it)")
    flags = [f"-D_N_={N}", f"-D_CHUNK_LEN_={RWKV_LM_CHUNK}", "--use_fast_math", "-O3", "--ptxas-options=-O3",
             "--extra-device-vectorization"]
    cpp_extension.load(name="rwkv7_clampw_v3", sources=[str(p.resolve()) for p in sources], is_python_module=False,
                       extra_cuda_cflags=flags)
    return torch.ops.rwkv7_clampw_v3


@pytest.mark.parametrize("shape", list(WKV7_SHAPES))
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_wkv7_rwkv_lm(record, dev, rwkv_lm, shape, direction):
    """RWKV-LM's training kernel, clampw v3 for the H100 (bf16; one block per sequence and head, the state
    in fp32 registers, one token after another), beside test_wkv7's bf16 rows: the same r, k, v, a, b
    (and dy) bits, and the decay as the bf16 logits x whose decay exp(-e^-0.5 * sigmoid(x)) rwkvx's f32 w
    holds (rwkvx.workloads.wkv7_decay_logits). Timed with torch.cuda.Event; the byte count is the bf16
    row's, so the copy-rate shares compare times. Where the two differ: the reference reads the decay as
    bf16 logits (2 bytes, against rwkvx's f32 decay) and computes the decay itself, and writes every
    gradient in bf16 (rwkvx: dw, dk, dv, da, db f32), dw as the logits' gradient; both forwards save sa
    and the state every 16 tokens. Before the timing its outputs (forward: y; backward: the six gradients,
    rwkvx's dw taken to the logits by wkv7_decay_logit_grad) must agree with rwkvx's chunked bf16 ones
    to AGREEMENT, norm-wise; the errors are printed and kept in the row's extra_info (rel_err)."""
    import torch
    from rwkvx._core import Plan
    B, T, H = WKV7_SHAPES[shape]
    shp = (B, T, H, N)
    b = RandomBuffers(dev, "bf16")
    inp, n = wkv7_inputs(b, B, T, H, N)
    sizes = wkv7.scratch_elems(B, T, H, N, dev.info, method="chunked")
    sa, ckpt, part = (b(sizes[name], "f32") for name in ("sa", "ckpt", "partials"))
    y = b(n)
    Plan(dev, wkv7.forward(*inp, y, B, T, H, N, dev.info, sa=sa, ckpt=ckpt, method="chunked",
                           partials=part)).run()

    def tensor(bits: np.ndarray) -> "torch.Tensor":
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(shp).cuda()

    def device_bits(ptr) -> np.ndarray:
        return dev.download(ptr, (n,), np.uint16)

    logits = wkv7_decay_logits(n)
    r, k, v, a, bb = (tensor(device_bits(p)) for p in (inp[0], *inp[2:]))
    w = tensor(to_storage("bf16", logits))
    ref_y, ref_sa = torch.empty_like(v), torch.empty(shp, dtype=torch.float32, device="cuda")
    s = torch.empty((B, H, T // RWKV_LM_CHUNK, N, N), dtype=torch.float32, device="cuda")

    def forward():
        rwkv_lm.forward(r, w, k, v, a, bb, ref_y, s, ref_sa)

    forward()
    nbytes = floor_bytes(direction, "bf16", n, 4 * (s.numel() + ref_sa.numel()))    # = rwkvx's saved bytes
    if direction == "forward":
        _agree(record, shape, {"y": (ref_y, bf16_bits_to_f32(device_bits(y)))})
        _record_torch(record, torch, forward, nbytes, wkv_flops(n))
        return
    dy, dr = b(n), b(n)
    f32_grads = [b(n, "f32") for _ in range(5)]
    Plan(dev, wkv7.backward(*inp, dy, sa, ckpt, dr, *f32_grads, B, T, H, N, dev.info, partials=part,
                            method="chunked")).run()
    ref_dy = tensor(device_bits(dy))
    ref = [torch.empty_like(v) for _ in range(6)]

    def backward():
        rwkv_lm.backward(r, w, k, v, a, bb, ref_dy, s, ref_sa, *ref)

    backward()
    dw, dk, dv, da, db = (dev.download(p, (n,), np.float32) for p in f32_grads)
    want = [bf16_bits_to_f32(device_bits(dr)), wkv7_decay_logit_grad(dw, logits), dk, dv, da, db]
    _agree(record, shape, dict(zip(("dr", "dw", "dk", "dv", "da", "db"), zip(ref, want))))
    _record_torch(record, torch, backward, nbytes, 2 * wkv_flops(n))


def _agree(record, shape: str, pairs: dict) -> None:
    """Print rel_err of each (reference tensor, rwkvx array) pair and keep them in the row's extra_info;
    fail where one exceeds AGREEMENT: a reference that computes something else is not timed."""
    from rwkvx.oracle import rel_err
    errs = {name: rel_err(got.float().cpu().numpy().reshape(-1), want) for name, (got, want) in pairs.items()}
    text = ", ".join(f"{name} {e:.2e}" for name, e in errs.items())
    print(f"RWKV-LM clampw v3 against rwkvx chunked bf16, {shape}: {text}")
    record.benchmark.extra_info["rel_err"] = text
    bad = {name: e for name, e in errs.items() if not e <= AGREEMENT}
    if bad:
        pytest.fail(f"RWKV-LM's kernel disagrees with rwkvx's at {shape} (rel_err > {AGREEMENT}): {bad}")


def _record_torch(record, torch, enqueue, nbytes: int, flops: float) -> None:
    """Time ``enqueue`` (torch's stream) with torch.cuda.Event after a warm-up call, as many calls as fill
    the timing budget, and record the mean."""
    from rwkvx.runtime.timing import budget_repeats
    enqueue()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def mean_ms(repeats: int) -> float:
        start.record()
        for _ in range(repeats):
            enqueue()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / repeats

    record.measured(mean_ms(budget_repeats(mean_ms(1))), lambda: (enqueue(), torch.cuda.synchronize()),
                    nbytes=nbytes, flops=flops)
