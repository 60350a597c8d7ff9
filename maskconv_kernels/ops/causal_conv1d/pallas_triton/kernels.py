"""The fused Pallas kernels of ``causal_conv1d(implementation="pallas_triton")``, lowered through Triton.

A depthwise causal 1-D convolution of width 2 to 8 does a handful of multiply-adds per
element it reads: it is memory bound, and what matters is that every element crosses
HBM once. Two kernels do all of it, on channels-last ``(B, L, D)`` arrays:

* ``causal_conv1d_fwd``: one ``[block_positions, block_channels]`` tile of ``y`` per
  program: the taps (each a load of the tile shifted back by ``(W-1-t) * dilation``
  positions, so the tile's ``(W-1) * dilation`` halo comes from the cache), bias, SiLU
  and the padding select, one rounding to x's dtype;
* ``causal_conv1d_bwd``: per channel block, a fixed range of position tiles walked in
  order: the pre-activation recomputed (no residual but the inputs), dSiLU, the input
  gradient ``dx[q] = sum_t w[t] * dpre[q + (W-1-t) * dilation]`` (the transposed taps,
  seen from the reading side), and the weight and bias gradients summed into float32
  registers; each program writes its partial sums, added afterwards in a fixed order
  (:func:`sum_in_order`). No atomics: the same bits run to run;
* ``causal_conv1d_bwd_state``: the initial state's gradient, the input gradient at the
  ``(W-1) * dilation`` positions before 0 (a small kernel: one program per row and
  channel block).

Segment selects are the library's (as the ``xla`` backend's depthwise maps): tap ``t`` of
output ``p`` reads input ``q = p - (W-1-t) * dilation`` only where ``ids[q] == ids[p] >=
0``; the initial state belongs to the row's first document. Positions outside the row
(and the state) are masked-off lanes of a load, never dereferenced; within it, each term
of a sum (a tap's product, a cotangent's contribution) is kept or dropped by a ``where``
select, never multiplied by a 0/1 mask: a NaN in one document changes no other's
output, and the gradient across documents is exactly 0.0.

Why Triton and not Mosaic GPU is a design note of the documentation. The kernels run
inside the op's primitives (:mod:`maskconv_kernels._core.fused`), which filter the lowering's deprecation warning while
they are lowered, and give them derivatives of every order.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...._core.tiling import cdiv, round_up, sum_in_order
from .config import Config

__all__ = ["Static", "KERNELS", "DTYPES", "forward", "backward"]

KERNELS = ("causal_conv1d_fwd", "causal_conv1d_bwd", "causal_conv1d_bwd_state")
DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything a kernel is specialised on but the shapes (hashable: a primitive parameter)."""

    width: int
    dilation: int
    silu: bool
    has_bias: bool
    has_ids: bool
    has_state: bool
    blocks: Config
    interpret: bool

    @property
    def halo(self) -> int:
        return (self.width - 1) * self.dilation

    def back(self, t: int) -> int:
        """How far before an output its tap ``t`` reads."""
        return (self.width - 1 - t) * self.dilation

    def operand_names(self, *extra: str) -> tuple[str, ...]:
        optional = (("bias", self.has_bias), ("ids", self.has_ids), ("state", self.has_state))
        return ("x", "w", *(name for name, present in optional if present), *extra)


# --------------------------------------------------------------------------- loads and selects


def _gather(ref, index, c, mask):
    """A ``[n, channels]`` tile of ``ref[index..., c]``: 0 where ``mask`` is False (never read).

    ``index``: the leading indices, scalars or ``[n]`` vectors in range; ``c``: ``c0 +
    arange`` (Triton vectorises a load only from that form).
    """
    shape = mask.shape
    idx = tuple(i if jnp.ndim(i) == 0 else jnp.broadcast_to(i[:, None], shape) for i in index)
    return plgpu.load(ref.at[(*idx, jnp.broadcast_to(c[None, :], shape))], mask=mask, other=0)


