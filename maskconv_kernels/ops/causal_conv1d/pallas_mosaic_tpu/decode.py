"""The Mosaic TPU kernel of ``causal_conv1d_update``'s decode step: one launch, the pool updated in place.

A decode step of a served hybrid model reads, for each of its ``B`` rows, the slot of a
state pool the row names, runs the row's ``T`` new tokens (usually one) through the
short convolution after that slot's inputs, and writes the slot's new inputs back. XLA
runs it as a gather of the rows' slots, the convolution and a scatter.
``causal_conv1d_tpu_update`` is one ``pallas_call``:

* the pool stays in HBM (``memory_space=ANY``) and is aliased to the new pool
  (``input_output_aliases``): under ``jax.jit(..., donate_argnums=...)`` it is updated in
  place, and only the rows' slots move;
* the rows' slot numbers are scalar-prefetched into SMEM, and each grid step (a block of
  ``rows`` rows and ``channels`` channels) copies its rows' slots into VMEM with one DMA
  each, started one step ahead (double-buffered), and its new states back with one DMA
  each, waited one step later;
* the tokens come and the outputs go as ordinary ``[rows, T, channels]`` blocks of ``x``
  and ``y``; the kernel computes on ``[rows, ., channels]`` slabs, a row per leading index
  (its slot's ``S`` inputs, then its ``T`` tokens, in the sublanes of a float32 frame), so
  no vector op depends on which row it serves. The sublanes past ``S + T`` are idle: the
  step is paced by its DMAs, not by its arithmetic.

**Exactness.** An output is ``act(bias + sum_t w[t] * x[p - back(t)])`` over the slot's
inputs and the row's tokens only, in float32 in that order (the forward kernel's, with
its tanh sigmoid), rounded once. The new slot is copies of inputs. A row whose slot is not read
(``has_initial_state`` false, or :data:`~..update.PAD_SLOT_ID`) gets its inputs from a
zero fill in VMEM, never from a DMA: a NaN in an unread slot cannot reach it. A pad row's
outputs are zeros and it writes nothing; a row whose index lies outside the pool (traced,
unchecked) reads NaN and writes nothing, as :func:`~..update.read_slots` and
:func:`~..update.write_slots` do.

Codes of the scalar-prefetched ``reads`` (``[B]`` int32): a slot ``>= 0``; :data:`ZEROS`
(the slot is not read: zeros); :data:`NAN` (an index outside the pool); :data:`PAD` (a
pad row). ``writes``: a slot, or ``-1`` (nothing written).
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...._core.tiling import cdiv, round_up
from ..checks import Problem
from .config import DECODE_KERNEL, NAN, PAD, ZEROS
from .kernels import pool_call, sigmoid

__all__ = ["DecodeStatic", "update"]


@dataclasses.dataclass(frozen=True)
class DecodeStatic:
    """What the kernel is specialised on but the arrays (hashable): the problem (``length``:
    the new tokens a row, ``T``), the pool's slot length and the blocks."""

    problem: Problem
    state_len: int  # S: inputs a slot holds, >= problem.state_len = (W - 1) * dilation
    rows: int  # rows of the batch per grid step
    channels: int  # channels per grid step: divides D

    @property
    def tokens(self) -> int:
        return self.problem.length

    def back(self, t: int) -> int:
        """How far before an output its tap ``t`` reads."""
        return self.problem.back(t)


def _copies(pool_hbm, buf, sem, slots_ref, step, s: DecodeStatic, blocks: int, dim: int, to_pool: bool):
    """The DMAs of grid step ``step``'s rows, one per row whose code in ``slots_ref`` is a slot:
    ``(condition, descriptor)`` pairs. ``buf``: ``[rows, P, channels]``, a row's slot in the
    first ``S`` rows of its ``[P, channels]`` slab (``P``: :func:`_call`'s ``slab``)."""
    if s.channels == dim:  # one block of channels: a static slice (a dynamic one must be 128-aligned)
        cols = slice(None)
    else:
        cols = pl.ds(pl.multiple_of(lax.div(step, blocks) * s.channels, 128), s.channels)
    base = lax.rem(step, blocks) * s.rows  # lax's: step >= 0, and jnp's floor needs the chip's generation
    out = []
    for b in range(s.rows):
        slot = slots_ref[base + b]
        there = pool_hbm.at[jnp.maximum(slot, 0), :, cols]
        here = buf.at[b] if buf.shape[1] == s.state_len else buf.at[b, pl.ds(0, s.state_len)]
        src, dst = (here, there) if to_pool else (there, here)
        out.append((slot >= 0, pltpu.make_async_copy(src, dst, sem)))
    return out


def _each(copies, method: str):
    for cond, copy in copies:
        pl.when(cond)(getattr(copy, method))


