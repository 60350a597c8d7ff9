"""The blocks the Mosaic TPU kernels run over, and what they hold in VMEM (pure Python, no kernels).

A stride-1 masked convolution is a sum of shifted GEMMs over the active taps: result
pixel ``(r, c)`` of tap ``t`` reads image pixel ``(r + dr[t], c + dc[t])`` of an image
zero-padded once, outside the kernel, so that every offset is ``>= 0`` and in bounds.
The forward reads ``x``; the input gradient reads ``dy`` with the flipped taps and the
complementary padding (:func:`forward_taps`, :func:`input_grad_taps`), so both are one
kernel. The weight gradient slides the same windows over ``x`` and contracts them with
``dy``.

A grid step owns a block of result pixels and reads the image window under it: the
block itself and a *halo* (the rows, or columns, that its taps read beyond it). Mosaic
BlockSpecs tile an array without overlap, so the window comes as two blocks of the same
padded image: the block of ``block`` rows at block index ``i`` and the halo block of
``halo`` rows at block index ``(i + 1) * block / halo`` (``halo`` divides ``block``),
both pipelined (double-buffered, prefetched) by Pallas on every jax version; the halo
rows are read twice from HBM, a fraction ``halo / block`` more. The kernel copies the
two into one VMEM window and slices each tap's operand from it at static offsets.

2-D problems (more than one result row) are blocked along rows, every column at once
(``axis=1``): rows are the arrays' leading dimension, which Mosaic does not tile, so any
block and halo height is legal. Single-row problems (1-D ones, lifted to height 1) are
blocked along columns (``axis=2``), the second-minor dimension, which Mosaic tiles by
8 (32-bit) or 16 (16-bit) sublanes: there blocks and halos are whole sublane tiles.

Mosaic tiles a block's last two dimensions by ``(sublanes, 128)``: the result width is
padded to whole sublane tiles so that a ``(rows, cols, C)`` window slice reshapes to a
``(rows * cols, C)`` matrix without a relayout, and VMEM sizes below count the padding
of channels to 128 lanes.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ...._core.tiling import cdiv, round_up
from ..kernel_problem import KernelProblem

__all__ = [
    "Runs", "Piece", "Taps", "Geometry", "forward_taps", "input_grad_taps", "make_geometry", "sublanes",
    "padded_bytes", "LANES",
]

LANES = 128  # a vreg's lanes: the minor dimension of every VMEM tile
Runs = tuple  # sorted (start, stop) channel runs, or None for every channel


@dataclasses.dataclass(frozen=True)
class Piece:
    """One term of a tap GEMM: tap ``tap`` (an index into :attr:`Taps.offsets`), reading
    the operand channels ``reads`` and writing the result channels ``writes`` (``None``:
    all). A window mask has one piece per active tap, reading and writing all channels."""

    tap: int
    reads: Runs | None = None
    writes: Runs | None = None

    @property
    def is_partial(self) -> bool:
        return self.reads is not None or self.writes is not None


@dataclasses.dataclass(frozen=True)
class Taps:
    """A sum of shifted GEMMs, static and hashable.

    Attributes:
      offsets: per distinct active tap, ``(dr, dc)``: result pixel ``(r, c)`` reads padded
        image pixel ``(r + dr, c + dc)``.
      pieces: the terms, in order (:class:`Piece`).
      pad_lo: the padded image's origin: padded pixel ``(r, c)`` is operand pixel
        ``(r - pad_lo[0], c - pad_lo[1])`` (zero outside the operand; negative: cropped).
      in_hw: the operand's spatial shape.
      out_hw: the result's spatial shape.
    """

    offsets: tuple[tuple[int, int], ...]
    pieces: tuple[Piece, ...]
    pad_lo: tuple[int, int]
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]

    @property
    def reach(self) -> tuple[int, int]:
        """The largest row and column offset: how far past a result pixel its taps read (none: 0)."""
        return max((dr for dr, _ in self.offsets), default=0), max((dc for _, dc in self.offsets), default=0)

    @property
    def has_partial(self) -> bool:
        return any(p.is_partial for p in self.pieces)


def _tap_index(problem: KernelProblem) -> dict:
    return {tap: i for i, tap in enumerate(problem.taps)}


def forward_taps(problem: KernelProblem) -> Taps:
    """``y = sum_t shift(x, t) @ k[t]``: tap ``(i, j)`` at offset ``(i * dh, j * dw)`` of ``x``
    padded by the problem's low padding; pieces read input and write output channels."""
    index = _tap_index(problem)
    (dh, dw) = problem.dilation
    return Taps(
        offsets=tuple((i * dh, j * dw) for i, j in problem.taps),
        pieces=tuple(Piece(index[p.tap], p.in_runs, p.out_runs) for p in problem.pieces),
        pad_lo=tuple(problem.pad_lo),
        in_hw=tuple(problem.in_hw),
        out_hw=tuple(problem.out_hw),
    )