class _Tile:
    """Positions ``p + k`` of one row ``b`` and channel block ``c``, for static offsets ``k``.

    ``p``: the tile's ``[n]`` int32 positions. A position ``q < 0`` is the initial
    state's ``q + S`` (it exists only with a state), ``q >= L`` nothing. Each offset's
    inputs, ids and cotangents are loaded once (the backward reads x at ``2W - 1``
    offsets, not ``W^2``) under a bounds mask, and every term is kept or dropped by a
    ``where`` select on the segment ids: a value of another document is loaded, but
    its terms are selected away, so it changes no output and gets no gradient.
    """

    def __init__(self, s: Static, refs: dict, b, p, c, c_ok, length: int):
        self.s, self.refs, self.b, self.p, self.c, self.c_ok, self.length = s, refs, b, p, c, c_ok, length
        self._x, self._dy, self._doc = {}, {}, {}

    def _clamp(self, q):
        return jnp.clip(q, 0, self.length - 1)

    def doc(self, k: int):
        """Segment ids at ``p + k``; before position 0, the first position's (the state's document)."""
        if k not in self._doc:
            self._doc[k] = plgpu.load(self.refs["ids"].at[self.b, self._clamp(self.p + k)])
        return self._doc[k]

    def exists(self, k: int):
        """An input at ``p + k``: in the row, or in the initial state before it."""
        q = self.p + k
        return (q >= (-self.s.halo if self.s.has_state else 0)) & (q < self.length)

    def live(self, k: int):
        """Outputs at ``p + k`` that exist and are not padding (padding outputs are zero constants)."""
        q = self.p + k
        ok = (q >= 0) & (q < self.length)
        return ok & (self.doc(k) >= 0) if self.s.has_ids else ok

    def reads(self, k_out: int, k_in: int):
        """Whether output ``p + k_out`` reads input ``p + k_in``: both exist, one document, no padding."""
        ok = self.live(k_out) & self.exists(k_in)
        return ok & (self.doc(k_in) == self.doc(k_out)) if self.s.has_ids else ok

    def x(self, k: int):
        """float32 ``[n, channels]`` inputs at ``p + k`` (0 where none exists)."""
        if k not in self._x:
            q = self.p + k
            mask = self.exists(k)[:, None] & self.c_ok[None, :]
            value = _gather(self.refs["x"], (self.b, self._clamp(q)), self.c, mask & (q >= 0)[:, None])
            if self.s.has_state:
                halo = self.s.halo
                from_state = _gather(self.refs["state"], (self.b, jnp.clip(q + halo, 0, halo - 1)), self.c,
                                     mask & (q < 0)[:, None])
                value = jnp.where((q < 0)[:, None], from_state, value)
            self._x[k] = value.astype(jnp.float32)
        return self._x[k]

    def pre(self, k: int, w, bias):
        """The pre-activation at outputs ``p + k``: ``bias + sum_t w[t] * x[p + k - back(t)]`` over the taps read."""
        acc = jnp.zeros((self.p.shape[0], self.c.shape[0]), jnp.float32)
        for t in range(self.s.width):
            k_in = k - self.s.back(t)
            acc = acc + jnp.where(self.reads(k, k_in)[:, None], w[t][None, :] * self.x(k_in), 0.0)
        return acc if bias is None else acc + bias[None, :]

    def dpre(self, k: int, w, bias):
        """The cotangent of the pre-activation at outputs ``p + k`` (dSiLU at the recomputed
        pre-activation), 0 past the row and at padding."""
        if k not in self._dy:
            q = self.p + k
            inside = (q >= 0) & (q < self.length)
            g = _gather(self.refs["dy"], (self.b, self._clamp(q)), self.c, inside[:, None] & self.c_ok[None, :])
            g = g.astype(jnp.float32)
            if self.s.silu:
                z = self.pre(k, w, bias)
                sig = jax.nn.sigmoid(z)
                g = g * (sig * (1 + z * (1 - sig)))
            self._dy[k] = jnp.where(self.live(k)[:, None], g, 0.0)
        return self._dy[k]

    def input_grad(self, w, bias):
        """``dx[p] = sum_t w[t] * dpre[p + back(t)]``, seen from the reading side: over the outputs that read ``p``."""
        acc = jnp.zeros((self.p.shape[0], self.c.shape[0]), jnp.float32)
        for t in range(self.s.width):
            k_out = self.s.back(t)
            acc = acc + jnp.where(self.reads(k_out, 0)[:, None], w[t][None, :] * self.dpre(k_out, w, bias), 0.0)
        return acc


def _vectors(s: Static, refs: dict, c):
    """The taps ``w[t, c]`` and the bias ``b[c]``, float32 ``[channels]`` each (0 past D)."""
    c_ok = c < refs["x"].shape[-1]
    w = [plgpu.load(refs["w"].at[t, c], mask=c_ok, other=0).astype(jnp.float32) for t in range(s.width)]
    bias = plgpu.load(refs["bias"].at[c], mask=c_ok, other=0).astype(jnp.float32) if s.has_bias else None
    return w, bias