def _kernel(reads_ref, writes_ref, x_ref, w_ref, *refs, s: DecodeStatic, blocks: int, steps: int, dim: int):
    """One ``[rows, T, channels]`` block of the outputs, and of the rows' new slots.

    Refs: ``reads``/``writes`` ``[B']`` int32 (SMEM); x ``[rows, T, channels]``; w ``[W,
    channels]`` and bias ``[1, channels]`` float32; the pool in HBM ``[slots, S, D]``; y
    ``[rows, T, channels]``; the new pool (the same buffer); scratch: the slots read and
    the slots to write, ``[2, rows, P, channels]`` in the pool's dtype each; the float32
    frame ``[rows, F, channels]`` (row ``b``'s ``S`` slot inputs, then its ``T`` tokens);
    a DMA semaphore pair for the reads and one for the writes.

    Every array op is on whole ``[rows, ., channels]`` slabs (a row per leading index), so
    the code has no loop over rows but the DMAs' and the fills'.
    """
    if s.problem.has_bias:
        bias_ref, *refs = refs
    pool_in, y_ref, pool_out, got, put, frame, sem_in, sem_out = refs
    step = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
    k = lax.rem(step, 2)
    common = dict(s=s, blocks=blocks, dim=dim)
    reads = functools.partial(_copies, pool_in, slots_ref=reads_ref, to_pool=False, **common)
    writes = functools.partial(_copies, pool_out, slots_ref=writes_ref, to_pool=True, **common)

    @pl.when(step == 0)
    def _():
        _each(reads(buf=got.at[0], sem=sem_in.at[0], step=step), "start")

    @pl.when(step + 1 < steps)
    def _():
        _each(reads(buf=got.at[1 - k], sem=sem_in.at[1 - k], step=step + 1), "start")

    _each(reads(buf=got.at[k], sem=sem_in.at[k], step=step), "wait")
    base = pl.program_id(1) * s.rows
    shape = (1, s.state_len, s.channels)
    for b in range(s.rows):  # slots not read: zeros, or NaN for an index outside the pool
        code = reads_ref[base + b]

        @pl.when((code == ZEROS) | (code == PAD))
        def _():
            got[k, b:b + 1, :s.state_len] = jnp.zeros(shape, got.dtype)

        @pl.when(code == NAN)
        def _():
            got[k, b:b + 1, :s.state_len] = jnp.full(shape, jnp.nan, got.dtype)

    sl, tokens = s.state_len, s.tokens
    frame[:, :sl] = got[k, :, :sl].astype(jnp.float32)
    frame[:, sl:sl + tokens] = x_ref[...].astype(jnp.float32)
    pre = jnp.zeros((s.rows, tokens, s.channels), jnp.float32)
    if s.problem.has_bias:
        pre = pre + bias_ref[...]
    for tap in range(s.problem.width):
        at = sl - s.back(tap)
        pre = pre + w_ref[tap:tap + 1, :] * frame[:, at:at + tokens]
    y = pre * sigmoid(pre) if s.problem.silu else pre
    y_ref[...] = y.astype(y_ref.dtype)
    put[k, :, :sl] = frame[:, tokens:tokens + sl].astype(put.dtype)
    for b in range(s.rows):  # a pad row's outputs are zeros

        @pl.when(reads_ref[base + b] == PAD)
        def _():
            y_ref[b:b + 1] = jnp.zeros((1, tokens, s.channels), y_ref.dtype)

    @pl.when(step > 0)
    def _():
        _each(writes(buf=put.at[1 - k], sem=sem_out.at[1 - k], step=step - 1), "wait")

    mine = writes(buf=put.at[k], sem=sem_out.at[k], step=step)
    _each(mine, "start")

    @pl.when(step == steps - 1)
    def _():
        _each(mine, "wait")


def update(x, pool, w, bias, reads, writes, *, s: DecodeStatic, interpret: bool):
    """``(y [B, T, D], pool)``: every token's output in x's dtype, and the pool with each
    row's new slot written (the same buffer, aliased).

    ``x [B, T, D]``; ``pool [slots, S, D]``; ``w [W, D]`` and ``bias [1, D]`` (or ``None``)
    float32; ``reads``, ``writes`` ``[B]`` int32 codes (the module docstring).
    """
    blocks = cdiv(x.shape[0], s.rows)
    padded = blocks * s.rows
    reads = jnp.pad(reads, (0, padded - x.shape[0]), constant_values=PAD)
    writes = jnp.pad(writes, (0, padded - x.shape[0]), constant_values=-1)
    call = _call(s, tuple(x.shape), jnp.dtype(x.dtype), tuple(pool.shape), jnp.dtype(pool.dtype), bool(interpret))
    operands = [x, w] + ([bias] if s.problem.has_bias else []) + [pool]
    y, pool = call(reads, writes, *operands)
    return y, pool


@functools.lru_cache(maxsize=64)
def _call(s: DecodeStatic, x_shape: tuple, x_dtype, pool_shape: tuple, pool_dtype, interpret: bool):
    """The ``pallas_call`` for these shapes, built once: a ``causal_conv1d_update`` lowered
    again (a new jit, the serving step's branches) reuses its kernel's trace."""
    batch, tokens, dim = x_shape
    blocks = cdiv(batch, s.rows)
    # A slot's rows in VMEM: whole 8-row tiles for a 32-bit pool (faster at D = 2048 on a
    # TPU v5e); S for a 16-bit one (Mosaic slices its packed tiles in whole tiles only).
    slab = round_up(s.state_len, 8) if pool_dtype.itemsize == 4 else s.state_len
    grid = (dim // s.channels, blocks)
    tile = pl.BlockSpec((s.rows, tokens, s.channels), lambda c, r, *_: (r, 0, c))
    return pool_call(
        functools.partial(_kernel, s=s, blocks=blocks, steps=grid[0] * grid[1], dim=dim),
        x=(x_shape, x_dtype), pool=(pool_shape, pool_dtype), prefetch=2, grid=grid, tokens=tile,
        channels=s.channels, problem=s.problem, name=DECODE_KERNEL, interpret=interpret,
        scratch=[
            pltpu.VMEM((2, s.rows, slab, s.channels), pool_dtype),
            pltpu.VMEM((2, s.rows, slab, s.channels), pool_dtype),
            pltpu.VMEM((s.rows, round_up(s.state_len + tokens, 8), s.channels), jnp.float32),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((2,)),
        ],
    )
