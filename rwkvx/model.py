"""The GPU model: resident weights, one device arena, and the training step as plans.

:class:`Model` is the public API; the arena's buffers are placed by :class:`rwkvx.arena.Layout` and the
step's op lists built by :class:`rwkvx.step.StepBuilder`. A Model allocates the arena once and runs the
ops through :class:`rwkvx._core.Plan` (and the training step as one CUDA graph).

The per-step inputs come from pinned host memory, copied by the step itself. There are :data:`SLOTS`
sets of these pinned buffers, used in turn by :meth:`Model.launch_step`, so the next batch is written
while the current step runs, and each step copies its losses and optimizer statistics into its own set
(:class:`PendingStep` reads them when asked for, waiting for that step's event only).
"""
from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from . import validate
from .arena import HEAD_CHUNK_BYTES, TRAINED, Layout
from .config import Config
from .cu import adamw, embedding, loss
from .lora import FactorDict, check_factors, lora_shapes, settings_of
from .optim import Schedule, bf16_moment_bits
from .params import ParamDict, check_params
from .precision import DEFAULT_PRECISION, Precision, resolve_precision
from .runtime.event import Event
from .runtime.dtypes import from_storage, poison_bits, storage_dtype, to_storage
from .runtime.ops import CopyDtoH, CopyHtoD, Gemm, flatten_ops
from .state_tuning import StateDict, check_states, state_shapes
from .step import StepBuilder, StepOps

RECOMPUTE_AUTO = "auto"
DEFAULT_RECOMPUTE: bool | str = RECOMPUTE_AUTO
# recompute="auto" keeps the forward state when that arena fits in the device's free memory with this
# much to spare: for what the process allocates besides the arena (cuBLASLt workspaces, kernel modules,
# the CUDA graph, NCCL's buffers when training data parallel) and for other processes' allocations.
RECOMPUTE_AUTO_MARGIN = 4 << 30


def check_recompute(value: object, owner: str = "recompute") -> bool | str:
    """``value`` if it is a valid ``recompute`` setting (True, False or ``"auto"``); TypeError or
    ValueError naming ``owner`` otherwise."""
    if isinstance(value, bool) or (isinstance(value, str) and value == RECOMPUTE_AUTO):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{owner} must be True, False or {RECOMPUTE_AUTO!r}, got {type(value).__name__}")
    raise ValueError(f"{owner} must be True, False or {RECOMPUTE_AUTO!r}, got {value!r}")


def auto_recompute(free_bytes: int, keep_bytes: int, margin: int = RECOMPUTE_AUTO_MARGIN) -> bool:
    """The resolution of ``recompute="auto"``: False (keep every block's forward state: faster) when the
    arena without recompute, ``keep_bytes`` (:attr:`rwkvx.arena.Layout.total` with recompute=False), fits
    in ``free_bytes`` of device memory leaving ``margin``; True (recompute: least memory) otherwise."""
    return keep_bytes + margin > free_bytes

SLOTS = 2                     # pinned staging sets: the step in flight's and the next one's
STATS_BUFFER = "adam_state"   # copied to pinned memory at the end of each training step


def rebased(ops, moves: dict[int, int]) -> list:
    """``ops`` flattened, with the pinned host address of every host copy that ``moves`` names (old ->
    new address) moved; everything else unchanged."""
    out = []
    for op in flatten_ops(ops):
        if isinstance(op, (CopyHtoD, CopyDtoH)) and op.host_ptr in moves:
            op = dataclasses.replace(op, host_ptr=moves[op.host_ptr])
        out.append(op)
    return out


def stats_from_state(state: np.ndarray) -> dict[str, float]:
    """``{"step", "lr", "grad_norm", "clip"}`` from the AdamW device state (float64 ``[STATE_DOUBLES]``)."""
    return {"step": int(state[adamw.ST_STEP]), "lr": float(state[adamw.ST_LR]),
            "grad_norm": float(state[adamw.ST_NORM]), "clip": float(state[adamw.ST_SCALE])}


