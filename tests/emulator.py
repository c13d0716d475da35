"""Runs GPU op lists on the CPU: device memory is numpy, each kernel launch is its oracle twin applied to
the buffers its arguments point at, GEMMs are column-major float64 products, copies are copies.

What this checks is the plumbing of a plan (which buffer each op reads and writes, offsets, strides,
sizes, element types, the order of ops), not the CUDA code: the kernels' own tests (tests/gpu) compare
them to the same twins. Buffers hold their element types: a bf16 buffer 2-byte values, rounded to nearest
on every store (a kernel's or a GEMM's output, computed in float64, is rounded once), so a bf16 step shows
the roundings of its stores and no others. :class:`Memory`'s exact mode takes those out too.
The kernels of the forward, of the decoder's step, of the device initialisation (GEMMs in fp32 or
fp64) and of the RWKV and MoBA blocks' backward are emulated,
the backward's for the input gradients they pass on: the parameters' gradients (the partial sums the
kernels leave for reduce_partials, the embedding's) are not computed; reduce_partials and
embedding_backward write NaN to them, so a result that reads them shows it. Kernels that compute part of
what one twin computes whole (the WKV7 backward's reduce, MoBA's selection, partial outputs and delta)
do nothing; MoBA's backward twin runs once per block, in moba_bwd_dq_own's launch, which leaves dk and dv
for moba_bwd_dkdv's. An unknown kernel raises.
"""
from __future__ import annotations

import numpy as np

import rwkvx.cu  # noqa: F401  (declares every kernel)
from rwkvx import oracle as O
from rwkvx.cu import init
from rwkvx.oracle import init as O_init
from rwkvx.runtime.dtypes import ELEM_BYTES, from_storage, storage_dtype, to_storage
from rwkvx.runtime.kernel import XTYPE_DEFINE, KernelFile
from rwkvx.runtime.ops import Copy, CopyDtoH, CopyHtoD, DevPtr, Gemm, Launch, Memset, flatten_ops


