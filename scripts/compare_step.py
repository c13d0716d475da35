"""Is a refactor bit-identical? Run the GPU step of whichever rwkvx is first on sys.path, save its
outputs, and compare two saves bit for bit (e.g. this checkout against an older commit).

  python scripts/compare_step.py dump OUT.npz          # loss, logits, every gradient: 4 configs x fp32/tf32
  python scripts/compare_step.py time OUT.json         # graph-replayed step times, 0.22B config, fp32 / tf32
  python scripts/compare_step.py compare A.npz B.npz   # bitwise comparison (and the relative size of diffs)

An older commit: ``git archive REV | tar -x -C old && (cd old && python setup.py build_ext --inplace)``,
then ``PYTHONPATH=$PWD/old python scripts/compare_step.py dump old.npz`` (run from outside the checkout
so that the installed rwkvx does not shadow it). Needs a GPU.
"""
import json
import runpy
import sys
from pathlib import Path

import numpy as np

# Loaded by path, not imported from the package: the rwkvx first on sys.path may be an older commit's.
MODEL_CASES = runpy.run_path(str(Path(__file__).resolve().parents[1] / "tests" / "model_cases.py")
                             )["MODEL_CASES"]
CASES = {
    "hybrid": MODEL_CASES["sparse_hybrid"],
    "leftover": MODEL_CASES["leftover_blocks"],
    "C256_N64": MODEL_CASES["C256_N64"],
    "N128_B1": (dict(vocab_size=300, n_embd=256, head_size=128, n_rwkv_layer=2, n_attn_layer=1,
                     moba_chunk_size=64, moba_top_k=3), 1, 300),
}


def params_for(cfg, seed):
    from rwkvx import init_params
    rng = np.random.default_rng(seed)
    out = {}
    for name, v in init_params(cfg, seed).items():
        if not v.any():
            v = rng.normal(0, 0.02, v.shape)
        out[name] = (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32)
    return out


def dump(path):
    from rwkvx import Config
    from rwkvx.model import Model
    res = {}
    for name, (kw, B, T) in CASES.items():
        cfg = Config(**kw)
        params = params_for(cfg, 5)
        rng = np.random.default_rng(7)
        tokens = rng.integers(0, cfg.vocab_size, (B, T))
        targets = rng.integers(0, cfg.vocab_size, (B, T))
        targets[rng.random((B, T)) < 0.2] = -100
        for precision in ("fp32", "tf32"):
            m = Model(cfg, params, B, T, precision=precision)
            loss, grads = m.loss_and_grads(tokens, targets)
            res[f"{name}/{precision}/loss"] = np.float64(loss)
            res[f"{name}/{precision}/logits"] = m.forward(tokens)
            for g, v in grads.items():
                res[f"{name}/{precision}/grad/{g}"] = v
            del m
    np.savez(path, **res)


def timing(path):
    from rwkvx import Config, init_params
    from rwkvx.model import Model
    from rwkvx.runtime import EventTimer, Graph
    cfg = Config(vocab_size=65536, n_embd=768, head_size=64, n_rwkv_layer=12, n_attn_layer=4,
                 moba_chunk_size=512, moba_top_k=3)
    out = {}
    for B, T in ((8, 4096), (1, 16384)):
        for precision in ("fp32", "tf32"):
            m = Model(cfg, init_params(cfg, 0), B, T, precision=precision)
            tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T))
            m.stage_batch(tok, np.roll(tok, -1, axis=1))
            m.run_step()
            m.dev.synchronize()
            g = Graph.capture(m.dev, m.run_step)
            g.launch()
            timer = EventTimer(m.dev)
            out[f"B{B}_T{T}/{precision}"] = round(timer.time_ms(g.launch, 3), 2)
            timer.close()
            g.close()
            del m
    json.dump(out, open(path, "w"))
    print(out)


def compare(a, b):
    A, Bz = np.load(a), np.load(b)
    assert set(A.files) == set(Bz.files), set(A.files) ^ set(Bz.files)
    bad = [k for k in A.files if not np.array_equal(np.atleast_1d(A[k]).view(np.uint8), np.atleast_1d(Bz[k]).view(np.uint8))]
    worst = {}
    for k in bad:
        x, y = A[k].astype(np.float64), Bz[k].astype(np.float64)
        worst[k] = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
    print(f"compared {len(A.files)} arrays: {len(A.files) - len(bad)} bit-identical, {len(bad)} differ")
    for k, e in sorted(worst.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {k}: rel diff {e:.3e}")


if __name__ == "__main__":
    COMMANDS = {"dump": dump, "time": timing, "compare": compare}
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    COMMANDS[sys.argv[1]](*sys.argv[2:])
