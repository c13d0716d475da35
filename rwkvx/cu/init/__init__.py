"""Kernel family ``init``: the device initialisation's counter-based draws and Cholesky QR.

The CUDA sources, their declared interface and launch builders (:mod:`.ops`) and README.md live in this
folder; the numpy model of the kernels is :mod:`.model` (no float64 twin in the oracle: the model is the
reference)."""
from .ops import *  # noqa: F401,F403  (the family's public builders, constants and declarations)
