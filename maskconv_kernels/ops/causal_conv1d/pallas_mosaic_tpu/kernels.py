"""The Mosaic TPU kernels of ``causal_conv1d(implementation="pallas_mosaic_tpu")``.

A depthwise causal conv of width 2 to 8 is a few multiply-adds per element read: no
matmul, so the MXU is idle and the kernels are VPU code paced by HBM. Two
``pallas_call`` bodies on channels-last arrays, every product and sum in float32 and
each result rounded once:

* ``causal_conv1d_tpu_fwd``: one ``[positions, channels]`` block of ``y``: the taps
  (each the block's frame read ``(W-1-t) * dilation`` rows back), bias, SiLU and the
  padding select;
* ``causal_conv1d_tpu_bwd``: one block of the input gradient, from the pre-activation's
  cotangent ``g = dy * act'(pre)`` (the pre-activation recomputed: no residual but the
  inputs), and that block's share of the weight and bias gradients, added into float32
  accumulators that stay in VMEM along the sequence (the grid's last, ``arbitrary``
  axis: the same order every run, no atomics); the first block also gives the state's
  gradient.

**The frame.** A grid step reads its block and the ``H`` rows before it (``H``:
:func:`~.config.halo_rows`, the ``S = (W-1) * dilation`` positions an output reaches
back, in whole tiles) as a second, ``H``-row BlockSpec of the same array, so Pallas'
pipeline fetches both and no element is read more than ``1 + H / positions`` times
(``pl.Element`` windows with low padding are unimplemented on jax 0.10's Mosaic). The
first block takes those rows from the **front**: ``H`` rows holding the initial state
in their last ``S`` (zeros without one). The backward also reads the ``H`` rows after
its block, where its taps' outputs lie. The rows are copied into a float32 VMEM frame
and every tap is a load from it at a static offset.

**Exactness.** A tap crosses no document: with segment ids, the input tap ``t`` of
output ``p`` reads is selected to zero unless ``ids[p - back(t)] == ids[p]`` (a ``where``
on the input, never a product with a 0/1 mask; in the backward, the cotangent it
multiplies), so a NaN in one document changes no other's output and the gradient across
documents is exactly 0.0; padding outputs (negative ids) are zeros, bias and activation
included, and receive no gradient. Rows past the sequence (a last, partial
block; the backward's rows after the last block) hold whatever the DMA brought: the
cotangent is selected to zero there, and so are the inputs the weight gradient reads.
The state rows belong to the row's first document (their ids are its id; without a
state, ``-1``).

Layouts: ``x``, ``y``, ``dy``, ``dx`` ``[B, L, D]``; ``front`` ``[B, H, D]`` (x's
dtype); ``w`` ``[W, D]`` and ``bias`` ``[1, D]`` float32; segment ids ``[B, L, 1]`` and
the front's ``[B, H, 1]`` int32 (a column: one id per row of a block); the weight and
bias gradients ``[B, W, D]`` and ``[B, 1, D]`` float32 partial sums, one per example,
added in order by the caller.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...._core.tiling import cdiv
from ..checks import Problem
from .config import KERNELS, VMEM_LIMIT_BYTES

__all__ = ["Static", "forward", "backward", "sigmoid", "pool_call"]

_SQUEEZED = pl.Squeezed()


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything a kernel is specialised on but the arrays (hashable): the problem and its blocks."""

    problem: Problem
    positions: int  # rows of a block, a multiple of halo
    channels: int  # columns of a block: a multiple of 128, or all of D
    halo: int  # H: rows read before (and after) a block

    def back(self, t: int) -> int:
        """How far before an output its tap ``t`` reads."""
        return self.problem.back(t)


# --------------------------------------------------------------------------- frames


