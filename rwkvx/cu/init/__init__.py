"""Kernel family ``init``: the device initialisation's counter-based draws and Cholesky QR.

The CUDA sources, their declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the twin, a numpy model giving the same draws bit for bit, is ``rwkvx.oracle.init``."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