def input_grad_taps(problem: KernelProblem) -> Taps:
    """``dx = sum_t shift(dy, flip(t)) @ k[t]^T``: the transpose of :func:`forward_taps`.

    Input pixel ``h`` receives from output ``h + pad_lo - i * dh`` through tap row ``i``
    (stride 1); over ``dy`` padded by ``(KH - 1) * dh - pad_lo`` that is the offset
    ``(KH - 1 - i) * dh``, a forward correlation with the flipped taps. Pieces read
    output and write input channels.
    """
    index = _tap_index(problem)
    (kh, kw), (dh, dw) = problem.window, problem.dilation
    return Taps(
        offsets=tuple(((kh - 1 - i) * dh, (kw - 1 - j) * dw) for i, j in problem.taps),
        pieces=tuple(Piece(index[p.tap], p.out_runs, p.in_runs) for p in problem.pieces),
        pad_lo=((kh - 1) * dh - problem.pad_lo[0], (kw - 1) * dw - problem.pad_lo[1]),
        in_hw=tuple(problem.out_hw),
        out_hw=tuple(problem.in_hw),
    )


def sublanes(itemsize: int) -> int:
    """Rows of a VMEM tile: 8 for 32-bit values, 16 for 16-bit ones (two per sublane)."""
    return 8 * max(1, 4 // itemsize)


def padded_bytes(shape, itemsize: int) -> int:
    """Bytes of a VMEM buffer of ``shape``: its last two dimensions padded to whole ``(sublanes, 128)`` tiles."""
    *lead, rows, lanes = (1,) * max(0, 2 - len(shape)) + tuple(shape)
    return int(np.prod(lead, dtype=np.int64)) * round_up(rows, sublanes(itemsize)) * round_up(lanes, LANES) * itemsize


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A tap GEMM's blocks (static, hashable).

    Attributes:
      taps: the shifted GEMMs.
      axis: 1: grid steps own blocks of result rows, every column; 2: blocks of result
        columns, every row (single-row problems).
      block: result rows (``axis=1``) or columns (``axis=2``) per grid step.
      halo: image rows (columns) a block's taps read beyond it: its halo block; ``0``
        when they read none. Divides ``block``.
      out_pad: the result's spatial shape padded to whole blocks (and, for ``axis=1``,
        its width to whole sublane tiles).
      image: the padded image's spatial shape.
      c_read: operand channels (the reduction).
      c_result: result channels.
      block_n: result channels per grid step: all of them, or a multiple of 128.
      itemsize: bytes of an operand element.
      inside: ``(H, W)`` where the kernel pads the operand itself (:func:`make_geometry`'s
        ``pad_inside``): it reads the unpadded ``[N, H, W, C]``, a whole image a step, and
        places it in its VMEM window, zero around; ``None``: the operand comes padded
        (``image``), a copy in HBM before the kernel.
    """

    taps: Taps
    axis: int
    block: int
    halo: int
    out_pad: tuple[int, int]
    image: tuple[int, int]
    c_read: int
    c_result: int
    block_n: int
    itemsize: int
    inside: tuple[int, int] | None = None

    @property
    def col_shift(self) -> int:
        """Columns the window has before the padded image's first where the kernel pads:
        the operand's first column then lands on a whole sublane tile (its store is
        aligned; the taps' loads are shifted anyway)."""
        if self.inside is None:
            return 0
        lo = self.taps.pad_lo[1]
        return round_up(lo, sublanes(self.itemsize)) - lo

    @property
    def halo_blocks(self) -> bool:
        """Whether a grid step reads a halo block beside its image block (the window is
        then their copy)."""
        return bool(self.halo) and self.inside is None

    @property
    def rows(self) -> int:
        """Result rows per grid step."""
        return self.block if self.axis == 1 else self.out_pad[0]

    @property
    def cols(self) -> int:
        """Result columns per grid step."""
        return self.out_pad[1] if self.axis == 1 else self.block

    @property
    def pixels(self) -> int:
        """Result pixels per grid step: the GEMMs' M."""
        return self.rows * self.cols

    @property
    def steps(self) -> int:
        """Grid steps along the blocked axis."""
        return self.out_pad[self.axis - 1] // self.block

    @property
    def c_result_pad(self) -> int:
        return round_up(self.c_result, self.block_n)

    @property
    def channel_blocks(self) -> int:
        return self.c_result_pad // self.block_n

    @property
    def main_block(self) -> tuple[int, int]:
        """Spatial shape of the image block a grid step reads (the halo's comes after it)."""
        if self.inside is not None:
            return self.inside
        return (self.block, self.image[1]) if self.axis == 1 else (self.image[0], self.block)

    @property
    def halo_block(self) -> tuple[int, int]:
        return (self.halo, self.image[1]) if self.axis == 1 else (self.image[0], self.halo)

    @property
    def window(self) -> tuple[int, int]:
        """Spatial shape of the VMEM window a grid step's taps read: its block and halo."""
        if self.inside is not None:
            return self.image[0], self.image[1] + self.col_shift
        if self.axis == 1:
            return self.block + self.halo, self.image[1]
        return self.image[0], self.block + self.halo

    def vmem_bytes(self, kernel: str, pieces_or_taps: int, out_itemsize: int = 4) -> int:
        """VMEM the kernel's buffers take (a bound on what Mosaic allocates besides its own scratch).

        Pallas double-buffers every pipelined block; the window, the float32 accumulator and
        the largest temporaries (one tap's operand matrix and one product) are single.
        ``pieces_or_taps``: the weight matrices per step (forward, input gradient) or the
        taps per step (weight gradient).
        """
        s, f32 = self.itemsize, 4
        image = 2 * padded_bytes((*self.main_block, self.c_read), s)
        if self.halo_blocks:
            image += 2 * padded_bytes((*self.halo_block, self.c_read), s)
        if self.halo_blocks or self.inside is not None:
            image += padded_bytes((*self.window, self.c_read), s)
        operand = padded_bytes((self.pixels, self.c_read), f32)  # one tap's slice, widened by selects at worst
        result = padded_bytes((self.pixels, self.block_n), f32)
        if kernel == "weight_grad":
            dy = 2 * padded_bytes((self.rows, self.cols, self.block_n), s)
            acc = padded_bytes((pieces_or_taps, self.c_read, self.block_n), f32)
            out = 2 * padded_bytes((pieces_or_taps, self.c_read, self.block_n), out_itemsize)
            product = padded_bytes((self.c_read, self.block_n), f32)
            return image + dy + acc + out + operand + product
        weights = 2 * padded_bytes((pieces_or_taps, self.c_read, self.block_n), s)
        out = 2 * padded_bytes((self.rows, self.cols, self.block_n), out_itemsize)
        return image + weights + out + 2 * result + operand