def _fill(frame_ref, front_ref, before_ref, main_ref, after_ref, first, s: Static):
    """``frame_ref[:H]`` the rows before the block (the front in the first block),
    ``[H:H + positions]`` the block and, given ``after_ref``, the ``H`` rows after: in the
    frame's dtype."""
    h, n, dtype = s.halo, s.positions, frame_ref.dtype

    @pl.when(first)
    def _():
        frame_ref[:h] = front_ref[...].astype(dtype)

    @pl.when(jnp.logical_not(first))
    def _():
        frame_ref[:h] = before_ref[...].astype(dtype)

    frame_ref[h:h + n] = main_ref[...].astype(dtype)
    if after_ref is not None:
        frame_ref[h + n:] = after_ref[...].astype(dtype)


def _same(ids_ref, lo: int, shift: int, rows: int, channels: int):
    """Bools ``[rows, channels]``: frame rows ``lo...`` and ``lo + shift...`` hold one document."""
    here = jnp.broadcast_to(ids_ref[lo:lo + rows], (rows, channels))
    there = jnp.broadcast_to(ids_ref[lo + shift:lo + shift + rows], (rows, channels))
    return here == there


def _pre(xs_ref, ids_ref, w_ref, bias_ref, lo: int, rows: int, s: Static):
    """float32 ``[rows, channels]``: the pre-activation at frame rows ``lo...``, ``bias +
    sum_t w[t] * x[p - back(t)]``, each input selected to zero where it lies in another
    document than the output (the select is on the input, so one product and one add per
    tap, as without segments)."""
    shape = (rows, s.channels)
    pre = jnp.broadcast_to(bias_ref[...], shape) if bias_ref is not None else jnp.zeros(shape, jnp.float32)
    for t in range(s.problem.width):
        k = lo - s.back(t)
        x = xs_ref[k:k + rows, :]
        if ids_ref is not None:
            x = jnp.where(_same(ids_ref, k, s.back(t), rows, s.channels), x, 0.0)
        pre = pre + w_ref[t:t + 1, :] * x
    return pre


def sigmoid(v):
    """SiLU's sigmoid as ``0.5 * tanh(v / 2) + 0.5``: one transcendental and no division,
    where ``jax.nn.sigmoid`` lowers to ``1 / (1 + exp(-v))`` on a TPU. The backward with
    bias and SiLU ran 9% faster with it on a TPU v5e (benchmarks/NOTES.md); float32
    either way, the two differ by a few float32 ulps."""
    return 0.5 * jnp.tanh(0.5 * v) + 0.5


def pool_call(kernel, *, x, pool, prefetch: int, grid: tuple, tokens: pl.BlockSpec, channels: int, problem,
              scratch: list, name: str, interpret: bool, ids: list | None = None):
    """The ``pallas_call`` of a kernel over a pool of slots (the decode step's and the mixed
    step's): ``prefetch`` scalar arrays, then an int32 column by each of ``ids`` (where given), x by
    ``tokens`` (a block of channel block ``c``, the grid's first axis), the weight ``[W,
    channels]`` and the bias ``[1, channels]`` (where the problem has one) of block ``c``,
    the pool left in HBM; results y like x and the pool, aliased to its operand. ``x``,
    ``pool``: ``(shape, dtype)``; both grid axes ``arbitrary`` (the DMAs and carries run in
    grid order)."""
    shared = lambda height: pl.BlockSpec((height, channels), lambda c, *_: (0, c))  # noqa: E731
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = list(ids or []) + [tokens, shared(problem.width)]
    in_specs += ([shared(1)] if problem.has_bias else []) + [hbm]
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(*x), jax.ShapeDtypeStruct(*pool)],
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=prefetch, grid=grid, in_specs=in_specs,
                                               out_specs=[tokens, hbm], scratch_shapes=scratch),
        input_output_aliases={prefetch + len(in_specs) - 1: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret,
        name=name,
    )


def _unpack(refs, names):
    """The refs by name (``None`` for each name not in use), in ``names``' order."""
    it = iter(refs)
    return {name: (next(it) if used else None) for name, used in names}


