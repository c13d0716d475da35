"""The GPU model's precision modes (docs/SPEC.md §4), each resolved and validated here and nowhere else.

A :class:`Precision` says everything that follows from the mode's name: the activation element type the
kernels are compiled for (``xtype``), how the GEMMs run (:class:`~rwkvx.runtime.gemm.GemmMode`), and which
WKV7 and MoBA kernel variants the mode runs (:meth:`Precision.kernel_methods`).

* ``fp32``: strict fp32 GEMMs and kernels (the parity mode); the chunked WKV7 computes every product in
  3xTF32 and MoBA runs its exact CUDA-core kernels;
* ``tf32``: fp32 storage, GEMMs on TF32 tensor cores, the tensor-core WKV7 and MoBA kernels;
* ``bf16``: bf16 activations and GEMM operands with fp32 accumulation, the tensor-core kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import Config
from .cu import moba, wkv7
from .runtime.gemm import GemmMode


@dataclass(frozen=True)
class Precision:
    """One precision mode; obtain it with :func:`resolve_precision`."""
    name: str             # "fp32", "tf32" or "bf16"
    xtype: str            # activation element type of every kernel launch: "f32" or "bf16"
    gemm: GemmMode        # operand and compute types of every GEMM
    tensor_cores: bool    # the WKV7 and MoBA kernels' tf32 / bf16 tensor-core variants

    def kernel_methods(self, cfg: Config) -> dict[str, str]:
        """The WKV7 and MoBA kernel methods for ``cfg``'s head size: the chunked WKV7 on tensor cores
        (3xTF32 products in fp32), MoBA's mma kernels with tensor cores and its exact CUDA-core kernels
        without; where a method does not support the head size, the sequential WKV7 and exact MoBA."""
        chunked = "chunked" if self.tensor_cores else "chunked_exact"
        return {"wkv7": chunked if cfg.head_size in wkv7.CHUNKED_HEAD_SIZES else "sequential",
                "moba": "mma" if self.tensor_cores and cfg.head_size in moba.MMA_HEAD_SIZES else "exact"}

    def __str__(self) -> str:
        return self.name


PRECISIONS = {p.name: p for p in (
    Precision("fp32", "f32", GemmMode("fp32"), tensor_cores=False),
    Precision("tf32", "f32", GemmMode("tf32"), tensor_cores=True),
    Precision("bf16", "bf16", GemmMode("fp32", bf16_operands=True), tensor_cores=True),
)}
PRECISION_NAMES = tuple(PRECISIONS)
DEFAULT_PRECISION = "fp32"


def resolve_precision(value: str | Precision) -> Precision:
    """The :class:`Precision` named ``value`` (a Precision is returned as it is)."""
    if isinstance(value, Precision):
        return value
    if not isinstance(value, str):
        raise TypeError(f"precision must be one of {', '.join(PRECISION_NAMES)} (a str), got {type(value).__name__}")
    try:
        return PRECISIONS[value]
    except KeyError:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_NAMES)}, got {value!r}") from None
