"""The two Mosaic TPU kernels: the tap GEMM (forward and input gradient) and the tap weight gradient.

Both slide the active taps' windows over a zero-padded image (:mod:`.geometry`): a grid
step reads one block of the image and its halo block (two BlockSpecs of the same array,
pipelined by Pallas), copies them into one VMEM window, and slices every active tap's
operand from it at static offsets. Each tap is one MXU matmul accumulated in a float32
VMEM scratch; the result is rounded once, when it is written. Masked taps have no code:
an output is a sum over active taps only, so a value reachable only through masked taps
is never an operand (exactness is structural, not a multiplication by zero).

Channel-partial taps are pieces (:class:`.geometry.Piece`): a piece's operand channels
outside its runs are *selected* to zero before its matmul (``where``, never a product,
so a NaN there cannot reach it), its weight matrix holds zeros selected outside its
(read x write) runs (made by :mod:`.conv`), and its product is kept only in the result
channels it writes. The weight gradient computes each entry of ``x_tap^T @ dy`` from
that entry's channels only; :mod:`.conv` selects the masked entries of partial taps to
zero.

Layouts (channels-last; ``Squeezed`` batch):

* image: ``[N, *geometry.image, C_read]`` (``x``, or ``dy`` for the input gradient);
* weights: ``[pieces, C_read, C_result_pad]``;
* tap GEMM result: ``[N, *geometry.out_pad, C_result_pad]``;
* weight gradient: ``[1, taps_pad, C_in, C_out_pad]`` from ``dy: [N, *geometry.out_pad, C_out_pad]``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...._core.tiling import cdiv
from ..kernel_problem import in_runs
from .config import VMEM_LIMIT_BYTES
from .geometry import Geometry

__all__ = ["tap_gemm", "tap_weight_grad"]


def _compiler_params(semantics: tuple[str, ...]):
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT_BYTES)


def _at(g: Geometry, n, i, c=0):
    """A 4-D block index: example ``n``, block ``i`` along the blocked axis, channel block ``c``."""
    return (n, i, 0, c) if g.axis == 1 else (n, 0, i, c)


def _image_specs(g: Geometry, n_of, i_of) -> list:
    """The image block of grid step ``(n_of(ids), i_of(ids))`` and, if its taps reach past it, its halo block.

    The halo block has ``g.halo`` rows (columns), which divides ``g.block``: the rows after
    block ``i`` are halo block ``(i + 1) * block / halo`` of the same padded image.
    """
    if g.inside is not None:  # the whole unpadded image, which the kernel pads
        return [pl.BlockSpec((pl.Squeezed(), *g.inside, g.c_read), lambda *ids: (n_of(ids), 0, 0, 0))]
    specs = [pl.BlockSpec((pl.Squeezed(), *g.main_block, g.c_read), lambda *ids: _at(g, n_of(ids), i_of(ids)))]
    if g.halo:
        per_block = g.block // g.halo
        specs.append(pl.BlockSpec(
            (pl.Squeezed(), *g.halo_block, g.c_read), lambda *ids: _at(g, n_of(ids), (i_of(ids) + 1) * per_block),
        ))
    return specs


def _result_spec(g: Geometry, n_of, i_of, c_of) -> pl.BlockSpec:
    """One grid step's ``(rows, cols, block_n)`` block of a ``[N, *out_pad, C_pad]`` array."""
    return pl.BlockSpec((pl.Squeezed(), g.rows, g.cols, g.block_n), lambda *ids: _at(g, n_of(ids), i_of(ids), c_of(ids)))


def _window(image_ref, halo_ref, window_ref, g: Geometry):
    """The ref every tap of this step reads: the image block followed by its halo block.

    Without a halo (every tap at offset 0 along the blocked axis) the image block is the
    window. The copy is one pass over the window per step, beside a matmul per tap. Where
    the kernel pads (``g.inside``), the window is the unpadded image stored at the padding's
    origin (its columns shifted by ``g.col_shift`` onto a whole sublane tile) and zeros
    stored around it.
    """
    if g.inside is not None:
        return _padded_window(image_ref, window_ref, g)
    if halo_ref is None:
        return image_ref
    b = g.block
    if g.axis == 1:
        window_ref[:b] = image_ref[...]
        window_ref[b:] = halo_ref[...]
    else:
        window_ref[:, :b] = image_ref[...]
        window_ref[:, b:] = halo_ref[...]
    return window_ref


def _padded_window(image_ref, window_ref, g: Geometry):
    """The padded image in ``window_ref``: zeros stored around the operand, each step (a
    core of a megacore chip may start at any step)."""
    (h, w), (rows, cols) = g.inside, g.window
    top, left = g.taps.pad_lo[0], g.taps.pad_lo[1] + g.col_shift
    zeros = lambda r, c: jnp.zeros((r, c, g.c_read), window_ref.dtype)  # noqa: E731
    if top:
        window_ref[:top] = zeros(top, cols)
    if rows > top + h:
        window_ref[top + h:] = zeros(rows - top - h, cols)
    if left:
        window_ref[top:top + h, :left] = zeros(h, left)
    if cols > left + w:
        window_ref[top:top + h, left + w:] = zeros(h, cols - left - w)
    window_ref[top:top + h, left:left + w] = image_ref[...]
    return window_ref


