"""rwkvx.oracle: the CPU reference implementation of the RWKV-X model (Cython + numpy).

``Oracle`` runs the full forward, the cross-entropy loss and a hand-written backward, in float64
(the ground truth) or float32, and the stateful forward of generation (``Oracle.stateful_forward``
with its ``DecodeState``), optionally from tuned initial WKV states (``Oracle(..., states=...)``) or
with LoRA factors (``Oracle(..., lora=..., lora_scale=...)``), whose gradients ``loss_and_grads`` then
returns too. The op-level functions are the float64 twins of the GPU kernel
families, one module per family of ``rwkvx/cu/<family>/``, named after it; the GPU unit tests compare
the kernels to them and ``Oracle`` is built from them. Every twin accepts float32 or float64 arrays,
computes in float64 and returns float outputs in its inputs' dtype (float64 unless all are float32),
except AdamW's (``adamw``), which does the kernel's float32 element arithmetic and which the CPU
optimizer ``rwkvx.optim.AdamW`` runs, and the device initialisation's (``init``), whose draws are the
kernels' bits. Rows [R, C]: R = B*T, row r = token r % T of sequence r // T,
channel c = h*N + n. Plain Python where the modules only chain numpy calls (``model`` is such glue);
Cython (``*.pyx``, built by setup.py) where they run the loops. Installed as ``rwkvx.oracle``.
"""
from ._common import DECAY_SCALE, GN_EPS, L2_EPS, LN_EPS, rel_err
from .adamw import adamw_update, clip_coefficient, global_grad_norm, learning_rate
from .channelmix import (channel_mix_shift_backward, channel_mix_shift_forward, relu_sq_backward,
                         relu_sq_forward)
from .decode import decode_gemv, decode_moba, decode_sample, decode_shift, decode_time_mix, decode_wkv7
from .embedding import embedding_backward, embedding_forward
from .layernorm import layernorm_backward, layernorm_forward
from .loss import cross_entropy, cross_entropy_rows
from .moba import (moba_attention_backward, moba_attention_cached, moba_attention_forward,
                   moba_block_means, moba_gate_gaps, moba_gates, moba_logsumexp, moba_select)
from .model import DecodeState, Oracle
from .reduce import column_sums
from .timemix import (group_norm_backward, group_norm_forward, sigmoid_backward, sigmoid_forward,
                      tanh_backward, tanh_forward, time_mix_gn_backward, time_mix_gn_forward,
                      time_mix_prep_backward, time_mix_prep_forward, time_shift_backward,
                      time_shift_forward)
from .wkv7 import wkv7_backward, wkv7_forward

__all__ = [
    "Oracle", "DecodeState", "rel_err",
    "LN_EPS", "GN_EPS", "DECAY_SCALE", "L2_EPS",
    "embedding_forward", "embedding_backward",
    "layernorm_forward", "layernorm_backward", "group_norm_forward", "group_norm_backward",
    "time_shift_forward", "time_shift_backward", "tanh_forward", "tanh_backward",
    "sigmoid_forward", "sigmoid_backward", "time_mix_prep_forward", "time_mix_prep_backward",
    "time_mix_gn_forward", "time_mix_gn_backward",
    "wkv7_forward", "wkv7_backward",
    "moba_attention_forward", "moba_attention_backward", "moba_attention_cached", "moba_logsumexp",
    "moba_select",
    "moba_gate_gaps", "moba_block_means", "moba_gates",
    "channel_mix_shift_forward", "channel_mix_shift_backward", "relu_sq_forward", "relu_sq_backward",
    "cross_entropy_rows", "cross_entropy",
    "column_sums",
    "decode_shift", "decode_wkv7", "decode_moba", "decode_sample", "decode_gemv",
    "decode_time_mix",
    "learning_rate", "global_grad_norm", "clip_coefficient", "adamw_update",
]
