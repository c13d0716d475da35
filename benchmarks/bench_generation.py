"""Generation speed at batch 1 after a 512-token prompt: stateful (the prompt once, then one step per
token) against the window re-run ``sample`` did before (a whole forward over the last ``ctx`` tokens for
every new token). Report, don't assert: ``extra_info["tokens_per_s"]`` of each row. Every token is
sampled from its logits as ``sample`` does (temperature 0.8, top-p 0.9: the CLI's defaults); the tokens
fed are a fixed random sequence, so every row does the same work.

* CPU: the tiny default model (the ``tiny`` preset), float32 oracle; the window re-run with the tiny
  run's context (its seq_len, 128: what ``sample`` used by default) and with the whole sequence (the
  same tokens as the stateful path).
* GPU: the 0.22B config (the ``base`` preset's model) in fp32, tf32 and bf16: the
  decoder's graph-replayed step with its sampling on the device (wall clock per ``step``, the host's
  sync and token read included, and CUDA-event time of the graph alone), against ``forward_padded`` over a 512-token window; and the
  time to the first token of a ``generate`` call after a first one (the decoder kept on the model:
  nothing built, the prompt's prefill and one step); and the device sampler ``dec_sample`` alone on
  V = 65536 logits (CUDA-event time per call, B = 1 and 256 rows).
* GPU, the decode step at small batch (``test_gpu_decode_step``): the RWKV-7 0.1B (``rwkv7-0.1b``) and
  1.5B (``rwkv7-1.5b``) and the 0.22B RWKV-X (``base``) models (parameters drawn on the device) in bf16
  and tf32 at B = 1, 8 and 64, the step's products in dec_gemv
  (the small-batch path) and, for comparison, in the forward's GEMMs (the large-batch path): tokens/s
  (B per ``step``, wall clock), the graph's CUDA-event time per step (with the rows' sampling, and
  greedy: ``dec_sample``'s one pass), and the memory floor of a step: the bytes it must read (every
  weight but the embedding's, in the GEMM operand type, and the WKV state read and written, fp32) at
  4.3 TB/s, with the share of it the greedy graph reaches.
* GPU, against an outside reference (``test_gpu_generate_against_the_rwkv_package``): ``generate`` on the
  rwkv7-0.1b weights beside the ``rwkv`` pip package (ChatRWKV's engine) on the same weights exported
  as an RWKV-LM ``.pth``: tokens/s of each by wall clock and their ratio; skipped without PyTorch (CUDA)
  or the package.

Run: ``python -m pytest benchmarks/bench_generation.py --benchmark-columns=mean,rounds`` (GPU rows skip
without a GPU).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from rwkvx import Config, init_params
from rwkvx.sampling import Sampling, sample_token
from rwkvx.presets import get_preset

PROMPT = 512
RNG = np.random.default_rng(0)


SAMPLING = Sampling(temperature=0.8, top_p=0.9)      # the CLI's defaults


def sample(logits: np.ndarray) -> int:
    return sample_token(logits, RNG.random(), SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p)


def tokens_per_s(benchmark, fn, tokens: int, rounds: int) -> float:
    """Time ``fn`` (producing ``tokens`` tokens) ``rounds`` times; store and return tokens/s of the mean."""
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
    rate = tokens / benchmark.stats.stats.mean
    benchmark.extra_info["tokens_per_s"] = round(rate, 1)
    return rate


# ------------------------------------------------------------------ CPU: the tiny default model

@pytest.fixture(scope="module")
def tiny():
    from rwkvx.oracle import Oracle
    preset = get_preset("tiny")
    cfg = Config(**preset["model"])
    oracle = Oracle(cfg, init_params(cfg, 0), dtype=np.float32)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, PROMPT + 64))
    return oracle, tokens, preset["train"].seq_len


def test_cpu_stateful(benchmark, tiny):
    oracle, tokens, _ = tiny
    _, prompt_state = oracle.stateful_forward(tokens[:, :PROMPT])
    n = tokens.shape[1] - PROMPT

    def decode():
        state = prompt_state
        for t in range(PROMPT, PROMPT + n):
            logits, state = oracle.stateful_forward(tokens[:, t:t + 1], state)
            sample(logits[0, -1])

    tokens_per_s(benchmark, decode, n, rounds=5)
    t0 = time.perf_counter()
    oracle.stateful_forward(tokens[:, :PROMPT])
    benchmark.extra_info["prefill_s"] = round(time.perf_counter() - t0, 4)


@pytest.mark.parametrize("window", ["run_seq_len", "whole_sequence"])
def test_cpu_window_rerun(benchmark, tiny, window):
    oracle, tokens, seq_len = tiny
    n = 8

    def rerun():
        for t in range(PROMPT, PROMPT + n):
            start = t - seq_len if window == "run_seq_len" else 0
            sample(oracle.forward(tokens[:, start:t])[0, -1])

    tokens_per_s(benchmark, rerun, n, rounds=3)
    benchmark.extra_info["ctx"] = seq_len if window == "run_seq_len" else f"{PROMPT}..{PROMPT + n - 1}"


# ------------------------------------------------------------------ GPU: the 0.22B config

@pytest.fixture(scope="module")
def base_params():
    cfg = Config(**get_preset("base")["model"])
    return cfg, init_params(cfg, 0), np.random.default_rng(0).integers(0, cfg.vocab_size, (1, PROMPT + 128))


def _model(dev, cfg, params, T, precision):
    from rwkvx.model import Model
    return Model(cfg, params, 1, T, precision=precision)


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp32"])
def test_gpu_stateful(benchmark, dev, base_params, precision):
    from rwkvx.decoder import Decoder
    from rwkvx.runtime import EventTimer
    cfg, params, tokens = base_params
    n = tokens.shape[1] - PROMPT
    decoder = Decoder(_model(dev, cfg, params, 1, precision), 1, PROMPT, PROMPT + n)
    try:
        t0 = time.perf_counter()
        fed = int(decoder.prefill(tokens[:, :PROMPT], SAMPLING)[0])
        for t in range(fed, PROMPT):             # the prompt's last tokens go through the step
            decoder.step(tokens[:, t], RNG.random(1))
        prefill_s = time.perf_counter() - t0
        steps = iter(range(PROMPT, PROMPT + n))

        def one_token():             # sampled on the device: only the token id comes back
            decoder.step(tokens[:, next(steps)], RNG.random(1))

        benchmark.pedantic(one_token, rounds=n - 8, iterations=1, warmup_rounds=4)
        benchmark.extra_info["tokens_per_s"] = round(1.0 / benchmark.stats.stats.mean, 1)
        timer = EventTimer(dev)
        graph_ms = timer.time_ms(decoder.graph.launch, 20)    # device time of the step alone
        timer.close()
        benchmark.extra_info.update(prefill_s=round(prefill_s, 4), graph_ms_per_token=round(graph_ms, 4),
                                    graph_tokens_per_s=round(1e3 / graph_ms, 1))
    finally:
        decoder.free()


HBM_BYTES_PER_S = 4.3e12          # the H200's memory bandwidth
DECODE_PROMPT = 64                # the small-batch rows' prompt (the step's cost hardly depends on it)


@pytest.fixture(scope="module", params=["rwkv7-0.1b", "base", "rwkv7-1.5b"])
def preset_params(request, dev):
    cfg = Config(**get_preset(request.param)["model"])
    return request.param, cfg, init_params(cfg, 0, device="gpu")


def step_floor_bytes(cfg: Config, params: dict, B: int, precision: str) -> int:
    """The bytes a decode step must move: every weight but the embedding's (bf16 operands in bf16, fp32
    otherwise) and the WKV state of the B sequences, read and written (fp32)."""
    weights = sum(p.size for n, p in params.items() if n != "rwkv.emb.weight")
    state = B * cfg.n_rwkv_layer * cfg.n_head * cfg.head_size ** 2
    return weights * (2 if precision == "bf16" else 4) + 2 * 4 * state


@pytest.mark.parametrize("path", ["dec_gemv", "gemm"])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_gpu_decode_step(benchmark, dev, preset_params, precision, B, path, monkeypatch):
    from rwkvx.cu import decode
    from rwkvx.decoder import Decoder
    from rwkvx.model import Model
    from rwkvx.runtime import EventTimer
    if path == "gemm":            # the step as at large batch: the forward's GEMMs and activation kernels
        monkeypatch.setattr(decode, "GEMV_ROWS", 0)
    name, cfg, params = preset_params
    n = 96
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (B, DECODE_PROMPT + n))
    decoder = Decoder(Model(cfg, params, B, 1, precision=precision), B, DECODE_PROMPT, DECODE_PROMPT + n)
    try:
        fed = int(decoder.prefill(tokens[:, :DECODE_PROMPT], SAMPLING)[0])
        for t in range(fed, DECODE_PROMPT):
            decoder.step(tokens[:, t], RNG.random(B))
        steps = iter(range(DECODE_PROMPT, DECODE_PROMPT + n))
        benchmark.pedantic(lambda: decoder.step(tokens[:, next(steps)], RNG.random(B)), rounds=n - 8,
                           iterations=1, warmup_rounds=4)
        timer = EventTimer(dev)
        graph_ms = timer.time_ms(decoder.graph.launch, 50)
        decoder.prefill(tokens[:, :DECODE_PROMPT], Sampling(temperature=0.0))   # greedy: dec_sample's one pass
        greedy_ms = timer.time_ms(decoder.graph.launch, 50)
        timer.close()
        floor_ms = 1e3 * step_floor_bytes(cfg, params, B, precision) / HBM_BYTES_PER_S
        benchmark.extra_info.update(model=name, path=path, tokens_per_s=round(B / benchmark.stats.stats.mean, 1),
                                    graph_ms_per_step=round(graph_ms, 4), greedy_graph_ms=round(greedy_ms, 4),
                                    graph_tokens_per_s=round(B * 1e3 / graph_ms, 1),
                                    floor_ms=round(floor_ms, 4), floor_share=round(floor_ms / greedy_ms, 3))
        print(f"\n{name} {precision} B={B} {path}: {B / benchmark.stats.stats.mean:.0f} tokens/s, graph "
              f"{graph_ms:.4f} ms/step ({B * 1e3 / graph_ms:.0f} tokens/s), greedy {greedy_ms:.4f} ms/step "
              f"({B * 1e3 / greedy_ms:.0f} tokens/s), floor {floor_ms:.4f} ms ({floor_ms / greedy_ms:.0%} of greedy)")
    finally:
        decoder.free()


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp32"])
def test_gpu_first_token_of_a_second_generate(benchmark, dev, base_params, precision):
    import rwkvx
    cfg, params, tokens = base_params
    model = _model(dev, cfg, params, 1, precision)
    t0 = time.perf_counter()
    rwkvx.generate(model, tokens[0, :PROMPT], 1)          # builds the decoder kept on the model
    benchmark.extra_info["first_call_s"] = round(time.perf_counter() - t0, 3)
    benchmark.pedantic(lambda: rwkvx.generate(model, tokens[0, :PROMPT], 1), rounds=5, iterations=1)
    benchmark.extra_info["first_token_s"] = round(benchmark.stats.stats.mean, 4)


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp32"])
def test_gpu_window_rerun(benchmark, dev, base_params, precision):
    from rwkvx.training.trainer import forward_padded
    cfg, params, tokens = base_params
    model = _model(dev, cfg, params, PROMPT, precision)
    steps = iter(range(PROMPT, PROMPT + 64))

    def one_token():
        t = next(steps)
        sample(forward_padded(model, tokens[:, t - PROMPT:t])[0, -1])

    benchmark.pedantic(one_token, rounds=8, iterations=1, warmup_rounds=2)
    benchmark.extra_info["tokens_per_s"] = round(1.0 / benchmark.stats.stats.mean, 2)


@pytest.mark.parametrize("B", [1, 256])
def test_gpu_dec_sample(benchmark, dev, B):
    from rwkvx._core import Plan
    from rwkvx.cu import decode
    from rwkvx.runtime import EventTimer
    from rwkvx.runtime.dtypes import to_storage
    V = 65536
    bufs = {name: dev.alloc(nbytes) for name, nbytes in
            (("logits", 2 * B * V), ("u", 8 * B), ("opts", 8 * len(decode.SAMPLE_OPTS)), ("out", 4 * B))}
    try:
        dev.upload(bufs["logits"], to_storage("bf16", RNG.standard_normal((B, V)) * 3))
        dev.upload(bufs["u"], RNG.random(B))
        dev.upload(bufs["opts"], np.array([getattr(SAMPLING, n) for n in decode.SAMPLE_OPTS], np.float64))
        plan = Plan(dev, decode.sample(*(bufs[n].typed(e) for n, e in (("logits", "bf16"), ("u", "f64"),
                                                                      ("opts", "f64"), ("out", "i32"))), B, V))
        plan.run()
        timer = EventTimer(dev)
        benchmark.pedantic(lambda: timer.time_ms(plan.run, 20), rounds=3, iterations=1)
        benchmark.extra_info["ms_per_call"] = round(timer.time_ms(plan.run, 20), 4)
        print(f"\ndec_sample B={B}: ms_per_call {benchmark.extra_info['ms_per_call']}")
        timer.close()
    finally:
        for buf in bufs.values():
            buf.close()


# ------------------------------------------------------------------ GPU: the rwkv package, an outside reference
RWKV_PACKAGE_NEW = 256            # tokens generated after the 512-token prompt


def test_gpu_generate_against_the_rwkv_package(benchmark, dev, tmp_path, monkeypatch):
    """Generation at batch 1 by wall clock, rwkvx against the ``rwkv`` pip package (ChatRWKV's engine:
    ``RWKV_V7_ON=1``, strategy "cuda bf16", PyTorch ops per token, no graph) on the same weights: the
    rwkv7-0.1b preset's random initialisation, exported by rwkvx as an RWKV-LM ``.pth``. Each generates
    RWKV_PACKAGE_NEW tokens after a PROMPT-token prompt, temperature 0.8 and top-p 0.9, the package with
    its own sampler (``PIPELINE.sample_logits``), rwkvx with ``generate`` on a built model (its decoder
    kept). Skipped where PyTorch with CUDA or the ``rwkv`` package is missing (the package is an outside
    reference only)."""
    import rwkvx
    from rwkvx.checkpoint import export_rwkv7_pth
    from rwkvx.model import Model
    torch = pytest.importorskip("torch", reason="the rwkv package runs on PyTorch, which is not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    monkeypatch.setenv("RWKV_V7_ON", "1")              # read when rwkv.model is imported
    monkeypatch.setenv("RWKV_CUDA_ON", "0")
    rwkv_model = pytest.importorskip("rwkv.model", reason="the rwkv package is not installed")
    rwkv_utils = pytest.importorskip("rwkv.utils", reason="the rwkv package is not installed")
    cfg = Config(**get_preset("rwkv7-0.1b")["model"])
    params = init_params(cfg, 0)
    export_rwkv7_pth(tmp_path / "model.pth", cfg, params, dtype="bf16")
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, PROMPT)
    package = rwkv_model.RWKV(model=str(tmp_path / "model"), strategy="cuda bf16")

    def package_generate():
        logits, state = package.forward(prompt.tolist(), None)
        for _ in range(RWKV_PACKAGE_NEW):
            token = rwkv_utils.PIPELINE.sample_logits(None, logits, temperature=0.8, top_p=0.9)
            logits, state = package.forward(token, state)
        torch.cuda.synchronize()

    model = Model(cfg, params, 1, 1, precision="bf16")
    rwkvx.generate(model, prompt, 1)                   # builds the decoder kept on the model

    def rwkvx_generate():
        rwkvx.generate(model, prompt, RWKV_PACKAGE_NEW, temperature=0.8, top_p=0.9)

    rates = {}
    for name, fn in (("rwkv_package", package_generate), ("rwkvx", rwkvx_generate)):
        fn()                                           # warm-up: kernels, caches
        t0 = time.perf_counter()
        fn()
        rates[name] = RWKV_PACKAGE_NEW / (time.perf_counter() - t0)
    benchmark.pedantic(rwkvx_generate, rounds=1, iterations=1)
    benchmark.extra_info.update({f"{k}_tokens_per_s": round(v, 1) for k, v in rates.items()})
    benchmark.extra_info["ratio"] = round(rates["rwkvx"] / rates["rwkv_package"], 2)
    print(f"\nrwkv7-0.1b bf16 batch 1, {PROMPT}-token prompt + {RWKV_PACKAGE_NEW}: rwkvx {rates['rwkvx']:.0f} "
          f"tokens/s, rwkv package {rates['rwkv_package']:.0f} tokens/s ({rates['rwkvx'] / rates['rwkv_package']:.1f}x)")