def _store(ref, b, start, c0, value, mask):
    """``ref[b, start:start + n, c0:c0 + channels] = value`` where ``mask``.

    Slices, not gathers: the interpreter writes a masked slice as a read-select-write
    of the slice (padded past the end), where a gather's clamped duplicate indices
    would write back the stale value of a masked-off lane over a stored one.
    """
    n, channels = value.shape
    plgpu.store(ref.at[b, pl.ds(start, n), pl.ds(c0, channels)], value.astype(ref.dtype), mask=mask)


def _refs(names, refs) -> dict:
    return dict(zip(names, refs))


# --------------------------------------------------------------------------- kernels


def _forward_kernel(*refs, s: Static, tiles: int):
    """One ``[block_positions, block_channels]`` tile of ``y = act(pre) where ids >= 0``.

    Operands (:meth:`Static.operand_names`): x ``[B, L, D]``, w ``[W, D]``, bias ``[D]``,
    ids ``[B, L]`` int32, state ``[B, S, D]``; y ``[B, L, D]``, all whole arrays.
    Program ``(j, k)``: row ``j // tiles``, position tile ``j % tiles``, channel block ``k``.
    """
    r = _refs(s.operand_names("y"), refs)
    bl, bd, _ = s.blocks.tile(backward=False)
    length = r["x"].shape[1]
    j = pl.program_id(0)
    b, l0, c0 = j // tiles, (j % tiles) * bl, pl.program_id(1) * bd
    p = l0 + jnp.arange(bl, dtype=jnp.int32)
    c = c0 + jnp.arange(bd, dtype=jnp.int32)
    c_ok = c < r["x"].shape[-1]
    tile = _Tile(s, r, b, p, c, c_ok, length)
    w, bias = _vectors(s, r, c)
    z = tile.pre(0, w, bias)
    y = z * jax.nn.sigmoid(z) if s.silu else z
    y = jnp.where(tile.live(0)[:, None], y, 0.0)  # padding outputs are zeros, bias and activation included
    _store(r["y"], b, l0, c0, y, (p < length)[:, None] & c_ok[None, :])


def _backward_kernel(*refs, s: Static, tiles: int, trips: int):
    """The input gradient of a channel block over ``trips`` position tiles, and their weight
    and bias gradients summed in order.

    Operands: as :func:`_forward_kernel`, then dy ``[B, L, D]``; outputs dx ``[B, L, D]``,
    dw ``[splits, W, D]`` and db ``[splits, D]`` float32 partial sums. Program ``(k,
    split)`` walks tiles ``split * trips ...`` of the ``B * tiles`` (row-major), a
    channel block ``k``.
    """
    r = _refs(s.operand_names("dy", "dx", "dw", "db"), refs)
    bl, bd, _ = s.blocks.tile(backward=True)
    batch, length = r["x"].shape[:2]
    split, c0 = pl.program_id(1), pl.program_id(0) * bd
    c = c0 + jnp.arange(bd, dtype=jnp.int32)
    c_ok = c < r["x"].shape[-1]
    w, bias = _vectors(s, r, c)

    def step(i, carry):
        dw, db = carry
        j = split * trips + i
        b = jnp.minimum(j, batch * tiles - 1) // tiles
        # A tile past the last one (the last split's rest) is moved past the row: nothing
        # reads, nothing is stored, nothing is added.
        l0 = jnp.where(j < batch * tiles, (j % tiles) * bl, length)
        p = l0 + jnp.arange(bl, dtype=jnp.int32)
        tile = _Tile(s, r, b, p, c, c_ok, length)
        _store(r["dx"], b, l0, c0, tile.input_grad(w, bias), (p < length)[:, None] & c_ok[None, :])
        dpre = tile.dpre(0, w, bias)
        new_dw = [
            dw[t] + jnp.sum(jnp.where(tile.reads(0, -s.back(t))[:, None], tile.x(-s.back(t)) * dpre, 0.0), axis=0)
            for t in range(s.width)
        ]
        return tuple(new_dw), db + jnp.sum(dpre, axis=0)

    zero = jnp.zeros((bd,), jnp.float32)
    dw, db = lax.fori_loop(0, trips, step, (tuple(zero for _ in range(s.width)), zero))
    for t in range(s.width):
        plgpu.store(r["dw"].at[split, jnp.int32(t), pl.ds(c0, bd)], dw[t], mask=c_ok)
    plgpu.store(r["db"].at[split, pl.ds(c0, bd)], db, mask=c_ok)


