"""The padded pixel grid the Mosaic GPU kernels run over (pure JAX, no kernels).

A stride-1 masked convolution is a sum of shifted GEMMs: output pixel ``(oh, ow)`` of tap
``t`` reads operand pixel ``(oh + rows[t] + row0, ow + cols[t] + col0)`` with
``rows[t], cols[t] >= 0``. One 2-D TMA box per (active tap, channel block) reads a run
of output rows' operands, no gather; masked taps have no box at all.

TMA boxes into wgmma's tiled shared memory must start on a multiple of 8 rows. The
operand is materialised once per distinct column offset ``c``: copy ``d`` holds, at grid
pixel ``(i, j)``, operand pixel ``(i + row0, j + c + col0)`` for ``j < W_o`` and zero for
``j`` up to the grid width ``Wp``, ``W_o`` rounded up to a multiple of 8. Tap ``t`` then
reads copy ``d(t)`` at flat row ``r + rows[t] * Wp``: every box starts on a multiple of 8,
and the only outputs computed past the valid ones are the rounding of ``W_o`` (none at
32x32) and of the last tile. A 3x3 type-B mask makes 3 copies, a 7x7 type-A mask 7, a
WaveNet tap pair 2.

Outputs computed at the grid's extra columns are discarded; the copies are zero there,
which the weight gradient relies on: it reduces over whole grid rows, and a product of
a zero operand column with a zero cotangent is zero, never ``0 * nan``.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...._core.tiling import round_up
from ..kernel_problem import KernelProblem

__all__ = [
    "Grid", "CHUNK", "forward_grid", "weight_grad_grid", "input_grad_grid", "channel_mask", "copies", "crop", "rows_of",
]


# wgmma's K, for operands that are not K-major (both of the weight gradient's: pixels are
# their major dimension), is a multiple of 64 with 128-byte swizzling: the smallest
# weight-gradient chunk, which divides every image's valid grid rows.
CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Grid:
    """One shifted-GEMM problem on a padded grid (static, hashable).

    Attributes:
      in_hw: the operand's spatial shape ``(H_a, W_a)``.
      out_hw: the result's valid spatial shape ``(H_o, W_o)``.
      origin: operand pixel of grid pixel ``(0, 0)``: ``(row0, col0)`` (negative: zero padding).
      height: grid rows per image (``H_o`` plus the largest row offset).
      width: grid columns ``Wp``: ``W_o`` rounded up to a multiple of ``align`` (each copy
        is already shifted by its column offset).
      rows: per active tap, its row offset (grid rows).
      cols: per active tap, its column offset (pixels).
      align: what ``width`` is a multiple of (8: TMA into tiled shared memory; the weight
        gradient also needs whole reduction chunks).
      reads: per tap, the operand channels it reads (channel-partial masks), as sorted
        ``(start, stop)`` runs, ``None`` for all. A tap's copy
        holds zeros (selected, never multiplied) in the channels it does not read.
    """

    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    origin: tuple[int, int]
    height: int
    width: int
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    align: int
    reads: tuple  # per tap, the operand channels it reads as (start, stop) runs; None: all

    @property
    def distinct_copies(self) -> tuple:
        """The copies: distinct ``(column offset, channel runs)`` of the taps, sorted."""
        return tuple(sorted(set(zip(self.cols, self.reads)), key=lambda c: (c[0], c[1] or ())))

    @property
    def copy_index(self) -> tuple[int, ...]:
        """Per active tap, which copy it reads."""
        index = {c: i for i, c in enumerate(self.distinct_copies)}
        return tuple(index[c] for c in zip(self.cols, self.reads))

    @property
    def chunk(self) -> int:
        """Pixels per weight-gradient reduction step: 128 or 64, dividing the valid rows ``H_o * Wp``."""
        valid = self.out_hw[0] * self.width
        return 2 * CHUNK if valid % (2 * CHUNK) == 0 else CHUNK

    @property
    def image_rows(self) -> int:
        """Flat grid rows per image."""
        return self.height * self.width

    def shifts(self) -> tuple[int, ...]:
        """Per active tap, its row shift within its copy (a multiple of 8)."""
        return tuple(r * self.width for r in self.rows)


def _grid(in_hw, out_hw, origin, rows, cols, align: int, reads) -> Grid:
    return Grid(
        in_hw=tuple(in_hw), out_hw=tuple(out_hw), origin=tuple(origin),
        height=out_hw[0] + max(rows), width=round_up(out_hw[1], align),
        rows=tuple(rows), cols=tuple(cols), align=align, reads=tuple(reads or (None,) * len(cols)),
    )


def forward_grid(p: KernelProblem, align: int = 8, taps=None, reads=None) -> Grid:
    """``y[oh, ow] = sum_t x[oh + th*dh - pad_h, ow + tw*dw - pad_w] @ k[t]`` as a grid over ``x``.

    ``taps``: the taps to sum (default: the active taps), ``reads`` the input channels each
    reads (channel-partial pieces; default: all).
    """
    taps = p.taps if taps is None else taps
    (dh, dw), (ph, pw) = p.dilation, p.pad_lo
    th0, tw0 = min(t[0] for t in taps), min(t[1] for t in taps)
    return _grid(
        p.in_hw, p.out_hw, (th0 * dh - ph, tw0 * dw - pw),
        [(th - th0) * dh for th, _ in taps], [(tw - tw0) * dw for _, tw in taps], align, reads,
    )


def weight_grad_grid(p: KernelProblem) -> Grid:
    """The forward grid, ``Wp`` such that whole 64-pixel chunks tile an image's valid rows.

    The weight gradient reduces over the valid rows ``[0, H_o * Wp)`` of each image and
    no further: past them the copies hold real pixels (other taps' rows) that a chunk
    would multiply by a zero cotangent, and ``0 * nan`` is not zero.
    """
    return forward_grid(p, align=math.lcm(8, CHUNK // math.gcd(p.out_hw[0], CHUNK)))


def input_grad_grid(p: KernelProblem, align: int = 8, taps=None, reads=None) -> Grid:
    """``dx[ih, iw] = sum_t dy[ih - th*dh + pad_h, iw - tw*dw + pad_w] @ k[t]^T`` as a grid over ``dy``.

    ``taps``, ``reads``: as :func:`forward_grid` (``reads``: the output channels of ``dy``).
    """
    taps = p.taps if taps is None else taps
    (dh, dw), (ph, pw) = p.dilation, p.pad_lo
    th1, tw1 = max(t[0] for t in taps), max(t[1] for t in taps)
    return _grid(
        p.out_hw, p.in_hw, (ph - th1 * dh, pw - tw1 * dw),
        [(th1 - th) * dh for th, _ in taps], [(tw1 - tw) * dw for _, tw in taps], align, reads,
    )


def copies(a: jax.Array, g: Grid, channels: int, tail: int) -> jax.Array:
    """``[D, N * height * width + tail, channels]``: the operand on the grid, once per
    distinct column offset (and channel runs, :attr:`Grid.distinct_copies`).

    ``a: [N, H_a, W_a, C]``. Copy ``d`` holds grid pixel ``(i, j + cols_d)`` at ``(i, j)``
    for ``j < W_o``, zeros elsewhere (the grid's extra columns, padding, the tail rows
    that the last tiles' boxes read past the end, channels the copy's taps do not read);
    channels zero-padded to ``channels``.
    """
    n, h, w, c = a.shape
    (row0, col0), span = g.origin, g.out_hw[1] + max(g.cols)
    # Negative padding crops: rows and columns no active tap reaches are never copied.
    on_grid = lax.pad(
        a, jnp.zeros((), a.dtype),
        ((0, 0, 0), (-row0, g.height - h + row0, 0), (-col0, span - w + col0, 0), (0, channels - c, 0)),
    )
    out_w = g.out_hw[1]
    shifted = [
        jnp.pad(_select_channels(on_grid[:, :, col:col + out_w], runs), ((0, 0), (0, 0), (0, g.width - out_w), (0, 0)))
        for col, runs in g.distinct_copies
    ]
    flat = jnp.stack(shifted).reshape(len(shifted), n * g.image_rows, channels)
    return jnp.pad(flat, ((0, 0), (0, tail), (0, 0)))


def channel_mask(runs, channels: int) -> np.ndarray:
    """Bool ``[channels]``: the channels in ``runs`` (``None``: all)."""
    mask = np.zeros(channels, bool) if runs is not None else np.ones(channels, bool)
    for start, stop in runs or ():
        mask[start:stop] = True
    return mask


def _select_channels(a: jax.Array, runs) -> jax.Array:
    # A select, not a product with a 0/1 mask: a NaN in an unread channel stays out.
    return a if runs is None else jnp.where(channel_mask(runs, a.shape[-1]), a, jnp.zeros((), a.dtype))


def rows_of(a: jax.Array, g: Grid, channels: int, tail: int = 0) -> jax.Array:
    """``[N * H_o * width + tail, channels]``: a result-shaped ``a: [N, H_o, W_o, C]`` on the
    grid's rows (zero in the extra columns, the padded channels and the tail)."""
    n, h, w, c = a.shape
    rows = jnp.pad(a, ((0, 0), (0, 0), (0, g.width - w), (0, channels - c)))
    return jnp.pad(rows.reshape(n * h * g.width, channels), ((0, tail), (0, 0)))


def crop(out: jax.Array, g: Grid, batch: int, image_stride: int, c_out: int) -> jax.Array:
    """``[N, H_o, W_o, c_out]`` from a kernel result of ``image_stride`` flat rows per image."""
    ho, wo = g.out_hw
    per_image = out[: batch * image_stride].reshape(batch, image_stride, out.shape[-1])
    return per_image[:, : ho * g.width].reshape(batch, ho, g.width, -1)[:, :, :wo, :c_out]
