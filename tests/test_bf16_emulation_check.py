"""scripts/bf16_emulation_check.py on the CPU: its command line (the --fp32 variants, --cache), and on a
tiny hybrid model that each variant is the emulated plan with its families promoted, that the float64
reference and the yardstick are computed once for all variants, and that a second run on the same inputs
reads them back from the cache (a run on other inputs computes them again). Skipped without PyTorch."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the script's twins need it)")

import torch_twin  # noqa: E402  (needs torch)
from rwkvx import Config  # noqa: E402
from seeding import seeded_rng  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CFG = Config(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1, moba_chunk_size=8,
             moba_top_k=2)


@pytest.fixture(scope="module")
def script():
    """The script as a module. It imports tests/conftest.py by the name ``conftest``, which pytest's own
    loading of the conftest files may have taken out of sys.modules, and prepends its folders to sys.path:
    both are put back afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delitem(sys.modules, "conftest", raising=False)
        mp.syspath_prepend(str(ROOT / "tests"))
        spec = importlib.util.spec_from_file_location("bf16_emulation_check", ROOT / "scripts/bf16_emulation_check.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


@pytest.fixture
def inputs(training_like):
    rng = seeded_rng(4)
    tokens, targets = rng.integers(0, CFG.vocab_size, (2, 2, 32))
    targets[rng.random((2, 32)) < 0.2] = -100
    return CFG, training_like(CFG, 4), tokens, targets


def test_fp32_variants_on_the_command_line(script):
    args = script.parse_args(["--case", "rwkv7-N64-T1024"])
    assert args.case == ("rwkv7", 64, 1024) and args.fp32 == [[]] and args.cache is None
    args = script.parse_args(["--case", "hybrid-N64-T4096", "--seed", "1", "--cpu", "--cache", "/tmp/c",
                              "--fp32", "--fp32", "r", "--fp32", "drkv", "lora"])
    assert args.fp32 == [[], ["r"], ["drkv", "lora"]] and args.cache == Path("/tmp/c")
    assert [script.variant(v) for v in args.fp32] == ["emulation", "emulation + r fp32",
                                                      "emulation + drkv, lora fp32"]
    assert script.variant(["decay", "r", "r"]) == "emulation + r fp32"      # decay is the plan's already


@pytest.mark.parametrize("argv, message", [
    (["--case", "rwkv7-N64-T1024", "--fp32", "bogus"], "invalid choice"),
    (["--case", "rwkv7-N64-T1024", "--cache", "/tmp/c"], "--cache needs --cpu"),
    (["--case", "rwkv7-N48-T1024"], "--case must be"),
])
def test_bad_command_lines_are_refused(script, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        script.parse_args(argv)
    assert exc.value.code != 0 and message in capsys.readouterr().err


def test_variants_share_one_cached_reference(script, inputs, tmp_path, monkeypatch):
    cfg, params, tokens, targets = inputs
    recipes = []
    twin = torch_twin.loss_and_grads

    def counted(*args, **kwargs):
        recipes.append(args[4])
        return twin(*args, **kwargs)

    monkeypatch.setattr(torch_twin, "loss_and_grads", counted)
    cache = tmp_path / "case.npz"
    variants = [[], ["r"], ["drkv", "lora"], ["r"]]
    ref, got = script.emulations(cfg, params, tokens, targets, variants, ["moba_bf16"], cache=cache)
    assert recipes == ["float64", "autocast_bf16"] + ["rwkvx_bf16"] * 3 and cache.exists()
    assert list(got) == ["emulation", "emulation + r fp32", "emulation + drkv, lora fp32", "yardstick"]
    want = twin(cfg, params, tokens, targets)
    assert all(np.array_equal(ref[n], g) for n, g in want.grads.items())
    plan_lora = twin(cfg, params, tokens, targets, "rwkvx_bf16", selection=want.selection, kernels=["moba_bf16"],
                     fp32_families=script.PLAN_FP32 | {"drkv", "lora"})
    assert all(np.array_equal(got["emulation + drkv, lora fp32"][n], g) for n, g in plan_lora.grads.items())

    recipes.clear()
    again_ref, again = script.emulations(cfg, params, tokens, targets, variants[:2], ["moba_bf16"], cache=cache)
    assert recipes == ["rwkvx_bf16"] * 2                    # the reference and the yardstick read back
    for name in ("emulation", "yardstick"):
        assert all(np.array_equal(again[name][n], g) for n, g in got[name].items())
    assert all(np.array_equal(again_ref[n], g) for n, g in ref.items())

    recipes.clear()
    script.emulations(cfg, params, tokens[:, ::-1].copy(), targets, [[]], ["moba_bf16"], cache=cache)
    assert recipes == ["float64", "autocast_bf16", "rwkvx_bf16"]   # other inputs: computed again


def test_compare_counts_the_tensors_over_the_bound(script):
    ref = {"a": np.ones(4), "b": np.ones(4)}
    got = {"emulation": {"a": np.full(4, 1.05), "b": np.full(4, 1.01)},
           "emulation + r fp32": {"a": np.full(4, 1.01), "b": np.full(4, 1.01)},
           "yardstick": {"a": np.full(4, 1.02), "b": np.full(4, 1.02)}}
    rows = script.compare(ref, got)
    assert rows[-1] == "| tensors over the bound | | | | 1 | 0 |"
    assert any(row.startswith("| a | 5.000e-02 | 1.000e-02 | 2.000e-02 | 2.000 | 0.400 |") for row in rows)
