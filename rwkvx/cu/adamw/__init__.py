"""Kernel family ``adamw``: fused AdamW over every parameter in one flat buffer, with global-norm clipping.

The CUDA source, its declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the float64 twin is ``rwkvx.oracle.adamw``."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
