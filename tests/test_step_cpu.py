"""The GPU model's whole training step on the CPU with rwkvx's real kernels (tests/cuda_cpu/step_device.py):
``Model`` builds and runs its plans on a stand-in device whose launches run the kernel files compiled by
g++, checked by the GPU parity test's own body (tests/gpu/test_model_parity.py: loss, every gradient and
the logits against the float64 oracle within its limits; recompute on and off bit-identical) at tiny
shapes; the LayerNorms fused with the token shifts (ln_shift_fwd, ln_shift_bwd) against the separate
kernels, bit for bit (the fused backward's LayerNorm weight and bias and channel-mix x_k gradients, summed
in another order, within 1e-5 of the largest); and training with AdamW by tests/gpu/test_train_gpu.py's comparison with the CPU backend. Skipped,
with the reason, where g++ or x86-64 is missing."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

from cuda_cpu import step_device  # noqa: E402
from cuda_cpu.executor import unavailable_reason  # noqa: E402
from rwkvx import Config  # noqa: E402
from rwkvx import model as model_module  # noqa: E402
from rwkvx.arena import Layout  # noqa: E402
from rwkvx.cu import channelmix, layernorm, timemix  # noqa: E402
from rwkvx.model import Model  # noqa: E402
from rwkvx.step import TIME_MIX_OUTPUTS, TIME_MIXES, StepBuilder  # noqa: E402
from seeding import seeded_rng  # noqa: E402
import test_model_parity  # noqa: E402
import test_train_gpu  # noqa: E402
from test_model_parity import TOLERANCES, TRAINING_LIKE_TOLERANCES, _check_against_oracle  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

# name -> (Config keywords, B, T), small enough for fibers: a pure RWKV-7 model (head size 16: the
# sequential WKV7 in every precision) and a hybrid with a MoBA block (head size 32: with tensor cores, the
# chunked WKV7 and MoBA's mma kernels). B, T and C are those of the GPU test's rwkv_only and sparse_hybrid:
# its reduced-precision limits hold for models of about that many tokens and channels (with fewer, bf16
# gradients of the small LoRA matrices reach its 5e-2 for some seeds).
CASES = {
    "rwkv7": (dict(vocab_size=37, n_embd=64, head_size=16, n_rwkv_layer=2), 2, 40),
    "hybrid": (dict(vocab_size=37, n_embd=64, head_size=32, n_rwkv_layer=1, n_attn_layer=1, moba_chunk_size=8,
                    moba_top_k=2), 2, 64),
}


@pytest.fixture
def cpu_step(monkeypatch) -> step_device.CpuStepDevice:
    """The CPU step device as the process's device for one test."""
    return step_device.install(monkeypatch)


PARITY = [(n, p, r) for n in CASES for p in ("fp32", "tf32", "bf16") for r in (True, False)]


@pytest.mark.parametrize("name, precision, recompute", PARITY,
                         ids=[f"{n}-{p}-{'recompute' if r else 'keep'}" for n, p, r in PARITY])