def _operand(window, g: Geometry, offset: tuple[int, int]):
    """Tap operand ``[rows, cols, C_read]``: the window at the tap's static offset.

    Row offsets index the untiled leading dimension; column offsets are static sublane
    offsets (Mosaic shifts the loaded tiles).
    """
    dr, dc = offset[0], offset[1] + g.col_shift
    return window[dr:dr + g.rows, dc:dc + g.cols, :]


def _lanes(shape, offset=0):
    """The minor-dimension index of each element of ``shape`` plus ``offset``."""
    return lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1) + offset


def _unpack(refs, g: Geometry):
    """``(image, halo or None, other input, output, accumulator, window or None)``."""
    if g.halo_blocks:
        image_ref, halo_ref, other_ref, out_ref, acc_ref, window_ref = refs
        return image_ref, halo_ref, other_ref, out_ref, acc_ref, window_ref
    if g.inside is not None:
        image_ref, other_ref, out_ref, acc_ref, window_ref = refs
        return image_ref, None, other_ref, out_ref, acc_ref, window_ref
    image_ref, other_ref, out_ref, acc_ref = refs
    return image_ref, None, other_ref, out_ref, acc_ref, None


def _scratch(g: Geometry, acc_shape, dtype) -> list:
    scratch = [pltpu.VMEM(acc_shape, jnp.float32)]
    if g.halo_blocks or g.inside is not None:
        scratch.append(pltpu.VMEM((*g.window, g.c_read), dtype))
    return scratch


# --------------------------------------------------------------------------- tap GEMM


def _tap_gemm_kernel(*refs, g: Geometry, precision):
    """One ``(rows, cols, block_n)`` block of ``sum_pieces select_out(select_in(tap operand) @ w[piece])``.

    Refs: image ``[*main_block, C_read]``, halo ``[*halo_block, C_read]`` (when the taps
    reach past the block), weights ``[pieces, C_read, block_n]``; the result block
    ``[rows, cols, block_n]``; scratch: the float32 accumulator ``[rows * cols, block_n]``
    and the window ``[*window, C_read]``.
    """
    image_ref, halo_ref, w_ref, out_ref, acc_ref, window_ref = _unpack(refs, g)
    window = _window(image_ref, halo_ref, window_ref, g)
    first_channel = pl.program_id(1) * g.block_n
    first = True
    for t, offset in enumerate(g.taps.offsets):
        a = _operand(window, g, offset).reshape(g.pixels, g.c_read)
        for index, piece in enumerate(g.taps.pieces):
            if piece.tap != t:
                continue
            operand = a
            if piece.reads is not None:
                operand = jnp.where(in_runs(_lanes(a.shape), piece.reads), a, jnp.zeros_like(a))
            product = jnp.dot(operand, w_ref[index], precision=precision, preferred_element_type=jnp.float32)
            if piece.writes is not None:
                keep = in_runs(_lanes(product.shape, first_channel), piece.writes)
                product = jnp.where(keep, product, jnp.zeros_like(product))
            if first:
                acc_ref[...] = product
                first = False
            else:
                acc_ref[...] += product
    out_ref[...] = acc_ref[...].reshape(g.rows, g.cols, g.block_n).astype(out_ref.dtype)


def tap_gemm(image, w, g: Geometry, out_dtype, *, precision, interpret: bool, name: str):
    """``[N, *g.out_pad, C_result_pad]`` in ``out_dtype``: the forward or the input gradient.

    Args:
      image: ``[N, *g.image, C_read]``, the padded operand (:func:`.conv._pad_image`), or
        the unpadded ``[N, *g.inside, C_read]`` where the kernel pads.
      w: ``[pieces, C_read, C_result_pad]``, one weight matrix per piece.
      g: the blocks.
      out_dtype: the result's dtype (accumulated in float32, rounded once).
      precision: the dots' precision (``None``: Mosaic's default).
      interpret: run in Pallas' interpreter (any platform).
      name: the ``pallas_call``'s name, as HLO and profiles show it.

    The grid is ``(N, channel blocks, pixel blocks)``, every step independent
    (``parallel``): the weights' block changes with the channel block only, the image's
    with the example and pixel block.
    """
    batch = image.shape[0]
    n_of, c_of, i_of = (lambda ids: ids[0]), (lambda ids: ids[1]), (lambda ids: ids[2])
    in_specs = _image_specs(g, n_of, i_of) + [
        pl.BlockSpec((w.shape[0], g.c_read, g.block_n), lambda n, c, i: (0, 0, c)),
    ]
    return pl.pallas_call(
        functools.partial(_tap_gemm_kernel, g=g, precision=precision),
        out_shape=jax.ShapeDtypeStruct((batch, *g.out_pad, g.c_result_pad), out_dtype),
        grid=(batch, g.channel_blocks, g.steps),
        in_specs=in_specs,
        out_specs=_result_spec(g, n_of, i_of, c_of),
        scratch_shapes=_scratch(g, (g.pixels, g.block_n), image.dtype),
        compiler_params=_compiler_params(("parallel", "parallel", "parallel")),
        interpret=interpret,
        name=name,
    )(*([image, image] if g.halo_blocks else [image]), w)


