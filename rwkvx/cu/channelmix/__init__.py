"""Kernel family ``channelmix``: the element-wise parts of the channel mix (token shift and mix, relu squared).

The CUDA source, its declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the float64 twin is ``rwkvx.oracle.channelmix``."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
