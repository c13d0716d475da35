"""Kernel family ``layernorm``: LayerNorm over the channels, with weight and bias, and LayerNorm fused with
the token shift and its mixes (``ln_shift_fwd``) and with their backward (``ln_shift_bwd``).

The CUDA sources, their declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the float64 twin is ``rwkvx.oracle.layernorm``."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
