"""Kernel family ``decode``: the single-token step kernels of generation and its device sampler.

The CUDA source, its declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the twin is ``rwkvx.oracle.decode``."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
