"""The ``xla`` backend's blocked strategies: each linear map written out over blocks of
pixels, ``"gemm"`` (im2col GEMMs) and ``"conv_blocks"`` (convolutions per box).

XLA's CPU convolution runs a forward pass near the machine's GEMM rate, but the weight
gradient XLA derives from it (a convolution whose window is the whole image) runs at a
third of it, and summing one convolution per box over the whole batch holds two or three
outputs the size of ``x``. Here each map is written out, one block of pixels at a time
(whole images, or rows of one image) inside a ``lax.scan``, so that what a block needs
stays in cache and the extra memory is one block's:

* forward:         ``y[p]  = sum_t x[p + t] @ K[t]``
* input gradient:  the same over the cotangent with the flipped taps, channels swapped
  (stride 1), ``dx[p] = sum_t dy[p - t] @ K[t]^T``
* weight gradient: ``dK[t] = sum_p x[p + t]^T @ dy[p]``, always as GEMMs.

``"gemm"`` computes a block as GEMMs over an im2col of the **active** taps only (every
box active for all channels in one GEMM, ``(P, T*C_in) @ (T*C_in, C_out)``; a
channel-partial box is its own piece); it emits no convolution, so it is exact on every
platform. ``"conv_blocks"`` computes a block's forward and input gradient as one
``lax.conv_general_dilated`` per box over that box's sub-kernel (XLA's CPU convolution
packs its patches as it multiplies, which the im2col copy does not match), ``"VALID"``
over the explicitly padded block, so no convolution here has a padding at all (jaxlib
0.10's CPU convolution reads garbage under some paddings; see :mod:`.xla`); its weight
gradient is ``"gemm"``'s. A masked tap is never sliced, so never read; the padding is
zeros that meet only active kernel entries or cotangents of real outputs. Every map
sums its blocks and pieces in the accumulation dtype, and the caller rounds once.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...._core.primitives import zeros_varying
from ..spec import ConvSpec

__all__ = ["BLOCK_BYTES", "STRATEGIES", "unsupported", "forward", "input_grad", "weight_grad", "take"]

STRATEGIES = ("gemm", "conv_blocks")

# One block's im2col patches (what a block's GEMMs read; ``"conv_blocks"`` blocks the
# same pixels). Chosen on a 2-core AMD EPYC VM (1 MiB L2 per core, 32 MiB shared L3), at
# the roofline benchmark's PixelCNN and WaveNet shapes (bench/shapes.py): 1-4 MiB within noise of one
# another, 8 MiB and more slower as a block leaves the caches (also for the convolutions:
# whole-batch blocks of 32-128 MiB ran at half the rate).
BLOCK_BYTES = 2 << 20


def unsupported(spec: ConvSpec, kind: str) -> str | None:
    """Why the blocked strategies do not compute map ``kind`` of ``spec`` (``None``: they do)."""
    if spec.groups != 1:
        return "feature groups"
    if spec.segmented:
        # A select inside a convolution is not possible, and the blocks' GEMMs read no ids.
        return "segment ids"
    if kind == "input_grad" and any(s != 1 for s in spec.strides):
        # The transpose of a strided map reads a cotangent dilated by zeros: the
        # convolution strategies' transposes do that; a GEMM would multiply the zeros.
        return "strides in the input gradient"
    return None


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """``out[n, o] = sum_t a[n, o * strides - pads_lo + taps[t] * dilation] @ k[t]`` (zeros outside ``a``)."""

    out_spatial: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]
    strides: tuple[int, ...]
    dilation: tuple[int, ...]
    window: tuple[int, ...]


def _forward_geometry(spec: ConvSpec) -> _Geometry:
    return _Geometry(spec.out_spatial, spec.padding, spec.strides, spec.dilation, spec.window)


def _transposed_geometry(spec: ConvSpec) -> _Geometry:
    """The input gradient (stride 1) as a correlation of the cotangent with the flipped taps.

    ``dx[i] = sum_t dy[i + lo - t * d] k[t]``; with ``t' = K - 1 - t`` that reads
    ``dy[i - ((K - 1) * d - lo) + t' * d]``: low padding ``(K - 1) * d - lo``, high
    ``(K - 1) * d - hi`` (negative pads crop).
    """
    pads = tuple(((k - 1) * d - lo, (k - 1) * d - hi) for (lo, hi), k, d in zip(spec.padding, spec.window, spec.dilation))
    return _Geometry(spec.in_spatial, pads, spec.strides, spec.dilation, spec.window)


# --------------------------------------------------------------------------- pieces


@dataclasses.dataclass(frozen=True)
class _Gemm:
    """Taps (raster order) active for the same channels, as one GEMM over their im2col.

    ``kernel``: ``(T * C_in', C_out')``. ``None`` channels: all of them.
    """

    taps: tuple[tuple[int, ...], ...]
    in_channels: tuple[int, ...] | None
    out_channels: tuple[int, ...] | None
    kernel: object = None

    def width(self, c_in: int) -> int:
        return len(self.taps) * _count(self.in_channels, c_in)

    def block(self, ap, geometry: _Geometry, out_block, spec: ConvSpec, dtype):
        """``(pixels, C_out')`` of the padded block ``ap``."""
        return _dot(_patches(ap, self, geometry, out_block).astype(dtype), self.kernel.astype(dtype), spec)


@dataclasses.dataclass(frozen=True)
class _Conv:
    """A box of taps active for the same channels, as one ``"VALID"`` convolution.

    ``kernel``: ``(*box.size, C_in', C_out')``.
    """

    start: tuple[int, ...]
    in_channels: tuple[int, ...] | None
    out_channels: tuple[int, ...] | None
    kernel: object = None

    def width(self, c_in: int) -> int:
        return math.prod(self.kernel.shape[:-2]) * _count(self.in_channels, c_in)

    def block(self, ap, geometry: _Geometry, out_block, spec: ConvSpec, dtype):
        """``(pixels, C_out')`` of the padded block ``ap``: the box's corner of it, convolved."""
        s, d = geometry.strides, geometry.dilation
        lo = tuple(t * dd for t, dd in zip(self.start, d))
        extent = tuple((o - 1) * ss + (k - 1) * dd + 1 for o, ss, k, dd in zip(out_block, s, self.kernel.shape, d))
        a = lax.slice(ap, (0, *lo, 0), (ap.shape[0], *(st + e for st, e in zip(lo, extent)), ap.shape[-1]))
        if self.in_channels is not None:
            a = take(a, self.in_channels, axis=-1)
        y = lax.conv_general_dilated(
            a.astype(dtype), self.kernel.astype(dtype), s, "VALID", rhs_dilation=d,
            dimension_numbers=spec.dimension_numbers, precision=spec.precision, preferred_element_type=spec.acc_dtype,
        )
        return y.reshape(-1, y.shape[-1])


def _gemm_pieces(spec: ConvSpec, kernel=None, flip: bool = False) -> list[_Gemm]:
    """Every box active for all channels in one piece; each channel-partial box
    (:attr:`Mask.terms`) its own. ``flip``: the input gradient's (taps flipped, channels
    swapped, ``kernel: (*window, C_out, C_in)``). ``kernel=None``: the pieces alone."""
    terms = spec.mask.terms
    groups = [(sorted(t for term in terms if term.in_channels is None and term.out_channels is None
                      for t in term.box.taps()), None, None)]
    groups += [(term.box.taps(), term.in_channels, term.out_channels)
               for term in terms if term.in_channels is not None or term.out_channels is not None]
    pieces = []
    for taps, ci, co in groups:
        if flip:
            ci, co = co, ci
        if taps:
            k = None if kernel is None else _kernel_matrix(kernel, taps, ci, co)
            pieces.append(_Gemm(tuple(_flip(t, spec.window) for t in taps) if flip else tuple(taps), ci, co, k))
    return pieces


def _conv_pieces(spec: ConvSpec, kernel, flip: bool = False) -> list[_Conv]:
    """One piece per box (:attr:`Mask.terms`); ``flip`` as in :func:`_gemm_pieces`."""
    pieces = []
    for term in spec.mask.terms:
        box = tuple(slice(s, s + n) for s, n in zip(term.box.start, term.box.size))
        if not flip:
            k = _channels(kernel[box], term.in_channels, term.out_channels)
            pieces.append(_Conv(term.box.start, term.in_channels, term.out_channels, k))
            continue
        k = jnp.flip(_channels(kernel[box], term.out_channels, term.in_channels), axis=tuple(range(spec.ndim)))
        start = tuple(w - s - n for w, s, n in zip(spec.window, term.box.start, term.box.size))
        pieces.append(_Conv(start, term.out_channels, term.in_channels, k))
    return pieces


def _flip(tap, window):
    return tuple(k - 1 - t for t, k in zip(tap, window))


# --------------------------------------------------------------------------- the three maps
#
# Every map takes its operands rounded as the problem reads them and ``dtype``, the dtype
# its GEMMs or convolutions read them in (a widening is exact); it returns
# ``spec.acc_dtype``.


def forward(x, kernel, spec: ConvSpec, strategy: str, dtype, block_bytes: int = BLOCK_BYTES):
    """``y: (N, *out_spatial, C_out)`` from ``x: (N, *spatial, C_in)`` and ``kernel: (*window, C_in, C_out)``."""
    pieces = (_gemm_pieces if strategy == "gemm" else _conv_pieces)(spec, kernel)
    return _correlate(x, pieces, _forward_geometry(spec), spec.c_out, spec, dtype, block_bytes)


def input_grad(dy, kernel, spec: ConvSpec, strategy: str, dtype, block_bytes: int = BLOCK_BYTES):
    """``dx: (N, *spatial, C_in)`` from ``dy: (N, *out_spatial, C_out)`` (stride 1): the
    forward's pieces on the flipped taps, channels swapped."""
    kernel_t = jnp.swapaxes(kernel, -1, -2)  # (*window, C_out, C_in)
    pieces = (_gemm_pieces if strategy == "gemm" else _conv_pieces)(spec, kernel_t, flip=True)
    return _correlate(dy, pieces, _transposed_geometry(spec), spec.c_in, spec, dtype, block_bytes)


def weight_grad(x, dy, spec: ConvSpec, dtype, block_bytes: int = BLOCK_BYTES):
    """``dk: (*window, C_in, C_out)``: per GEMM piece ``patches(x)^T @ dy`` summed over
    pixel blocks; masked entries exact zeros, never computed."""
    pieces = _gemm_pieces(spec)
    geometry = _forward_geometry(spec)
    batch, c_out, dtype = x.shape[0], spec.c_out, np.dtype(dtype)
    widths = [p.width(spec.c_in) for p in pieces]
    # A block's patches are held twice: the slices, and their stack.
    images, rows = _block_shape(batch, geometry.out_spatial, 2 * sum(widths) * dtype.itemsize, block_bytes)

    def block(sums, xp, dy_block, out_block):
        """Adds one block's products: ``xp`` the padded input rows, ``dy_block`` their outputs."""
        dyb = dy_block.reshape(-1, c_out).astype(dtype)
        new = []
        for piece, total in zip(pieces, sums):
            patches = _patches(xp, piece, geometry, out_block, transposed=True).astype(dtype)
            cot = dyb if piece.out_channels is None else take(dyb, piece.out_channels, axis=-1)
            new.append(total + _dot(patches, cot, spec))
        return tuple(new)

    def images_step(sums, i):
        xp, dys = _pad(_images(x, i, images), geometry), _images(dy, i, images)
        if rows == geometry.out_spatial[0]:
            return block(sums, xp, dys, geometry.out_spatial), None
        return _fold_rows(
            lambda s, r0, n: block(s, _rows(xp, geometry, r0, n), lax.dynamic_slice_in_dim(dys, r0, n, axis=1),
                                   (n, *geometry.out_spatial[1:])),
            sums, geometry.out_spatial[0], rows,
        ), None

    init = tuple(zeros_varying((w, _count(p.out_channels, c_out)), spec.acc_dtype, dy) for w, p in zip(widths, pieces))
    sums, _ = lax.scan(images_step, init, jnp.arange(batch // images))
    return _scatter(sums, pieces, spec)


# --------------------------------------------------------------------------- blocks


def _correlate(a, pieces, geometry: _Geometry, c_out: int, spec: ConvSpec, dtype, block_bytes: int):
    """``sum over pieces of piece(a)``, block by block: ``(N, *geometry.out_spatial, c_out)``."""
    batch, dtype = a.shape[0], np.dtype(dtype)
    width = sum(p.width(a.shape[-1]) for p in pieces)
    images, rows = _block_shape(batch, geometry.out_spatial, width * dtype.itemsize, block_bytes)
    out_rest = geometry.out_spatial[1:]

    def block(ap, out_block):
        """One block's output ``(images, *out_block, c_out)`` from its padded input ``ap``."""
        out = None
        for piece in pieces:
            y = piece.block(ap, geometry, out_block, spec, dtype)
            if piece.out_channels is None:
                out = y if out is None else out + y
            else:
                out = (jnp.zeros((y.shape[0], c_out), y.dtype) if out is None else out).at[:, piece.out_channels].add(y)
        return out.reshape(ap.shape[0], *out_block, c_out)

    def images_step(_, i):
        ap = _pad(_images(a, i, images), geometry)
        if rows == geometry.out_spatial[0]:
            return None, block(ap, geometry.out_spatial)
        return None, _map_rows(lambda r0, n: block(_rows(ap, geometry, r0, n), (n, *out_rest)), geometry.out_spatial[0], rows)

    _, out = lax.scan(images_step, None, jnp.arange(batch // images))
    return out.reshape(batch, *geometry.out_spatial, c_out)


def _block_shape(batch: int, out_spatial, bytes_per_pixel: int, block_bytes: int) -> tuple[int, int]:
    """``(images, rows)`` per block: whole images while their patches fit ``block_bytes``
    (a divisor of the batch, so every block has the same shape), else one image in blocks
    of rows along the first spatial axis."""
    per_row = math.prod(out_spatial[1:]) * bytes_per_pixel
    per_image = out_spatial[0] * per_row
    if per_image > block_bytes:
        # As few blocks as fit, of equal rows where they divide (32 rows in 4 blocks of 8,
        # not 3 of 10 and a remainder of 2).
        blocks = math.ceil(out_spatial[0] / max(1, block_bytes // per_row))
        return 1, math.ceil(out_spatial[0] / blocks)
    most = max(1, block_bytes // per_image)
    return max(d for d in range(1, min(batch, most) + 1) if batch % d == 0), out_spatial[0]


def _map_rows(block, total: int, rows: int):
    """``block(row0, n)`` over row blocks covering ``[0, total)``, joined along axis 1: the
    full blocks in one ``lax.scan``, the remainder once more."""
    full = total // rows
    _, ys = lax.scan(lambda _, i: (None, block(i * rows, rows)), None, jnp.arange(full))
    out = jnp.moveaxis(ys, 0, 1)  # (images = 1, blocks, rows, ...): a reshape, no copy
    out = out.reshape(out.shape[0], full * rows, *out.shape[3:])
    if total % rows:
        out = jnp.concatenate([out, block(full * rows, total % rows)], axis=1)
    return out


def _fold_rows(block, init, total: int, rows: int):
    """``block(carry, row0, n)`` over row blocks covering ``[0, total)``: one ``lax.scan``
    and the remainder."""
    full = total // rows
    carry, _ = lax.scan(lambda c, i: (block(c, i * rows, rows), None), init, jnp.arange(full))
    if total % rows:
        carry = block(carry, full * rows, total % rows)
    return carry


def _images(a, i, images: int):
    """Block ``i`` of ``images`` whole images. Sliced inside the loop: a scan over
    ``a.reshape(groups, images, ...)`` copied all of ``a`` into the loop's state
    (jaxlib 0.10.2, one image per block)."""
    return lax.dynamic_slice_in_dim(a, i * images, images, axis=0)


def _pad(a, geometry: _Geometry):
    """The images with their zero padding (negative pads crop): tap ``t`` of output ``o`` reads ``o * s + t * d``."""
    zero = jnp.zeros((), a.dtype)
    return lax.pad(a, zero, ((0, 0, 0), *((lo, hi, 0) for lo, hi in geometry.pads), (0, 0, 0)))


def _rows(ap, geometry: _Geometry, row0, n_rows: int):
    """The padded input rows that output rows ``[row0, row0 + n_rows)`` (``row0`` traced) can reach."""
    s, d = geometry.strides[0], geometry.dilation[0]
    return lax.dynamic_slice_in_dim(ap, row0 * s, (n_rows - 1) * s + (geometry.window[0] - 1) * d + 1, axis=1)


def _patches(ap, piece: _Gemm, geometry: _Geometry, out_block, transposed: bool = False):
    """``(pixels, T * C)``, the inputs under the piece's taps for the outputs ``out_block``
    of the padded block ``ap``; ``transposed``: ``(T * C, pixels)``.

    A slice per tap, stacked: XLA:CPU copies each slice, then the stack (a row gather in
    one pass measured slower). Transposed, the slices are taken from the block with its
    channels moved first, so that the stack is the GEMM's operand as it is: stacking
    ``(pixels, C)`` slices by tap and contracting the pixels made XLA transpose every
    block's patches once more (10-25% slower at 7x7 and 3x3), and contracting the pixels
    of ``(pixels, T * C)`` patches ran at half the rate.
    """
    s, d = geometry.strides, geometry.dilation
    if piece.in_channels is not None:
        ap = take(ap, piece.in_channels, axis=-1)
    taps, channels = len(piece.taps), ap.shape[-1]
    if transposed:
        ap = jnp.moveaxis(ap, -1, 0)  # (C, images, *spatial)
    lead = ap.shape[:2] if transposed else ap.shape[:1]
    cols = []
    for tap in piece.taps:
        start = tuple(t * dd for t, dd in zip(tap, d))
        limit = tuple(st + (o - 1) * ss + 1 for st, o, ss in zip(start, out_block, s))
        if transposed:
            cols.append(lax.slice(ap, (0, 0, *start), (*lead, *limit), (1, 1, *s)))  # (C, images, *out)
        else:
            cols.append(lax.slice(ap, (0, *start, 0), (*lead, *limit, channels), (1, *s, 1)))  # (images, *out, C)
    if transposed:
        return jnp.stack(cols).reshape(taps * channels, -1)
    return jnp.stack(cols, axis=-2).reshape(-1, taps * channels)


def _kernel_matrix(kernel, taps, in_channels, out_channels):
    """``(T * C_in', C_out')``: the kernel entries of ``taps`` (in order) for the piece's channels."""
    k = _channels(jnp.stack([kernel[t] for t in taps]), in_channels, out_channels)  # (T, C_in', C_out')
    return k.reshape(-1, k.shape[-1])


def _channels(k, in_channels, out_channels):
    """``k[..., in_channels, out_channels]`` (``None``: all)."""
    if in_channels is not None:
        k = take(k, in_channels, axis=-2)
    if out_channels is not None:
        k = take(k, out_channels, axis=-1)
    return k


def _dot(a, b, spec: ConvSpec):
    """``a @ b``, accumulated in ``spec.acc_dtype``."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=spec.precision, preferred_element_type=spec.acc_dtype)


def _scatter(sums, pieces, spec: ConvSpec):
    """The dense ``(*window, C_in, C_out)`` kernel gradient from each piece's ``(T * C_in', C_out')``:
    masked entries are exact zeros, never computed (pieces are disjoint)."""
    if len(pieces) == 1 and pieces[0].in_channels is None and pieces[0].out_channels is None:
        return _place_taps(sums[0].reshape(len(pieces[0].taps), spec.c_in, spec.c_out), pieces[0].taps, spec.window)
    dense = jnp.zeros((*spec.window, spec.c_in, spec.c_out), spec.acc_dtype)
    for piece, total in zip(pieces, sums):
        ci = np.arange(spec.c_in) if piece.in_channels is None else np.asarray(piece.in_channels)
        co = np.arange(spec.c_out) if piece.out_channels is None else np.asarray(piece.out_channels)
        taps = np.asarray(piece.taps).T  # one index array per window dim
        index = (*(t[:, None, None] for t in taps), ci[None, :, None], co[None, None, :])
        dense = dense.at[index].set(total.reshape(len(piece.taps), len(ci), len(co)))
    return dense


def _place_taps(values, taps, window):
    """``(*window, C_in, C_out)`` holding ``values[i]`` at ``taps[i]`` and exact zeros elsewhere."""
    index = {t: i for i, t in enumerate(taps)}
    zeros = jnp.zeros(values.shape[1:], values.dtype)
    dense = [values[index[t]] if t in index else zeros for t in np.ndindex(*window)]
    return jnp.stack(dense).reshape(*window, *values.shape[1:])


def _count(channels, total: int) -> int:
    return total if channels is None else len(channels)


def take(a, indices, axis):
    """``a[..., indices]`` as a slice when the indices are contiguous (no gather)."""
    axis = a.ndim + axis if axis < 0 else axis
    start = indices[0]
    if tuple(indices) == tuple(range(start, start + len(indices))):
        return lax.slice_in_dim(a, start, start + len(indices), axis=axis)
    return jnp.take(a, jnp.asarray(indices), axis=axis)
