"""The GPU decoder's op lists, built on the CPU (no device; plans assume an H200): the prompt's forward
with its state copies and the one-token step, every pointer inside the model's arena or the state
arena, the step on B rows with decode.cu where a block looks at earlier tokens."""
import pytest

from rwkvx import Config
from rwkvx.decoder import PREFILL_METHODS, DecodeStepBuilder, PrefillBuilder, state_sizes
from rwkvx.arena import Layout
from rwkvx.precision import DEFAULT_PRECISION
from rwkvx.cu import decode, layernorm, wkv7
from rwkvx.cu._common import carve, carved_bytes
from rwkvx.runtime.device import H200
from rwkvx.runtime.ops import Copy, Gemm, Launch, flatten_ops

BASE, STATE = 1 << 40, 1 << 42
SMALL = dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=2, moba_chunk_size=8,
             moba_top_k=3)
CONFIGS = [
    (SMALL, 2, 20, 40),
    (SMALL, 1, 3, 6),                       # shorter than a MoBA block: no block mean is ever needed
    (dict(SMALL, moba_top_k=1, ln0=False), 1, 5, 9),
    (dict(vocab_size=50, n_embd=32, head_size=8, n_rwkv_layer=2), 3, 1, 2),
    (dict(vocab_size=65536, n_embd=768, head_size=64, n_rwkv_layer=12, n_attn_layer=4, moba_chunk_size=512,
          moba_top_k=3), 1, 512, 768),
]
FORWARD_ONLY_OF_SEQUENCES = {"tm_shift_fwd", "cm_shift_mix", "wkv7_forward", "moba_kmean", "moba_select",
                             "moba_fwd_own", "moba_fwd_past"}


def build(kwargs, B, P, max_len):
    layout = Layout(Config(**kwargs), B, P, H200, DEFAULT_PRECISION, recompute=True,
                    methods=PREFILL_METHODS)
    sizes = state_sizes(layout, max_len)
    state = carve(STATE, sizes)
    args = (layout, BASE, state, max_len)
    return layout, carved_bytes(sizes), PrefillBuilder(*args).forward(), DecodeStepBuilder(*args).forward()


def pointers(op):
    if isinstance(op, Launch):
        return [(v, 0) for kind, v in op.args if kind == "p" and v]
    if isinstance(op, Gemm):
        return [(op.A, 0), (op.B, 0), (op.C, 0)]
    if isinstance(op, Copy):
        return [(op.dst, op.nbytes), (op.src, op.nbytes)]
    return []


@pytest.mark.parametrize("kwargs, B, P, max_len", CONFIGS)
def test_decoder_plans_stay_inside_their_arenas(kwargs, B, P, max_len):
    layout, state_bytes, prefill, step = build(kwargs, B, P, max_len)
    for ops in (prefill, step):
        for op in flatten_ops(ops):
            for ptr, nbytes in pointers(op):
                inside_model = BASE <= ptr and ptr + nbytes <= BASE + layout.total
                inside_state = STATE <= ptr and ptr + nbytes <= STATE + state_bytes
                assert inside_model or inside_state, (op, hex(ptr))


@pytest.mark.parametrize("kwargs, B, P, max_len", CONFIGS)
def test_step_is_one_token_per_sequence(kwargs, B, P, max_len):
    cfg = Config(**kwargs)
    _, _, prefill, step = build(kwargs, B, P, max_len)
    step = flatten_ops(step)
    names = [op.name for op in step if isinstance(op, Launch)]
    assert not FORWARD_ONLY_OF_SEQUENCES & set(names)
    assert names.count("dec_shift") == 2 * cfg.n_rwkv_layer + cfg.n_attn_layer
    assert names.count("dec_wkv7") == cfg.n_rwkv_layer and names.count("dec_moba") == cfg.n_attn_layer
    assert all(op.n == B for op in step if isinstance(op, Gemm))     # every GEMM on B rows
    # ln1 and ln2 of every block copy the residual (B rows) for the GEMM that adds to it
    params = [n for n, _ in layernorm.LN_FORWARD.params]
    lns = [dict(zip(params, (v for _, v in op.args))) for op in step
           if isinstance(op, Launch) and op.name == "ln_forward"]
    copying = [a for a in lns if a["x_copy"]]
    assert len(copying) == 2 * cfg.n_blocks and all(a["R"] == B for a in copying)
    # the prompt's forward saves the WKV checkpoints (the state after its last token) for the copies
    fwd = [op for op in flatten_ops(prefill) if isinstance(op, Launch) and op.name == "wkv7_forward"]
    ckpt = [n for n, _ in wkv7.WKV7_FORWARD.params].index("ckpt")
    assert len(fwd) == cfg.n_rwkv_layer and all(op.args[ckpt][1] for op in fwd)


def test_moba_step_checks_its_shared_memory():
    cfg = dict(SMALL, moba_chunk_size=4096, moba_top_k=16)
    with pytest.raises(ValueError, match="shared memory"):
        build(cfg, 1, 8, 1 << 16)
    assert decode.moba_smem_bytes(64, 512, 3, 1536 // 512) <= H200.smem_per_block
