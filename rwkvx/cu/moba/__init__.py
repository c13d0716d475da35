"""Kernel family ``moba``: MoBA sparse attention: block selection, exact CUDA-core attention, tensor-core attention.

The CUDA source, its declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the float64 twin is ``rwkvx.oracle.moba``."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
