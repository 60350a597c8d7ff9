"""The three Pallas (Triton) kernels: forward, input gradient and weight gradient.

Every kernel is an implicit GEMM over the mask's active taps only: the forward and
input-gradient kernels run one loop over (active tap, channel block) pairs whose tap
comes from the static list of active taps (``_tap_at``: a masked tap is never named, so
nothing can read it), and the weight-gradient grid has one row per active tap.
The kernels work on a 2-D problem; 1-D convolutions are 2-D ones of height 1.

Layouts (channels-last, as the public API):

* ``x: [N, H, W, C_in]``, ``dy: [N, OH, OW, C_out]`` read with gathers whose lanes
  outside the image, padding or channel count are masked off (``other=0``), so C=1, 3
  or 130 needs no padded copy of ``x``. Pixel indices are clamped into range; channel
  indices are left as ``c0 + arange``, never clamped, because Triton proves a load
  contiguous (and vectorises it to 16-byte accesses) only from that form, and a
  masked-off lane is never dereferenced;
* ``kernel: [KH, KW, C_in_pad, C_out_pad]`` zero-padded to whole channel tiles (small);
* outputs are written as whole tiles into arrays padded to whole tiles, then sliced.

Every index is kept per dimension (``n``, row, column, channel), each below 2^31; the
Triton lowering multiplies them by the strides in 64-bit arithmetic when an array
exceeds 2^32 bytes, so flattened offsets do not overflow.

Channel-partial taps (full-shaped masks) are split into pieces ``(tap, input set,
output set)`` in which every product is of an active entry: the kernel block is
``where``-selected to the piece's entries, the input load is masked to the piece's input
set (``other=0`` selects, it never multiplies) and the products are kept only in its
output set with a ``where``, so an input reachable only through masked entries (even inf
or NaN) never reaches an output and gets an exactly zero gradient. Channel sets are
static runs ``(start, stop)``, compared against iotas in the kernel: the kernels close
over no array constants (``custom_partitioning`` in
:mod:`maskconv_kernels._core.partitioning` requires that).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...._core.tiling import cdiv, round_up
from ..kernel_problem import KernelProblem, Piece, in_runs
from .config import Config, weight_grad_splits

__all__ = ["Geometry", "forward", "input_grad", "weight_grad"]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The kernel problem and its tiles: everything static a kernel is specialised on (hashable)."""

    problem: KernelProblem
    blocks: Config

    @property
    def c_in_pad(self) -> int:
        return round_up(self.problem.c_in, self.blocks.block_c_in)

    @property
    def c_out_pad(self) -> int:
        return round_up(self.problem.c_out, self.blocks.block_c_out)


def _full_block(shape):
    """A BlockSpec holding the whole array: the kernel gathers from it itself."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _compiler_params(blocks: Config):
    # Explicitly Triton: since jax 0.9 a GPU pallas_call without compiler params lowers
    # through Mosaic GPU, whose programming model these kernels do not use.
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _dot(a, b, g: Geometry, *, trans_a=False, trans_b=False):
    # DEFAULT precision is TF32 for float32 on NVIDIA GPUs; HIGHEST asks for IEEE products.
    precision = lax.Precision.HIGHEST if g.problem.highest else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _piece_kernel_block(kb, piece: Piece, ci, co):
    """The kernel block restricted to the piece's active entries (a select, never a product)."""
    if piece.in_runs is None and piece.out_runs is None:
        return kb
    keep = jnp.ones(kb.shape, jnp.bool_)
    if piece.in_runs is not None:
        keep &= in_runs(ci, piece.in_runs)[:, None]
    if piece.out_runs is not None:
        keep &= in_runs(co, piece.out_runs)[None, :]
    return jnp.where(keep, kb, jnp.zeros((), kb.dtype))


def _loop(trips: int, body, acc):
    """``fori_loop`` over a static trip count, inlined when there is one trip (small channel counts)."""
    if trips == 1:
        return body(jnp.int32(0), acc)
    return lax.fori_loop(0, trips, body, acc)


def _in_range(idx, size):
    return (idx >= 0) & (idx < size)


def _clamp(idx, size):
    return jnp.clip(idx, 0, size - 1)