class Memory:
    """Address ranges backed by numpy byte arrays (device arenas and pinned host buffers alike).

    ``exact``: every 2-byte slot also has a float64 shadow, and a float (f32, bf16) element reads back
    the value last written to it, unrounded, for as long as its bytes are those that store wrote (after
    another store to them, the bytes as they are): the plan's data flow with the roundings of its stores
    taken out, so that a buffer read after another one overwrote it still shows."""

    def __init__(self, exact: bool = False):
        self.exact = exact
        self.regions: list[tuple[int, np.ndarray, np.ndarray | None]] = []
        # results a twin computed for a later launch that writes them (MoBA's dk, dv), by that launch
        self.pending: dict[tuple, tuple[np.ndarray, ...]] = {}

    def add(self, base: int, nbytes: int, buf: np.ndarray | None = None) -> np.ndarray:
        """A region of ``nbytes`` at ``base``: zeros, or the uint8 array ``buf`` (memory that exists elsewhere)."""
        buf = np.zeros(nbytes, np.uint8) if buf is None else buf
        self.regions.append((int(base), buf, np.zeros((nbytes + 1) // 2) if self.exact else None))
        return buf

    def remove(self, base: int) -> None:
        """Free the region added at ``base`` (a later access to it raises IndexError)."""
        self.regions[:] = [region for region in self.regions if region[0] != base]

    def _region(self, addr: int, nbytes: int) -> tuple[int, np.ndarray, np.ndarray | None]:
        for base, buf, shadow in self.regions:
            if base <= addr and addr + nbytes <= base + buf.size:
                return base, buf, shadow
        raise IndexError(f"no memory at 0x{addr:x} (+{nbytes})")

    def bytes(self, addr: int, nbytes: int) -> np.ndarray:
        base, buf, _ = self._region(addr, nbytes)
        return buf[addr - base:addr - base + nbytes]

    def _shadow(self, addr: int, nbytes: int, step: int = 1) -> np.ndarray | None:
        """The shadow slots of ``nbytes`` at ``addr``, every ``step``-th (an element's first), or None."""
        base, _, shadow = self._region(addr, nbytes)
        if shadow is None:
            return None
        start = (addr - base) // 2
        return shadow[start:start + (nbytes + 1) // 2:step]

    def _exact(self, addr: int, elem: str, count: int) -> np.ndarray | None:
        """The unrounded values of ``count`` float elements at ``addr`` (None: not exact, or not floats)."""
        if elem not in ("f32", "bf16"):
            return None
        return self._shadow(addr, count * ELEM_BYTES[elem], ELEM_BYTES[elem] // 2)

    def array(self, addr: int, elem: str, count: int) -> np.ndarray:
        """A writable view of the storage of ``count`` ``elem`` elements at ``addr`` (bf16: uint16 bits)."""
        return self.bytes(addr, count * ELEM_BYTES[elem]).view(storage_dtype(elem))

    def read(self, addr: int, count: int, shape=None, elem: str | None = None) -> np.ndarray:
        """``count`` elements at ``addr`` as float64 (int64 for i32); ``elem`` defaults to the element type
        of a :class:`~rwkvx.runtime.ops.DevPtr` ``addr``, else f32."""
        elem = elem or getattr(addr, "elem", "f32")
        stored = self.array(addr, elem, count)
        a = from_storage(elem, stored).astype(np.float64 if elem != "i32" else np.int64)
        exact = self._exact(addr, elem, count)
        if exact is not None:
            a = np.where(to_storage(elem, exact) == stored, exact, a)
        return a.reshape(shape) if shape is not None else a

    def write(self, addr: int, values, elem: str | None = None, index: np.ndarray | None = None) -> None:
        """Store ``values`` at ``addr`` as ``elem`` (default as in :meth:`read`), rounding to nearest as a
        kernel's store does; with ``index``, at those element positions from ``addr`` (a scatter)."""
        elem = elem or getattr(addr, "elem", "f32")
        values = np.asarray(values).ravel()
        at = slice(None) if index is None else np.ravel(index)
        count = values.size if index is None else int(at.max()) + 1
        self.array(addr, elem, count)[at] = to_storage(elem, values)
        exact = self._exact(addr, elem, count)
        if exact is not None:
            exact[at] = values

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """``nbytes`` from ``src`` to ``dst`` (and their exact values)."""
        self.bytes(dst, nbytes)[:] = self.bytes(src, nbytes).copy()
        if self.exact:
            self._shadow(dst, nbytes)[:] = self._shadow(src, nbytes).copy()

    def zero(self, addr: int, nbytes: int) -> None:
        """``nbytes`` at ``addr`` set to zero bytes (and zero values)."""
        self.bytes(addr, nbytes)[:] = 0
        if self.exact:
            self._shadow(addr, nbytes)[:] = 0


def write_tensors(mem: Memory, layout, base: int, tensors: dict[str, dict[str, np.ndarray]]) -> None:
    """Write name-keyed ``tensors`` into the flat regions of ``layout``'s arena at ``base`` ("params",
    "states", "lora": at the layout's offsets of that region, and into the region's bf16 GEMM copy where
    the layout has one, rounded to nearest as the model's upload does)."""
    regions = {"params": {"params": layout.region_offsets["params"], "params_x": layout.region_offsets["params_x"]},
               "states": {"states": layout.state_offsets},
               "lora": {"lora": layout.lora_offsets, "lora_x": layout.lora_offsets}}
    for source, values in tensors.items():
        for region, offsets in regions[source].items():
            if not layout.counts.get(region):
                continue
            elem = layout.elems[region]
            for n, (off, _) in offsets.items():
                mem.write(base + layout.offsets[region] + ELEM_BYTES[elem] * off, values[n], elem)


def arena_memory(layout, base: int, host: dict[str, int], tensors: dict[str, dict[str, np.ndarray]],
                 exact: bool = False) -> Memory:
    """Memory holding the arena of ``layout`` at ``base`` (zeros) and the pinned buffers ``host`` (name ->
    address), with ``tensors`` written as :func:`write_tensors` does. ``exact``: :class:`Memory`'s."""
    mem = Memory(exact)
    mem.add(base, layout.total)
    for name, ptr in host.items():
        mem.add(ptr, layout.nbytes(name))
    write_tensors(mem, layout, base, tensors)
    return mem


def _args(op: Launch) -> dict:
    """The arguments of launch ``op`` by name, pointers as :class:`~rwkvx.runtime.ops.DevPtr` of their
    declared element type (``floatX`` resolved by the launch's defines)."""
    kernel = KernelFile.registry[op.module].kernels[op.name]
    xtype = "bf16" if int(dict(op.defines).get(XTYPE_DEFINE, 0)) else "f32"
    return {name: DevPtr(value, xtype if decl.elem == "x" else decl.elem) if decl.kind == "ptr" else value
            for (name, decl), (_, value) in zip(kernel.params, op.args)}


def _head_size(op: Launch) -> int:
    return int(dict(op.defines)["HEAD_SIZE"])


def run_memory_op(mem: Memory, op) -> bool:
    """Execute ``op`` on ``mem`` when it is a copy or a memset; whether it was."""
    if isinstance(op, (Copy, CopyHtoD, CopyDtoH)):
        src = op.host_ptr if isinstance(op, CopyHtoD) else op.src
        dst = op.host_ptr if isinstance(op, CopyDtoH) else op.dst
        mem.copy(dst, src, op.nbytes)
    elif isinstance(op, Memset):
        mem.zero(op.ptr, op.nbytes)
    else:
        return False
    return True


def run(mem: Memory, ops) -> None:
    """Execute ``ops`` in order on ``mem``."""
    for op in flatten_ops(ops):
        if run_memory_op(mem, op):
            continue
        if isinstance(op, Gemm):
            _gemm(mem, op)
        elif isinstance(op, Launch):
            KERNELS[op.name](mem, _args(op), op)
        else:
            raise TypeError(f"cannot emulate {op!r}")


def _rowmajor(mem, ptr, rows, cols, ld, elem="f64"):
    """A writable [rows, cols] view of the storage of a row-major matrix (or a block of one) with leading
    dimension ``ld``."""
    size = ELEM_BYTES[elem]
    flat = mem.array(ptr, elem, ld * (rows - 1) + cols)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (size * ld, size))


def _gemm(mem, g: Gemm) -> None:
    """D = alpha op(A) op(B) + beta C in float64 from the operands as stored (a bf16 GEMM's products are
    exact in its fp32 accumulation; TF32's operand rounding is not emulated), rounded once to D's type."""
    p = g.precision

    def at(rows, cols, ld, trans=False):         # element positions of op(M) [rows, cols], M column-major
        return np.add.outer(np.arange(rows) * (ld if trans else 1), np.arange(cols) * (1 if trans else ld))

    def operand(ptr, rows, cols, ld, elem, trans=False):
        index = at(rows, cols, ld, trans)
        return mem.read(ptr, int(index.max()) + 1, elem=elem)[index]

    out = g.alpha * (operand(g.A, g.m, g.k, g.lda, p.a, g.transa) @ operand(g.B, g.k, g.n, g.ldb, p.b, g.transb))
    if g.beta:
        out += g.beta * operand(g.C, g.m, g.n, g.ldc, p.c)
    mem.write(g.D, out, p.c, at(g.m, g.n, g.ldc))


# ---------------------------------------------------------------- kernels, by name

def _embedding_forward(mem, a, op):
    R, C, V = a["R"], a["C"], a["V"]
    tok = mem.read(a["tok"], R, elem="i32")
    mem.write(a["x"], mem.read(a["emb"], V * C, (V, C))[tok])


def _ln_forward(mem, a, op):
    R, C = a["R"], a["C"]
    x = mem.read(a["x"], R * C, (R, C))
    if a["y"]:
        mem.write(a["y"], O.layernorm_forward(x, mem.read(a["w"], C), mem.read(a["b"], C), a["eps"]))


def _ln_shift_fwd(mem, a, op):
    R, C, T = a["R"], a["C"], a["T"]
    n = int(dict(op.defines)["LNS_M"])
    h, mean, rstd = O.layernorm_forward(mem.read(a["x"], R * C, (R, C)), mem.read(a["w"], C), mem.read(a["b"], C),
                                        a["eps"], return_stats=True)
    for name, v in (("h", h), ("mean_out", mean), ("rstd_out", rstd)):
        if a[name]:
            mem.write(a[name], v)
    mixes = np.stack([mem.read(a[f"m{j}"], C) for j in range(n)])
    outs = O.time_shift_forward(h, mixes, T) if n == 6 else [O.channel_mix_shift_forward(h, mixes[0], T)]
    for j in range(n):
        mem.write(a[f"o{j}"], outs[j])


def _elementwise(fn):
    def kernel(mem, a, op):
        mem.write(a["out"], fn(mem.read(a["a"], a["n"])))
    return kernel


def _elementwise_backward(fn):
    def kernel(mem, a, op):
        mem.write(a["out"], fn(mem.read(a["a"], a["n"]), mem.read(a["b"], a["n"])))
    return kernel


def _tm_prep_fwd(mem, a, op):
    R, C, N, layer = a["R"], a["C"], _head_size(op), a["layer"]
    rows = lambda name: mem.read(a[name], R * C, (R, C))          # noqa: E731
    vec = lambda name: mem.read(a[name], C)                       # noqa: E731
    out = O.time_mix_prep_forward(rows("k"), rows("v"), rows("wl"), rows("al"), rows("vl") if layer else None,
                                  rows("vf") if layer else None, vec("w0"), vec("a0"),
                                  vec("v0") if layer else None, vec("k_k"), vec("k_a"), N, layer)
    for name in ("decay", "kp", "wa", "wb"):
        mem.write(a[name], out[name])
    if layer:
        mem.write(a["vp"], out["vp"])
    else:
        mem.write(a["vf"], out["v_first"])


def _bthn(mem, ptr, B, T, H, N):
    return mem.read(ptr, B * T * H * N, (B, T, H, N))


def _wkv7_forward(mem, a, op):
    N, H, T = _head_size(op), a["H"], a["T"]
    B = op.grid[2]
    x = [_bthn(mem, a[n], B, T, H, N) for n in "rwkvab"]
    s0 = mem.read(a["s_init"], H * N * N, (1, H, N, N)) if a["s_init"] else None    # the shared initial state
    mem.write(a["y"], O.wkv7_forward(*x, state=s0))
    if a["ckpt"]:                    # the state after the last token of each chunk of CHUNK tokens
        from rwkvx.cu.wkv7 import CHUNK, n_chunks
        nC = n_chunks(T)
        ck = np.zeros((B, H, nC, N, N))
        for c in range(nC):
            end = min((c + 1) * CHUNK, T)
            ck[:, :, c] = O.wkv7_forward(*(t[:, :end] for t in x), state=s0, return_state=True)[1]
        mem.write(a["ckpt"], ck)


def _tm_gn_fwd(mem, a, op):
    R, C, N = a["R"], a["C"], _head_size(op)
    rows = [mem.read(a[n], R * C, (R, C)) for n in ("y", "r", "kp", "vp", "g")]
    mem.write(a["z"], O.time_mix_gn_forward(*rows, mem.read(a["lnw"], C), mem.read(a["lnb"], C),
                                            mem.read(a["rk"], C), N))


def _cm_relu_sq_forward(mem, a, op):
    mem.write(a["k"], O.relu_sq_forward(mem.read(a["h"], a["n"])))


def _cross_entropy_loss(mem, a, op):
    R, V = a["R"], a["V"]
    loss, dlogits = O.cross_entropy_rows(mem.read(a["logits"], R * V, (R, V)), mem.read(a["targets"], R, elem="i32"),
                                         a["ignore_index"])
    mem.write(a["loss"], loss, "f64")
    if a["dlogits"]:
        mem.write(a["dlogits"], dlogits * mem.read(a["inv_count"], 1, elem="f64")[0])


def _write_or_add(mem, ptr, values, accumulate) -> None:
    mem.write(ptr, values + (mem.read(ptr, values.size, values.shape) if accumulate else 0))


def _layernorm_dx(mem, a, x, dy) -> None:
    """The LayerNorm backward's dx of x [R, C] for dy: written or added to (``accumulate``), and its copy."""
    R, C = a["R"], a["C"]
    _write_or_add(mem, a["dx"], O.layernorm_backward(x, mem.read(a["w"], C), dy)[0], a["accumulate"])
    if a["dx_copy"]:                    # the bf16 GEMM operand of the fp32 result
        mem.write(a["dx_copy"], mem.read(a["dx"], R * C))


def _ln_backward_dx(mem, a, op):
    R, C = a["R"], a["C"]
    _layernorm_dx(mem, a, mem.read(a["x"], R * C, (R, C)), mem.read(a["dy"], R * C, (R, C)))


def _ln_shift_bwd(mem, a, op):
    R, C, T = a["R"], a["C"], a["T"]
    n = int(dict(op.defines)["LNS_M"])
    x = mem.read(a["x"], R * C, (R, C))
    h = O.layernorm_forward(x, mem.read(a["w"], C), mem.read(a["b"], C))
    mixes = np.stack([mem.read(a[f"m{j}"], C) for j in range(n)])
    douts = np.stack([mem.read(a[f"d{j}"], R * C, (R, C)) for j in range(n)])
    dh = (O.time_shift_backward(h, mixes, douts, T) if n == 6
          else O.channel_mix_shift_backward(douts[0], h, mixes[0], T))[0]
    _layernorm_dx(mem, a, x, dh)


def _cm_relu_sq_backward(mem, a, op):
    src = mem.read(a["src"], a["n"])
    h = np.sqrt(src) if a["src_is_k"] else src            # k = relu(h)^2: relu(h) = sqrt(k)
    mem.write(a["dh"], O.relu_sq_backward(mem.read(a["dk"], a["n"]), h))


def _parameter_partials(mem, a, op):
    """A kernel's parameter-gradient partial sums: not computed (reduce_partials' twin writes NaN)."""


def _reduce_partials(mem, a, op):
    for j in range(a["nout"]):
        mem.write(a[f"o{j}"], np.full(a["C"], np.nan))


def _embedding_backward(mem, a, op):
    mem.write(a["demb"], np.full(a["V"] * a["C"], np.nan))


def _tm_gn_bwd(mem, a, op):
    R, C, N = a["R"], a["C"], _head_size(op)
    rows = [mem.read(a[n], R * C, (R, C)) for n in ("y", "r", "kp", "vp", "g")]
    g = O.time_mix_gn_backward(*rows, mem.read(a["lnw"], C), mem.read(a["lnb"], C), mem.read(a["rk"], C), N,
                               mem.read(a["dz"], R * C, (R, C)))
    for out, name in (("dy", "dy"), ("dg", "dg"), ("dr2", "dr"), ("dkp2", "dkp"), ("dvp2", "dvp")):
        mem.write(a[out], g[name])


def _done_by_another_twin(mem, a, op):
    """A part of what another kernel's twin computes whole (the parts' intermediates are not emulated)."""


def _wkv7_backward(mem, a, op):
    """The gradients whole: the twin of the row-split kernel and its reduce (wkv7_backward_reduce) at once."""
    N, H, T = _head_size(op), a["H"], a["T"]
    B = op.grid[2]
    if a["s_init"] or a["ds_part"]:
        raise NotImplementedError("emulated WKV7 backwards start from zero states")
    x = [_bthn(mem, a[n], B, T, H, N) for n in "rwkvab"]
    for name, grad in zip(("dr", "dw", "dk", "dv", "da", "db"), O.wkv7_backward(*x, _bthn(mem, a["dy"], B, T, H, N))):
        mem.write(a[name], grad)


def _tm_prep_bwd(mem, a, op):
    R, C, N, layer = a["R"], a["C"], _head_size(op), a["layer"]
    rows = lambda name: mem.read(a[name], R * C, (R, C)) if a[name] else 0.0      # noqa: E731
    vec = lambda name: mem.read(a[name], C)                                       # noqa: E731
    g = O.time_mix_prep_backward(rows("k"), rows("v"), rows("wl"), rows("al"), rows("vl") if layer else None,
                                 rows("vf") if layer else None, vec("w0"), vec("a0"), vec("v0") if layer else None,
                                 vec("k_k"), vec("k_a"), N, layer, rows("dd"), rows("dkp") + rows("dkp2"),
                                 rows("dvp") + rows("dvp2"), rows("dwa"), rows("dwb"),
                                 dvf_in=None if layer or not a["dvf"] else rows("dvf"))
    dr_out = rows("dr") + rows("dr2")
    for name in ("dk", "dv", "dwl", "dal") + (("dvl",) if layer else ()):
        mem.write(a[name], g[name])
    if a["dr2"]:
        mem.write(a["dr_out"], dr_out)
    if layer:
        _write_or_add(mem, a["dvf"], g["dvf"], a["vf_acc"])


def _moba_kmean(mem, a, op):
    T, H, chunk, N, B = a["T"], a["H"], a["chunk"], _head_size(op), op.grid[2]
    mem.write(a["kmean"], O.moba_block_means(_bthn(mem, a["k"], B, T, H, N), chunk))


def _moba_fwd_own(mem, a, op):
    # the whole attention, selection included, from q, k, v (the other forward kernels are its parts);
    # K1 is 0 here also when no query has a past block: own blocks only, as with top_k = 1
    T, H, chunk, N, B = a["T"], a["H"], a["chunk"], _head_size(op), op.grid[2]
    qkv = (_bthn(mem, a[n], B, T, H, N) for n in "qkv")
    o = O.moba_attention_forward(*qkv, chunk, a["K1"] + 1)[0]
    mem.write(a["o"], o)
    if a["olo"]:                    # bf16: the rounding residual of o
        mem.write(a["olo"], o - mem.read(a["o"], o.size, o.shape))


_MOBA_BWD_IN = ("q", "k", "v", "dout")


def _moba_dkdv_key(a) -> tuple:
    """Where moba_bwd_dq_own's twin leaves dk, dv for the moba_bwd_dkdv launch on the same inputs."""
    return ("moba_bwd_dkdv", *(int(a[n]) for n in _MOBA_BWD_IN))


def _moba_bwd_dq_own(mem, a, op):
    # the whole backward from q, k, v and dout, the selection recomputed as _moba_fwd_own does (lse, delta
    # and the partial sums, the other backward kernels' work, unused): dq now, dk and dv for moba_bwd_dkdv,
    # the launch after this one, whose arguments alone point at their buffers
    T, H, chunk, N, B = a["T"], a["H"], a["chunk"], _head_size(op), op.grid[2]
    dq, dk, dv = O.moba_attention_backward(*(_bthn(mem, a[n], B, T, H, N) for n in _MOBA_BWD_IN), chunk,
                                           a["K1"] + 1, None)
    mem.write(a["dq"], dq)
    mem.pending[_moba_dkdv_key(a)] = dk, dv


def _moba_bwd_dkdv(mem, a, op):
    key = _moba_dkdv_key(a)
    if key not in mem.pending:
        raise RuntimeError("moba_bwd_dkdv: no moba_bwd_dq_own launch on the same q, k, v, dout before it "
                           "(its twin computes dk and dv)")
    dk, dv = mem.pending.pop(key)
    mem.write(a["dk"], dk)
    mem.write(a["dv"], dv)


def _dec_shift(mem, a, op):
    B, C, n = a["B"], a["C"], a["nmix"]
    mixes = np.stack([mem.read(a[f"m{j}"], C) for j in range(n)])
    outs, prev = O.decode_shift(mem.read(a["x"], B * C, (B, C)), mem.read(a["prev"], B * C, (B, C)), mixes)
    for j in range(n):
        mem.write(a[f"o{j}"], outs[j])
    mem.write(a["prev"], prev)


def _dec_ln_shift(mem, a, op):
    B, C, n = op.grid[0], a["C"], a["nmix"]
    x = mem.read(a["x"], B * C, (B, C))
    y, mean, rstd = O.layernorm_forward(x, mem.read(a["w"], C), mem.read(a["b"], C), a["eps"], return_stats=True)
    for name, v in (("mean_out", mean), ("rstd_out", rstd)):
        if a[name]:
            mem.write(a[name], v)
    mixes = np.stack([mem.read(a[f"m{j}"], C) for j in range(n)])
    outs, prev = O.decode_shift(y, mem.read(a["prev"], B * C, (B, C)), mixes)
    for j in range(n):
        mem.write(a[f"o{j}"], outs[j])
    mem.write(a["y"], y)
    mem.write(a["prev"], prev)


def _dec_wkv7(mem, a, op):
    N, H, B = _head_size(op), a["H"], op.grid[1]
    x = [mem.read(a[n], B * H * N, (B, H, N)) for n in "rwkvab"]
    y, state = O.decode_wkv7(*x, mem.read(a["state"], B * H * N * N, (B, H, N, N)))
    mem.write(a["y"], y)
    mem.write(a["state"], state)


def _dec_tmix(mem, a, op):
    from rwkvx.cu.decode import LORA2
    N, H, B = _head_size(op), a["H"], op.grid[1]
    C = H * N
    ranks = {p: a[f"d{p}"] for p in LORA2 if a[f"h{p}"]}
    hidden = {p: mem.read(a[f"h{p}"], B * d, (B, d)) for p, d in ranks.items()}
    second = {p: mem.read(a[f"{p}2"], d * C, (d, C)) for p, d in ranks.items()}
    rows = {n: mem.read(a[n], B * C, (B, C)) for n in ("r", "k", "v", "vf")}
    vec = {n: mem.read(a[n], C) if a[n] else None for n in ("w0", "a0", "v0", "k_k", "k_a", "lnw", "lnb", "rk")}
    z, state, v_first = O.decode_time_mix(
        hidden, second, rows["r"], rows["k"], rows["v"], rows["vf"], vec["w0"], vec["a0"], vec["v0"], vec["k_k"],
        vec["k_a"], mem.read(a["state"], B * H * N * N, (B, H, N, N)), vec["lnw"], vec["lnb"], vec["rk"], N)
    mem.write(a["z"], z)
    mem.write(a["state"], state)
    mem.write(a["vf"], v_first)


def _dec_moba(mem, a, op):
    N, H, B, Tmax, chunk, K1, maxblk = (_head_size(op), a["H"], op.grid[1], a["Tmax"], a["chunk"], a["K1"],
                                        a["maxblk"])
    pos = mem.read(a["pos"], B, elem="i32")
    q, k, v = (mem.read(a[n], B * H * N, (B, H, N)) for n in "qkv")
    kc, vc = (_bthn(mem, a[n], B, Tmax, H, N) for n in ("kc", "vc"))
    kmean = mem.read(a["kmean"], B * H * maxblk * N, (B, H, maxblk, N)) if a["kmean"] else np.zeros((B, H, 0, N))
    o = np.zeros((B, H, N))
    sel = np.zeros((B, H, K1), np.int64)
    for b, t in enumerate(int(p) for p in pos):      # each sequence at its own position: the twin row by row
        row = slice(b, b + 1)
        o[row], sel[row], kc2, vc2, km2 = O.decode_moba(q[row], k[row], v[row], kc[row], vc[row], kmean[row], t,
                                                       chunk, K1 + 1)
        kc[row, :t + 1], vc[row, :t + 1] = kc2, vc2
        kmean[row, :, :km2.shape[2]] = km2
    mem.write(a["o"], o)
    mem.write(a["kc"], kc)
    mem.write(a["vc"], vc)
    if a["kmean"]:
        mem.write(a["kmean"], kmean)
    if a["sel_out"]:
        mem.write(a["sel_out"], sel, "i32")


def _dec_gemv(mem, a, op):
    from rwkvx.cu.decode import GEMV_EPILOGUES, GEMV_JOBS, GEMV_KN
    B = a["B"]
    epilogue = {code: name for name, code in GEMV_EPILOGUES.items()}
    for j in range(GEMV_JOBS):
        n, k, mode = a[f"n{j}"], a[f"k{j}"], a[f"mode{j}"]
        if not n:
            continue
        x, w = mem.read(a[f"x{j}"], B * k, (B, k)), mem.read(a[f"w{j}"], n * k)
        kn = bool(mode & GEMV_KN)
        out = O.decode_gemv(x, w.reshape((k, n) if kn else (n, k)), kn, epilogue[mode & (GEMV_KN - 1)])
        if a[f"r{j}"]:
            mem.write(a[f"r{j}"], mem.read(a[f"a{j}"], B * n, (B, n)) + out)
        else:
            mem.write(a[f"y{j}"], out)


def _dec_sample(mem, a, op):
    from rwkvx.cu.decode import SAMPLE_CLUSTER
    B, V = op.grid[0] // SAMPLE_CLUSTER, a["V"]
    logits = mem.read(a["logits"], B * V, (B, V)).astype(np.float32)
    mem.write(a["out"], O.decode_sample(logits, mem.read(a["u"], B, elem="f64"), mem.read(a["opts"], 3, elem="f64")),
              "i32")


def _init_normal(mem, a, op):
    mem.write(a["out"], O_init.normal(a["count"], {k: a[k] for k in init.KEY_ARGS}), "f64")


def _init_uniform(mem, a, op):
    keys = {k: a[k] for k in init.KEY_ARGS}
    mem.write(a["out"], O_init.uniform(a["count"], keys, a["lo"], a["width"]), "f32")


def _chol_diag(mem, a, op):
    info, j0, jb, ld = mem.array(a["info"], "i32", 1), a["j0"], a["jb"], a["ld"]
    if info[0]:
        return
    block = _rowmajor(mem, a["g"] + 8 * (j0 * ld + j0), jb, jb, ld)
    factor, failed = O_init.chol_block(block)
    if failed >= 0:
        info[0] = j0 + failed + 1
        return
    lower = np.tril_indices(jb)
    block[lower] = factor[lower]


def _trsm_rows(mem, a, op):
    b = _rowmajor(mem, a["b"], a["rows"], a["jb"], a["ldb"])
    with np.errstate(divide="ignore", invalid="ignore"):     # after a failed chol_diag L may hold zeros
        b[...] = O_init.solve_rows(b, _rowmajor(mem, a["l"], a["jb"], a["jb"], a["ldl"]))


def _gram_deviation(mem, a, op):
    out = mem.array(a["out"], "f64", 1)
    out[0] = max(out[0], np.abs(_rowmajor(mem, a["g"], a["n"], a["n"], a["n"]) - np.eye(a["n"])).max())


def _store_f32(mem, a, op):
    q = a["gain"] * _rowmajor(mem, a["a"], a["m"], a["n"], a["n"])
    mem.write(a["out"], (q.T if a["transpose"] else q).astype(np.float32))


KERNELS = {
    "embedding_forward": _embedding_forward, "ln_forward": _ln_forward, "ln_shift_fwd": _ln_shift_fwd,
    "tm_tanh_fwd": _elementwise(np.tanh), "tm_sigmoid_fwd": _elementwise(lambda x: 1 / (1 + np.exp(-x))),
    "tm_prep_fwd": _tm_prep_fwd, "wkv7_forward": _wkv7_forward, "tm_gn_fwd": _tm_gn_fwd,
    "cm_relu_sq_forward": _cm_relu_sq_forward, "moba_kmean": _moba_kmean,
    "moba_select": _done_by_another_twin, "moba_scan": _done_by_another_twin, "moba_fill": _done_by_another_twin,
    "moba_fwd_past": _done_by_another_twin, "moba_fwd_own": _moba_fwd_own, "moba_bwd_delta": _done_by_another_twin,
    "moba_bwd_dq_past": _done_by_another_twin, "moba_bwd_dq_own": _moba_bwd_dq_own, "moba_bwd_dkdv": _moba_bwd_dkdv,
    "dec_shift": _dec_shift, "dec_wkv7": _dec_wkv7, "dec_moba": _dec_moba, "dec_sample": _dec_sample,
    "dec_gemv": _dec_gemv, "dec_ln_shift": _dec_ln_shift, "dec_tmix": _dec_tmix,
    "cross_entropy_loss": _cross_entropy_loss, "ln_backward_dx": _ln_backward_dx,
    "ln_backward_dwdb": _parameter_partials, "reduce_partials": _reduce_partials,
    "cm_relu_sq_backward": _cm_relu_sq_backward, "ln_shift_bwd": _ln_shift_bwd, "tm_gn_bwd": _tm_gn_bwd,
    "wkv7_backward": _wkv7_backward, "wkv7_backward_reduce": _done_by_another_twin, "tm_prep_bwd": _tm_prep_bwd,
    "tm_tanh_bwd": _elementwise_backward(O.tanh_backward), "tm_sigmoid_bwd": _elementwise_backward(O.sigmoid_backward),
    "embedding_backward": _embedding_backward,
    "init_normal": _init_normal, "init_uniform": _init_uniform, "chol_diag": _chol_diag, "trsm_rows": _trsm_rows,
    "gram_deviation": _gram_deviation, "store_f32": _store_f32,
}
KERNELS.update({name + "_mma": KERNELS[name] for name in ("moba_fwd_past", "moba_fwd_own", "moba_bwd_dq_past",
                                                           "moba_bwd_dq_own", "moba_bwd_dkdv")})