# --------------------------------------------------------------------------- kernels


def _forward_names(s: Static):
    p = s.problem
    return (
        ("x", True), ("before", True), ("front", True), ("w", True), ("bias", p.has_bias),
        ("ids", p.segmented), ("ids_before", p.segmented), ("ids_front", p.segmented),
        ("y", True), ("xs", True), ("is", p.segmented),
    )


def _forward_kernel(*refs, s: Static):
    """One block of ``y = act(pre)``, zeros at padding.

    Refs (as :func:`_forward_names`): x ``[positions, channels]``, the rows before it
    and the front ``[H, channels]`` (x's dtype), w ``[W, channels]``, bias ``[1,
    channels]``, ids ``[positions, 1]`` and ``[H, 1]`` twice; y ``[positions, channels]``;
    scratch: the float32 frame ``[H + positions, channels]`` and the ids' ``[H +
    positions, 1]``.
    """
    r = _unpack(refs, _forward_names(s))
    first = pl.program_id(2) == 0
    _fill(r["xs"], r["front"], r["before"], r["x"], None, first, s)
    if s.problem.segmented:
        _fill(r["is"], r["ids_front"], r["ids_before"], r["ids"], None, first, s)
    pre = _pre(r["xs"], r["is"], r["w"], r["bias"], s.halo, s.positions, s)
    y = pre * sigmoid(pre) if s.problem.silu else pre
    if s.problem.segmented:
        live = jnp.broadcast_to(r["ids"][...], y.shape) >= 0
        y = jnp.where(live, y, 0.0)  # padding outputs are zeros, bias and activation included
    r["y"][...] = y.astype(r["y"].dtype)


def _backward_names(s: Static):
    p = s.problem
    return (
        ("x", True), ("before", True), ("after", True), ("front", True), ("dy", True), ("dy_after", True),
        ("w", True), ("bias", p.has_bias and p.silu),
        ("ids", p.segmented), ("ids_before", p.segmented), ("ids_after", p.segmented), ("ids_front", p.segmented),
        ("dx", True), ("dw", True), ("db", p.has_bias), ("dfront", p.has_state),
        ("xs", True), ("gs", True), ("is", p.segmented),
    )


def _backward_kernel(*refs, s: Static):
    """One block of the input gradient; its share of the weight and bias gradients; in the
    first block, the state's gradient.

    Frame row ``e`` is position ``block * positions - H + e``. Refs (as
    :func:`_backward_names`): the forward's inputs, with the ``H`` rows after the block
    of x, dy and the ids; dx ``[positions, channels]`` (x's dtype), dw ``[W, channels]``
    and db ``[1, channels]`` float32 accumulators (this example's, across the
    sequence's blocks), dfront ``[H, channels]`` (x's dtype); scratch: the float32 input
    frame and the cotangent frame ``[2H + positions, channels]``, the ids' ``[2H +
    positions, 1]``.
    """
    r = _unpack(refs, _backward_names(s))
    h, n, c = s.halo, s.positions, s.channels
    block = pl.program_id(2)
    first = block == 0
    start = block * n  # the block's first position
    _fill(r["xs"], r["front"], r["before"], r["x"], r["after"], first, s)
    if s.problem.segmented:
        _fill(r["is"], r["ids_front"], r["ids_before"], r["ids"], r["ids_after"], first, s)

    # g = dy * act'(pre) at frame rows [H, 2H + positions): the block and the rows after it.
    rows = n + h
    position = start + lax.broadcasted_iota(jnp.int32, (rows, c), 0)
    valid = position < s.problem.length
    if s.problem.segmented:
        valid = valid & (jnp.broadcast_to(r["is"][h:], (rows, c)) >= 0)
    gs = r["gs"]
    gs[h:h + n] = r["dy"][...].astype(jnp.float32)
    gs[h + n:] = r["dy_after"][...].astype(jnp.float32)
    g = gs[h:]
    if s.problem.silu:
        pre = _pre(r["xs"], r["is"], r["w"], r["bias"], h, rows, s)
        sig = sigmoid(pre)
        g = g * (sig * (1.0 + pre * (1.0 - sig)))
    gs[h:] = jnp.where(valid, g, 0.0)
    gs[:h] = jnp.zeros((h, c), jnp.float32)

    @pl.when(first)
    def _():
        r["dw"][...] = jnp.zeros(r["dw"].shape, jnp.float32)
        if s.problem.has_bias:
            r["db"][...] = jnp.zeros(r["db"].shape, jnp.float32)
        # The state's rows are the frame's last S before the block: their gradient too.
        _input_grads(r, 0 if s.problem.has_state else h, start, s)

    @pl.when(jnp.logical_not(first))
    def _():
        _input_grads(r, h, start, s)

    if s.problem.has_bias:
        r["db"][...] += jnp.sum(gs[h:h + n], axis=0, keepdims=True)