def _tap_input(g: Geometry, oh, ow, th, tw, ok):
    """The input pixels tap ``(th, tw)`` of output pixels ``(oh, ow)`` reads.

    Returns ``(ok, row, col)``: ``ok`` narrowed to pixels inside the image (padding
    reads nothing), the row and column clamped into range for the masked-off rest.
    """
    (h, w) = g.problem.in_hw
    ih = oh * g.problem.strides[0] - g.problem.pad_lo[0] + th * g.problem.dilation[0]
    iw = ow * g.problem.strides[1] - g.problem.pad_lo[1] + tw * g.problem.dilation[1]
    return ok & _in_range(ih, h) & _in_range(iw, w), _clamp(ih, h), _clamp(iw, w)


def _gather(ref, pixel, chans, mask):
    """A ``[rows, channels]`` tile of a channels-last ``ref``, 0 where ``mask`` is False.

    ``pixel``: indices of the leading dims, each a scalar or a ``[rows]`` vector in
    range; ``chans``: ``c0 + arange`` (never clamped: Triton vectorises the load only
    from that form, and a masked-off lane is never dereferenced).
    """
    shape = mask.shape
    idx = tuple(i if jnp.ndim(i) == 0 else jnp.broadcast_to(i[:, None], shape) for i in pixel)
    return plgpu.load(ref.at[(*idx, jnp.broadcast_to(chans[None, :], shape))], mask=mask, other=0.0)


def _partial_pieces(g: Geometry) -> tuple[Piece, ...]:
    """Pieces of channel-partial taps: each has its own static code (rare: full-shaped masks)."""
    return tuple(p for p in g.problem.pieces if p.is_partial)


def _tap_at(t, taps: tuple[tuple[int, int], ...], run: int | None, kw: int):
    """``(row, col)`` of the ``t``-th of the static ``taps`` for a traced int32 ``t``.

    Taps in a raster run (``run``: PixelCNN, causal and stack masks, flat indices
    ``run .. run+T-1``, found once on the mask) cost a division; any other set, a chain
    of scalar selects. Either way ``t`` only ever names an active tap, and the kernels
    close over no array constant.
    """
    if run is not None:
        f = t + run
        return lax.div(f, kw), lax.rem(f, kw)
    th = tw = jnp.int32(0)
    for idx, (i, j) in enumerate(taps):
        th = jnp.where(t == idx, jnp.int32(i), th)
        tw = jnp.where(t == idx, jnp.int32(j), tw)
    return th, tw


def _tap_loop(taps, run, trips: int, kw: int, step, acc):
    """``acc`` + ``step(th, tw, j)`` over every active tap and reduction block ``j < trips``.

    One ``fori_loop`` of ``len(taps) * trips`` iterations, not one loop per tap: Triton
    software-pipelines the loads across taps, and the kernel's code (and its compile
    time) no longer grows with the number of taps.
    """
    if not taps:
        return acc

    def body(it, acc):
        if trips == 1:
            return acc + step(*_tap_at(it, taps, run, kw), jnp.int32(0))
        return acc + step(*_tap_at(lax.div(it, trips), taps, run, kw), lax.rem(it, trips))

    if len(taps) * trips == 1:
        return body(jnp.int32(0), acc)
    return lax.fori_loop(0, len(taps) * trips, body, acc)


def _sum_over_pieces(g: Geometry, trips: int, step, shape):
    """float32 ``sum step(th, tw, j[, piece])`` over every active tap and reduction block ``j``.

    Taps active for all channel pairs share one loop (:func:`_tap_loop`); each piece of a
    channel-partial tap gets static code of its own, so its masked entries have none.
    """
    acc = _tap_loop(g.problem.plain_taps, g.problem.plain_tap_run, trips, g.problem.window[1], step, jnp.zeros(shape, jnp.float32))
    for piece in _partial_pieces(g):
        acc = _loop(trips, lambda j, acc, piece=piece: acc + step(*piece.tap, j, piece), acc)
    return acc


