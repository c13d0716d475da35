"""Data-parallel training over several GPUs (one process each) through NCCL, or CPU oracle ranks.

* :mod:`~rwkvx.dist.env`: the launcher's variables (``--gpus N``, torchrun-style, mpirun/srun);
* :mod:`~rwkvx.dist.launch`: ``python -m rwkvx train --gpus N`` starts and watches N local ranks;
* :mod:`~rwkvx.dist.store` / :mod:`~rwkvx.dist.world`: the rendezvous, host collectives, failure watch;
* :mod:`~rwkvx.dist.nccl`: the NCCL communicator (nccl4py, ``cu13`` extra, imported only when used);
* :mod:`~rwkvx.dist.step`: the GPU step with per-block gradient all-reduces inside its CUDA graph.

Importing this package loads neither NCCL nor the CUDA runtime.
"""
from .env import LaunchInfo, launch_info
from .store import DistributedError
from .world import DEFAULT_TIMEOUT_S, World, init_world

__all__ = ["LaunchInfo", "launch_info", "DistributedError", "DEFAULT_TIMEOUT_S", "World", "init_world"]
