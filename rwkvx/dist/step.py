"""The training step of one data-parallel GPU rank, captured as one CUDA graph with its NCCL calls.

:func:`build_program` cuts the model's step (:class:`rwkvx.step.StepOps`) at the backward's
gradient-ready points and puts a collective at each cut, in this order::

    stage + forward + loss, copy the per-token losses (+ this rank's stop flag) to a send buffer
    GatherLoss                  all-gather of those losses and flags (for the logged global loss)
    backward[:k1]               head and ln_out gradients final
    AllReduce(head, ln_out)     average over ranks, in place, fp32
    backward[k1:k2]             the last block's gradients final
    AllReduce(last block) ...   one per block, in backward order, then the embedding (+ block 0)
    Join                        the compute stream waits for every collective
    AdamW (clipping after the reduction), copy the gathered losses to pinned host memory

Collectives run on a second stream: the compute stream records an event, the communication stream
waits for it and issues the NCCL call, so the reduction of block i overlaps the backward of the
blocks before it; the join is an event the other way. The ops are exactly the plain step's, in the
plain step's order, plus two copies that touch no model state: with one rank (NCCL's average of one
is the identity) the step is bit-identical to :meth:`rwkvx.model.Model.train_step`. Every rank
captures the same graph (same model, same shapes), as NCCL requires.

:class:`DistributedStep` runs the program (eagerly or captured), waits for it through
:meth:`~rwkvx.dist.nccl.NcclCommunicator.wait` (a dead or hung rank ends in an error, not a hang) and
returns the global mean loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.ops import Copy, CopyDtoH, CopyHtoD, DevPtr, flatten_ops


@dataclass(frozen=True)
class AllReduce:
    """Average ``count`` float32 gradients at ``ptr`` over the ranks, in place."""
    ptr: int
    count: int
    names: tuple


@dataclass(frozen=True)
class GatherLoss:
    """All-gather ``count`` float64 (the per-token losses and the stop flag) from ``send`` into ``recv``."""
    send: int
    recv: int
    count: int


@dataclass(frozen=True)
class Join:
    """The compute stream waits for every collective issued so far."""


COLLECTIVES = (AllReduce, GatherLoss, Join)


def grad_buckets(layout, grad_ready) -> list[tuple[int, int, int, tuple]]:
    """``(k, start, count, names)`` per gradient-ready point: the float32 elements ``[start, start+count)``
    of the flat gradient buffer holding ``names`` (padding between them included), contiguous.

    ValueError when the points do not name every parameter exactly once, or a point's tensors are not
    contiguous in the flat layout (then one all-reduce could not cover them)."""
    seen: dict[str, int] = {}
    out = []
    for k, names in grad_ready:
        for n in names:
            if n in seen:
                raise ValueError(f"gradient {n} is marked ready twice")
            seen[n] = k
        spans = sorted(layout.param_offsets[n] for n in names)
        if not spans:
            continue
        order = [n for n in layout.param_offsets]
        first = order.index(min(names, key=lambda n: layout.param_offsets[n][0]))
        if set(order[first:first + len(names)]) != set(names):
            raise ValueError(f"the gradients ready together ({names[0]}...) are not contiguous in the layout")
        start, end = spans[0][0], spans[-1][0] + spans[-1][1]
        out.append((k, start, end - start, tuple(names)))
    missing = [n for n in layout.param_offsets if n not in seen]
    if missing:
        raise ValueError(f"no gradient-ready point for {', '.join(missing[:3])}"
                         + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    return out


def build_program(ops, layout, grads: DevPtr, optimizer: list, loss_t: DevPtr, send: int, recv: int,
                  stop_flag_host: int, recv_host: int, world_size: int) -> list:
    """The data-parallel step as a list of op lists and collectives (see the module docstring).

    ``grads``/``loss_t`` are the model's buffers, ``send`` ([R+1] f64) / ``recv`` ([world_size*(R+1)]
    f64) device buffers of the caller, ``stop_flag_host`` (1 f64) / ``recv_host`` (like ``recv``)
    pinned host buffers. Building it needs no GPU."""
    if layout.elems["grads"] != "f32":
        raise ValueError(f"gradients of element type {layout.elems['grads']}: the data-parallel step "
                         "reduces float32 gradients only")
    R = layout.B * layout.T
    head = flatten_ops(ops.stage_tokens + ops.stage_targets + ops.forward + ops.loss)
    head += [Copy(send, loss_t, 8 * R), CopyHtoD(send + 8 * R, stop_flag_host, 8)]
    program: list = [head, GatherLoss(send, recv, R + 1)]
    done = 0
    for k, start, count, names in grad_buckets(layout, ops.grad_ready):
        program.append(flatten_ops(ops.backward[done:k]))
        program.append(AllReduce(int(grads.offset(start)), count, names))
        done = k
    tail = flatten_ops(ops.backward[done:])
    if tail:
        raise ValueError(f"{len(tail)} backward ops after the last gradient-ready point")
    program.append(Join())
    program.append(flatten_ops(optimizer) + [CopyDtoH(recv_host, recv, 8 * world_size * (R + 1))])
    return [item for item in program if not (isinstance(item, list) and not item)]


class DistributedStep:
    """One rank's training step: forward, loss, backward with per-block gradient all-reduces, AdamW.

    Built on a :class:`rwkvx.model.Model` after ``configure_optimizer`` (the AdamW settings are the
    model's) and an :class:`~rwkvx.dist.nccl.NcclCommunicator`. :meth:`train_step` is the
    data-parallel counterpart of ``Model.train_step``; the ranks' stop requests travel with the loss."""

    def __init__(self, model, comm):
        from .._core import Plan
        if not hasattr(model, "schedule"):
            raise RuntimeError("DistributedStep: call model.configure_optimizer() first")
        if model.layout.trains != "params":     # its all-reduces cover the parameters' gradients only
            from ..training.trainer import TUNING_DATA_PARALLEL
            raise ValueError(f"DistributedStep: {TUNING_DATA_PARALLEL}")
        self.model, self.comm, self.dev = model, comm, model.dev
        L, b = model.layout, model.builder.buf
        self.R = model.B * model.T
        N = comm.world_size
        self._send = self.dev.alloc(8 * (self.R + 1))
        self._recv = self.dev.alloc(8 * N * (self.R + 1))
        self._flag = self.dev.alloc_pinned(8)
        self._gathered = self.dev.alloc_pinned(8 * N * (self.R + 1))
        self.program = build_program(
            model.ops, L, b("grads"), model.builder.optimizer(model.weight_decay, bool(model.grad_clip)),
            b("loss_t"), self._send.ptr, self._recv.ptr, self._flag.ptr, self._gathered.ptr, N)
        self._items = [Plan(self.dev, item) if isinstance(item, list) else item for item in self.program]
        self._graph = None
        self.stop_agreed = False

    def _run(self, optimizer: bool = True) -> None:
        comm = self.comm
        for item in self._items:
            if isinstance(item, AllReduce):
                comm.fork()
                comm.all_reduce_mean_f32(item.ptr, item.count)
            elif isinstance(item, GatherLoss):
                comm.fork()
                comm.all_gather_f64(item.send, item.recv, item.count)
            elif isinstance(item, Join):
                comm.join()
                if not optimizer:
                    return
            else:
                item.run()

    def train_step(self, tokens, targets, stop: bool = False, graph: bool = True) -> float:
        """Forward, loss, backward, all-reduce and AdamW on this rank's shard; returns the mean loss over
        all ranks. ``stop``: this rank asks to stop; afterwards ``stop_agreed`` says whether any rank
        did (the same on every rank)."""
        model = self.model
        model.stage_batch(tokens, targets)
        self._flag.array(np.float64, (1,))[0] = float(bool(stop))
        if not graph:
            self._run()
        else:
            if self._graph is None:
                from ..runtime import Graph
                self._run(optimizer=False)   # warm-up: modules, cuBLAS and NCCL connections ready
                self.comm.wait(self.dev)
                self._graph = Graph.capture(self.dev, self._run)
            self._graph.launch()
        self.comm.wait(self.dev)
        gathered = self._gathered.array(np.float64, (self.comm.world_size, self.R + 1))
        self.stop_agreed = bool(gathered[:, self.R].any())
        from .._core import sum_float64
        # every rank weighs the same: the mean of the ranks' mean losses (of the global batch when the
        # ranks have as many targets each, as every training batch), in the one-GPU summation order
        losses = np.ascontiguousarray(gathered[:, :self.R])
        return sum_float64(losses) * model.inv_count() / self.comm.world_size