def _pixel_tiled(kernel, name: str, a, k_pad, g: Geometry, hw, channels: int, block_channels: int, dtype,
                 interpret: bool):
    """A kernel whose program writes one ``[block_pixels, block_channels]`` tile of ``[N, *hw, channels]``.

    ``a`` (``x`` or ``dy``) and ``k_pad`` are whole-array operands the kernel gathers
    from; the output is written as whole tiles of an array padded to them, then sliced.
    """
    b = g.blocks
    batch, pixels = a.shape[0], hw[0] * hw[1]
    channels_pad = round_up(channels, block_channels)
    grid = (batch, cdiv(pixels, b.block_pixels), channels_pad // block_channels)
    out = _pallas_call(
        functools.partial(kernel, g=g),
        name=name,
        grid=grid,
        in_specs=[_full_block(a.shape), _full_block(k_pad.shape)],
        out_specs=pl.BlockSpec((pl.Squeezed(), b.block_pixels, block_channels), lambda n, i, j: (n, i, j)),
        out_shape=jax.ShapeDtypeStruct((batch, grid[1] * b.block_pixels, channels_pad), dtype),
        blocks=b,
        interpret=interpret,
    )(a, k_pad)
    return out[:, :pixels, :channels].reshape(batch, *hw, channels)


# --------------------------------------------------------------------------- forward


def _forward_kernel(x_ref, k_ref, y_ref, *, g: Geometry):
    """One ``[block_pixels, block_c_out]`` tile of ``y = sum_active_taps x_tap @ k_tap``.

    x_ref: [N, H, W, C_in]; k_ref: [KH, KW, C_in_pad, C_out_pad];
    y_ref: [block_pixels, block_c_out] (one tile of [N, OH*OW padded, C_out_pad]).
    """
    b = g.blocks
    bp, bci, bco = b.block_pixels, b.block_c_in, b.block_c_out
    oh_size, ow_size = g.problem.out_hw
    n = pl.program_id(0)
    p = pl.program_id(1) * bp + jnp.arange(bp, dtype=jnp.int32)
    co0 = pl.program_id(2) * bco
    co = co0 + jnp.arange(bco, dtype=jnp.int32)
    p_ok = p < oh_size * ow_size
    oh, ow = lax.div(p, ow_size), lax.rem(p, ow_size)
    trips = g.c_in_pad // bci

    def step(th, tw, j, piece=None):
        """The product of tap ``(th, tw)`` and input-channel block ``j`` (of ``piece``'s entries)."""
        ok, rows, cols = _tap_input(g, oh, ow, th, tw, p_ok)
        ci0 = j * bci
        ci = ci0 + jnp.arange(bci, dtype=jnp.int32)
        ci_ok = ci < g.problem.c_in
        if piece is not None and piece.in_runs is not None:
            ci_ok &= in_runs(ci, piece.in_runs)
        xb = _gather(x_ref, (n, rows, cols), ci, ok[:, None] & ci_ok[None, :])
        kb = k_ref[th, tw, pl.ds(ci0, bci), pl.ds(co0, bco)]
        if piece is not None:
            kb = _piece_kernel_block(kb, piece, ci, co)
        prod = _dot(xb, kb, g)
        if piece is not None and piece.out_runs is not None:
            prod = jnp.where(in_runs(co, piece.out_runs)[None, :], prod, 0.0)
        return prod

    y_ref[...] = _sum_over_pieces(g, trips, step, (bp, bco)).astype(y_ref.dtype)


def forward(x, k_pad, g: Geometry, out_dtype, interpret: bool):
    """``y: [N, OH, OW, C_out]`` from ``x: [N, H, W, C_in]``, accumulated in float32."""
    return _pixel_tiled(_forward_kernel, "maskconv_fwd", x, k_pad, g, g.problem.out_hw, g.problem.c_out, g.blocks.block_c_out,
                        out_dtype, interpret)


# --------------------------------------------------------------------------- input gradient


def _input_grad_kernel(dy_ref, k_ref, dx_ref, *, g: Geometry):
    """One ``[block_pixels, block_c_in]`` tile of ``dx``: the transposed problem.

    Input pixel ``i`` receives from output ``o`` through tap ``t`` when
    ``o * stride - pad_lo + t * dilation == i``: per tap, ``o = (i + pad_lo - t * dilation) / stride``
    where that division is exact and ``o`` is in range. Taps are the active ones only,
    so an input reachable only through masked taps is never accumulated into (exact 0).

    dy_ref: [N, OH, OW, C_out]; k_ref: [KH, KW, C_in_pad, C_out_pad];
    dx_ref: [block_pixels, block_c_in] (one tile of [N, H*W padded, C_in_pad]).
    """
    b = g.blocks
    bp, bci, bco = b.block_pixels, b.block_c_in, b.block_c_out
    (h, w), (oh_size, ow_size) = g.problem.in_hw, g.problem.out_hw
    n = pl.program_id(0)
    i = pl.program_id(1) * bp + jnp.arange(bp, dtype=jnp.int32)
    ci0 = pl.program_id(2) * bci
    ci = ci0 + jnp.arange(bci, dtype=jnp.int32)
    i_ok = i < h * w
    ih, iw = lax.div(i, w), lax.rem(i, w)
    trips = g.c_out_pad // bco

    def step(th, tw, j, piece=None):
        """The product of tap ``(th, tw)`` and output-channel block ``j`` (of ``piece``'s entries)."""
        ok = i_ok
        out_idx = []
        for pos, lo, t, d, s, size in zip(
            (ih, iw), g.problem.pad_lo, (th, tw), g.problem.dilation, g.problem.strides, (oh_size, ow_size)
        ):
            num = pos + lo - t * d
            ok &= num >= 0
            num = jnp.maximum(num, 0)  # division and remainder on non-negative values only
            if s > 1:
                ok &= lax.rem(num, s) == 0
                num = lax.div(num, s)
            ok &= num < size
            out_idx.append(_clamp(num, size))
        co0 = j * bco
        co = co0 + jnp.arange(bco, dtype=jnp.int32)
        co_ok = co < g.problem.c_out
        if piece is not None and piece.out_runs is not None:
            co_ok &= in_runs(co, piece.out_runs)
        dyb = _gather(dy_ref, (n, *out_idx), co, ok[:, None] & co_ok[None, :])
        kb = k_ref[th, tw, pl.ds(ci0, bci), pl.ds(co0, bco)]
        if piece is not None:
            kb = _piece_kernel_block(kb, piece, ci, co)
        prod = _dot(dyb, kb, g, trans_b=True)
        if piece is not None and piece.in_runs is not None:
            prod = jnp.where(in_runs(ci, piece.in_runs)[None, :], prod, 0.0)
        return prod

    dx_ref[...] = _sum_over_pieces(g, trips, step, (bp, bci)).astype(dx_ref.dtype)


def input_grad(dy, k_pad, g: Geometry, dx_dtype, interpret: bool):
    """``dx: [N, H, W, C_in]`` from ``dy: [N, OH, OW, C_out]``."""
    return _pixel_tiled(_input_grad_kernel, "maskconv_bwd_input", dy, k_pad, g, g.problem.in_hw, g.problem.c_in, g.blocks.block_c_in,
                        dx_dtype, interpret)


# --------------------------------------------------------------------------- weight gradient


def _weight_grad_kernel(x_ref, dy_ref, dk_ref, *, g: Geometry, batch: int, trips: int):
    """One ``[block_c_in, block_c_out]`` tile of ``dk[tap] = sum_pixels x_tap^T @ dy``, partial.

    The grid runs over (split, active tap, C_in tile, C_out tile): each program owns its
    tile of one split's partial sum and loops over ``trips`` pixel blocks of the
    ``N * OH * OW`` output pixels in a fixed order; the splits are added afterwards, in a
    fixed order too. No atomics, so the result is the same run to run. Entries of
    channel-partial taps outside the mask are selected to exact zeros.

    x_ref: [N, H, W, C_in]; dy_ref: [N, OH, OW, C_out];
    dk_ref: [block_c_in, block_c_out] (one tile of [splits, T, C_in_pad, C_out_pad]).
    """
    b = g.blocks
    bq, bci, bco = b.block_pixels_reduce, b.block_c_in, b.block_c_out
    oh_size, ow_size = g.problem.out_hw
    split, t = pl.program_id(0), pl.program_id(1)
    th, tw = _tap_at(t, g.problem.taps, g.problem.tap_run, g.problem.window[1])
    ci = pl.program_id(2) * bci + jnp.arange(bci, dtype=jnp.int32)
    co = pl.program_id(3) * bco + jnp.arange(bco, dtype=jnp.int32)
    ci_ok, co_ok = ci < g.problem.c_in, co < g.problem.c_out
    pixels = oh_size * ow_size

    def body(j, acc):
        q = (split * trips + j) * bq + jnp.arange(bq, dtype=jnp.int32)
        q_ok = q < batch * pixels
        q = jnp.minimum(q, batch * pixels - 1)
        n, p = lax.div(q, pixels), lax.rem(q, pixels)
        oh, ow = lax.div(p, ow_size), lax.rem(p, ow_size)
        x_ok, rows, cols = _tap_input(g, oh, ow, th, tw, q_ok)
        xb = _gather(x_ref, (n, rows, cols), ci, x_ok[:, None] & ci_ok[None, :])
        dyb = _gather(dy_ref, (n, oh, ow), co, q_ok[:, None] & co_ok[None, :])
        return acc + _dot(xb, dyb, g, trans_a=True)

    acc = _loop(trips, body, jnp.zeros((bci, bco), jnp.float32))
    # Channel-partial taps: keep each piece's (input set x output set) entries only.
    partial: dict[tuple[int, int], list[Piece]] = {}
    for piece in g.problem.pieces:
        if piece.in_runs is not None or piece.out_runs is not None:
            partial.setdefault(piece.tap, []).append(piece)
    for tap, pieces in partial.items():
        keep = None
        for piece in pieces:
            k = jnp.ones((bci, bco), jnp.bool_)
            if piece.in_runs is not None:
                k &= in_runs(ci, piece.in_runs)[:, None]
            if piece.out_runs is not None:
                k &= in_runs(co, piece.out_runs)[None, :]
            keep = k if keep is None else keep | k
        acc = jnp.where((t != g.problem.taps.index(tap)) | keep, acc, 0.0)
    dk_ref[...] = acc.astype(dk_ref.dtype)


def weight_grad(x, dy, g: Geometry, dk_dtype, interpret: bool):
    """``[splits, T, C_in, C_out]``: partial sums of ``dk`` for the active taps ``g.problem.taps`` only.

    The core adds the splits in a fixed order (deterministic, unlike atomics).
    """
    b = g.blocks
    batch = x.shape[0]
    tiles = (g.c_in_pad // b.block_c_in, g.c_out_pad // b.block_c_out)
    reduce_blocks = cdiv(batch * g.problem.out_hw[0] * g.problem.out_hw[1], b.block_pixels_reduce)
    splits = weight_grad_splits(len(g.problem.taps) * tiles[0] * tiles[1], reduce_blocks)
    trips = cdiv(reduce_blocks, splits)
    # One split: the kernel writes dk in its dtype. Several: float32 partial sums.
    part_dtype = dk_dtype if splits == 1 else jnp.float32
    dk = _pallas_call(
        functools.partial(_weight_grad_kernel, g=g, batch=batch, trips=trips),
        name="maskconv_bwd_weight",
        grid=(splits, len(g.problem.taps), *tiles),
        in_specs=[_full_block(x.shape), _full_block(dy.shape)],
        out_specs=pl.BlockSpec(
            (pl.Squeezed(), pl.Squeezed(), b.block_c_in, b.block_c_out), lambda s, t, i, j: (s, t, i, j)
        ),
        out_shape=jax.ShapeDtypeStruct((splits, len(g.problem.taps), g.c_in_pad, g.c_out_pad), part_dtype),
        blocks=b,
        interpret=interpret,
    )(x, dy)
    return dk[:, :, : g.problem.c_in, : g.problem.c_out]


# --------------------------------------------------------------------------- pallas_call


def _pallas_call(kernel, *, name, blocks, interpret, **kwargs):
    # jax >= 0.11 deprecates the Pallas Triton backend ("jax-pallas-triton") when a call is
    # lowered; the core filters that warning while it lowers this backend's kernels only
    # (the backend record's lowering_warnings).
    return pl.pallas_call(kernel, name=name, compiler_params=_compiler_params(blocks), interpret=interpret, **kwargs)