def _input_grads(r, lo: int, start, s: Static):
    """The input gradient of frame rows ``[lo, H + positions)`` into dx (the block's) and
    dfront (rows before the block: the first block's, with a state), and their products
    with the cotangent into dw: ``dx[e] = sum_t w[t] g[e + back(t)]``, ``dw[t] += sum_e x[e]
    g[e + back(t)]``, each ``g`` selected to zero where it lies in another document than
    ``e``. Inputs past the sequence are selected to zero (their cotangents are zero, but
    the rows may hold anything). Rows before ``lo`` belong to the previous block, or to
    no input."""
    h, n, c = s.halo, s.positions, s.channels
    rows = h + n - lo
    e = lo + lax.broadcasted_iota(jnp.int32, (rows, c), 0)
    x = jnp.where(e < s.problem.length - start + h, r["xs"][lo:h + n], 0.0)
    dx = jnp.zeros((rows, c), jnp.float32)
    for t in range(s.problem.width):
        k = s.back(t)
        g = r["gs"][lo + k:lo + k + rows]
        if s.problem.segmented:
            g = jnp.where(_same(r["is"], lo, k, rows, c), g, 0.0)
        dx = dx + r["w"][t:t + 1, :] * g
        r["dw"][t:t + 1, :] += jnp.sum(x * g, axis=0, keepdims=True)
    r["dx"][...] = dx[h - lo:].astype(r["dx"].dtype)
    if lo < h and s.problem.has_state:
        r["dfront"][...] = dx[:h - lo].astype(r["dfront"].dtype)


# --------------------------------------------------------------------------- launches


def _params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT_BYTES)


def _halo_specs(s: Static, rows_total: int, ids: bool = False) -> dict:
    """BlockSpecs, on grid ``(b, c, block)``, of an ``[B, L, C]`` array's block (``C``: the
    block's channels, or the one column of ids), of the ``H`` rows before it, of the ``H``
    rows after it (the array's last ``H``-row block past its end: those rows are masked),
    and of the front's ``[B, H, C]`` block."""
    n, h = s.positions, s.halo
    ratio, last = n // h, cdiv(rows_total, h) - 1
    cols = 1 if ids else s.channels
    col = (lambda c: 0) if ids else (lambda c: c)
    return {
        "block": pl.BlockSpec((_SQUEEZED, n, cols), lambda b, c, i: (b, i, col(c))),
        "before": pl.BlockSpec((_SQUEEZED, h, cols), lambda b, c, i: (b, jnp.maximum(i * ratio - 1, 0), col(c))),
        "after": pl.BlockSpec((_SQUEEZED, h, cols), lambda b, c, i: (b, jnp.minimum((i + 1) * ratio, last), col(c))),
        "front": pl.BlockSpec((_SQUEEZED, h, cols), lambda b, c, i: (b, 0, col(c))),
    }


