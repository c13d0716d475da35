"""Training: :class:`TrainConfig` (every training setting), :class:`Trainer` (a model and its optimizer
on the CPU or GPU backend), and a training run into a run directory (:mod:`~rwkvx.training.setup`
resolves it, :mod:`~rwkvx.training.loop` runs it, :mod:`~rwkvx.training.rundir` names and writes its
files). The GPU runtime is imported only when the GPU backend is built."""
from .config import TrainConfig
from .trainer import Trainer

__all__ = ["TrainConfig", "Trainer"]
