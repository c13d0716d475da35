"""GPU step timings (report, don't assert): eager plan vs CUDA-graph replay, and peak device memory.

Each benchmark times with CUDA events on the model's stream (pytest-benchmark's own wall-clock rounds
are one synchronised call each); ``extra_info`` carries the event-timed per-step milliseconds and the
device memory. Skipped without a GPU.
"""
import numpy as np
import pytest

from rwkvx import Config, init_params

CONFIGS = {
    # launch-bound: PyTorch eager needs ~40 ms per step here on the same H200 (issue 4)
    "small_B8_T512": (dict(vocab_size=256, n_embd=256, head_size=64, n_rwkv_layer=4, n_attn_layer=1,
                           moba_chunk_size=64, moba_top_k=3), 8, 512),
    # PyTorch eager + RWKV-LM's bf16 WKV kernel: 454 ms / 96 GB (bf16), 653 ms / 120 GB (tf32) (issue 3)
    "base_B8_T4096": (dict(vocab_size=65536, n_embd=768, head_size=64, n_rwkv_layer=12, n_attn_layer=4,
                           moba_chunk_size=512, moba_top_k=3), 8, 4096),
    "base_B1_T16384": (dict(vocab_size=65536, n_embd=768, head_size=64, n_rwkv_layer=12, n_attn_layer=4,
                            moba_chunk_size=512, moba_top_k=3), 1, 16384),
    # pure RWKV-7; RWKV-LM train_temp (bf16): 172 ms / 32 GB (B8 T4096), 62 ms / 8.7 GB (B16 T512)
    "pure_B8_T4096": (dict(vocab_size=65536, n_embd=768, head_size=64, n_rwkv_layer=12), 8, 4096),
    "pure_B16_T512": (dict(vocab_size=65536, n_embd=768, head_size=64, n_rwkv_layer=12), 16, 512),
    # one long sequence: must train within 40 GB (issue 10)
    "base_B1_T131072": (dict(vocab_size=65536, n_embd=768, head_size=64, n_rwkv_layer=12, n_attn_layer=4,
                             moba_chunk_size=512, moba_top_k=3), 1, 131072),
}
LONG = ("base_B1_T131072",)       # bf16 with recompute only (the other modes need more memory)

RUNS = ([(name, "eager", "fp32", True) for name in ("small_B8_T512", "base_B8_T4096")]
        + [(name, "graph", precision, recompute) for recompute in (True, False)
           for name in CONFIGS if name not in LONG for precision in ("fp32", "tf32", "bf16")]
        + [(name, "graph", "bf16", True) for name in LONG])


@pytest.mark.parametrize("name, mode, precision, recompute", RUNS,
                         ids=[f"{n}-{m}-{p}-{'recompute' if r else 'keep'}" for n, m, p, r in RUNS])
def test_step(benchmark, dev, name, mode, precision, recompute):
    from rwkvx.model import Model
    from rwkvx.runtime import EventTimer, Graph
    kwargs, B, T = CONFIGS[name]
    cfg = Config(**kwargs)
    rng = np.random.default_rng(0)
    dev.reset_peak()
    model = Model(cfg, init_params(cfg, 0), B, T, precision=precision, recompute=recompute)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    model.stage_batch(tokens, np.roll(tokens, -1, axis=1))
    model.run_step()              # warm-up: modules loaded, cuBLAS heuristics chosen
    dev.synchronize()
    if mode == "graph":
        graph = Graph.capture(dev, model.run_step)
        enqueue = graph.launch
    else:
        enqueue = model.run_step
    enqueue()
    dev.synchronize()
    timer = EventTimer(dev)
    repeats = 20 if name.startswith("small") else 1 if name in LONG else 3
    step_ms = timer.time_ms(enqueue, repeats)

    def one_step():
        enqueue()
        dev.synchronize()

    benchmark.pedantic(one_step, rounds=1 if name in LONG else 3, iterations=1)
    mem = dev.memory_info()
    benchmark.extra_info.update({
        "event_ms_per_step": round(step_ms, 3),
        "tokens_per_s": round(B * T / (step_ms / 1e3)),
        "arena_GiB": round(model.memory_bytes() / 2**30, 2),
        "arena_KiB_per_token": round(model.layout.bytes_per_token() / 1024, 1),
        "peak_alloc_GiB": round(mem["peak_allocated"] / 2**30, 2),
        "device_used_GiB": round((mem["total"] - mem["free"]) / 2**30, 2),
        "loss": round(model.mean_loss(), 4),
    })
    timer.close()
    if mode == "graph":
        graph.close()
