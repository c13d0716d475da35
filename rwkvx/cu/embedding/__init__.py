"""Kernel family ``embedding``: the embedding lookup and its deterministic gradient.

The CUDA source, its declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the float64 twin is ``rwkvx.oracle.embedding``."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