def make_geometry(
    taps: Taps, c_read: int, c_result: int, itemsize: int, block_pixels: int, block_channels: int,
    pad_inside: bool = False,
) -> Geometry:
    """The blocks of ``taps`` for about ``block_pixels`` result pixels and at most
    ``block_channels`` result channels (a multiple of 128) per grid step; with
    ``pad_inside``, the kernel pads the operand where :func:`_fits_inside` allows."""
    sub = sublanes(itemsize)
    (oh, ow), (reach_r, reach_c) = taps.out_hw, taps.reach
    if oh > 1:
        halo = reach_r
        owp = round_up(ow, sub)
        # Rows are untiled: any height, a multiple of the halo's so that the halo block
        # that follows block i is block (i + 1) * block / halo of the same array.
        block = round_up(min(oh, max(1, cdiv(block_pixels, owp))), max(halo, 1))
        out_pad = (round_up(oh, block), owp)
        image = (out_pad[0] + halo, owp + reach_c)
        axis = 1
    else:
        # Columns are the second-minor dimension: blocks and halo of whole sublane tiles.
        halo = round_up(reach_c, sub)
        unit = max(halo, sub)
        block = round_up(min(round_up(ow, sub), max(sub, block_pixels)), unit)
        out_pad = (oh, round_up(ow, block))
        image = (oh + reach_r, out_pad[1] + halo)
        axis = 2
    block_n = c_result if c_result <= block_channels else block_channels
    g = Geometry(taps, axis, block, halo, out_pad, image, c_read, c_result, block_n, itemsize)
    return dataclasses.replace(g, inside=tuple(taps.in_hw)) if pad_inside and _fits_inside(g) else g


def _fits_inside(g: Geometry) -> bool:
    """Whether the kernel can pad the operand itself: one grid step of rows holds the whole
    image (2-D), the padding is not negative, every operand row and column lies within the
    padded image (the padding outside would crop none), and the operand's width is whole
    sublane tiles (its store into the window is aligned at both ends)."""
    (lo_h, lo_w), (h, w) = g.taps.pad_lo, g.taps.in_hw
    return (g.axis == 1 and g.steps == 1 and lo_h >= 0 and lo_w >= 0 and lo_h + h <= g.image[0]
            and lo_w + w <= g.image[1] and w % sublanes(g.itemsize) == 0)
