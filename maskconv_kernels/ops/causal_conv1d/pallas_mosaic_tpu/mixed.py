"""The Mosaic TPU kernel of ``causal_conv1d_step``'s mixed step: prefill chunks and decode tokens in one launch.

A scheduler step's tokens are ragged: request ``r`` owns rows ``[qsl[r], qsl[r + 1])`` of
the flat ``x [T, D]``, and each of its outputs reads its own earlier tokens or, for its
first ``(W - 1) * dilation`` tokens, the slot of the pool it names. ``step`` is one
``pallas_call`` over tiles of ``tile`` tokens (and blocks of channels), with the pool left
in HBM and aliased to the new pool, as the decode kernel (:mod:`.decode`) keeps it:

* **every output is computed densely** over the tile, from a float32 frame holding the
  tile's tokens after the previous tile's last ``H`` (a VMEM carry along the grid's tile
  axis), as the forward kernel computes it;
* **the tokens whose taps reach before their request's first token are computed again,
  alone**, as ``[1, channels]`` rows at their static row of the tile, each tap's input
  selected (``where``, on a per-token scalar) between the frame and the request's slot,
  and stored over the dense row. Positions in the tile are static throughout: what varies
  from step to step are scalars (each token's request and index in it, read from SMEM),
  never an offset into a vector (the design of tpu-inference's ragged kernel, ported);
* each request's slot is read by one DMA at the tile of its first token (and at the next
  tiles while its tokens still reach it), and its new state, the last ``S`` inputs of its
  slot and tokens, is assembled at its last token's row and written by one DMA.

**Exactness.** A token's output is ``act(bias + sum_t w[t] * v_t)`` in float32 in tap
order, rounded once, where ``v_t`` is its own request's input or its slot's: the dense
rows that read another request's tokens (or the zeros before the first tile) are exactly
the ones computed again, so no value crosses from one request to another, and a NaN in an
unread slot is never loaded (``has_initial_state`` false, pad rows: a zero fill). New
states are copies. Within rounding of XLA's composition (the tanh form of the sigmoid),
not bit for bit.

Scalar-prefetched (SMEM): ``qsl [R + 1]``, ``reads [R]`` (the decode kernel's codes: a
slot, :data:`ZEROS`, :data:`NAN`, :data:`PAD`), ``writes [R]`` (a slot or ``-1``),
``owner [T]`` (each token's request, ``R`` for padding) and ``within [T]`` (its index in
its request). Taken for steps whose requests write the slots they read (each slot read
by one request at most), ``state_len >= (W - 1) * dilation``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...._core.tiling import cdiv, round_up
from ..checks import Problem
from .config import MIXED_KERNEL, NAN, PAD, ZEROS
from .kernels import pool_call, sigmoid

__all__ = ["MixedStatic", "step"]


@dataclasses.dataclass(frozen=True)
class MixedStatic:
    """What the kernel is specialised on but the arrays (hashable)."""

    problem: Problem  # the width, dilation, bias and activation
    state_len: int  # S: inputs a slot holds, >= problem.state_len = (W - 1) * dilation
    tile: int  # tokens per grid step (a multiple of 16, or all T)
    channels: int  # channels per grid step: D, or a multiple of 128 that divides it

    @property
    def halo(self) -> int:
        """``H``: rows of the previous tile the frame keeps, for the taps and the state."""
        return round_up(max(self.problem.state_len, self.state_len, 1), 16)


def _act(pre, s: MixedStatic):
    return pre * sigmoid(pre) if s.problem.silu else pre


def _token(i: int, k, owner_ref, within_ref, tokens: int, requests: int):
    """Token ``i`` of tile ``k``: ``(t, r, j, live)``: its index in the step (clamped), its
    request (``R`` for padding), its index in the request, and whether it is a request's
    token (not padding, not past ``T``)."""
    t_raw = k * tokens + i
    t = jnp.minimum(t_raw, owner_ref.shape[0] - 1)
    r = owner_ref[t]
    live = (t_raw < owner_ref.shape[0]) & (r < requests)
    return t, r, within_ref[t], live


def _slot_copy(pool_hbm, buf, sem, slot, i: int, s: MixedStatic, cols, to_pool: bool):
    """The DMA between slot ``slot`` of the pool and row ``i`` of ``buf`` (its first ``S``
    rows), into the pool or out of it."""
    here = buf.at[i] if buf.shape[1] == s.state_len else buf.at[i, pl.ds(0, s.state_len)]
    there = pool_hbm.at[jnp.maximum(slot, 0), :, cols]
    return pltpu.make_async_copy(*((here, there) if to_pool else (there, here)), sem)


def _kernel(qsl_ref, reads_ref, writes_ref, owner_ref, within_ref, x_ref, w_ref, *refs, s: MixedStatic,
            dim: int, requests: int):
    """One ``[tile, channels]`` block of the outputs, and the new states of the requests
    whose last token lies in it.

    Refs: the five scalar arrays (SMEM); x ``[tile, channels]``; w ``[W, channels]`` and
    bias ``[1, channels]`` float32; the pool in HBM ``[slots, S, D]``; y ``[tile,
    channels]``; the new pool (the same buffer); scratch: the slots read ``[tile, P,
    channels]`` in the pool's dtype (row ``i``: the slot of the request whose first token,
    or the tile's first token, is row ``i``) and in float32; the states to write (row ``i``:
    the request whose last token is row ``i``), in the pool's dtype and in float32; the
    float32 frame ``[H + tile, channels]``; a DMA semaphore for reads and one for writes.
    """
    if s.problem.has_bias:
        bias_ref, *refs = refs
    pool_in, y_ref, pool_out, got, got32, put, put32, frame, sem_in, sem_out = refs
    c, k = pl.program_id(0), pl.program_id(1)
    tile, sl, h = s.tile, s.state_len, s.halo
    cols = slice(None) if s.channels == dim else pl.ds(pl.multiple_of(c * s.channels, 128), s.channels)
    token = functools.partial(_token, k=k, owner_ref=owner_ref, within_ref=within_ref, tokens=tile, requests=requests)

    def reads_slot(i):
        """Whether row ``i`` holds a slot this tile reads: its request starts there, or it is
        the tile's first token and its request's slot is still read (``j < S``)."""
        _, r, j, live = token(i)
        first = (j == 0) if i else (j < sl)
        return live & first, reads_ref[jnp.minimum(r, requests - 1)]

    # The slots: a DMA each, all started, then all waited (one tile's worth).
    for i in range(tile):
        need, code = reads_slot(i)

        @pl.when(need & (code >= 0))
        def _():
            _slot_copy(pool_in, got, sem_in, code, i, s, cols, to_pool=False).start()

        @pl.when(need & ((code == ZEROS) | (code == PAD)))
        def _():
            got[i:i + 1, :sl] = jnp.zeros((1, sl, s.channels), got.dtype)

        @pl.when(need & (code == NAN))
        def _():
            got[i:i + 1, :sl] = jnp.full((1, sl, s.channels), jnp.nan, got.dtype)

    for i in range(tile):
        need, code = reads_slot(i)

        @pl.when(need & (code >= 0))
        def _():
            _slot_copy(pool_in, got, sem_in, code, i, s, cols, to_pool=False).wait()

    got32[:, :sl] = got[:, :sl].astype(jnp.float32)

    # The frame: the previous tile's last H rows (zeros before the first), then this tile's.
    @pl.when(k == 0)
    def _():
        frame[:h] = jnp.zeros((h, s.channels), jnp.float32)

    @pl.when(k > 0)
    def _():
        frame[:h] = frame[tile:tile + h]

    frame[h:] = x_ref[...].astype(jnp.float32)
    width = s.problem.width
    pre = jnp.zeros((tile, s.channels), jnp.float32)
    if s.problem.has_bias:
        pre = pre + bias_ref[...]
    for tap in range(width):
        at = h - s.problem.back(tap)
        pre = pre + w_ref[tap:tap + 1, :] * frame[at:at + tile]
    y_ref[...] = _act(pre, s).astype(y_ref.dtype)

    # The tokens whose taps reach their slot, alone; padding and pad rows: zeros.
    window = s.problem.state_len
    for i in range(tile):
        _, r, j, live = token(i)
        live = live & (reads_ref[jnp.minimum(r, requests - 1)] != PAD)
        slot_row = jnp.maximum(i - j, 0)  # the row of ``got32`` holding its request's slot

        @pl.when(~live)
        def _():
            y_ref[i:i + 1] = jnp.zeros((1, s.channels), y_ref.dtype)

        @pl.when(live & (j < window))
        def _():
            row = jnp.zeros((1, s.channels), jnp.float32)
            if s.problem.has_bias:
                row = row + bias_ref[...]
            for tap in range(width):
                back = s.problem.back(tap)
                v = frame[h + i - back:h + i - back + 1]
                for jj in range(back):  # token jj of its request reads its slot's input S - back + jj
                    v = jnp.where(j == jj, got32[slot_row, sl - back + jj:sl - back + jj + 1], v)
                row = row + w_ref[tap:tap + 1, :] * v
            y_ref[i:i + 1] = _act(row, s).astype(y_ref.dtype)

    # The new states: at each request's last token, its slot's and tokens' last S inputs.
    def writes_state(i):
        _, r, j, live = token(i)
        rr = jnp.minimum(r, requests - 1)
        last = live & (k * tile + i == qsl_ref[rr + 1] - 1)
        return last & (writes_ref[rr] >= 0), writes_ref[rr], j

    for i in range(tile):
        write, slot, j = writes_state(i)
        slot_row = jnp.maximum(i - j, 0)

        @pl.when(write)
        def _():
            for srow in range(sl):  # input srow of the state is d = S - 1 - srow before the last token
                d = sl - 1 - srow
                v = frame[h + i - d:h + i - d + 1]
                for jj in range(d):  # a request of jj + 1 tokens: the slot's input jj + 1 + srow
                    v = jnp.where(j == jj, got32[slot_row, jj + 1 + srow:jj + 2 + srow], v)
                put32[i, srow:srow + 1] = v
            put[i:i + 1, :sl] = put32[i:i + 1, :sl].astype(put.dtype)  # whole packed tiles for 16-bit pools
            _slot_copy(pool_out, put, sem_out, slot, i, s, cols, to_pool=True).start()

    for i in range(tile):
        write, slot, _ = writes_state(i)

        @pl.when(write)
        def _():
            _slot_copy(pool_out, put, sem_out, slot, i, s, cols, to_pool=True).wait()


def step(x, pool, w, bias, qsl, reads, writes, owner, within, *, s: MixedStatic, interpret: bool):
    """``(y [T, D], pool)``: every token's output in x's dtype (zeros for padding and pad
    rows), and the pool with each request's new state written (the same buffer, aliased).

    ``x [T, D]``; ``pool [slots, S, D]``; ``w [W, D]`` and ``bias [1, D]`` (or ``None``)
    float32; ``qsl [R + 1]``, ``reads``, ``writes [R]``, ``owner``, ``within [T]`` int32
    (the module docstring).
    """
    call = _call(s, tuple(x.shape), jnp.dtype(x.dtype), tuple(pool.shape), jnp.dtype(pool.dtype),
                 int(reads.shape[0]), bool(interpret))
    operands = [x, w] + ([bias] if s.problem.has_bias else []) + [pool]
    return call(qsl, reads, writes, owner, within, *operands)


@functools.lru_cache(maxsize=64)
def _call(s: MixedStatic, x_shape: tuple, x_dtype, pool_shape: tuple, pool_dtype, requests: int, interpret: bool):
    """The ``pallas_call`` for these shapes, built once."""
    tokens, dim = x_shape
    slab = round_up(s.state_len, 8) if pool_dtype.itemsize == 4 else s.state_len  # as the decode kernel's
    grid = (dim // s.channels, cdiv(tokens, s.tile))
    tile = pl.BlockSpec((s.tile, s.channels), lambda c, k, *_: (k, c))
    rows = round_up(s.state_len, 8)
    return pool_call(
        functools.partial(_kernel, s=s, dim=dim, requests=requests),
        x=(x_shape, x_dtype), pool=(pool_shape, pool_dtype), prefetch=5, grid=grid, tokens=tile,
        channels=s.channels, problem=s.problem, name=MIXED_KERNEL, interpret=interpret,
        scratch=[
            pltpu.VMEM((s.tile, slab, s.channels), pool_dtype),
            pltpu.VMEM((s.tile, rows, s.channels), jnp.float32),
            pltpu.VMEM((s.tile, slab, s.channels), pool_dtype),
            pltpu.VMEM((s.tile, rows, s.channels), jnp.float32),
            pltpu.VMEM((s.halo + s.tile, s.channels), jnp.float32),
            pltpu.SemaphoreType.DMA(()),
            pltpu.SemaphoreType.DMA(()),
        ],
    )
