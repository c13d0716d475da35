"""The training step as op lists: :class:`StepBuilder` composes forward, loss and backward op by op from
the launch builders of :mod:`rwkvx.cu` and cuBLAS GEMMs, on the buffers of a :class:`~rwkvx.arena.Layout`;
:class:`StepOps` holds the result.

With the layout's ``recompute`` the backward runs each block's forward again from its saved input;
without, every block keeps the transients its backward reads. Building the op lists needs no GPU
(pointers are base + offset, typed by the element type of their buffer), so plans are tested on CPU CI;
:class:`rwkvx.model.Model` runs them through :class:`rwkvx._core.Plan`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .arena import GEMM_COPIES, KF_PRE, TRAINED, Layout
from .cu import adamw, channelmix, embedding, layernorm, loss, moba, timemix, wkv7
from .lora import factor_names
from .params import EMB_WEIGHT, HEAD_WEIGHT
from .runtime import gemm
from .runtime.ops import CopyDtoH, CopyHtoD, DevPtr, Memset
from .state_tuning import state_name

# The time mix's token-shift mixes (parameters att.<name>) and the buffers of their outputs, in one order
TIME_MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
TIME_MIX_OUTPUTS = ("xr", "xw", "xk", "xv", "xa", "xg")


@dataclass
class StepOps:
    """The op lists of one step. ``forward`` ends with the final LayerNorm's output; ``loss`` runs the
    head and cross-entropy chunk by chunk of rows (logits, loss, dlogits in place, the head's gradients);
    ``evaluate`` is ``loss`` without gradients; ``head[c]`` computes the logits of chunk c alone.

    ``grad_ready``: ``(k, names)`` pairs in backward order: after ``backward[:k]`` the gradients of
    ``names`` are final (no later op of the step touches them) — where a data-parallel step starts
    reducing them (:mod:`rwkvx.dist.step`). Every parameter is named exactly once."""
    stage_tokens: list
    stage_targets: list
    forward: list
    loss: list
    backward: list
    evaluate: list
    head: list
    grad_ready: list = field(default_factory=list)

    @property
    def step(self) -> list:
        """The whole step without the optimizer: inputs staged, forward, loss, backward."""
        return self.stage_tokens + self.stage_targets + self.forward + self.loss + self.backward


class StepBuilder:
    """Composes the step from the launch builders of :mod:`rwkvx.cu` and cuBLAS GEMMs in the layout's
    precision, on the arena of ``layout`` at device address ``base``; ``host`` holds the pinned host
    addresses of the per-step inputs and of ``loss_t`` (:meth:`~rwkvx.arena.Layout.host_inputs`)."""

    def __init__(self, layout: Layout, base: int, host: dict[str, int]):
        self.L = layout
        self.cfg = layout.cfg
        self.dev = layout.dev
        self.B, self.T = layout.B, layout.T
        self.R = self.B * self.T
        self.base = base
        self.host = host  # pinned host pointers: tokens, targets, emb_order, ...
        self.mm = layout.precision.gemm     # every GEMM's mode
        self.methods = layout.methods       # the WKV7 and MoBA kernel methods
        self.block_pos: int | None = None   # the block being built: selects its own forward state

    # -- addresses ----------------------------------------------------------------------------
    def buf(self, name: str) -> DevPtr | None:
        """Typed device pointer of buffer ``name``; None for an empty buffer."""
        own = f"{name}@{self.block_pos}"
        if own in self.L.offsets:
            name = own
        if not self.L.counts[name]:
            return None
        return DevPtr(self.base + self.L.offsets[name], self.L.elems[name])

    def _param_in(self, region: str, name: str) -> DevPtr:
        return self.buf(region).offset(self.L.region_offsets[region][name][0])

    def p(self, name: str) -> DevPtr:
        """Device address of parameter ``name``'s float32 value."""
        return self._param_in("params", name)

    def w(self, name: str) -> DevPtr:
        """Parameter ``name`` as a GEMM operand: the bf16 copy in bf16 mode, else the fp32 weight."""
        if self.L.counts["params_x"]:
            return self._param_in("params_x", name)
        return self.p(name)

    def gp(self, name: str) -> DevPtr | None:
        """Device address of the gradient of parameter ``name``; None for a frozen parameter, whose gradient
        the step does not form (:meth:`rwkvx.arena.Layout._parameter_regions`)."""
        if name not in self.L.region_offsets["grads"]:
            return None
        return self._param_in("grads", name)

    def weight_grad(self, gemm_op, x, dy, name: str, *args, **kwargs) -> list:
        """``[gemm_op(x, dy, dW, *args, **kwargs)]``: the GEMM forming parameter ``name``'s gradient dW, or
        nothing when the parameter is frozen."""
        dw = self.gp(name)
        return [] if dw is None else [gemm_op(x, dy, dw, *args, **kwargs)]

    def factor(self, name: str) -> DevPtr:
        """LoRA factor ``name`` as a GEMM operand: its bf16 copy where the GEMMs read bf16, else the fp32
        factor."""
        return self.buf("lora_x" if self.L.counts.get("lora_x") else "lora").offset(self.L.lora_offsets[name][0])

    def factor_grad(self, name: str) -> DevPtr:
        """Device address of the gradient of LoRA factor ``name``."""
        return self.buf("lora_grads").offset(self.L.lora_offsets[name][0])

    def operand(self, name: str) -> DevPtr:
        """Buffer ``name`` as a GEMM operand: its copy in the activation type (:data:`rwkvx.arena.GEMM_COPIES`)."""
        return self.buf(GEMM_COPIES[name])

    def copy_out(self, name: str) -> DevPtr | None:
        """Where the kernel writing buffer ``name`` also writes its GEMM-operand copy: None where the copy
        is the buffer itself (fp32 and tf32)."""
        copy = self.operand(name)
        return None if int(copy) == int(self.buf(name)) else copy

    # -- the step -----------------------------------------------------------------------------
    def build(self) -> StepOps:
        """Every op list of the step (:class:`StepOps`)."""
        stage = {n: CopyHtoD(self.buf(n), self.host[n], self.L.nbytes(n)) for n in self.L.host_inputs(self.R)}
        stage_tokens = [stage.pop("tokens")]
        forward, loss_ops, backward = self.forward(), self.loss(), self.backward()
        return StepOps(stage_tokens, list(stage.values()), forward, loss_ops, backward,
                       self.loss(with_grad=False), [self.head_logits(r0) for r0 in self.head_chunks()],
                       self.grad_ready)

    def forward(self) -> list:
        """Embedding (and ln0), every block in order, and the final LayerNorm into ``lnout``."""
        cfg, R, C, V, dev = self.cfg, self.R, self.cfg.n_embd, self.cfg.vocab_size, self.dev
        ops = []
        x0 = self.buf("block_in.0")
        if cfg.ln0:
            ops += embedding.forward(self.buf("tokens"), self.p(EMB_WEIGHT),
                                     self.buf("emb_out"), R, C, V, dev)
            ops += layernorm.forward(self.buf("emb_out"), self.p("rwkv.blocks.0.ln0.weight"),
                                     self.p("rwkv.blocks.0.ln0.bias"), x0,
                                     self.buf("ln0_mean"), self.buf("ln0_rstd"), R, C)
        else:
            ops += embedding.forward(self.buf("tokens"), self.p(EMB_WEIGHT), x0, R, C, V, dev)
        for pos, (kind, idx) in enumerate(cfg.block_order()):
            self.block_pos = pos
            xin, xout = self.buf(f"block_in.{pos}"), self.buf(f"block_in.{pos + 1}")
            if kind == "rwkv":
                ops += self.rwkv_forward(idx, xin, for_backward=not self.L.recompute)
            else:
                ops += self.attn_forward(idx, xin)
            ops += self.channel_mix_forward(self._prefix(kind, idx), xout)
        self.block_pos = None
        final = self.buf(f"block_in.{cfg.n_blocks}")
        ops += layernorm.forward(final, self.p("rwkv.ln_out.weight"), self.p("rwkv.ln_out.bias"),
                                 self.buf("lnout"), self.buf("lnout_mean"), self.buf("lnout_rstd"), R, C)
        return ops

    def head_chunks(self) -> range:
        """First row of each head / cross-entropy chunk."""
        return range(0, self.R, self.L.head_rows)

    def head_logits(self, r0: int) -> list:
        """Logits of rows [r0, r0 + rows) into the chunk buffer ``logits``."""
        rows, C, V = min(self.L.head_rows, self.R - r0), self.cfg.n_embd, self.cfg.vocab_size
        return [gemm.linear(self.buf("lnout").offset(r0 * C), self.w(HEAD_WEIGHT), self.buf("logits"),
                            rows, C, V, precision=self.mm)]

    def loss(self, with_grad: bool = True) -> list:
        """Head and cross-entropy per row chunk: float64 per-token losses, and ``with_grad`` dlogits in
        place, the head's weight gradient accumulated over the chunks in order, and dlnout."""
        C, V, mm = self.cfg.n_embd, self.cfg.vocab_size, self.mm
        lnout, dlogits = self.buf("lnout"), self.buf("logits")
        ops = []
        for r0 in self.head_chunks():
            rows = min(self.L.head_rows, self.R - r0)
            ops += self.head_logits(r0)
            ops += loss.cross_entropy(self.buf("logits"), self.buf("targets").offset(r0),
                                      self.buf("loss_t").offset(r0), dlogits if with_grad else None,
                                      self.buf("inv_count"), rows, V)
            if with_grad:
                ops += self.weight_grad(gemm.linear_dw, lnout.offset(r0 * C), dlogits, HEAD_WEIGHT, rows, C, V,
                                        beta=1.0 if r0 else 0.0, precision=mm)
                ops.append(gemm.linear_dx(dlogits, self.w(HEAD_WEIGHT), self.buf("dlnout").offset(r0 * C),
                                          rows, C, V, precision=mm))
        ops.append(CopyDtoH(self.host["loss_t"], self.buf("loss_t"), self.L.nbytes("loss_t")))
        return ops

    def backward(self) -> list:
        """From dlnout (the loss's output) back to the embedding, with every gradient but the head's."""
        cfg, R, C, V, dev = self.cfg, self.R, self.cfg.n_embd, self.cfg.vocab_size, self.dev
        dx = self.buf("dx")
        final = self.buf(f"block_in.{cfg.n_blocks}")
        ops = layernorm.backward(final, self.p("rwkv.ln_out.weight"), self.buf("dlnout"), dx,
                                  self.gp("rwkv.ln_out.weight"), self.gp("rwkv.ln_out.bias"),
                                  self.buf("lnout_mean"), self.buf("lnout_rstd"), self.buf("partials"),
                                  R, C, dev, dx_copy=self.copy_out("dx"))
        self.grad_ready = []
        self._grads_ready(ops, "rwkv.head.", "rwkv.ln_out.")
        ln0 = ("rwkv.blocks.0.ln0.weight", "rwkv.blocks.0.ln0.bias") if cfg.ln0 else ()
        ops.append(Memset(self.buf("dv_first"), self.L.nbytes("dv_first")))
        for pos, (kind, idx) in reversed(list(enumerate(cfg.block_order()))):
            self.block_pos = pos
            xin = self.buf(f"block_in.{pos}")
            prefix = self._prefix(kind, idx)
            if self.L.recompute:    # the block's forward again from its saved input, then back through it
                if kind == "rwkv":
                    ops += self.rwkv_forward(idx, xin, for_backward=True)
                else:
                    ops += self.attn_forward(idx, xin, attend=False)
                ops += self.channel_mix_forward(prefix, None)
            ops += self.channel_mix_backward(prefix)
            ops += self.rwkv_backward(idx, xin) if kind == "rwkv" else self.attn_backward(idx, xin)
            self._grads_ready(ops, prefix, exclude=ln0)   # block 0's ln0 comes after the last block
        self.block_pos = None
        demb_in = dx
        if cfg.ln0:
            demb_in = self.buf("dh1")
            ops += layernorm.backward(self.buf("emb_out"), self.p("rwkv.blocks.0.ln0.weight"), dx,
                                      demb_in, self.gp("rwkv.blocks.0.ln0.weight"),
                                      self.gp("rwkv.blocks.0.ln0.bias"), self.buf("ln0_mean"),
                                      self.buf("ln0_rstd"), self.buf("partials"), R, C, dev)
        if self.gp(EMB_WEIGHT) is not None:
            ops += embedding.backward(demb_in, self.buf("tokens"), self.buf("emb_order"),
                                      self.buf("emb_seg_start"), self.buf("emb_n_seg"), self.gp(EMB_WEIGHT), R, C, V)
        self._grads_ready(ops, "rwkv.emb.", *ln0)
        return ops

    def _grads_ready(self, ops: list, *prefixes: str, exclude: tuple = ()) -> None:
        """Mark the gradients of the parameters named by ``prefixes`` final after ``ops`` so far (when the
        parameters train: data parallelism all-reduces them at these points)."""
        if self.L.trains != "params":
            return
        names = tuple(n for n in self.L.param_offsets if n.startswith(prefixes) and n not in exclude)
        self.grad_ready.append((len(ops), names))

    def optimizer(self, weight_decay: float, clip: bool) -> list:
        """One fused AdamW update of every parameter, or of the initial states alone under state tuning, or
        of the LoRA factors alone (:data:`rwkvx.arena.TRAINED`; oracle/adamw.py's formulas; state on
        device); the bf16 copy of what it updates (``params_x``, ``lora_x``) refreshed where there is one."""
        b = self.buf
        values, grads, m, v = TRAINED[self.L.trains]
        copy = {"params": "params_x", "lora": "lora_x"}.get(self.L.trains)
        return adamw.step(b(values), b(grads), b(m), b(v), b("adam_table"),
                          b("adam_lrmul"), b("adam_state"), self.L.adam_chunks, b("adam_partials"),
                          weight_decay=weight_decay, clip=clip, params_x=b(copy) if copy else None)

    @staticmethod
    def _prefix(kind: str, idx: int) -> str:
        return f"rwkv.blocks.{idx}." if kind == "rwkv" else f"moba.{idx}."

    # -- shared block parts ---------------------------------------------------------------------
    def _residual_add(self, act, name: str, residual, out, n_in: int) -> list:
        """out = residual + act @ W^T (+ its LoRA update) for parameter ``name``, one GEMM (cuBLASLt reads
        C = residual and writes D = out)."""
        return [gemm.linear(act, self.w(name), out, self.R, n_in, self.cfg.n_embd, beta=1.0, precision=self.mm,
                            addend=residual)] + self.lora_forward(act, name, out, n_in, self.cfg.n_embd)

    def project(self, x, name: str, y, n_in: int, n_out: int) -> list:
        """y [R, n_out] = x @ W^T for projection ``name`` (W [n_out, n_in]), plus its LoRA update."""
        return ([gemm.linear(x, self.w(name), y, self.R, n_in, n_out, precision=self.mm)]
                + self.lora_forward(x, name, y, n_in, n_out))

    def project_backward(self, x, dy, name: str, dx, n_in: int, n_out: int, beta: float = 0.0) -> list:
        """Backward of :meth:`project`: dW = dy^T x, dx = dy @ W (+ ``beta`` * dx), and the LoRA update's
        gradients."""
        mm = self.mm
        return (self.weight_grad(gemm.linear_dw, x, dy, name, self.R, n_in, n_out, precision=mm)
                + [gemm.linear_dx(dy, self.w(name), dx, self.R, n_in, n_out, beta=beta, precision=mm)]
                + self.lora_backward(x, dy, name, dx, n_in, n_out))

    def _adapter(self, name: str) -> tuple[str, str] | None:
        """The factors (A, B) of projection ``name`` when the layout adapts it, else None."""
        factors = factor_names(name)
        return factors if factors[0] in self.L.lora_offsets else None

    def lora_forward(self, x, name: str, y, n_in: int, n_out: int) -> list:
        """y += s·(x·A)·B for projection ``name`` when it is adapted (h = x·A into ``lora_h``), else nothing."""
        adapter = self._adapter(name)
        if adapter is None:
            return []
        a, b = adapter
        r, h, mm = self.L.lora.rank, self.buf("lora_h"), self.mm
        return [gemm.matmul(x, self.factor(a), h, self.R, n_in, r, precision=mm),
                gemm.matmul(h, self.factor(b), y, self.R, r, n_out, beta=1.0, alpha=self.L.lora.scale,
                            precision=mm)]

    def lora_backward(self, x, dy, name: str, dx, n_in: int, n_out: int) -> list:
        """The LoRA gradients of projection ``name`` when it is adapted, else nothing: h = x·A again (one
        [R, r] buffer serves every projection, so the forward's is gone), dB = s·hᵀ·dy, then
        dh = s·dy·Bᵀ in h's place, dA = xᵀ·dh and dx += dh·Aᵀ."""
        adapter = self._adapter(name)
        if adapter is None:
            return []
        a, b = adapter
        R, r, h, s, mm = self.R, self.L.lora.rank, self.buf("lora_h"), self.L.lora.scale, self.mm
        return [gemm.matmul(x, self.factor(a), h, R, n_in, r, precision=mm),
                gemm.matmul_dw(h, dy, self.factor_grad(b), R, r, n_out, alpha=s, precision=mm),
                gemm.matmul_dx(dy, self.factor(b), h, R, r, n_out, alpha=s, precision=mm),
                gemm.matmul_dw(x, h, self.factor_grad(a), R, n_in, r, precision=mm),
                gemm.matmul_dx(h, self.factor(a), dx, R, n_in, r, beta=1.0, precision=mm)]

    # The token shifts, the WKV recurrence and the MoBA attention are the parts of a block that look
    # at other tokens; each is one method, so that rwkvx.decoder's stateful builders can replace them.
    # A token shift comes with the LayerNorm before it, in one kernel (layernorm.forward_shift), and so do
    # their backwards (layernorm.backward_shift, which recomputes the LayerNorm's output from its input and
    # statistics): the output h (h1, h2) is stored only where ``h`` is given (the decoder's prefill keeps
    # its last rows).
    def channel_shift(self, prefix: str, xin, h: DevPtr | None = None) -> list:
        """h2 = LN2(xin) (ln2_mean, ln2_rstd saved; stored in ``h`` when given) and
        xk2 = h2 + (shift(h2) - h2) * ffn.x_k of block ``prefix``."""
        b, p = self.buf, self.p
        return layernorm.forward_shift(xin, p(prefix + "ln2.weight"), p(prefix + "ln2.bias"), [p(prefix + "ffn.x_k")],
                                       [b("xk2")], h, b("ln2_mean"), b("ln2_rstd"), self.R, self.cfg.n_embd, self.T)

    def time_shift(self, i: int, xin, h: DevPtr | None = None) -> list:
        """h1 = LN1(xin) (ln1_mean, ln1_rstd saved; stored in ``h`` when given) and the six token-shift mixes
        xr .. xg of h1 in RWKV block i."""
        pre, b = f"rwkv.blocks.{i}.", self.buf
        return layernorm.forward_shift(xin, self.p(pre + "ln1.weight"), self.p(pre + "ln1.bias"),
                                       [self.p(pre + "att." + m) for m in TIME_MIXES],
                                       [b(n) for n in TIME_MIX_OUTPUTS], h, b("ln1_mean"), b("ln1_rstd"),
                                       self.R, self.cfg.n_embd, self.T)

    def channel_shift_backward(self, prefix: str) -> list:
        """From dxk2 (and dx = d x1's residual part) through the channel mix's token shift and LN2: dx += d LN2,
        with the gradients of ffn.x_k and ln2's weight and bias."""
        b, p, gp = self.buf, self.p, self.gp
        return layernorm.backward_shift(b("x1"), p(prefix + "ln2.weight"), p(prefix + "ln2.bias"), b("ln2_mean"),
                                        b("ln2_rstd"), [p(prefix + "ffn.x_k")], [b("dxk2")], b("dx"),
                                        [gp(prefix + "ffn.x_k")], gp(prefix + "ln2.weight"), gp(prefix + "ln2.bias"),
                                        b("partials"), self.R, self.cfg.n_embd, self.T, self.dev, accumulate_dx=True,
                                        dx_copy=self.copy_out("dx"))

    def time_shift_backward(self, i: int, xin) -> list:
        """From dxr .. dxg (and dx = d xin's residual part) through RWKV block i's token shift and LN1:
        dx += d LN1, with the gradients of the six mixes and ln1's weight and bias."""
        pre, b, p, gp = f"rwkv.blocks.{i}.", self.buf, self.p, self.gp
        att = pre + "att."
        return layernorm.backward_shift(xin, p(pre + "ln1.weight"), p(pre + "ln1.bias"), b("ln1_mean"),
                                        b("ln1_rstd"), [p(att + m) for m in TIME_MIXES],
                                        [b("d" + n) for n in TIME_MIX_OUTPUTS], b("dx"),
                                        [gp(att + m) for m in TIME_MIXES], gp(pre + "ln1.weight"),
                                        gp(pre + "ln1.bias"), b("partials"), self.R, self.cfg.n_embd, self.T,
                                        self.dev, accumulate_dx=True, dx_copy=self.copy_out("dx"))

    def wkv(self, i: int, for_backward: bool) -> list:
        """y = WKV7(r, decay, kp, v', wa, wb) of RWKV block i (v' = vp, or v in block 0); with
        ``for_backward`` it also saves what wkv7's backward reads (sa and the state checkpoints)."""
        b, cfg = self.buf, self.cfg
        saved = dict(sa=b("wkv_sa"), ckpt=b("wkv_ckpt"), records=self._wkv_records()) if for_backward else {}
        return wkv7.forward(b("r"), b("decay"), b("kp"), self._value(i), b("wa"), b("wb"), b("y"),
                            self.B, self.T, cfg.n_head, cfg.head_size, self.dev, **saved,
                            method=self.methods["wkv7"], partials=b("wkv_partials"), **self._wkv_state(i))

    def _wkv_state(self, i: int, grad: bool = False) -> dict:
        """Under state tuning, RWKV block i's initial state ``s0`` (and with ``grad`` where its gradient
        goes: ``ds0``, ``ds0_partials``) as wkv7's arguments; else none."""
        if not self.L.tune_states:
            return {}
        off = self.L.state_offsets[state_name(i)][0]
        args = {"s0": self.buf("states").offset(off)}
        if grad:
            args.update(ds0=self.buf("state_grads").offset(off), ds0_partials=self.buf("wkv_ds0_partials"))
        return args

    def _wkv_records(self) -> DevPtr | None:
        """The WKV7 backward's chunk records as the recomputed forward keeps them (recompute, chunked), else None."""
        return self.buf("wkv_records") if "wkv_records" in self.L.offsets else None

    def attention(self, j: int) -> list:
        """y = MoBA attention of (q, k, v) = (r, k, v) in attention block j."""
        b = self.buf
        return moba.forward(b("r"), b("k"), b("v"), b("y"), **self._moba_args(j))

    def channel_mix_forward(self, prefix: str, xout) -> list:
        """h2 = LN2(x1) and its shift mix xk2; kf = relu(xk2 @ key^T)^2; xout = x1 + kf @ value^T (skipped
        when None)."""
        R, C, F, dev = self.R, self.cfg.n_embd, self.cfg.ffn_dim, self.dev
        b = self.buf
        ops = self.channel_shift(prefix, b("x1"))
        pre = b(KF_PRE) if KF_PRE in self.L.offsets else b("kf")     # fp32 kf: relu² in place
        ops += self.project(b("xk2"), prefix + "ffn.key.weight", pre, C, F)
        ops += channelmix.relu_sq(pre, b("kf"), R * F, dev)
        if xout is not None:
            ops += self._residual_add(b("kf"), prefix + "ffn.value.weight", b("x1"), xout, F)
        return ops

    def channel_mix_backward(self, prefix: str) -> list:
        """From dx (= d block output) to dx = d x1 (in place), with the FFN and ln2 gradients."""
        R, C, F, dev = self.R, self.cfg.n_embd, self.cfg.ffn_dim, self.dev
        b = self.buf
        ops = self.project_backward(b("kf"), self.operand("dx"), prefix + "ffn.value.weight", b("dkf"), F, C)
        ops += channelmix.relu_sq_backward(b("dkf"), b("kf"), b("dkf"), R * F, dev, src_is_k=True)
        ops += self.project_backward(b("xk2"), b("dkf"), prefix + "ffn.key.weight", b("dxk2"), C, F)
        return ops + self.channel_shift_backward(prefix)

    def _ln1_forward(self, prefix: str, xin, h1) -> list:
        R, C, b = self.R, self.cfg.n_embd, self.buf
        return layernorm.forward(xin, self.p(prefix + "ln1.weight"), self.p(prefix + "ln1.bias"),
                                 h1, b("ln1_mean"), b("ln1_rstd"), R, C)

    def _ln2_forward(self, prefix: str, xin) -> list:
        """h2 = LN2(xin) of block ``prefix`` alone (ln2_mean, ln2_rstd saved), for builders that shift h2
        with a kernel of their own."""
        R, C, b = self.R, self.cfg.n_embd, self.buf
        return layernorm.forward(xin, self.p(prefix + "ln2.weight"), self.p(prefix + "ln2.bias"),
                                 b("h2"), b("ln2_mean"), b("ln2_rstd"), R, C)

    def _ln1_backward(self, prefix: str, xin) -> list:
        R, C, b = self.R, self.cfg.n_embd, self.buf
        return layernorm.backward(xin, self.p(prefix + "ln1.weight"), b("dh1"), b("dx"),
                                  self.gp(prefix + "ln1.weight"), self.gp(prefix + "ln1.bias"),
                                  b("ln1_mean"), b("ln1_rstd"), b("partials"), R, C, self.dev, accumulate_dx=True,
                                  dx_copy=self.copy_out("dx"))

    # -- RWKV-7 time mix ------------------------------------------------------------------------
    def _lora(self, i: int) -> list[tuple[str, str, str, str, int]]:
        """(input, hidden, output, letter, rank) of the LoRA paths of RWKV block i."""
        cfg = self.cfg
        paths = [("xw", "hw", "wl", "w", cfg.dim_w), ("xa", "ha", "al", "a", cfg.dim_a)]
        if i > 0:
            paths.append(("xv", "hv", "vl", "v", cfg.dim_v))
        paths.append(("xg", "hg", "g", "g", cfg.dim_g))
        return paths

    def _prep_inputs(self, i: int) -> dict:
        """The arguments prep_forward and prep_backward share for RWKV block i."""
        b, p, att = self.buf, self.p, f"rwkv.blocks.{i}.att."
        return dict(k=b("k"), v=b("v"), wl=b("wl"), al=b("al"), vl=b("vl"), v_first=b("v_first"),
                    w0=p(att + "w0"), a0=p(att + "a0"), v0=p(att + "v0") if i else None,
                    k_k=p(att + "k_k"), k_a=p(att + "k_a"), R=self.R, C=self.cfg.n_embd,
                    N=self.cfg.head_size, layer=i, dev=self.dev)

    def _value(self, i: int) -> DevPtr:
        """v' of RWKV block i, the WKV's value: vp after the value residual, or v itself in block 0."""
        return self.buf("vp") if i else self.buf("v")

    def _gn_inputs(self, i: int) -> dict:
        """The arguments gn_forward and gn_backward share for RWKV block i."""
        b, p, att = self.buf, self.p, f"rwkv.blocks.{i}.att."
        return dict(y=b("y"), r=b("r"), kp=b("kp"), vp=self._value(i), g=b("g"),
                    ln_w=p(att + "ln_x.weight"), ln_b=p(att + "ln_x.bias"), r_k=p(att + "r_k"),
                    R=self.R, C=self.cfg.n_embd, N=self.cfg.head_size, dev=self.dev)

    def rwkv_forward(self, i: int, xin, for_backward: bool = False) -> list:
        """x1 = xin + TimeMix(LN1(xin)) (docs/SPEC.md §2.3), leaving every transient the backward needs; only
        ``for_backward`` (the forward the backward reads: the recompute, or the forward itself without
        recompute) saves the WKV state for it."""
        R, C, dev, mm = self.R, self.cfg.n_embd, self.dev, self.mm
        pre, b = f"rwkv.blocks.{i}.", self.buf
        att = pre + "att."
        ops = self.time_shift(i, xin)
        for src, dst, name in (("xr", "r", "receptance"), ("xk", "k", "key"), ("xv", "v", "value")):
            ops += self.project(b(src), f"{att}{name}.weight", b(dst), C, C)
        for src, hid, out, letter, rank in self._lora(i):
            ops.append(gemm.matmul(b(src), self.w(f"{att}{letter}1"), b(hid), R, C, rank, precision=mm))
            if letter == "w":
                ops += timemix.tanh_forward(b(hid), b(hid), R * rank, dev)
            elif letter == "g":
                ops += timemix.sigmoid_forward(b(hid), b(hid), R * rank, dev)
            ops.append(gemm.matmul(b(hid), self.w(f"{att}{letter}2"), b(out), R, rank, C, precision=mm))
        ops += timemix.prep_forward(**self._prep_inputs(i), decay=b("decay"), kp=b("kp"), vp=b("vp"),
                                    wa=b("wa"), wb=b("wb"))
        ops += self.wkv(i, for_backward)
        ops += timemix.gn_forward(**self._gn_inputs(i), z=b("z"))
        ops += self._residual_add(b("z"), att + "output.weight", xin, b("x1"), C)
        return ops

    def rwkv_backward(self, i: int, xin) -> list:
        """From dx = d x1 to dx = d xin (in place), with every TimeMix and ln1 gradient of block i."""
        R, C, T, N, H, dev, mm = (self.R, self.cfg.n_embd, self.T, self.cfg.head_size, self.cfg.n_head,
                                  self.dev, self.mm)
        pre, b, gp = f"rwkv.blocks.{i}.", self.buf, self.gp
        att = pre + "att."
        gn = self._gn_inputs(i)
        ops = self.project_backward(b("z"), self.operand("dx"), att + "output.weight", b("dz"), C, C)
        ops += timemix.gn_backward(**gn, dz=b("dz"), dy=b("dy"), dg=b("dg"), dr2=b("dr2"), dkp2=b("dkp2"),
                                   dvp2=b("dvp2"), partials=b("partials"),
                                   dparams=(gp(att + "ln_x.weight"), gp(att + "ln_x.bias"), gp(att + "r_k")))
        ops += wkv7.backward(b("r"), b("decay"), b("kp"), gn["vp"], b("wa"), b("wb"), b("dy"), b("wkv_sa"),
                             b("wkv_ckpt"), b("dr"), b("ddecay"), b("dkp"), b("dvp"), b("dwa"), b("dwb"),
                             self.B, T, H, N, dev, partials=b("wkv_partials"), method=self.methods["wkv7"],
                             records=self._wkv_records(), **self._wkv_state(i, grad=True))
        dparams = [gp(att + n) for n in ("w0", "a0", "k_k", "k_a")] + ([gp(att + "v0")] if i else [])
        ops += timemix.prep_backward(**self._prep_inputs(i),
                                     d_decay=b("ddecay"), dkp=b("dkp"), dvp=b("dvp"), dwa=b("dwa"), dwb=b("dwb"),
                                     dkp2=b("dkp2"), dvp2=b("dvp2"), dr=b("dr"), dr2=b("dr2"), dr_out=b("dr"),
                                     dk=b("dk"), dv=b("dv"), dwl=b("dwl"), dal=b("dal"), dvl=b("dvl"),
                                     dv_first=b("dv_first"), partials=b("partials"), dparams=dparams)
        # projections r, k, v: dx* = d(out) @ W, dW = d(out)^T x*
        for src, dsrc, dout, name in (("xr", "dxr", "dr", "receptance"), ("xk", "dxk", "dk", "key"),
                                      ("xv", "dxv", "dv", "value")):
            ops += self.project_backward(b(src), b(dout), f"{att}{name}.weight", b(dsrc), C, C)
        # LoRA paths: out = act(src @ W1) @ W2
        grads_of = {"wl": "dwl", "al": "dal", "vl": "dvl", "g": "dg"}
        for src, hid, out, letter, rank in self._lora(i):
            dout, dhid = b(grads_of[out]), b("d" + hid)
            ops += self.weight_grad(gemm.matmul_dw, b(hid), dout, f"{att}{letter}2", R, rank, C, precision=mm)
            ops.append(gemm.matmul_dx(dout, self.w(f"{att}{letter}2"), dhid, R, rank, C, precision=mm))
            if letter == "w":
                ops += timemix.tanh_backward(b(hid), dhid, dhid, R * rank, dev)
            elif letter == "g":
                ops += timemix.sigmoid_backward(b(hid), dhid, dhid, R * rank, dev)
            ops += self.weight_grad(gemm.matmul_dw, b(src), dhid, f"{att}{letter}1", R, C, rank, precision=mm)
            # xv feeds both the value projection and the v LoRA: accumulate its gradient
            beta = 1.0 if letter == "v" else 0.0
            ops.append(gemm.matmul_dx(dhid, self.w(f"{att}{letter}1"), b("d" + src), R, C, rank, beta=beta,
                                      precision=mm))
        return ops + self.time_shift_backward(i, xin)

    # -- MoBA attention -------------------------------------------------------------------------
    def _moba_args(self, j: int) -> dict:
        cfg = self.cfg
        scratch = {name: (self.buf(f"moba_sel.{j}") if name == "sel" else self.buf("moba_" + name))
                   for name in moba.SCRATCH_NAMES}
        return dict(scratch=scratch, B=self.B, T=self.T, H=cfg.n_head, N=cfg.head_size,
                    chunk=cfg.moba_chunk_size, top_k=cfg.moba_top_k, dev=self.dev, method=self.methods["moba"])

    def attn_forward(self, j: int, xin, attend: bool = True) -> list:
        """x1 = xin + Attn_j(LN1(xin)) (docs/SPEC.md §2.3, MoBA). Without ``attend`` (the recompute) the block's
        kept MoBA output and selection (:data:`rwkvx.arena.ATTENTION_KEPT`) stand for the attention."""
        C, b = self.cfg.n_embd, self.buf
        pre = f"moba.{j}."
        h1 = self.operand("h1")          # only GEMMs read an attention block's LN1 output
        ops = self._ln1_forward(pre, xin, h1)
        for dst, name in (("r", "receptance"), ("k", "key"), ("v", "value")):
            ops += self.project(h1, f"{pre}att.{name}.weight", b(dst), C, C)
        if attend:
            ops += self.attention(j)
        ops += self._residual_add(b("y"), pre + "att.output.weight", xin, b("x1"), C)
        return ops

    def attn_backward(self, j: int, xin) -> list:
        """From dx = d x1 to dx = d xin (in place), with the attention and ln1 gradients."""
        C, b = self.cfg.n_embd, self.buf
        pre = f"moba.{j}."
        ops = self.project_backward(b("y"), self.operand("dx"), pre + "att.output.weight", b("dz"), C, C)
        ops += moba.backward(b("r"), b("k"), b("v"), b("y"), b("dz"), b("dr"), b("dk"), b("dv"),
                             **self._moba_args(j))
        for n, (dsrc, name) in enumerate((("dr", "receptance"), ("dk", "key"), ("dv", "value"))):
            ops += self.project_backward(self.operand("h1"), b(dsrc), f"{pre}att.{name}.weight", b("dh1"), C, C,
                                         beta=1.0 if n else 0.0)
        ops += self._ln1_backward(pre, xin)
        return ops
