"""rwkvx.oracle: the CPU reference implementation of the RWKV-X model (Cython, float64/float32).

``Oracle`` runs the full forward, the cross-entropy loss and a hand-written backward; the op-level
functions are the twins of the GPU kernel families and are what the GPU unit tests compare to.
Built by setup.py from ``oracle/*.pyx`` (installed as ``rwkvx.oracle``).
"""
from ._layers import (cross_entropy, group_norm_backward, group_norm_forward, layernorm_backward,
                      layernorm_forward, wkv7_backward, wkv7_forward)
from ._moba import moba_attention_backward, moba_attention_forward
from ._model import Oracle

__all__ = ["Oracle", "layernorm_forward", "layernorm_backward", "group_norm_forward",
           "group_norm_backward", "wkv7_forward", "wkv7_backward", "moba_attention_forward",
           "moba_attention_backward", "cross_entropy"]
