"""Stateful generation on the GPU: :class:`Decoder`, the GPU :class:`rwkvx.generation.Session`.

**Prefill** (once per prompt of P tokens): the forward of a :class:`rwkvx.model.Model` built for (B, P),
in parallel over the prompt, with the WKV state saved (the forward's checkpoint after the last token is
the state after the prompt); after each block, copies leave what decoding needs in the decoder's state
arena: the last LN1 and LN2 rows (the token shifts), the WKV state, MoBA's keys, values and the means of
the complete key blocks. The model's own forward kernels can expose these states, so the prompt is not
fed token by token.

**Step** (one token per sequence): the same :class:`rwkvx.step.StepBuilder` forward on B rows of the
model's arena (its weights and transients), with the parts that look at earlier tokens (token shifts,
WKV, MoBA) replaced by rwkvx/cu/decode/decode.cu's single-token kernels reading and updating the state arena.
The token ids and the position (a device int MoBA reads) come from pinned memory, the logits [B, V]
go back to pinned memory, and the whole step is one CUDA graph, replayed per token.

State arena (elements; X = the model's activation type): per RWKV block i ``tm_prev.i`` X [B, C] and
``wkv.i`` fp32 [B, H, N, N]; per block ``cm_prev.<prefix>`` X [B, C]; per attention block j the caches
``kc.j``, ``vc.j`` X [B, Tmax, H, N] and (top_k > 1) ``kmean.j`` fp32 [B, H, Tmax // chunk, N] and
``sel.j`` int32 [B, H, top_k-1] (the last step's selection); ``pos`` int32.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .arena import Layout
from .cu import decode, wkv7
from .cu._common import carve, carved_bytes
from .model import Model
from .runtime.dtypes import ELEM_BYTES, from_storage, storage_dtype
from .runtime.ops import Copy, CopyDtoH, CopyHtoD, DevPtr, Memset
from .step import StepBuilder
from .validate import check_tokens


# The kernel methods a decoder's Model needs: the sequential WKV7 forward, whose last checkpoint is the
# state after the prompt (the chunked one saves the states entering its chunks).
PREFILL_METHODS = {"wkv7": "sequential"}


def state_sizes(layout: Layout, max_len: int) -> dict[str, tuple[int, str]]:
    """(elements, element type) of every buffer of the state arena of a model of ``layout``."""
    cfg, B, X = layout.cfg, layout.B, layout.xtype
    C, H, N, K1 = cfg.n_embd, cfg.n_head, cfg.head_size, cfg.moba_top_k - 1
    sizes: dict[str, tuple[int, str]] = {"pos": (1, "i32")}
    for kind, idx in cfg.block_order():
        if kind == "rwkv":
            sizes[f"tm_prev.{idx}"] = (B * C, X)
            sizes[f"wkv.{idx}"] = (B * H * N * N, "f32")
        else:
            sizes[f"kc.{idx}"] = sizes[f"vc.{idx}"] = (B * max_len * C, X)
            sizes[f"kmean.{idx}"] = (B * H * (max_len // cfg.moba_chunk_size) * N if K1 else 0, "f32")
            sizes[f"sel.{idx}"] = (B * H * K1, "i32")
        sizes["cm_prev." + StepBuilder._prefix(kind, idx)] = (B * C, X)
    return sizes


class PrefillBuilder(StepBuilder):
    """The forward over the prompt (the model's, B x T = P tokens at ``base``) that also fills the
    state arena ``state`` (:func:`state_sizes` carved, caches of ``max_len`` tokens)."""

    def __init__(self, layout: Layout, base: int, state: dict[str, DevPtr | None], max_len: int):
        if any(layout.methods[k] != v for k, v in PREFILL_METHODS.items()):
            raise ValueError("the prefill reads the state after the prompt from the sequential WKV7 "
                             "kernel's checkpoints: build the Model with methods=rwkvx.decoder.PREFILL_METHODS")
        super().__init__(layout, base, {})
        self.state, self.max_len = state, max_len

    def _last_rows(self, src: DevPtr, dst: DevPtr) -> list:
        """dst [B, C] = the last row of each sequence of src [B*T, C]."""
        C, T = self.cfg.n_embd, self.T
        return [Copy(dst.offset(b * C), src.offset((b * T + T - 1) * C), C * ELEM_BYTES[src.elem])
                for b in range(self.B)]

    def time_shift(self, i: int) -> list:
        return super().time_shift(i) + self._last_rows(self.buf("h1"), self.state[f"tm_prev.{i}"])

    def channel_shift(self, prefix: str) -> list:
        return super().channel_shift(prefix) + self._last_rows(self.buf("h2"), self.state["cm_prev." + prefix])

    def wkv(self, i: int, for_backward: bool) -> list:
        # checkpoint slot nC-1 of every (b, h) is the state after the prompt's last token
        H, N, nC = self.cfg.n_head, self.cfg.head_size, wkv7.n_chunks(self.T)
        ckpt, dst = self.buf("wkv_ckpt"), self.state[f"wkv.{i}"]
        return super().wkv(i, for_backward=True) + [
            Copy(dst.offset(bh * N * N), ckpt.offset((bh * nC + nC - 1) * N * N), N * N * 4)
            for bh in range(self.B * H)]

    def attention(self, j: int) -> list:
        cfg, B, T = self.cfg, self.B, self.T
        C, H, N, chunk = cfg.n_embd, cfg.n_head, cfg.head_size, cfg.moba_chunk_size
        ops = super().attention(j)
        for name, cache in (("k", f"kc.{j}"), ("v", f"vc.{j}")):
            src, dst = self.buf(name), self.state[cache]
            ops += [Copy(dst.offset(b * self.max_len * C), src.offset(b * T * C), T * C * ELEM_BYTES[src.elem])
                    for b in range(B)]
        full = T // chunk                 # the forward's block means of the prompt's complete blocks
        if cfg.moba_top_k > 1 and full:
            src, dst = self.buf("moba_kmean"), self.state[f"kmean.{j}"]
            nblk, maxblk = -(-T // chunk), self.max_len // chunk
            ops += [Copy(dst.offset(bh * maxblk * N), src.offset(bh * nblk * N), full * N * 4)
                    for bh in range(B * H)]
        return ops


class DecodeStepBuilder(StepBuilder):
    """One token per sequence: the forward on B rows of the model's arena at ``base``, with decode.cu
    where it looks at earlier tokens (state arena ``state``, caches of ``max_len`` tokens)."""

    def __init__(self, layout: Layout, base: int, state: dict[str, DevPtr | None], max_len: int):
        super().__init__(layout, base, {})
        self.T, self.R = 1, self.B
        self.state, self.max_len = state, max_len

    def time_shift(self, i: int) -> list:
        att, b = f"rwkv.blocks.{i}.att.", self.buf
        return decode.shift(b("h1"), self.state[f"tm_prev.{i}"],
                            [self.p(att + m) for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")],
                            [b(n) for n in ("xr", "xw", "xk", "xv", "xa", "xg")], self.B, self.cfg.n_embd, self.dev)

    def channel_shift(self, prefix: str) -> list:
        return decode.shift(self.buf("h2"), self.state["cm_prev." + prefix], [self.p(prefix + "ffn.x_k")],
                            [self.buf("xk2")], self.B, self.cfg.n_embd, self.dev)

    def wkv(self, i: int, for_backward: bool) -> list:
        b, cfg = self.buf, self.cfg
        return decode.wkv7_step(b("r"), b("decay"), b("kp"), self._value(i), b("wa"), b("wb"),
                                self.state[f"wkv.{i}"], b("y"), self.B, cfg.n_head, cfg.head_size)

    def attention(self, j: int) -> list:
        b, cfg, s = self.buf, self.cfg, self.state
        return decode.moba_step(b("r"), b("k"), b("v"), s[f"kc.{j}"], s[f"vc.{j}"], s[f"kmean.{j}"], s["pos"],
                                b("y"), self.B, cfg.n_head, cfg.head_size, self.max_len, cfg.moba_chunk_size,
                                cfg.moba_top_k, self.dev, sel=s[f"sel.{j}"])


def decoder_ops(layout: Layout, base: int, state: dict[str, DevPtr | None], max_len: int,
                stage_tokens: list, host_inputs: int, host_logits: int) -> tuple[list, list]:
    """(prefill ops, step ops) of a model of ``layout`` at ``base`` with the state arena ``state``
    (needs no GPU). ``stage_tokens``: the model's copy of the prompt from pinned memory; pinned
    ``host_inputs`` int32 [B + 1] (the step's tokens, then its position) and ``host_logits`` [B, V]
    (the step's logits, in the activation type). The prefill ends with the final LayerNorm's output
    (the model's head turns it into logits: :meth:`rwkvx.model.Model.logits`)."""
    built = (layout, base, state, max_len)
    step = DecodeStepBuilder(*built)
    B, V = layout.B, layout.cfg.vocab_size
    step_ops = [CopyHtoD(step.buf("tokens"), host_inputs, 4 * B),
                CopyHtoD(state["pos"], host_inputs + 4 * B, 4),
                *step.forward(), *step.head_logits(0),
                CopyDtoH(host_logits, step.buf("logits"), B * V * ELEM_BYTES[layout.xtype])]
    return stage_tokens + PrefillBuilder(*built).forward(), step_ops


class Decoder:
    """Stateful generation of ``model.B`` sequences on the GPU (see the module docstring).

    ``model``: a :class:`rwkvx.model.Model` built for (B, P): its forward processes the P-token prompt,
    its weights and buffers serve every step (the model is used, not copied). ``max_len`` (>= P): the
    most tokens fed to the model, prompt included (the length of the MoBA caches). Use
    :meth:`prefill` once, then :meth:`step` up to ``max_len - P`` times; :meth:`close` frees it.
    """

    def __init__(self, model: Model, max_len: int) -> None:
        from ._core import Plan
        from .runtime import Graph
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < model.T:
            raise ValueError(f"max_len must be an int >= the prompt length {model.T}, got {max_len!r}")
        self.model, self.dev, self.cfg = model, model.dev, model.cfg
        self.B, self.P, self.max_len = model.B, model.T, int(max_len)
        self.length: int | None = None                   # tokens fed so far (None: no prompt yet)
        sizes = state_sizes(model.layout, self.max_len)
        self.arena = self.dev.alloc(carved_bytes(sizes))
        self.state = carve(self.arena.ptr, sizes)
        B, V, X = self.B, self.cfg.vocab_size, model.layout.xtype
        self._logits_elem = X
        self._pinned_in = self.dev.alloc_pinned(4 * (B + 1))                 # tokens, then the position
        self._pinned_logits = self.dev.alloc_pinned(B * V * ELEM_BYTES[X])
        Plan(self.dev, [Memset(self.arena.ptr, self.arena.nbytes)]).run()      # no garbage in the state
        prefill_ops, step_ops = decoder_ops(model.layout, model.arena.ptr, self.state, self.max_len,
                                            model.ops.stage_tokens, self._pinned_in.ptr, self._pinned_logits.ptr)
        self._prefill_plan = Plan(self.dev, prefill_ops)
        self._graph = None
        if self.max_len > self.P:
            self._step_plan = Plan(self.dev, step_ops)
            # one eager step (modules, cuBLAS) before the capture, on a position the prefill and the
            # first step overwrite before anything reads it
            self._stage(np.zeros(B, np.int64), self.P)
            self._step_plan.run()
            self.dev.synchronize()
            self._graph = Graph.capture(self.dev, self._step_plan.run)

    @classmethod
    def from_model(cls, model: Any, batch: int, prompt_len: int, max_len: int) -> "Decoder":
        """A Decoder on ``model`` itself when it is built for (batch, prompt_len) with the sequential
        WKV7 kernel (whose checkpoints hold the state after the prompt), else on a Model of that shape
        with ``model``'s parameters and precision."""
        if not isinstance(model, Model):
            raise TypeError(f"expected an rwkvx.Model, got {type(model).__name__}")
        if ((model.B, model.T) != (batch, prompt_len)
                or any(model.layout.methods[k] != v for k, v in PREFILL_METHODS.items())):
            model = Model(model.cfg, model.params(), batch, prompt_len, precision=model.precision,
                          recompute=True, methods=PREFILL_METHODS)   # no backward: the least memory
        return cls(model, max_len)

    def _stage(self, tokens: np.ndarray, pos: int) -> None:
        pin = self._pinned_in.array(np.int32, (self.B + 1,))
        pin[:self.B] = tokens
        pin[self.B] = pos

    def prefill(self, tokens: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Process the prompt int [B, P]: logits [B, V] of its last position ([B, P, V] with
        ``all_logits``); every state is set for :meth:`step` (a second prefill starts over)."""
        self.model.stage_tokens(tokens)
        self._prefill_plan.run()
        self.dev.synchronize()
        self.length = self.P
        logits = self.model.logits().reshape(self.B, self.P, self.cfg.vocab_size)
        return logits if all_logits else logits[:, -1].copy()

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per sequence (int [B]): logits [B, V] of that position (graph replay)."""
        if self.length is None:
            raise RuntimeError("Decoder.step before prefill")
        if self.length >= self.max_len:
            raise ValueError(f"the decoder holds at most max_len={self.max_len} tokens")
        tokens = check_tokens(np.asarray(tokens).reshape(self.B, 1), self.cfg.vocab_size)
        self._stage(tokens[:, 0], self.length)
        self._graph.launch()
        self.dev.synchronize()
        self.length += 1
        raw = self._pinned_logits.array(storage_dtype(self._logits_elem), (self.B, self.cfg.vocab_size))
        return from_storage(self._logits_elem, raw).copy()

    @property
    def graph(self):
        """The step's CUDA graph (None when max_len == the prompt length): replaying it alone repeats the
        last step's position, for timing the device work of a step."""
        return self._graph

    def selection(self) -> list[np.ndarray]:
        """Per attention block, the last step's MoBA selection: int32 [B, H, top_k - 1]."""
        cfg = self.cfg
        shape = (self.B, cfg.n_head, cfg.moba_top_k - 1)
        return [self.dev.download(self.state[f"sel.{j}"], shape, np.int32) if cfg.moba_top_k > 1
                else np.zeros(shape, np.int32) for j in range(cfg.n_attn_layer)]

    def close(self) -> None:
        """Free the graph, the state arena and the pinned buffers (the model stays)."""
        if self._graph is not None:
            self._graph.close()
            self._graph = None
        for buf in (self.arena, self._pinned_in, self._pinned_logits):
            buf.close()
        self.length = None