class PendingStep:
    """A training step enqueued by :meth:`Model.launch_step`. :meth:`result` (``loss()``, ``stats()``)
    waits for this step's own event — not for work enqueued after it — and reads the mean loss and the
    optimizer statistics the step copied to its pinned slot; read once, kept. Launching the step after
    next on the same slot reads them first, so nothing is lost when a result is asked for late."""

    def __init__(self, model: "Model", slot: int):
        self._model, self._slot = model, slot
        self._result: tuple[float, dict[str, float]] | None = None

    def done(self) -> bool:
        """Whether the step has finished on the device (never waits)."""
        return self._result is not None or self._model._events[self._slot].query()

    def result(self) -> tuple[float, dict[str, float]]:
        """``(mean loss, {"step", "lr", "grad_norm", "clip"})`` of this step; waits for it on first call."""
        if self._result is None:
            self._result = self._model._read_slot(self._slot)
        return self._result

    def loss(self) -> float:
        """The step's mean loss (before its update)."""
        return self.result()[0]

    def stats(self) -> dict[str, float]:
        """The step's optimizer statistics (:meth:`Model.optimizer_stats`'s keys)."""
        return self.result()[1]


class Model:
    """An RWKV-X model resident on the GPU, for a fixed batch size and sequence length.

    Same contract as :class:`rwkvx.oracle.Oracle`: ``forward(tokens)`` -> logits,
    ``loss_and_grads(tokens, targets, ignore_index)`` -> (loss, grads). Weights, gradients, optimizer
    moments and every activation live in one device arena sized at construction; a step allocates
    nothing. :meth:`train_step` waits for its step's end to return the loss; :meth:`launch_step` returns
    at once (a :class:`PendingStep`), so the host stages the next batch while the step runs.

    ``precision`` (docs/SPEC.md §4; a :class:`~rwkvx.precision.Precision` or its name, default
    :data:`rwkvx.precision.DEFAULT_PRECISION`): "fp32" (exact), "tf32" (tensor-core GEMMs), "bf16" (bf16 GEMM
    operands and activations; fp32 master weights, gradients, optimizer state, WKV state and statistics);
    the attribute ``precision`` is the resolved :class:`~rwkvx.precision.Precision`.
    ``recompute`` (default :data:`DEFAULT_RECOMPUTE`): True, the backward recomputes each block's forward
    from its saved input; False keeps every block's transients instead (more memory, no second forward);
    ``"auto"`` is False when that arena fits in the device memory free at construction, leaving
    :data:`RECOMPUTE_AUTO_MARGIN` (:func:`auto_recompute`), else True. The attribute ``recompute`` is the
    resolved bool.
    ``methods`` overrides the precision's kernel methods (e.g. ``{"wkv7": "sequential"}``).
    ``head_chunk_bytes`` (default :data:`rwkvx.arena.HEAD_CHUNK_BYTES`): the most bytes of logits the head
    computes at once (the head and the cross entropy run over the rows in chunks of at least 64 rows).
    ``moments``: how AdamW keeps its moments, "f32" or "bf16" (stochastically rounded,
    :mod:`rwkvx.oracle.adamw`: 4 bytes a parameter less).
    ``states`` (state tuning, :mod:`rwkvx.state_tuning`): every RWKV block starts its WKV recurrence from
    its initial state there (shared by the batch), and the states are what the model trains: gradients
    and AdamW update the states alone (clipping over their gradients), the parameters stay bit for bit
    (the GEMMs of their weight gradients are left out of the step).
    ``lora`` (LoRA, :mod:`rwkvx.lora`: factors adapting every matrix of some targets, one rank r) and
    ``lora_scale`` (s = alpha / r): every adapted projection adds s·(x·A)·B, and the factors are what the
    model trains, the parameters frozen as under state tuning (:meth:`lora_factors`; :meth:`grads` gives
    the factors' gradients).
    """

    def __init__(self, cfg: Config, params: ParamDict, batch_size: int, seq_len: int,
                 precision: Precision | str = DEFAULT_PRECISION, recompute: bool | str = DEFAULT_RECOMPUTE,
                 methods: dict[str, str] | None = None, *, head_chunk_bytes: int = HEAD_CHUNK_BYTES,
                 moments: str = "f32", states: StateDict | None = None, lora: FactorDict | None = None,
                 lora_scale: float = 1.0):
        if not isinstance(cfg, Config):
            raise TypeError("Model expects an rwkvx.Config")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        precision = resolve_precision(precision)
        recompute = check_recompute(recompute)
        check_params(cfg, params)
        if states is not None:
            states = check_states(cfg, states)
        settings = None if lora is None else settings_of(cfg, lora, lora_scale)
        if states is not None and settings is not None:
            raise ValueError("Model: states (state tuning) and lora (LoRA) train different tensors; give one")
        from ._core import Plan
        from .runtime import Device  # raises RuntimeError without a GPU
        self.cfg, self.B, self.T, self.precision = cfg, batch_size, seq_len, precision
        self.dev = Device.get()
        self._events = [Event(self.dev) for _ in range(SLOTS)]   # the last step launched on each slot

        def layout(recompute: bool) -> Layout:
            return Layout(cfg, batch_size, seq_len, self.dev.info, precision, recompute, methods,
                          head_chunk_bytes=head_chunk_bytes, tune_states=states is not None, moments=moments,
                          lora=settings)

        if recompute == RECOMPUTE_AUTO:
            keep = layout(False)
            recompute = auto_recompute(self.dev.memory_info()["free"], keep.total)
            self.layout = layout(True) if recompute else keep
        else:
            self.layout = layout(recompute)
        self.recompute: bool = recompute
        self.arena = self.dev.alloc(self.layout.total)
        R = batch_size * seq_len
        # one set of pinned buffers per slot: the per-step inputs, the per-token losses, the optimizer
        # state after the step; the op lists are built on slot 0's, a step on another slot is rebased
        self._slots = [{name: self.dev.alloc_pinned(self.layout.nbytes(name))
                        for name in [*Layout.host_inputs(R), "loss_t", STATS_BUFFER]} for _ in range(SLOTS)]
        self._pinned = self._slots[0]
        # the step whose results each slot holds, unread (weak: a step nobody can read any more is only
        # waited for before its slot is written again)
        self._owners: list[weakref.ref | None] = [None] * SLOTS
        self._next_slot = 0
        self.builder = StepBuilder(self.layout, self.arena.ptr, {k: v.ptr for k, v in self._pinned.items()})
        self.ops = self.builder.build()
        # every GEMM's algorithm, chosen before anything in the arena past the per-step inputs is live:
        # new shapes are timed with their outputs written there, so the plans allocate nothing for it
        ops = self.ops
        gemms = [op for op in flatten_ops([ops.step, ops.evaluate, ops.head]) if isinstance(op, Gemm)]
        free = self.layout.offsets["tokens"]
        self.dev.cublas.prepare(gemms, scratch=(self.arena.ptr + free, self.layout.total - free))
        self._forward_plan = Plan(self.dev, self.ops.stage_tokens + self.ops.forward)
        self._step_plan = Plan(self.dev, self.ops.step)
        self.load_params(params)
        if states is not None:
            self.load_states(states)
        if lora is not None:
            self.load_lora_factors(lora)

    # -- parameters ------------------------------------------------------------------------------
    def _tensors(self, region: str) -> tuple[dict[str, tuple[int, int]], dict[str, tuple]]:
        """Name -> (offset, size) and name -> shape of the tensors of flat region ``region``: the
        parameters', the initial states' or the LoRA factors' (:data:`rwkvx.arena.TRAINED`)."""
        if region in TRAINED["states"]:
            return self.layout.state_offsets, state_shapes(self.cfg)
        if region in TRAINED["lora"]:
            return self.layout.lora_offsets, lora_shapes(self.cfg, self.layout.lora)
        offsets = self.layout.region_offsets.get(region, self.layout.param_offsets)
        return offsets, {n: self.layout.param_shapes[n] for n in offsets}

    def _region(self, region: str) -> dict[str, np.ndarray]:
        offsets, shapes = self._tensors(region)
        elem = self.layout.elems[region]
        flat = from_storage(elem, self.dev.download(self.builder.buf(region), (self.layout.counts[region],),
                                                    storage_dtype(elem)))
        return {n: flat[off:off + size].reshape(shapes[n]).copy() for n, (off, size) in offsets.items()}

    def _pack(self, region: str, tensors: dict[str, np.ndarray], elem: str = "f32") -> np.ndarray:
        """The flat image of region ``region`` holding its tensors of the name-keyed ``tensors``, in the host
        storage of ``elem`` (bf16: bits rounded to nearest), converted one tensor at a time: a 7.2B model's
        bf16 copy never has a float32 image on the host."""
        flat = np.zeros(self.layout.counts[region], storage_dtype(elem))
        for n, (off, size) in self._tensors(region)[0].items():
            flat[off:off + size] = to_storage(elem, np.asarray(tensors[n], np.float32).ravel())
        return flat

    def _upload_region(self, region: str, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """Inverse of :meth:`_region`: one name-keyed tensor per parameter (or state), packed and uploaded
        (float32 values; a bf16 region takes only bf16 values, :func:`rwkvx.optim.bf16_moment_bits`)."""
        flat = self._pack(region, tensors)
        stored = bf16_moment_bits(flat, region) if self.layout.elems[region] == "bf16" else flat
        self.dev.upload(self.builder.buf(region), stored)
        return flat

    def load_params(self, params: ParamDict) -> None:
        """Upload ``params`` (names and shapes of ``param_shapes(cfg)``) to the device (and their bf16
        copy, the GEMMs' operands, in bf16 mode). A model whose parameters are frozen (state tuning,
        LoRA) keeps a reference to ``params``: its device holds some weights only as bf16 operands."""
        check_params(self.cfg, params)
        self._upload_region("params", params)
        if self.layout.counts["params_x"]:
            self.dev.upload(self.builder.buf("params_x"), self._pack("params_x", params, self.layout.elems["params_x"]))
        self._frozen_params = dict(params) if self.layout.trains != "params" else None

    def params(self) -> ParamDict:
        """The current parameters, name-keyed float32 copies: downloaded, or the frozen parameters (state
        tuning, LoRA) as they were loaded."""
        if self._frozen_params is not None:
            return {n: np.array(p, np.float32) for n, p in self._frozen_params.items()}
        return self._region("params")

    def grads(self) -> ParamDict:
        """The gradients of the last :meth:`loss_and_grads`, downloaded, name-keyed: of every parameter,
        or under state tuning of every initial state, or under LoRA of every factor (the parameters' are
        not computed in either)."""
        return self._region(TRAINED[self.layout.trains][1])

    def load_states(self, states: StateDict) -> None:
        """Upload the initial WKV states (state tuning: the model was built with ``states``)."""
        if not self.layout.tune_states:
            raise ValueError("this Model has no initial states: build it with states=... (state tuning)")
        self._upload_region("states", check_states(self.cfg, states))

    def states(self) -> StateDict | None:
        """The current initial WKV states, downloaded (float32 [H, N, N] each); None without them."""
        return self._region("states") if self.layout.tune_states else None

    def load_lora_factors(self, factors: FactorDict) -> None:
        """Upload the LoRA factors (the model was built with ``lora``; the same targets and rank), and
        their bf16 copy where the GEMMs read bf16 operands."""
        if self.layout.lora is None:
            raise ValueError("this Model has no LoRA factors: build it with lora=... (LoRA)")
        flat = self._upload_region("lora", check_factors(self.cfg, factors, self.layout.lora))
        if self.layout.counts["lora_x"]:
            self.dev.upload(self.builder.buf("lora_x"), to_storage(self.layout.elems["lora_x"], flat))

    def lora_factors(self) -> FactorDict | None:
        """The current LoRA factors, downloaded (float32 A [in, r], B [r, out]); None without them."""
        return self._region("lora") if self.layout.lora is not None else None

    # -- steps ---------------------------------------------------------------------------------
    def _claim(self, slot: int) -> dict:
        """Slot ``slot``'s pinned buffers, free to write: the step that last used them has finished and
        its results are read (it waits for that step when it has not)."""
        owner = self._owners[slot]() if self._owners[slot] is not None else None
        if owner is not None:
            owner.result()
        else:
            self._events[slot].synchronize()
        return self._slots[slot]

    def _stage_tokens(self, slot: int, tokens) -> np.ndarray:
        tokens = validate.check_tokens(tokens, self.cfg.vocab_size)
        if tokens.shape != (self.B, self.T):
            raise ValueError(f"tokens have shape {tokens.shape}, this Model was built for "
                             f"(batch_size, seq_len) = {(self.B, self.T)}")
        self._claim(slot)["tokens"].array(np.int32, (self.B * self.T,))[:] = tokens.ravel()
        return tokens

    def stage_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """Validate ``tokens`` [B, T] and write them into the pinned buffer the forward reads."""
        return self._stage_tokens(0, tokens)

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        """Logits ``[B, T, V]`` (float32) for int tokens ``[B, T]``."""
        self.stage_tokens(tokens)
        self._forward_plan.run()
        return self.logits().reshape(self.B, self.T, self.cfg.vocab_size)

    def logits(self) -> np.ndarray:
        """Logits ``[B*T, V]`` (float32) of the last forward (its final LayerNorm's output), through the
        head chunk by chunk of rows."""
        from ._core import Plan
        if getattr(self, "_head_plans", None) is None:
            self._head_plans = [Plan(self.dev, ops) for ops in self.ops.head]
        V, rows, buf = self.cfg.vocab_size, self.layout.head_rows, self.builder.buf("logits")
        out = np.empty((self.B * self.T, V), np.float32)
        for plan, r0 in zip(self._head_plans, self.builder.head_chunks()):
            plan.run()
            n = min(rows, self.B * self.T - r0)
            out[r0:r0 + n] = from_storage(buf.elem, self.dev.download(buf, (n, V), storage_dtype(buf.elem)))
        return out

    def _stage_batch(self, slot: int, tokens, targets, ignore_index: int) -> None:
        tokens = self._stage_tokens(slot, tokens)
        targets = validate.check_targets(targets, tokens.shape, self.cfg.vocab_size, ignore_index)
        flat = np.where(targets == ignore_index, validate.IGNORE_INDEX, targets).astype(np.int32).ravel()
        order, seg_start, n_seg = embedding.sort_tokens(tokens)
        pin = self._slots[slot]
        pin["targets"].array(np.int32, flat.shape)[:] = flat
        pin["emb_order"].array(np.int32, order.shape)[:] = order
        pin["emb_seg_start"].array(np.int32, seg_start.shape)[:] = seg_start
        pin["emb_n_seg"].array(np.int32, (1,))[:] = n_seg
        pin["inv_count"].array(np.float64, (1,))[:] = loss.inv_count(flat)

    def stage_batch(self, tokens: np.ndarray, targets: np.ndarray, ignore_index: int = validate.IGNORE_INDEX) -> None:
        """Validate a batch and write it into the pinned buffers the step reads (ignored targets are
        stored as validate.IGNORE_INDEX, the value the loss kernel was built with)."""
        self._stage_batch(0, tokens, targets, ignore_index)

    def inv_count(self, slot: int = 0) -> float:
        """1 / the number of targets != ignore_index in the batch staged on ``slot`` (float64, as the
        loss uses it)."""
        return float(self._slots[slot]["inv_count"].array(np.float64, (1,))[0])

    def mean_loss(self, slot: int = 0) -> float:
        """The mean loss of the last step run on ``slot`` (0: the one :meth:`stage_batch` fills), from
        its pinned per-token losses, reduced in double."""
        from ._core import sum_float64
        losses = self._slots[slot]["loss_t"].array(np.float64, (self.B * self.T,))
        return sum_float64(losses) * self.inv_count(slot)

    def run_step(self) -> None:
        """Enqueue one forward + loss + backward on the staged batch (no synchronisation); slot 0's
        buffers are written again only after it has run."""
        self._step_plan.run()
        self._events[0].record()

    def loss_and_grads(self, tokens: np.ndarray, targets: np.ndarray,
                       ignore_index: int = validate.IGNORE_INDEX) -> tuple[float, ParamDict]:
        """Mean cross-entropy over targets != ignore_index, and the gradient of every parameter."""
        self.stage_batch(tokens, targets, ignore_index)
        self.run_step()
        self.dev.synchronize()
        return self.mean_loss(), self.grads()

    # -- training: the whole step, AdamW included, as one CUDA graph -----------------------------
    def configure_optimizer(self, schedule: Schedule, weight_decay: float = 0.0,
                            grad_clip: float | None = None) -> None:
        """Set up AdamW (moments zeroed, step 0) and the training plans that :meth:`launch_step` runs."""
        from ._core import Plan
        b = self.builder.buf
        self.dev.upload(b("adam_table"), self.layout.adam_table)
        self.dev.upload(b("adam_lrmul"), self.layout.adam_lrmul)
        self.dev.upload(b("adam_state"), adamw.state_from_schedule(schedule, grad_clip))
        _, _, m, v = TRAINED[self.layout.trains]
        zeros = np.zeros(self.layout.counts[m], storage_dtype(self.layout.elems[m]))
        self.dev.upload(b(m), zeros)
        self.dev.upload(b(v), zeros)
        self.schedule, self.weight_decay, self.grad_clip = schedule, weight_decay, grad_clip
        stats = CopyDtoH(self._pinned[STATS_BUFFER].ptr, b(STATS_BUFFER), self.layout.nbytes(STATS_BUFFER))
        train = flatten_ops(self.ops.step + self.builder.optimizer(weight_decay, bool(grad_clip)) + [stats])
        self._train_plans = [Plan(self.dev, self._on_slot(train, slot)) for slot in range(SLOTS)]
        self._train_graphs: list | None = None

    def _on_slot(self, ops: list, slot: int) -> list:
        """``ops`` (built on slot 0's pinned buffers) reading and writing slot ``slot``'s instead."""
        return rebased(ops, {self._slots[0][n].ptr: buf.ptr for n, buf in self._slots[slot].items()})

    def _capture(self, slot: int) -> None:
        """Capture one CUDA graph per slot, after a warm-up step without an update on the batch staged on
        ``slot`` (modules and cuBLAS ready before the capture)."""
        from ._core import Plan
        from .runtime import Graph
        warm_up = Plan(self.dev, self._on_slot(self.ops.step, slot))
        warm_up.run()
        self.dev.synchronize()
        self._train_graphs = [Graph.capture(self.dev, plan.run) for plan in self._train_plans]

    def launch_step(self, tokens: np.ndarray, targets: np.ndarray, ignore_index: int = validate.IGNORE_INDEX,
                    graph: bool = True) -> PendingStep:
        """Enqueue forward, loss, backward and AdamW update on one batch; returns at once with the
        :class:`PendingStep` that reads its loss when asked.

        The batch goes to the next of the :data:`SLOTS` pinned slots (waiting only when the step that
        used that slot before, the one before last, has not finished). With ``graph`` (default) the step
        is a replay of the slot's CUDA graph (captured on first use); otherwise the same plan is
        enqueued op by op. Both give bit-identical results, as does :meth:`train_step`.
        """
        if getattr(self, "_train_plans", None) is None:
            raise RuntimeError("call configure_optimizer() before training steps")
        slot = self._next_slot
        self._stage_batch(slot, tokens, targets, ignore_index)
        if not graph:
            self._train_plans[slot].run()
        else:
            if self._train_graphs is None:
                self._capture(slot)
            self._train_graphs[slot].launch()
        self._events[slot].record()
        pending = PendingStep(self, slot)
        self._owners[slot], self._next_slot = weakref.ref(pending), (slot + 1) % SLOTS
        return pending

    def _read_slot(self, slot: int) -> tuple[float, dict[str, float]]:
        """Wait for the step launched on ``slot``; its mean loss and optimizer statistics (the slot is
        free afterwards)."""
        self._events[slot].synchronize()
        state = self._slots[slot][STATS_BUFFER].array(np.float64, (adamw.STATE_DOUBLES,))
        result = self.mean_loss(slot), stats_from_state(state)
        self._owners[slot] = None
        return result

    def train_step(self, tokens: np.ndarray, targets: np.ndarray, ignore_index: int = validate.IGNORE_INDEX,
                   graph: bool = True) -> float:
        """Forward, loss, backward and AdamW update on one batch; returns the mean loss (waits for it).
        :meth:`launch_step` without the wait; ``graph`` as there."""
        return self.launch_step(tokens, targets, ignore_index, graph).loss()

    def evaluate(self, tokens: np.ndarray, targets: np.ndarray, ignore_index: int = validate.IGNORE_INDEX) -> float:
        """Mean loss on one batch: forward and loss only, the parameters untouched (after every step
        launched before)."""
        from ._core import Plan
        if getattr(self, "_eval_plan", None) is None:
            ops = self.ops
            self._eval_plan = Plan(self.dev, ops.stage_tokens + ops.stage_targets + ops.forward + ops.evaluate)
        self.stage_batch(tokens, targets, ignore_index)
        self._eval_plan.run()
        self.dev.synchronize()
        return self.mean_loss()

    def optimizer_stats(self) -> dict[str, float]:
        """``{"step", "lr", "grad_norm", "clip"}`` of the last update, read from the device state."""
        return stats_from_state(self.dev.download(self.builder.buf(STATS_BUFFER), (adamw.STATE_DOUBLES,),
                                                  np.float64))

    def _moments(self) -> tuple[tuple[str, str], ...]:
        """(key, region) of AdamW's two moments of what the model trains."""
        return tuple(zip(("m", "v"), TRAINED[self.layout.trains][2:]))

    def optimizer_state(self) -> dict:
        """AdamW moments and step, in :meth:`rwkvx.optim.AdamW.state_dict`'s format (the states'
        moments under state tuning, the factors' under LoRA)."""
        tensors = {}
        for key, region in self._moments():
            for name, value in self._region(region).items():
                tensors[f"optim.{key}.{name}"] = value
        return {"tensors": tensors, "meta": {"optim_step": self.optimizer_stats()["step"]}}

    def load_optimizer_state(self, state: dict) -> None:
        """Restore moments and step saved by :meth:`optimizer_state` (or the CPU AdamW)."""
        tensors, meta = state.get("tensors") or {}, state.get("meta") or {}
        step = meta.get("optim_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"optimizer state needs an int step count 'optim_step' >= 0, got {step!r}")
        for key, region in self._moments():
            moments = {}
            for name, shape in self._tensors(region)[1].items():
                full = f"optim.{key}.{name}"
                if full not in tensors:
                    raise ValueError(f"optimizer state is missing {full}")
                moments[name] = np.asarray(tensors[full], np.float32)
                if moments[name].shape != shape:
                    raise ValueError(f"optimizer state {full} has shape {moments[name].shape}")
            self._upload_region(region, moments)
        self.dev.upload(self.builder.buf("adam_state"),
                        adamw.state_from_schedule(self.schedule, self.grad_clip, step=step))

    def moba_selection(self) -> list[np.ndarray]:
        """Each attention block's selection of the last forward: int32 ``[B, H, T, top_k-1]``."""
        cfg = self.cfg
        shape = (self.B, cfg.n_head, self.T, cfg.moba_top_k - 1)
        n = int(np.prod(shape))
        if n == 0:                          # top_k == 1: nothing is selected, no buffer exists
            return [np.zeros(shape, np.int32) for _ in range(cfg.n_attn_layer)]
        return [self.dev.download(self.builder.buf(f"moba_sel.{j}"), shape, np.int32)
                for j in range(cfg.n_attn_layer)]

    def poison(self) -> None:
        """Fill gradients and every activation with NaN (tests: whatever a step leaves unwritten shows)."""
        L = self.layout
        self.dev.upload(self.arena.ptr + L.offsets["tokens"], L.poison_image())
        for grads in {"grads", TRAINED[L.trains][1]}:
            if L.counts[grads]:
                self.dev.upload(self.builder.buf(grads), poison_bits(L.elems[grads], L.counts[grads]))

    def memory_bytes(self) -> int:
        """Bytes of the device arena (weights, gradients, optimizer state, activations, scratch)."""
        return self.layout.total