def _state_grad_kernel(*refs, s: Static):
    """The initial state's gradient: the input gradient at positions ``-S .. -1`` of row ``b``.

    Operands: as :func:`_backward_kernel`'s inputs; output dstate ``[B, S_pad, D]``, the
    state's ``S`` positions rounded up to whole tiles. Program ``(b, k)``: row ``b``,
    channel block ``k``.
    """
    r = _refs(s.operand_names("dy", "dstate"), refs)
    bl, bd, _ = s.blocks.tile(backward=True)
    length = r["x"].shape[1]
    b, c0 = pl.program_id(0), pl.program_id(1) * bd
    c = c0 + jnp.arange(bd, dtype=jnp.int32)
    c_ok = c < r["x"].shape[-1]
    w, bias = _vectors(s, r, c)
    for start in range(0, s.halo, bl):
        q = start - s.halo + jnp.arange(bl, dtype=jnp.int32)
        dq = _Tile(s, r, b, q, c, c_ok, length).input_grad(w, bias)
        _store(r["dstate"], b, start, c0, dq, (q < 0)[:, None] & c_ok[None, :])


def _whole(a):
    return pl.BlockSpec(a.shape, lambda *_: (0,) * len(a.shape))


def _pallas_call(kernel, name: str, s: Static, grid, operands, out_shape, backward: bool):
    return pl.pallas_call(
        kernel,
        name=name,
        grid=grid,
        in_specs=[_whole(a) for a in operands],
        out_specs=[_whole(o) for o in out_shape],
        out_shape=out_shape,
        # Explicitly Triton: since jax 0.9 a GPU pallas_call without compiler params
        # lowers through Mosaic GPU.
        compiler_params=plgpu.CompilerParams(num_warps=s.blocks.tile(backward)[2], num_stages=1),
        interpret=s.interpret,
    )(*operands)


def _blocks(s: Static, batch: int, length: int, dim: int, backward: bool) -> tuple[int, int]:
    """``(position tiles of all rows, channel blocks)``."""
    positions, channels, _ = s.blocks.tile(backward)
    return batch * cdiv(length, positions), cdiv(dim, channels)


def forward(*operands, s: Static):
    """``[y]`` from the operands :meth:`Static.operand_names` lists."""
    x = operands[0]
    tiles, blocks = _blocks(s, *x.shape, backward=False)
    kernel = functools.partial(_forward_kernel, s=s, tiles=tiles // x.shape[0])
    out = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    return _pallas_call(kernel, KERNELS[0], s, (tiles, blocks), operands, out, backward=False)


def _backward(*operands, s: Static):
    """``(dx, dw_parts, db_parts)`` from the forward's operands and ``dy``."""
    x = operands[0]
    tiles, blocks = _blocks(s, *x.shape, backward=True)
    splits = s.blocks.splits(blocks, tiles)
    out = [
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct((splits, s.width, x.shape[2]), jnp.float32),
        jax.ShapeDtypeStruct((splits, x.shape[2]), jnp.float32),
    ]
    kernel = functools.partial(_backward_kernel, s=s, tiles=tiles // x.shape[0], trips=cdiv(tiles, splits))
    return _pallas_call(kernel, KERNELS[1], s, (blocks, splits), operands, out, backward=True)


def _state_grad(*operands, s: Static):
    x = operands[0]
    _, blocks = _blocks(s, *x.shape, backward=True)
    # Whole tiles of state positions, cropped after: a store's slice must fit its array
    # (jax 0.12 checks static ones), and the state is a few positions.
    padded = round_up(s.halo, s.blocks.backward_block_positions)
    out = [jax.ShapeDtypeStruct((x.shape[0], padded, x.shape[2]), x.dtype)]
    kernel = functools.partial(_state_grad_kernel, s=s)
    (dstate,) = _pallas_call(kernel, KERNELS[2], s, (x.shape[0], blocks), operands, out, backward=True)
    return [dstate[:, : s.halo]]


def backward(*operands, s: Static):
    """The cotangents of x, the weight, the bias and the state (those present), from the
    forward's operands and ``dy``: the partial sums added in a fixed order, each rounded
    once to its operand's dtype."""
    names = s.operand_names("dy")
    r = dict(zip(names, operands))
    operands = (*operands[:-1], r["dy"].astype(r["x"].dtype))
    dx, dw_parts, db_parts = _backward(*operands, s=s)
    out = [dx, sum_in_order(dw_parts).astype(r["w"].dtype)]
    if s.has_bias:
        out.append(sum_in_order(db_parts).astype(r["bias"].dtype))
    if s.has_state:
        out.extend(_state_grad(*operands, s=s))
    return out
