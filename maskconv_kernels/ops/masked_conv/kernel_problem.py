"""The kernel-facing problem: one masked convolution as every kernel backend sees it.

Built once per :class:`~.spec.ConvSpec` (:func:`kernel_problem`, cached)
and read by every kernel backend; none re-derives it. It is 2-D and channels-last: a
1-D problem is the 2-D one of height 1 (``H = KH = 1``, tap row 0, no row padding), and
arrays are lifted to it by a reshape (:func:`lift`). It names the *active* taps only,
in raster order; masked taps appear nowhere below this point.

Also here, written once for every kernel backend: the fixed-order sum of a weight
gradient's partial sums and the scatter of active-tap weight gradients into the dense
kernel gradient (masked taps are exact zeros, never computed).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..._core.tiling import sum_in_order  # re-exported: the kernels' fixed-order sum
from ...masks import raster_run
from .spec import ConvSpec

__all__ = ["Piece", "KernelProblem", "kernel_problem", "lift", "in_runs", "sum_in_order", "scatter_taps"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One active tap, or one channel group of a channel-partial tap.

    ``in_runs`` / ``out_runs``: the channels the piece reads / writes, as sorted
    ``(start, stop)`` runs (``None``: all channels).
    """

    tap: tuple[int, int]
    in_runs: tuple[tuple[int, int], ...] | None = None
    out_runs: tuple[tuple[int, int], ...] | None = None

    @property
    def is_partial(self) -> bool:
        return self.in_runs is not None or self.out_runs is not None


@dataclasses.dataclass(frozen=True)
class KernelProblem:
    """The static 2-D problem every kernel is specialised on (hashable, batch-free).

    Output tap ``(th, tw)`` of output pixel ``(oh, ow)`` reads input pixel
    ``(oh * strides[0] - pad_lo[0] + th * dilation[0], ow * strides[1] - pad_lo[1] + tw * dilation[1])``.
    """

    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    window: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    pad_lo: tuple[int, int]
    c_in: int
    c_out: int
    taps: tuple[tuple[int, int], ...]  # distinct active taps, raster order
    tap_run: int | None  # first flat tap when ``taps`` is one raster run (Mask.raster_run)
    pieces: tuple[Piece, ...]  # per tap, or per channel group of a channel-partial tap; raster order
    plain_taps: tuple[tuple[int, int], ...]  # taps active for every channel pair (all taps of a window mask)
    plain_tap_run: int | None  # first flat tap when ``plain_taps`` is one raster run
    precision: lax.Precision | tuple | None
    lifted: bool  # a 1-D problem seen as 2-D

    @property
    def highest(self) -> bool:
        """IEEE float32 products asked for (``precision=HIGHEST``) instead of TF32."""
        return lax.Precision.HIGHEST in self._precisions

    @property
    def high(self) -> bool:
        return lax.Precision.HIGH in self._precisions

    @property
    def _precisions(self) -> tuple:
        p = self.precision
        values = p if isinstance(p, tuple) else (p,)
        return tuple(lax.Precision(v) if isinstance(v, str) else v for v in values if v is not None)

    @property
    def flat_taps(self) -> tuple[int, ...]:
        """Raster indices ``row * KW + col`` of the active taps."""
        return tuple(i * self.window[1] + j for i, j in self.taps)

    @property
    def has_partial_taps(self) -> bool:
        return any(p.is_partial for p in self.pieces)

    def x_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, *self.in_hw, self.c_in)

    def y_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, *self.out_hw, self.c_out)

    def kernel_shape(self) -> tuple[int, ...]:
        return (*self.window, self.c_in, self.c_out)


def in_runs(index, runs: tuple[tuple[int, int], ...]):
    """Bools: where ``index`` (an array of channel indices, in a kernel or not) lies in one of
    the static ``(start, stop)`` runs of a :class:`Piece`: how a kernel selects a
    channel-partial piece's channels (a select, never a product with zero)."""
    hit = None
    for start, stop in runs:
        h = (index >= start) & (index < stop)
        hit = h if hit is None else hit | h
    return hit


def _runs(channels) -> tuple[tuple[int, int], ...]:
    """Sorted channel indices as maximal ``(start, stop)`` runs: ``(0, 1, 2, 5)`` -> ``((0, 3), (5, 6))``."""
    runs: list[list[int]] = []
    for c in channels:
        if runs and runs[-1][1] == c:
            runs[-1][1] = c + 1
        else:
            runs.append([c, c + 1])
    return tuple((a, b) for a, b in runs)


@functools.lru_cache(maxsize=1024)
def kernel_problem(spec: ConvSpec) -> KernelProblem:
    """The kernels' view of ``spec`` (1-D or 2-D, ungrouped), built once per spec."""
    if spec.ndim not in (1, 2) or spec.groups != 1:
        raise ValueError(f"kernel problems are 1-D or 2-D and ungrouped, got {spec.ndim}-D, groups={spec.groups}")
    lifted = spec.ndim == 1
    ones = (lambda t: (1, *t)) if lifted else tuple
    zeros = (lambda t: (0, *t)) if lifted else tuple
    # The mask's own decomposition into dense pieces (masks.Mask.terms): boxes of taps,
    # each active for a set of (input, output) channels; a piece per tap of each box.
    pieces = sorted(
        (
            Piece(
                zeros(tap),
                None if term.in_channels is None else _runs(term.in_channels),
                None if term.out_channels is None else _runs(term.out_channels),
            )
            for term in spec.mask.terms
            for tap in term.box.taps()
        ),
        key=lambda p: p.tap,  # raster order: neighbouring taps read neighbouring memory
    )
    window = ones(spec.window)
    plain = tuple(p.tap for p in pieces if not p.is_partial)
    return KernelProblem(
        in_hw=ones(spec.in_spatial),
        out_hw=ones(spec.out_spatial),
        window=window,
        strides=ones(spec.strides),
        dilation=ones(spec.dilation),
        pad_lo=zeros(tuple(lo for lo, _ in spec.padding)),
        c_in=spec.c_in,
        c_out=spec.c_out,
        taps=tuple(zeros(t) for t in spec.mask.active_taps),
        tap_run=spec.mask.raster_run,
        pieces=tuple(pieces),
        plain_taps=plain,
        plain_tap_run=spec.mask.raster_run if len(plain) == len(pieces) else raster_run(
            i * window[1] + j for i, j in plain
        ),
        precision=spec.precision,
        lifted=lifted,
    )


def lift(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``a`` reshaped to its 2-D problem shape (a 1-D array gains a row axis; 2-D is unchanged)."""
    return a if a.shape == tuple(shape) else a.reshape(shape)


def scatter_taps(active: jax.Array, problem: KernelProblem) -> jax.Array:
    """``[KH, KW, C_in, C_out]`` from the active taps' ``[T, C_in, C_out]``: masked taps exact zeros."""
    zeros = jnp.zeros(active.shape[1:], active.dtype)
    index = dict(zip(problem.taps, range(len(problem.taps))))
    kh, kw = problem.window
    dense = [active[index[(i, j)]] if (i, j) in index else zeros for i in range(kh) for j in range(kw)]
    return jnp.stack(dense).reshape(kh, kw, *active.shape[1:])