def _shared_spec(rows: int, s: Static):
    """The BlockSpec of a ``[rows, D]`` operand every example shares (weights, bias): the block's channels."""
    return pl.BlockSpec((rows, s.channels), lambda b, c, i: (0, c))


def forward(x, front, w, bias, ids, ids_front, *, s: Static, interpret: bool):
    """``y [B, L, D]`` in x's dtype (operands as the module docstring lays them out;
    ``bias``, ``ids`` and ``ids_front`` ``None`` where not in use)."""
    batch, length, dim = x.shape
    n, c = s.positions, s.channels
    rows = _halo_specs(s, length)
    in_specs = [rows["block"], rows["before"], rows["front"], _shared_spec(s.problem.width, s)]
    operands = [x, x, front, w]
    if s.problem.has_bias:
        in_specs.append(_shared_spec(1, s))
        operands.append(bias)
    scratch = [pltpu.VMEM((s.halo + n, c), jnp.float32)]
    if s.problem.segmented:
        id_rows = _halo_specs(s, length, ids=True)
        in_specs += [id_rows["block"], id_rows["before"], id_rows["front"]]
        operands += [ids, ids, ids_front]
        scratch.append(pltpu.VMEM((s.halo + n, 1), jnp.int32))
    return pl.pallas_call(
        functools.partial(_forward_kernel, s=s),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(batch, cdiv(dim, c), cdiv(length, n)),
        in_specs=in_specs,
        out_specs=rows["block"],
        scratch_shapes=scratch,
        compiler_params=_params(("parallel", "parallel", "parallel")),
        interpret=interpret,
        name=KERNELS[0],
    )(*operands)


def backward(x, front, w, bias, ids, ids_front, dy, *, s: Static, interpret: bool):
    """``(dx [B, L, D], dw [B, W, D], db [B, 1, D] or None, dfront [B, H, D] or None)``:
    dx and dfront in x's dtype, the per-example weight and bias gradients float32."""
    batch, length, dim = x.shape
    n, c, h = s.positions, s.channels, s.halo
    rows = _halo_specs(s, length)
    in_specs = [rows["block"], rows["before"], rows["after"], rows["front"], rows["block"], rows["after"],
                _shared_spec(s.problem.width, s)]
    operands = [x, x, x, front, dy, dy, w]
    if s.problem.has_bias and s.problem.silu:
        in_specs.append(_shared_spec(1, s))
        operands.append(bias)
    scratch = [pltpu.VMEM((2 * h + n, c), jnp.float32), pltpu.VMEM((2 * h + n, c), jnp.float32)]
    if s.problem.segmented:
        id_rows = _halo_specs(s, length, ids=True)
        in_specs += [id_rows["block"], id_rows["before"], id_rows["after"], id_rows["front"]]
        operands += [ids, ids, ids, ids_front]
        scratch.append(pltpu.VMEM((2 * h + n, 1), jnp.int32))
    per_example = lambda height: pl.BlockSpec((_SQUEEZED, height, c), lambda b, c_, i: (b, 0, c_))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((batch, s.problem.width, dim), jnp.float32)]
    out_specs = [rows["block"], per_example(s.problem.width)]
    if s.problem.has_bias:
        out_shape.append(jax.ShapeDtypeStruct((batch, 1, dim), jnp.float32))
        out_specs.append(per_example(1))
    if s.problem.has_state:
        out_shape.append(jax.ShapeDtypeStruct((batch, h, dim), x.dtype))
        out_specs.append(per_example(h))
    outs = pl.pallas_call(
        functools.partial(_backward_kernel, s=s),
        out_shape=out_shape,
        grid=(batch, cdiv(dim, c), cdiv(length, n)),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
        compiler_params=_params(("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=KERNELS[1],
    )(*operands)
    dx, dw, rest = outs[0], outs[1], list(outs[2:])
    db = rest.pop(0) if s.problem.has_bias else None
    dfront = rest.pop(0) if s.problem.has_state else None
    return dx, dw, db, dfront