def test_model_matches_oracle(cpu_step, name, precision, recompute, random_params, training_like,
                              record_property):
    """Loss, gradients and logits of the step run with the real kernels, against the oracle: fp32 with
    random parameters at the fp32 limits, reduced precisions on a training-like model at theirs."""
    kwargs, B, T = CASES[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    seed = int(rng.integers(1 << 31))
    if precision == "fp32":
        params = {k: v.astype(np.float32) for k, v in random_params(cfg, seed).items()}
        tolerances = TOLERANCES[precision]
    else:
        params = training_like(cfg, seed)
        tolerances = TRAINING_LIKE_TOLERANCES[precision]
    _check_against_oracle(cfg, params, B, T, precision, *tolerances, rng, record_property, ignore_some=True,
                          recompute=recompute)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_no_recompute_is_bit_identical(cpu_step, monkeypatch, name, precision, random_params):
    """The GPU test's body on the tiny cases: recompute=False gives recompute=True's loss and gradients
    bit for bit."""
    monkeypatch.setattr(test_model_parity, "CASES", CASES)
    test_model_parity.test_no_recompute_is_bit_identical(name, precision, random_params)


def test_adamw_training_matches_cpu_backend(cpu_step, random_params):
    """Trainer(backend="gpu") on the CPU step device: four steps (AdamW with weight decay and clipping,
    through the graph path) against the float64 CPU backend, by the GPU test's body."""
    test_train_gpu.test_gpu_adamw_matches_cpu_twin(random_params, "standard")


class _LayoutWithLnOutputs(Layout):
    """A Layout with the LayerNorm outputs h1 and h2, which the separate kernels' steps store and read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, ln_outputs=True, **kwargs)


def _separate_shifts(monkeypatch) -> None:
    """StepBuilder's LayerNorm + token shifts as two kernels each (ln_forward, then tm_shift_fwd /
    cm_shift_mix), h1 and h2 always stored (Model's layouts have them): the step before ln_shift_fwd."""
    monkeypatch.setattr(model_module, "Layout", _LayoutWithLnOutputs)

    def time_shift(self, i, xin, h=None):
        b, att = self.buf, f"rwkv.blocks.{i}.att."
        mixes = [self.p(att + m) for m in TIME_MIXES]
        return (self._ln1_forward(f"rwkv.blocks.{i}.", xin, b("h1"))
                + timemix.shift_forward(b("h1"), mixes, [b(n) for n in TIME_MIX_OUTPUTS],
                                        self.R, self.cfg.n_embd, self.T, self.dev))

    def channel_shift(self, prefix, xin, h=None):
        b = self.buf
        return (self._ln2_forward(prefix, xin)
                + channelmix.shift_mix(b("h2"), self.p(prefix + "ffn.x_k"), b("xk2"), self.R, self.T,
                                       self.cfg.n_embd, self.dev))

    monkeypatch.setattr(StepBuilder, "time_shift", time_shift)
    monkeypatch.setattr(StepBuilder, "channel_shift", channel_shift)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_fused_shifts_are_bit_identical(cpu_step, monkeypatch, precision, recompute, random_params):
    """The step with ln_shift_fwd (h1, h2 never stored) gives the loss and gradients of
    the step with ln_forward + the shift kernels bit for bit (the hybrid: RWKV and MoBA blocks)."""
    kwargs, B, T = CASES["hybrid"]
    separate = (lambda: _separate_shifts(monkeypatch), recompute)
    test_model_parity.assert_steps_bit_identical(Config(**kwargs), B, T, precision, random_params,
                                                 [(None, recompute), separate])


def _separate_shift_backwards(monkeypatch) -> None:
    """StepBuilder's token shift + LayerNorm backwards as the shift's backward (tm_shift_bwd / cm_mix_backward)
    into dh1 / dh2, then the LayerNorm backward, reading the h1 and h2 the forward stores: the step before
    ln_shift_bwd (with recompute, where the block's forward has just stored them; Model's layouts have them).
    dh2 lives in dlnout, free once ln_out's backward has run."""
    monkeypatch.setattr(model_module, "Layout", _LayoutWithLnOutputs)
    fused_time, fused_channel = StepBuilder.time_shift, StepBuilder.channel_shift

    def time_shift(self, i, xin, h=None):
        return fused_time(self, i, xin, self.buf("h1"))

    def channel_shift(self, prefix, xin, h=None):
        return fused_channel(self, prefix, xin, self.buf("h2"))

    def time_shift_backward(self, i, xin):
        b, att = self.buf, f"rwkv.blocks.{i}.att."
        return (timemix.shift_backward(b("h1"), [self.p(att + m) for m in TIME_MIXES],
                                       [b("d" + n) for n in TIME_MIX_OUTPUTS], b("dh1"),
                                       [self.gp(att + m) for m in TIME_MIXES], b("partials"), self.R,
                                       self.cfg.n_embd, self.T, self.dev)
                + self._ln1_backward(f"rwkv.blocks.{i}.", xin))

    def channel_shift_backward(self, prefix):
        b, R, C, dh2 = self.buf, self.R, self.cfg.n_embd, self.buf("dlnout")
        return (channelmix.mix_backward(b("dxk2"), b("h2"), self.p(prefix + "ffn.x_k"), dh2,
                                        self.gp(prefix + "ffn.x_k"), b("partials"), R, self.T, C, self.dev)
                + layernorm.backward(b("x1"), self.p(prefix + "ln2.weight"), dh2, b("dx"),
                                     self.gp(prefix + "ln2.weight"), self.gp(prefix + "ln2.bias"), b("ln2_mean"),
                                     b("ln2_rstd"), b("partials"), R, C, self.dev, accumulate_dx=True,
                                     dx_copy=self.copy_out("dx")))

    for name, method in (("time_shift", time_shift), ("channel_shift", channel_shift),
                         ("time_shift_backward", time_shift_backward),
                         ("channel_shift_backward", channel_shift_backward)):
        monkeypatch.setattr(StepBuilder, name, method)


# the gradients ln_shift_bwd sums over the rows in another order than the separate kernels: every block's
# ln2 and ffn.x_k, the RWKV blocks' ln1 (an attention block's LN1 backward is the separate kernel)
REORDERED = ("ln2.weight", "ln2.bias", "ffn.x_k")
REORDERED_LN1 = ("ln1.weight", "ln1.bias")
REORDERED_LIMIT = 1e-5        # of the gradient's largest magnitude


@pytest.mark.parametrize("name,precision", [("hybrid", "fp32"), ("hybrid", "tf32"), ("hybrid", "bf16"),
                                            ("rwkv7", "fp32")])
def test_fused_shift_backwards_match_separate(cpu_step, monkeypatch, name, precision, random_params, record_property):
    """The step with ln_shift_bwd gives the loss and every gradient of the step with the separate shift and
    LayerNorm backwards bit for bit (h recomputed from LN's input and statistics is the stored h, dx the
    same sums), the time mix's x_r .. x_g gradients too (the same walks); the RWKV blocks' ln1 weight
    and bias, every block's ln2 weight and bias and ffn.x_k gradients, summed over the rows in another
    order, within 1e-5 of their largest."""
    kwargs, B, T = CASES[name]
    cfg = Config(**kwargs)
    rng = seeded_rng()
    params = {k: v.astype(np.float32) for k, v in random_params(cfg, int(rng.integers(1 << 31))).items()}
    tokens, targets = rng.integers(0, cfg.vocab_size, (2, B, T))
    results = []
    for setup in (lambda: None, lambda: _separate_shift_backwards(monkeypatch)):
        setup()
        model = Model(cfg, params, B, T, precision=precision, recompute=True)
        model.poison()
        results.append(model.loss_and_grads(tokens, targets))
    (loss, fused), (loss_separate, separate) = results
    assert loss == loss_separate
    reordered = [n for n in fused
                 if n.endswith(REORDERED) or n.startswith("rwkv.blocks.") and n.endswith(REORDERED_LN1)]
    assert reordered and [n for n in fused if n not in reordered and not np.array_equal(fused[n], separate[n])] == []
    worst = max(np.abs(fused[n] - separate[n]).max() / np.abs(separate[n]).max() for n in reordered)
    record_property("reordered_max_rel", float(worst))
    assert worst <= REORDERED_LIMIT, worst
