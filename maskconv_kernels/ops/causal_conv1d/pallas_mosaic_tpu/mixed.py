"""The Mosaic TPU kernel of ``causal_conv1d_step``'s mixed step: prefill chunks and decode tokens in one launch.

A scheduler step's tokens are ragged: request ``r`` owns rows ``[qsl[r], qsl[r + 1])`` of
the flat ``x [T, D]``, and each of its outputs reads its own earlier tokens or, for its
first ``(W - 1) * dilation`` tokens, the slot of the pool it names. ``step`` is one
``pallas_call`` over tiles of ``tile`` tokens (and blocks of channels), with the pool left
in HBM and aliased to the new pool, as the decode kernel (:mod:`.decode`) keeps it.

Scalar work is per request, vector work per tile; nothing is per token:

* **slots in**: each request whose first token is row ``p`` of the tile has its slot
  DMA'd to row ``p`` of a ``[tile, S, channels]`` buffer (a loop over the tile's requests,
  with run-time bounds); row ``q`` of every slot at once, ``got[:, q, :]`` (a strided
  load), is then "slot input ``q`` of the request starting at each row";
* **outputs**: tap ``b`` rows back of token ``i`` reads the float32 frame (the tile's
  tokens after the previous tile's last ``H``, a VMEM carry) at row ``i - b`` when the
  token's index in its request ``j = within[i] >= b``, and otherwise slot input ``S - b
  + j`` of the request starting at row ``i - j``: for each ``j < b``, a static shift of
  that strided load, selected by ``where`` on the ``within`` column. The shifted loads
  come from ``[H + tile, channels]`` buffers carried like the frame, so a request begun
  in an earlier tile still finds its slot;
* **states out**: the same selections (one per distance back, shared by a tap and a
  state row) give, at every row, the state a request ending there would leave (its last
  ``S`` inputs of slot and tokens); stored as rows of a ``[tile, S, channels]`` buffer
  (strided stores), each state the step writes is sent to its slot by one DMA: each
  request's last one, and with prefix caching the one after each block boundary it
  crosses (:func:`state_events`). With ``states_from_frame`` those stores are made only in
  tiles where a state of fewer than ``S`` of its request's tokens is written (``busy`` bit
  1); in the others each state, its last ``S`` inputs, is read from the frame by one
  aligned 16-row load and a sublane roll.

**Exactness.** A token's output is ``act(bias + sum_t w[t] * v_t)`` in float32 in tap
order, rounded once, where ``v_t`` is its own request's input or its slot's: a row is
taken from another request's tokens or slot only where ``where`` discards it, so no value
crosses from one request to another, and a NaN in an unread slot is never loaded
(``has_initial_state`` false: a zero fill; pad rows: zeros out, no read). New states are
copies. Within rounding of XLA's composition (the tanh form of the sigmoid), not bit for
bit.

Scalar-prefetched (SMEM): ``qsl [R + 1]``, ``reads [R]`` (the decode kernel's codes: a
slot, :data:`ZEROS`, :data:`NAN`, :data:`PAD`), ``shifts [R]`` (speculative decoding: a
slot whose history ends ``shift`` rows before its last, moved that far by a sublane roll
once read); per tile ``k`` the requests whose first
tokens lie in it (``first[k]`` to ``first[k + 1]``), ``busy[k]`` (bit 0: a token of it
reads its slot, for a tap or a state row; a tile that none does, the middle of a long
prefill, makes no selection, as the forward kernel; bit 1: a state of fewer than ``S``
tokens is written in it), and its states to write (``events[k]`` to ``events[k + 1]``);
the states' rows, slots and kinds ``[E]`` (:func:`state_events`). Blocked like x: ``within
[tiles * tile, 1]``, each token's index in its request, ``-1`` for padding and pad rows
(zeros out); with ``positioned``, ``limit [tiles * tile, 1]`` too, how far back each
token may read (to its request's last document start at or before it), inputs further
back selected to zeros, in its outputs and in the state a request ending there leaves.
``state_len >= (W - 1) * dilation``. The DMAs run in grid order, so a slot
must not be written twice in a step, nor written by one request and read by another
(``causal_conv1d_step`` takes XLA's composition for such a step). A request without
tokens writes zeros where it starts fresh (``has_initial_state`` false), else nothing.
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
from . import config
from .config import MIXED_KERNEL, NAN, PAD, SUBLANES, VMEM_LIMIT_BYTES, ZEROS, MiB
from .kernels import pool_call, sigmoid

__all__ = ["MixedStatic", "state_events", "step"]

# The kinds of states a step writes (state_events): the state at a token's row, or zeros.
_SENT, _ZEROS = 0, 1


@dataclasses.dataclass(frozen=True)
class MixedStatic:
    """What the kernel is specialised on but the arrays (hashable)."""

    problem: Problem  # the width, dilation, bias and activation
    state_len: int  # S: inputs a slot holds, >= problem.state_len = (W - 1) * dilation
    tile: int  # tokens per grid step (a multiple of 16, or all T)
    channels: int  # channels per grid step: D, or a multiple of 128 that divides it
    states_from_frame: bool = False  # Config.step_states_from_frame
    shifted: bool = False  # some slot's history ends before its last row (speculative decoding's shifts)
    positioned: bool = False  # documents start inside requests: each token reads no further back than ``limit``

    @property
    def frame_states(self) -> bool:
        """Whether ending requests of ``S`` tokens or more take their states from the frame:
        asked for, a state within one 8-row tile, and tiles of whole 8-row tiles (the
        16-row window at a multiple of 8 that holds a state stays in the frame)."""
        return self.states_from_frame and self.state_len <= 8 and self.tile % 8 == 0

    @property
    def halo(self) -> int:
        """``H``: rows of the previous tile the frame keeps, for the taps and the state."""
        return round_up(max(self.problem.state_len, self.state_len, 1), 16)

    @property
    def slot_rows(self) -> int:
        """Rows of a float32 slot buffer: ``S`` on whole 8-row sublane tiles."""
        return round_up(self.state_len, 8)

    def vmem_bytes(self, x_itemsize: int, pool_itemsize: int) -> int:
        """The VMEM a grid step holds: the float32 slots read and states to write (8 rows a
        token), their 16-bit twins for a 16-bit pool, the frame and the slot inputs by row,
        and x's and y's double-buffered blocks."""
        packed_rows = round_up(self.state_len, 16)
        slots = 2 * self.tile * self.slot_rows * self.channels * 4
        packed = 0 if pool_itemsize == 4 else 2 * self.tile * packed_rows * self.channels * pool_itemsize
        frames = (1 + len(_slot_rows(self))) * (self.halo + self.tile) * self.channels * 4
        return slots + packed + frames + 4 * self.tile * self.channels * x_itemsize

    def fitted(self, x_itemsize: int, pool_itemsize: int) -> MixedStatic:
        """This one, with its tokens a step halved (in whole 16-row tiles) until its VMEM
        leaves 8 MiB of ``VMEM_LIMIT_BYTES`` to Mosaic's own."""
        s = self
        while s.tile > SUBLANES and s.vmem_bytes(x_itemsize, pool_itemsize) > VMEM_LIMIT_BYTES - 8 * MiB:
            s = dataclasses.replace(s, tile=max(SUBLANES, round_up(s.tile // 2, SUBLANES)))
        return s


def _act(pre, s: MixedStatic):
    return pre * sigmoid(pre) if s.problem.silu else pre


def _slot_copy(pool_hbm, buf, sem, slot, p, s: MixedStatic, cols, to_pool: bool):
    """The DMA between slot ``slot`` of the pool and row ``p`` of ``buf`` (its first ``S``
    rows), into the pool or out of it."""
    here = buf.at[p] if buf.shape[1] == s.state_len else buf.at[p, pl.ds(0, s.state_len)]
    there = pool_hbm.at[jnp.maximum(slot, 0), :, cols]
    return pltpu.make_async_copy(*((here, there) if to_pool else (there, here)), sem)


def _slot_rows(s: MixedStatic) -> tuple[int, ...]:
    """The rows ``q`` of a slot some output or state reads: ``S - b + j`` for a tap ``b``
    rows back and a token ``j < b`` of its request; ``j + 1 + srow`` for state row ``srow``
    of a request of ``j + 1 < S - srow`` tokens."""
    sl, p = s.state_len, s.problem
    taps = {sl - p.back(t) + j for t in range(p.width) for j in range(p.back(t))}
    return tuple(sorted(taps | set(range(1, sl))))


def _chosen(frame_rows, slot_row, within, back: int, first: int, h: int, tile: int):
    """Rows of the tile ``back`` inputs before each token: the frame's where its request
    has them (``within >= back``), else input ``first + j`` of its request's slot, ``j =
    within``: ``slot_row(q)`` is the ``[H + tile, channels]`` buffer of slot inputs ``q``
    by the row of their request's first token."""
    v = frame_rows
    for j in range(back):
        v = jnp.where(within == j, slot_row(first + j)[h - j:h - j + tile], v)
    return v


def _store_state_row(put32, srow: int, v):
    """Row ``srow`` of every token's would-be state: ``put32[:, srow]``, one sublane a token."""
    put32[:, srow, :] = v


def _load_slot_inputs(by_row, got32, rows: tuple[int, ...], h: int):
    """Each slot input ``q`` in ``rows`` by the row of its request's first token:
    ``got32[:, q]``, one sublane a token."""
    for n, q in enumerate(rows):
        by_row[n, h:] = got32[:, q, :]


def _state_from_frame(frame, put32, p, s: MixedStatic):
    """``put32[p, :S]`` = frame rows ``H + p - S + 1 .. H + p``: the last ``S`` inputs of a
    request of ``S`` tokens or more whose last token is row ``p`` of the tile. One aligned
    16-row load (at a multiple of 8, no further than the frame's end) and a sublane roll
    by the state's offset in it; rows ``S..7`` of the result are not read."""
    first = s.halo + p - s.state_len + 1  # >= 1: H >= S
    base = pl.multiple_of(jnp.minimum(first & -8, s.halo + s.tile - 16), 8)  # bit masks: no division in Mosaic
    window = frame[pl.ds(base, 16), :]
    put32[p] = pltpu.roll(window, (16 - (first - base)) & 15, 0)[:8]


def _shift_history(got32, p, shift):
    """Slot ``got32[p]`` (``[rows, channels]``) moved ``shift`` rows later, zeros before: its
    history ends ``shift`` rows before its last (drafts rejected after it). A run-time
    sublane roll and a select, where ``shift > 0``."""
    @pl.when(shift > 0)
    def _():
        rows = got32[p]
        moved = pltpu.roll(rows, shift, 0)
        got32[p] = jnp.where(lax.broadcasted_iota(jnp.int32, rows.shape, 0) >= shift, moved, 0.0)


def _kernel(qsl_ref, reads_ref, shifts_ref, first_ref, busy_ref, events_ref, rows_ref, slots_ref, kinds_ref, within_ref,
            *refs, s: MixedStatic, dim: int):
    """One ``[tile, channels]`` block of the outputs, and the states whose last token lies
    in it.

    Refs: the nine scalar arrays (SMEM); within ``[tile, 1]`` int32 (and with
    ``positioned``, limit likewise); x ``[tile, channels]``; w ``[W, channels]`` and bias ``[1, channels]`` float32; the pool in HBM
    ``[slots, S, D]``; y ``[tile, channels]``; the new pool (the same buffer); scratch: the
    slots read ``[tile, P, channels]`` (row ``p``: the slot of the request whose first
    token is row ``p``) in float32 and, for a 16-bit pool, in its dtype; the states to
    write likewise (row ``p``: the state whose last token is row ``p``); the float32
    frame ``[H + tile, channels]``; the slot inputs by row ``[Q, H + tile, channels]``; a
    DMA semaphore for reads and one for writes. Once the tile's outputs are made, the
    slots read are dead until the next tile: row 0 of them is the zeros a request without
    tokens that starts fresh writes.
    """
    limit_ref = None
    if s.positioned:
        limit_ref, *refs = refs
    x_ref, w_ref, *refs = refs
    if s.problem.has_bias:
        bias_ref, *refs = refs
    pool_in, y_ref, pool_out, got32, put32, frame, by_row, sem_in, sem_out, *packed = refs
    got, put = packed if packed else (got32, put32)
    c, k = pl.program_id(0), pl.program_id(1)
    tile, sl, h = s.tile, s.state_len, s.halo
    cols = slice(None) if s.channels == dim else pl.ds(pl.multiple_of(c * s.channels, 128), s.channels)
    base = k * tile

    def starting(r):
        """Request ``r`` (whose first token is in this tile): its row, whether it has
        tokens, its read code."""
        return qsl_ref[r] - base, qsl_ref[r + 1] > qsl_ref[r], reads_ref[r]

    def fetch(r, carry):
        p, some, code = starting(r)

        @pl.when(some & (code >= 0))
        def _():
            _slot_copy(pool_in, got, sem_in, code, p, s, cols, to_pool=False).start()

        @pl.when(some & (code == ZEROS))
        def _():
            got32[pl.ds(p, 1), :sl] = jnp.zeros((1, sl, s.channels), jnp.float32)

        @pl.when(some & (code == NAN))
        def _():
            got32[pl.ds(p, 1), :sl] = jnp.full((1, sl, s.channels), jnp.nan, jnp.float32)

        return carry

    def landed(r, carry):
        p, some, code = starting(r)

        @pl.when(some & (code >= 0))
        def _():
            _slot_copy(pool_in, got, sem_in, code, p, s, cols, to_pool=False).wait()
            if packed:
                got32[pl.ds(p, 1), :sl] = got[pl.ds(p, 1), :sl].astype(jnp.float32)
            if s.shifted:
                _shift_history(got32, p, shifts_ref[r])

        return carry

    lax.fori_loop(first_ref[k], first_ref[k + 1], fetch, 0)
    lax.fori_loop(first_ref[k], first_ref[k + 1], landed, 0)

    # The frame and the slot inputs by row: the previous tile's last H rows, then this tile's.
    rows = _slot_rows(s)

    @pl.when(k > 0)
    def _():
        frame[:h] = frame[tile:tile + h]
        for n in range(len(rows)):
            by_row[n, :h] = by_row[n, tile:tile + h]

    @pl.when(k == 0)
    def _():
        frame[:h] = jnp.zeros((h, s.channels), jnp.float32)

    frame[h:] = x_ref[...].astype(jnp.float32)
    slot_row = lambda q: by_row.at[rows.index(q)]  # noqa: E731
    within = within_ref[...]
    limit = None if limit_ref is None else limit_ref[...]

    # Whether every row's would-be state is stored (else the ending requests' come from the frame).
    every_state = (busy_ref[k] & 2) != 0

    def state_row(srow: int, v):
        if not s.frame_states:
            return _store_state_row(put32, srow, v)

        @pl.when(every_state)
        def _():
            _store_state_row(put32, srow, v)

    def outputs_and_states(select: bool):
        """y, and every row's would-be state in ``put32``; ``select``: some token reads its
        slot (else every input is the frame's, and no selection is made)."""
        def inputs_back(back):  # each token's input ``back`` rows before it: its own or its slot's
            rows_back = frame[h - back:h - back + tile]
            v = _chosen(rows_back, slot_row, within, back, sl - back, h, tile) if select else rows_back
            return v if limit is None or back == 0 else jnp.where(limit >= back, v, 0.0)  # before its document: 0

        # A distance back serves a tap and, where ``back < S``, row ``S - 1 - back`` of the state.
        pre = jnp.zeros((tile, s.channels), jnp.float32)
        if s.problem.has_bias:
            pre = pre + bias_ref[...]
        backs = [s.problem.back(tap) for tap in range(s.problem.width)]
        for tap, back in enumerate(backs):
            v = inputs_back(back)
            if back < sl:
                state_row(sl - 1 - back, v)
            pre = pre + w_ref[tap:tap + 1, :] * v
        y_ref[...] = jnp.where(within < 0, 0.0, _act(pre, s)).astype(y_ref.dtype)
        for back in sorted(set(range(sl)) - set(backs)):
            state_row(sl - 1 - back, inputs_back(back))

    @pl.when((busy_ref[k] & 1) != 0)
    def _():
        _load_slot_inputs(by_row, got32, rows, h)
        outputs_and_states(True)

    @pl.when((busy_ref[k] & 1) == 0)  # a tile of prefill tokens past their slots' reach
    def _():
        outputs_and_states(False)

    def event(e):
        """State ``e`` (whose last token is in this tile): its row, its slot (``-1``: none)
        and its kind (:func:`state_events`)."""
        return rows_ref[e] - base, slots_ref[e], kinds_ref[e]

    def prepare(e, carry):  # every state of the tile made before any is sent (two may share a row)
        p, slot, kind = event(e)

        @pl.when((slot >= 0) & (kind == _SENT))
        def _():
            if s.frame_states:
                @pl.when(jnp.logical_not(every_state))
                def _():
                    _state_from_frame(frame, put32, p, s)

            if packed:
                put[pl.ds(p, 1), :sl] = put32[pl.ds(p, 1), :sl].astype(put.dtype)

        @pl.when((slot >= 0) & (kind == _ZEROS))
        def _():
            got[pl.ds(0, 1), :sl] = jnp.zeros((1, sl, s.channels), got.dtype)

        return carry

    def copies(e):
        """``(condition, DMA)`` pairs: state ``e`` from its row, or zeros, to its slot."""
        p, slot, kind = event(e)
        return [((slot >= 0) & (kind == _SENT), _slot_copy(pool_out, put, sem_out, slot, p, s, cols, to_pool=True)),
                ((slot >= 0) & (kind == _ZEROS), _slot_copy(pool_out, got, sem_out, slot, 0, s, cols, to_pool=True))]

    def send(e, carry):
        for some, dma in copies(e):
            pl.when(some)(dma.start)
        return carry

    def sent(e, carry):
        for some, dma in copies(e):
            pl.when(some)(dma.wait)
        return carry

    for fn in (prepare, send, sent):
        lax.fori_loop(events_ref[k], events_ref[k + 1], fn, 0)


def step(x, pool, w, bias, qsl, reads, writes, owner, within, *, s: MixedStatic, interpret: bool, blocks=None,
         shifts=None, limits=None):
    """``(y [T, D], pool)``: every token's output in x's dtype (zeros for padding and pad
    rows), and the pool with each request's new state written (the same buffer, aliased).

    ``x [T, D]``; ``pool [slots, S, D]``; ``w [W, D]`` and ``bias [1, D]`` (or ``None``)
    float32; ``qsl [R + 1]``, ``reads``, ``writes [R]`` int32 (the module docstring);
    ``owner``, ``within [T]`` int32: each token's request (``R`` for padding) and its index
    in it; ``blocks``: prefix caching's ``(K, targets [R, M], computed [R])``, as
    :func:`state_events` takes them, or ``None``; ``shifts [R]`` int32 (with
    ``s.shifted``): how many rows before a slot's last its history ends (its first rows
    zeros), or ``None``; ``limits [T]`` int32 (with ``s.positioned``): how far back each
    token may read (the module docstring), or ``None``.
    """
    tokens, requests = x.shape[0], reads.shape[0]
    tiles = cdiv(tokens, s.tile)
    live = (owner < requests) & (jnp.take(reads, jnp.minimum(owner, requests - 1)) != PAD)
    within = jnp.pad(jnp.where(live, within, -1), (0, tiles * s.tile - tokens), constant_values=-1)[:, None]
    edges = jnp.arange(tiles + 1, dtype=jnp.int32) * s.tile
    first = jnp.searchsorted(qsl[:-1], edges, side="left", method="compare_all")  # requests starting before each edge
    rows, slots, kinds, consumed = state_events(qsl, reads, writes, blocks, tiles * s.tile)
    events = jnp.searchsorted(rows, edges, side="left", method="compare_all")  # states ending before each edge
    reach = max(s.problem.state_len, s.state_len - 1)  # tokens at least this far into a request read no slot
    busy = ((within >= 0) & (within < reach)).reshape(tiles, s.tile).any(axis=1).astype(jnp.int32)
    busy = busy | 2 * _short_states(rows, slots, kinds, consumed, s, tiles, limits)
    call = _call(s, tuple(x.shape), jnp.dtype(x.dtype), tuple(pool.shape), jnp.dtype(pool.dtype), bool(interpret))
    operands = [within]
    if s.positioned:
        operands.append(jnp.pad(limits.astype(jnp.int32), (0, tiles * s.tile - tokens))[:, None])
    operands += [x, w] + ([bias] if s.problem.has_bias else []) + [pool]
    shifts = jnp.zeros_like(reads) if shifts is None else shifts.astype(jnp.int32)
    return call(qsl, reads, shifts, first.astype(jnp.int32), busy, events.astype(jnp.int32), rows, slots, kinds,
                *operands)


def state_events(qsl, reads, writes, blocks, past: int):
    """``(rows, slots, kinds, consumed)``, ``[E]`` int32 each, in row order: every state a
    step writes, as the row of its last token, the slot it goes to (``-1``: none), its kind
    (``_SENT``: the state at that row; ``_ZEROS``: zeros) and how many of its request's
    tokens of the step it follows.

    Request ``r``'s states: with prefix caching (``blocks = (K, targets [R, M], computed
    [R])``), the one after each block boundary its tokens cross, ``(m + 1) * K`` tokens of
    its sequence with ``computed[r]`` before the step, to ``targets[r, m]`` (``-1``: not
    cached), then its last one, to ``writes[r]``: where it has no token, zeros if it starts
    fresh (``reads[r]`` :data:`ZEROS`; at the row before it, or row 0), else nothing. ``E = R`` without
    blocks, else ``min(2R + past // K, R (M + 1))`` (``past >= T``, past the last tile): a
    request of ``n`` tokens crosses at most ``n // K + 1`` boundaries. Unused entries: row
    ``past``, slot ``-1``.
    """
    counts = qsl[1:] - qsl[:-1]
    ends = jnp.where((counts > 0) | (reads == ZEROS), writes, -1)
    end_kinds = jnp.where(counts > 0, _SENT, _ZEROS)
    end_rows = jnp.maximum(qsl[1:] - 1, 0)
    if blocks is None:
        return end_rows, ends, end_kinds, counts
    size, targets, computed = blocks
    requests, cached = targets.shape
    first = computed // size  # the first boundary not yet crossed: (first + 1) * K > computed
    crossed = jnp.clip(jnp.minimum((computed + counts) // size, cached) - first, 0, None)
    start = jnp.cumsum(crossed + 1) - (crossed + 1)  # each request's first entry
    j = jnp.arange(min(2 * requests + past // size, requests * (cached + 1)), dtype=jnp.int32)
    r = jnp.clip(jnp.searchsorted(start, j, side="right", method="compare_all") - 1, 0, requests - 1)
    i = j - start[r]
    used, block = i <= crossed[r], i < crossed[r]
    m = first[r] + i
    consumed = jnp.where(block, (m + 1) * size - computed[r], counts[r])
    slots = jnp.where(block, targets[r, jnp.clip(m, 0, cached - 1)], ends[r])
    rows = jnp.where(block, qsl[r] + consumed - 1, end_rows[r])
    kinds = jnp.where(block, _SENT, end_kinds[r])
    return (jnp.where(used, rows, past).astype(jnp.int32), jnp.where(used, slots, -1).astype(jnp.int32),
            kinds.astype(jnp.int32), consumed.astype(jnp.int32))


def _short_states(rows, slots, kinds, consumed, s: MixedStatic, tiles: int, limits=None):
    """``[tiles]`` int32: 1 where a state is sent that the frame does not hold whole: one of
    fewer than ``S`` of its request's tokens (it mixes slot and tokens) or, with ``limits
    [T]``, one with a document start among its last ``S`` inputs (zeros before it); or
    everywhere without ``frame_states``."""
    if not s.frame_states:
        return jnp.ones((tiles,), jnp.int32)
    short = consumed < s.state_len
    if limits is not None:
        short |= jnp.take(limits, jnp.minimum(rows, limits.shape[0] - 1)) < s.state_len - 1
    tile_of = jnp.where((slots >= 0) & (kinds == _SENT) & short, rows // s.tile, tiles)
    if tiles * tile_of.shape[0] <= config.COMPARE_PAIRS:
        return jnp.any(tile_of[None, :] == jnp.arange(tiles)[:, None], axis=1).astype(jnp.int32)
    return jnp.zeros((tiles,), jnp.int32).at[tile_of].set(1, mode="drop")


@functools.lru_cache(maxsize=64)
def _call(s: MixedStatic, x_shape: tuple, x_dtype, pool_shape: tuple, pool_dtype, interpret: bool):
    """The ``pallas_call`` for these shapes, built once."""
    tokens, dim = x_shape
    grid = (dim // s.channels, cdiv(tokens, s.tile))
    tile = pl.BlockSpec((s.tile, s.channels), lambda c, k, *_: (k, c))
    slots32 = [pltpu.VMEM((s.tile, s.slot_rows, s.channels), jnp.float32) for _ in range(2)]
    packed = [] if pool_dtype.itemsize == 4 else [pltpu.VMEM((s.tile, s.state_len, s.channels), pool_dtype)] * 2
    return pool_call(
        functools.partial(_kernel, s=s, dim=dim),
        x=(x_shape, x_dtype), pool=(pool_shape, pool_dtype), prefetch=9, grid=grid, tokens=tile,
        ids=[pl.BlockSpec((s.tile, 1), lambda c, k, *_: (k, 0))] * (2 if s.positioned else 1),
        channels=s.channels, problem=s.problem, name=MIXED_KERNEL, interpret=interpret,
        scratch=[
            *slots32,
            pltpu.VMEM((s.halo + s.tile, s.channels), jnp.float32),
            pltpu.VMEM((len(_slot_rows(s)), s.halo + s.tile, s.channels), jnp.float32),
            pltpu.SemaphoreType.DMA(()),
            pltpu.SemaphoreType.DMA(()),
            *packed,
        ],
    )
