"""Fused Pallas kernels of :func:`~maskconv_kernels.causal_conv1d`: ``implementation="pallas_triton"``.

A depthwise causal 1-D convolution of width 2 to 8 does a handful of multiply-adds per
element it reads: it is memory bound, and what matters is that every element crosses
HBM once. Two kernels do all of it, on channels-last ``(B, L, D)`` arrays:

* ``short_conv_fwd``: one ``[block_positions, block_channels]`` tile of ``y`` per
  program: the taps (each a load of the tile shifted back by ``(W-1-t) * dilation``
  positions, so the tile's ``(W-1) * dilation`` halo comes from the cache), bias, SiLU
  and the padding select, one rounding to x's dtype;
* ``short_conv_bwd``: per channel block, a fixed range of position tiles walked in
  order: the pre-activation recomputed (no residual but the inputs), dSiLU, the input
  gradient ``dx[q] = sum_t w[t] * dpre[q + (W-1-t) * dilation]`` (the transposed taps,
  seen from the reading side), and the weight and bias gradients summed into float32
  registers; each program writes its partial sums, added afterwards in a fixed order
  (:func:`~maskconv_kernels.problem.sum_in_order`). No atomics: the same bits run to run;
* ``short_conv_bwd_state``: the initial state's gradient, the input gradient at the
  ``(W-1) * dilation`` positions before 0 (a small kernel: one program per row and
  channel block).

Segment selects are the library's (:mod:`maskconv_kernels.depthwise`): tap ``t`` of
output ``p`` reads input ``q = p - (W-1-t) * dilation`` only where ``ids[q] == ids[p] >=
0``; the initial state belongs to the row's first document. Positions outside the row
(and the state) are masked-off lanes of a load, never dereferenced; within it, each term
of a sum (a tap's product, a cotangent's contribution) is kept or dropped by a ``where``
select, never multiplied by a 0/1 mask: a NaN in one document changes no other's
output, and the gradient across documents is exactly 0.0.

Why the Pallas Triton lowering and not Mosaic GPU (the project's direction): these are
elementwise kernels whose every load is shifted by a few positions and selected per
position. Mosaic GPU (``plgpu.kernel``) reads through TMA boxes into shared memory, then
into registers in one of its fragment layouts; the shifts (any offset, not a multiple of
8 rows, negative at a row's first tile), the per-position selects (a row vector
broadcast over channels, which its layouts broadcast only from WGMMA row fragments) and
the halo would each have been a layout question that only a compile on sm_90 can settle,
and this project has no GPU to settle them on. Triton expresses a masked, shifted gather
directly, its interpreter runs on jax 0.10 to 0.12, and its cuda lowering is checked on
any host. The lowering warns it is deprecated since jax 0.11; the kernels are wrapped in
primitives whose lowering filters that warning, and only it, while they are lowered
(as the core does for the ``pallas_triton`` backend).

Derivatives: the kernels sit under a ``jax.custom_vjp``, so this path has first
derivatives only, in reverse mode: ``jax.jvp`` and ``jax.grad`` of ``jax.grad`` raise
(``implementation="xla"`` has every order and forward mode). ``vmap`` works: over the
examples, the forward folds into the batch; the backward maps.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jcore
from jax._src import dispatch
from jax._src.interpreters import mlir
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.extend.core import Primitive
from jax.interpreters import batching

from .hardware import SM_COUNT
from .problem import sum_in_order

__all__ = ["BlockSizes", "causal_conv1d_fused", "final_state", "IMPLEMENTATION", "KERNELS"]

IMPLEMENTATION = "pallas_triton"
KERNELS = ("short_conv_fwd", "short_conv_bwd", "short_conv_bwd_state")
_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
_DEPRECATION = "The Pallas Triton backend is deprecated"


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the fused short-convolution kernels: the forward's, and the backward's
    (the input, weight and bias gradients; the state's gradient too).

    Attributes:
      block_positions, backward_block_positions: positions per tile (a power of two, 16
        to 1024). Each tap reloads the tile shifted by up to ``(W-1) * dilation``
        positions; those reloads hit the cache, so HBM sees each element once plus the
        halo, ``(W-1) * dilation / block_positions`` of it.
      block_channels, backward_block_channels: channels per tile (a power of two, 16 to
        1024): contiguous, so each position's load is whole 16-byte vectors.
      num_warps, backward_num_warps: warps per program (1, 2, 4, 8 or 16).
      backward_splits: the most ranges the backward splits each channel block's position
        tiles into (each one program, its weight-gradient partial sum added in a fixed
        order afterwards); ``None``: enough programs to fill every SM four times.

    The defaults, from ptxas at sm_90a (bfloat16 and float32, width 4, SiLU, segment ids
    and a state): the forward at 32 x 128 and 4 warps holds 32 values of a tile per
    thread (88 to 154 registers, no spills; 64 x 128 needs 235 to 255); the backward
    keeps ``2W - 1`` input tiles and ``W`` cotangent tiles live, and ptxas gives it all
    255 registers at any tile: 16 x 64 at 2 warps (16 values a thread) spills nothing,
    32 x 128 at 4 warps spills 1.4 KB.
    """

    block_positions: int = 32
    block_channels: int = 128
    num_warps: int = 4
    backward_block_positions: int = 16
    backward_block_channels: int = 64
    backward_num_warps: int = 2
    backward_splits: int | None = None

    def __post_init__(self):
        for field in ("block_positions", "block_channels", "backward_block_positions", "backward_block_channels"):
            value = getattr(self, field)
            if not _is_int(value) or not 16 <= value <= 1024 or value & (value - 1):
                raise ValueError(f"BlockSizes.{field} must be a power of two from 16 to 1024, got {value!r}")
        for field in ("num_warps", "backward_num_warps"):
            value = getattr(self, field)
            if not _is_int(value) or value not in (1, 2, 4, 8, 16):
                raise ValueError(f"BlockSizes.{field} must be 1, 2, 4, 8 or 16, got {value!r}")
        splits = self.backward_splits
        if splits is not None and (not _is_int(splits) or splits < 1):
            raise ValueError(f"BlockSizes.backward_splits must be None or a positive int, got {splits!r}")

    @classmethod
    def get_default(cls, length: int, dim: int) -> BlockSizes:
        """The defaults (see the class), smaller where the sequence or the channels are."""
        fit = lambda n, most: min(most, max(16, _next_pow2(n)))  # noqa: E731
        return cls(
            block_positions=fit(length, 32), block_channels=fit(dim, 128),
            backward_block_positions=fit(length, 16), backward_block_channels=fit(dim, 64),
        )

    def tile(self, backward: bool) -> tuple[int, int, int]:
        """``(positions, channels, warps)`` of the forward's or the backward's tiles."""
        if backward:
            return self.backward_block_positions, self.backward_block_channels, self.backward_num_warps
        return self.block_positions, self.block_channels, self.num_warps

    def splits(self, channel_blocks: int, position_tiles: int) -> int:
        """Position ranges per channel block in the backward: ``channel_blocks * splits``
        programs fill every SM four times (or ``backward_splits`` caps them), none empty.

        Four: the backward holds 255 registers a thread, so four 2-warp programs fit an
        SM's 64K registers; each walks its tiles in order, and more of them keep more
        loads in flight. The partial sums, ``splits * (W + 1) * D`` float32, are small.
        """
        wanted = self.backward_splits or -(-4 * SM_COUNT // channel_blocks)
        splits = max(1, min(wanted, position_tiles))
        return -(-position_tiles // -(-position_tiles // splits))


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything a kernel is specialised on but the shapes (hashable: a primitive parameter)."""

    width: int
    dilation: int
    silu: bool
    has_bias: bool
    has_ids: bool
    has_state: bool
    blocks: BlockSizes
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

    def __init__(self, s: _Static, refs: dict, b, p, c, c_ok, length: int):
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


def _vectors(s: _Static, refs: dict, c):
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


def _forward_kernel(*refs, s: _Static, tiles: int):
    """One ``[block_positions, block_channels]`` tile of ``y = act(pre) where ids >= 0``.

    Operands (:meth:`_Static.operand_names`): x ``[B, L, D]``, w ``[W, D]``, bias ``[D]``,
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


def _backward_kernel(*refs, s: _Static, tiles: int, trips: int):
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


def _state_grad_kernel(*refs, s: _Static):
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


def _pallas_call(kernel, name: str, s: _Static, grid, operands, out_shape, backward: bool):
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


def _blocks(s: _Static, batch: int, length: int, dim: int, backward: bool) -> tuple[int, int]:
    """``(position tiles of all rows, channel blocks)``."""
    positions, channels, _ = s.blocks.tile(backward)
    return batch * -(-length // positions), -(-dim // channels)


def _forward(*operands, s: _Static):
    x = operands[0]
    tiles, blocks = _blocks(s, *x.shape, backward=False)
    kernel = functools.partial(_forward_kernel, s=s, tiles=tiles // x.shape[0])
    out = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    return _pallas_call(kernel, "short_conv_fwd", s, (tiles, blocks), operands, out, backward=False)


def _backward(*operands, s: _Static):
    """``(dx, dw_parts, db_parts)`` from the forward's operands and ``dy``."""
    x = operands[0]
    tiles, blocks = _blocks(s, *x.shape, backward=True)
    splits = s.blocks.splits(blocks, tiles)
    out = [
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct((splits, s.width, x.shape[2]), jnp.float32),
        jax.ShapeDtypeStruct((splits, x.shape[2]), jnp.float32),
    ]
    kernel = functools.partial(_backward_kernel, s=s, tiles=tiles // x.shape[0], trips=-(-tiles // splits))
    return _pallas_call(kernel, "short_conv_bwd", s, (blocks, splits), operands, out, backward=True)


def _state_grad(*operands, s: _Static):
    x = operands[0]
    _, blocks = _blocks(s, *x.shape, backward=True)
    # Whole tiles of state positions, cropped after: a store's slice must fit its array
    # (jax 0.12 checks static ones), and the state is a few positions.
    padded = -(-s.halo // s.blocks.backward_block_positions) * s.blocks.backward_block_positions
    out = [jax.ShapeDtypeStruct((x.shape[0], padded, x.shape[2]), x.dtype)]
    kernel = functools.partial(_state_grad_kernel, s=s)
    (dstate,) = _pallas_call(kernel, "short_conv_bwd_state", s, (x.shape[0], blocks), operands, out, backward=True)
    return [dstate[:, : s.halo]]


# --------------------------------------------------------------------------- primitives


def _primitive(name: str, impl, foldable: bool, extra: tuple[str, ...] = ()) -> Primitive:
    """``impl`` (a function of arrays and ``s=``) as a primitive: lowered with the Pallas
    Triton deprecation warning filtered, for cuda (or any platform interpreted), and batched.

    ``foldable``: its results are per example along the batch (the forward, the state's
    gradient); a ``vmap`` over the examples alone (not the weight or bias) folds into
    the batch. The backward's weight gradient sums over the batch: it is mapped.
    ``extra``: the names of operands after the forward's (``"dy"``).
    """
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))

    def abstract_eval(*avals, s):
        outs = jax.eval_shape(functools.partial(impl, s=s), *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
        return [jcore.ShapedArray(o.shape, o.dtype) for o in outs]

    prim.def_abstract_eval(abstract_eval)

    def lowering(ctx, *operands, s):
        platforms = tuple(ctx.platforms or ctx.module_context.platforms)
        for platform in platforms:
            if not s.interpret and platform != "cuda":
                raise NotImplementedError(
                    f'causal_conv1d(implementation="{IMPLEMENTATION}") cannot be lowered for platform "{platform}": '
                    "its kernels lower through Triton for NVIDIA GPUs (pass interpret=True to run them in the "
                    'Pallas interpreter, or use implementation="xla")'
                )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DEPRECATION, category=DeprecationWarning)
            return mlir.lower_fun(functools.partial(impl, s=s), multiple_results=True)(ctx, *operands)

    mlir.register_lowering(prim, lowering)

    def batch_rule(args, dims, *, s):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        front = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        shared = [n in ("w", "bias") for n in s.operand_names(*extra)]
        if foldable and not any(d is not None for d, sh in zip(dims, shared) if sh):
            folded = [a if sh else _fold(_broadcast(a, d, size)) for a, d, sh in zip(front, dims, shared)]
            outs = prim.bind(*folded, s=s)
            return [o.reshape(size, -1, *o.shape[1:]) for o in outs], [0] * len(outs)
        mapped = [_broadcast(a, d, size) for a, d in zip(front, dims)]
        outs = lax.map(lambda ops: tuple(prim.bind(*ops, s=s)), tuple(mapped))
        return list(outs), [0] * len(outs)

    batching.primitive_batchers[prim] = batch_rule
    return prim


def _broadcast(a, d, size):
    return jnp.broadcast_to(a, (size, *a.shape)) if d is None else a


def _fold(a):
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


_FORWARD = _primitive("short_conv_fwd", _forward, foldable=True)
_BACKWARD = _primitive("short_conv_bwd", _backward, foldable=False, extra=("dy",))
_STATE_GRAD = _primitive("short_conv_bwd_state", _state_grad, foldable=True, extra=("dy",))


# --------------------------------------------------------------------------- the differentiable function


def _operands(s: _Static, x, weight, bias, ids, state):
    optional = ((bias, s.has_bias), (ids, s.has_ids), (state, s.has_state))
    return (x, weight, *(a for a, present in optional if present))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(s: _Static, x, weight, bias, ids, state):
    return _FORWARD.bind(*_operands(s, x, weight, bias, ids, state), s=s)[0]


def _conv_fwd(s: _Static, x, weight, bias, ids, state):
    return _conv(s, x, weight, bias, ids, state), (x, weight, bias, ids, state)


def _conv_bwd(s: _Static, residuals, dy):
    x, weight, bias, ids, state = residuals
    operands = (*_operands(s, *residuals), dy.astype(x.dtype))
    dx, dw_parts, db_parts = _BACKWARD.bind(*operands, s=s)
    dw = sum_in_order(dw_parts).astype(weight.dtype)
    db = sum_in_order(db_parts).astype(bias.dtype) if s.has_bias else None
    dstate = _STATE_GRAD.bind(*operands, s=s)[0] if s.has_state else None
    ids_cotangent = None if ids is None else np.zeros(ids.shape, jax.dtypes.float0)
    return dx, dw, db, ids_cotangent, dstate


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_conv1d_fused(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    segment_ids: jax.Array | None,
    initial_state: jax.Array | None,
    *,
    activation: str | None,
    dilation: int,
    config: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``y`` of :func:`~maskconv_kernels.causal_conv1d` from the fused kernels (arguments checked there).

    Args:
      x: ``(B, L, D)``, float32, bfloat16 or float16.
      weight: ``(W, D)``, float32, bfloat16 or float16 (may differ from x's).
      bias: ``(D,)`` or ``None``.
      segment_ids: ``(B, L)`` int32 or ``None``.
      initial_state: ``(B, (W-1) * dilation, D)`` in x's dtype, or ``None``.
      activation: ``None`` or ``"silu"``/``"swish"``.
      dilation: the taps' spacing.
      config: :class:`BlockSizes`, or ``None`` for :meth:`BlockSizes.get_default`.
      interpret: run the kernels in the Pallas interpreter (any platform, slowly).

    Returns:
      ``y``: ``(B, L, D)`` in x's dtype (float32 accumulation, bias and SiLU in float32,
      rounded once). Differentiable once, in reverse mode, in x, weight, bias and the state.
    """
    for name, a in (("x", x), ("weight", weight), ("bias", bias)):
        if a is not None and np.dtype(a.dtype) not in _DTYPES:
            raise NotImplementedError(
                f'causal_conv1d(implementation="{IMPLEMENTATION}") takes float32, bfloat16 and float16; {name} is '
                f'{np.dtype(a.dtype)} (implementation="xla" takes it)'
            )
    if config is not None and not isinstance(config, BlockSizes):
        raise TypeError(
            f'causal_conv1d(implementation="{IMPLEMENTATION}") takes config=maskconv_kernels.short_conv_kernels.'
            f"BlockSizes(...) or None, got {type(config).__name__}"
        )
    batch, length, dim = x.shape
    width = weight.shape[0]
    s = _Static(
        width=int(width), dilation=int(dilation), silu=activation is not None, has_bias=bias is not None,
        has_ids=segment_ids is not None, has_state=initial_state is not None and (width - 1) * dilation > 0,
        blocks=config or BlockSizes.get_default(length, dim), interpret=bool(interpret),
    )
    if length == 0 or dim == 0 or batch == 0:
        return jnp.zeros(x.shape, x.dtype)
    ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
    state = initial_state if s.has_state else None
    return _conv(s, x, weight, bias, ids, state)


def final_state(x: jax.Array, initial_state: jax.Array | None, segment_ids: jax.Array | None, state_len: int):
    """:func:`~maskconv_kernels.causal_conv1d`'s final state without concatenating the state and ``x``.

    The last ``state_len`` inputs of the sequence ``initial_state ++ x`` (zeros for a
    missing state); with ``segment_ids``, those of each row's last document (zeros before
    its start, and in an all-padding row). Gathers of ``state_len`` positions a row:
    ``x`` is not copied.
    """
    batch, length, d = x.shape
    if state_len == 0:
        return jnp.zeros((batch, 0, d), x.dtype)
    state = jnp.zeros((batch, state_len, d), x.dtype) if initial_state is None else initial_state
    # Positions of the extended sequence: e in [0, state_len) is the state, e - state_len of x after.
    if segment_ids is None:
        end = jnp.full((batch,), state_len + length - 1)
        keep_doc = lambda index: jnp.ones(index.shape, bool)  # noqa: E731
    else:
        ids = segment_ids
        last = jnp.max(jnp.where(ids >= 0, jnp.arange(length), -1), axis=1)  # -1: an all-padding row
        end = jnp.where(last >= 0, last + state_len, -1)
        last_id = jnp.take_along_axis(ids, jnp.maximum(last, 0)[:, None], axis=1)
        # The state's positions belong to the row's first document.
        keep_doc = lambda index: (jnp.take_along_axis(ids, jnp.clip(index - state_len, 0, length - 1), axis=1)  # noqa: E731
                                  == last_id) & (end[:, None] >= 0)
    index = end[:, None] - state_len + 1 + jnp.arange(state_len)  # (B, state_len)
    from_x = jnp.take_along_axis(x, jnp.clip(index - state_len, 0, max(length - 1, 0))[..., None], axis=1) if length else None
    from_state = jnp.take_along_axis(state, jnp.clip(index, 0, state_len - 1)[..., None], axis=1)
    values = from_state if from_x is None else jnp.where((index >= state_len)[..., None], from_x, from_state)
    keep = (index >= 0) & keep_doc(index)
    return jnp.where(keep[..., None], values, jnp.zeros((), x.dtype))