# --------------------------------------------------------------------------- weight gradient


def _valid_pixels(g: Geometry, block):
    """Bools ``[rows, cols, C_in]``: which pixels of grid step ``block`` are real results, or ``None`` if all are.

    Results past the real ones (whole blocks, whole sublane tiles) have a zero cotangent,
    but their tap operands may be real inputs no real result reads through that tap: a
    ``0 * nan`` there would reach the weight gradient, so such operands are selected to zero.
    """
    (oh, ow), (hp, wp) = g.taps.out_hw, g.out_pad
    shape = (g.rows, g.cols, g.c_read)  # full-shaped: no broadcast of a bool across lanes
    valid = None
    if hp > oh:  # axis 1 only: rows are padded to whole blocks
        valid = lax.broadcasted_iota(jnp.int32, shape, 0) < oh - block * g.block
    if wp > ow:
        col = lax.broadcasted_iota(jnp.int32, shape, 1)
        in_cols = col < ow if g.axis == 1 else col < ow - block * g.block
        valid = in_cols if valid is None else valid & in_cols
    return valid


def _weight_grad_kernel(*refs, g: Geometry, tap_blocks: tuple[tuple[int, ...], ...], precision):
    """Adds one step's ``x_tap^T @ dy`` to a ``[block_taps, C_in, block_n]`` float32 accumulator.

    The grid is ``(tap blocks, channel blocks, N, pixel blocks)``: the accumulator is
    zeroed on each tile's first (example, pixel block) step and written on its last.
    Refs: image and halo blocks of ``x`` (as the tap GEMM's), ``dy`` ``[rows, cols,
    block_n]``; the result ``[block_taps, C_in, block_n]``; scratch: the accumulator and
    the window.
    """
    image_ref, halo_ref, dy_ref, out_ref, acc_ref, window_ref = _unpack(refs, g)
    tap_block, n, block = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when((n == 0) & (block == 0))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    window = _window(image_ref, halo_ref, window_ref, g)
    dy = dy_ref[...].reshape(g.pixels, g.block_n)
    valid = _valid_pixels(g, block)

    def accumulate(taps):
        for local, t in enumerate(taps):
            a = _operand(window, g, g.taps.offsets[t])
            if valid is not None:
                a = jnp.where(valid, a, jnp.zeros_like(a))
            a = a.reshape(g.pixels, g.c_read)
            # Contracting the pixels of both: (C_in, pixels) x (pixels, block_n) on the MXU.
            acc_ref[local] += lax.dot_general(
                a, dy, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32,
            )

    if len(tap_blocks) == 1:
        accumulate(tap_blocks[0])
    else:
        for b, taps in enumerate(tap_blocks):
            pl.when(tap_block == b)(functools.partial(accumulate, taps))

    @pl.when((n == pl.num_programs(2) - 1) & (block == pl.num_programs(3) - 1))
    def _write():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tap_weight_grad(image, dy, g: Geometry, block_taps: int, out_dtype, *, precision, interpret: bool, name: str):
    """``[1, taps_pad, C_in, C_out_pad]`` in ``out_dtype``: ``sum_pixels x_tap^T @ dy`` per active tap.

    Args:
      image: ``[N, *g.image, C_in]``, the padded ``x``, as the forward reads it (unpadded
        where the kernel pads).
      dy: ``[N, *g.out_pad, C_out_pad]``, zero-padded.
      g: the forward's blocks.
      block_taps: active taps per grid step (``taps_pad`` is the taps rounded up to it).

    One partial sum (``splits = 1``): the reduction over examples and pixel blocks is the
    grid's last two (``arbitrary``) axes, in a fixed order; tap and channel blocks are
    ``parallel``.
    """
    batch, taps = image.shape[0], len(g.taps.offsets)
    tap_blocks = tuple(tuple(range(s, min(taps, s + block_taps))) for s in range(0, taps, block_taps))
    c_of, n_of, i_of = (lambda ids: ids[1]), (lambda ids: ids[2]), (lambda ids: ids[3])  # ids[0]: the tap block
    in_specs = _image_specs(g, n_of, i_of) + [_result_spec(g, n_of, i_of, c_of)]
    return pl.pallas_call(
        functools.partial(_weight_grad_kernel, g=g, tap_blocks=tap_blocks, precision=precision),
        out_shape=jax.ShapeDtypeStruct((1, cdiv(taps, block_taps) * block_taps, g.c_read, g.c_result_pad), out_dtype),
        grid=(len(tap_blocks), g.channel_blocks, batch, g.steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((pl.Squeezed(), block_taps, g.c_read, g.block_n), lambda t, c, n, i: (0, t, 0, c)),
        scratch_shapes=_scratch(g, (block_taps, g.c_read, g.block_n), image.dtype),
        compiler_params=_compiler_params(("parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name=name,
    )(*([image, image] if g.halo_blocks else [image]), dy)
