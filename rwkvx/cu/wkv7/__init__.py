"""Kernel family ``wkv7``: the RWKV-7 WKV recurrence: sequential and chunked tensor-core kernels.

The CUDA source, its declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the float64 twin is ``rwkvx.oracle.wkv7``."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
