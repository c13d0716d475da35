"""rwkvx: train RWKV-X language models (RWKV-7 + MoBA attention) on NVIDIA GPUs without PyTorch.

CPU reference: :class:`rwkvx.oracle.Oracle`. GPU step: :class:`rwkvx.Model` (needs a CUDA GPU and
the ``cu13`` extra). Training: :class:`rwkvx.TrainConfig`, :class:`rwkvx.Trainer` and ``python -m rwkvx train``. Stateful
generation: :func:`rwkvx.generate` and ``python -m rwkvx sample``.
"""
from .checkpoint import load_checkpoint, save_checkpoint
from .config import Config
from .params import init_params, param_shapes, rwkv7_to_rwkvx

__all__ = ["Config", "init_params", "param_shapes", "rwkv7_to_rwkvx", "save_checkpoint",
           "load_checkpoint", "Model", "TrainConfig", "Trainer", "generate"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The GPU model and the trainer import the CUDA runtime lazily: `import rwkvx` stays light.
    if name == "Model":
        from .model import Model
        return Model
    if name == "Trainer":
        from .training import Trainer
        return Trainer
    if name == "TrainConfig":
        from .training import TrainConfig
        return TrainConfig
    if name == "generate":
        from .generation import generate
        return generate
    raise AttributeError(f"module 'rwkvx' has no attribute {name!r}")
