"""Kernel family ``timemix``: the element-wise parts of the RWKV-7 time mix (shift, mixes, LoRA activations, prep, GroupNorm and bonus).

The CUDA source, its declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the float64 twin is ``rwkvx.oracle.timemix``."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
