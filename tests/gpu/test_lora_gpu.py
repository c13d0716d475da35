"""LoRA with a GPU present: training refuses the GPU backend before any device work, and a trained
adapter merged into the weights (what ``sample --lora`` / ``export --lora`` do) gives the GPU model the
loss the CPU backend computes for the adapted model."""
import numpy as np
import pytest

from rwkvx.lora import merge
from rwkvx.model import Model
from rwkvx.training.trainer import Trainer

from test_train_gpu import B, CFG, T, batches

LORA = dict(tune="lora", lora_rank=4, lora_alpha=8.0, batch_size=B, seq_len=T, lr=1e-2, lr_min=1e-3,
            warmup=0, steps=3, lora_targets=("att.key", "att.output", "ffn.value", "moba.value"))


def test_lora_training_refuses_the_gpu_before_any_device_work(dev, random_params):
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 30).items()}
    allocated = dev.allocated_bytes
    with pytest.raises(ValueError, match=r"LoRA fine-tuning \(tune='lora'\) is not available on the GPU"):
        Trainer(CFG, params, backend="gpu", **LORA)
    assert dev.allocated_bytes == allocated
    assert Trainer(CFG, params, backend="auto", **LORA).device == "cpu"


def test_merged_adapter_on_the_gpu_matches_the_cpu_adapter(random_params):
    """fp32 loss within 1e-5 of the float64 oracle's for any parameters (docs/SPEC.md §4); the adapter
    moves the loss by far more than that."""
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 31).items()}
    cpu = Trainer(CFG, params, backend="cpu", cpu_dtype="float64", **LORA)
    for tokens, targets in batches(3, 30):
        cpu.step(tokens, targets)
    base = Trainer(CFG, params, backend="cpu", cpu_dtype="float64", **dict(LORA, tune="full"))
    model = Model(CFG, merge(CFG, params, cpu.lora, cpu.config.lora.scale), B, T, precision="fp32")
    for tokens, targets in batches(2, 31):
        expected = cpu.evaluate(tokens, targets)
        assert abs(model.evaluate(tokens, targets) - expected) <= 1e-5 * abs(expected)
        assert abs(base.evaluate(tokens, targets) - expected) > 1e-4 * abs(expected)
