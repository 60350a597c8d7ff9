"""Decode caches: one masked-convolution layer evaluated one position at a time.

Autoregressive sampling from a convolutional model (PixelCNN, gated PixelCNN, WaveNet)
usually runs the whole network over the whole image for every generated pixel:
``(H * W)^2`` pixel-layer evaluations where ``H * W`` suffice. Ramachandran et al.
(2017, "Fast Generation for Convolutional Autoregressive Models") keep, per layer, a
cache of the recent inputs its taps read and compute one position per step. This
module does that for any layer :func:`maskconv_kernels.masked_conv` runs with stride 1:

* the cache is sized from the mask's *active* taps: for 2-D, the rows the active taps
  reach above the current one plus the current row (whose earlier pixels are the only
  ones read from it); for 1-D, ``(k - 1) * dilation + 1`` steps of a ring buffer for a
  causal kernel of size ``k`` (fewer when the mask drops the oldest taps);
* a step at position ``p`` writes the new input into the cache and returns the layer's
  output at ``p`` as a sum over the active taps only: the taps' inputs are gathered from
  the cache and contracted with the active kernel entries. Masked taps are never read,
  and padding is selected (``jnp.where``), never multiplied, so a NaN in a slot no
  active tap reads cannot reach the output, exactly as in ``masked_conv``;
* positions are traced values (one compilation for a whole ``lax.scan`` over positions)
  and may differ per example (``position`` of shape ``(N,)``, like causal-conv1d's
  ``cache_seqlens``).

Two steps exist for 2-D layers (``DecodeSpec.unit``):

* ``"pixel"``: one pixel in raster order. Every active tap must read a pixel at or
  before the current one (PixelCNN masks, the gated PixelCNN's horizontal stack).
* ``"row"``: one whole row. Every active tap must read the current row or a row above
  (the gated PixelCNN's vertical stack, whose type "B" layers read the current row's
  pixels on both sides: computable once per row, not once per pixel).

Channel-grouped masks (the original PixelCNN's R/G/B ordering, where a pixel's green
channels see its red ones) decode in sub-pixel steps (``channel_groups=G``): step
``s`` gives channel group ``s % G`` of pixel ``s // G``, each group contracting only the
(tap, input channel) entries its mask keeps.

``shift`` serves the first layer of a model: at step ``p`` the newest known input is
the one at ``p - shift`` (the pixel just sampled), and a layer whose mask never reads
the current position (type "A") can still give its output at ``p``. Decoding the model
then feeds the previous sample and gets the logits of the next one, like a transformer
decoder fed its shifted tokens.

Shapes: ``cache: (N, *DecodeSpec.cache_spatial, C_in)``; at one position, the input is
``(N, C_in)`` (pixel step) or ``(N, W, C_in)`` (row step) and the output ``(N, C_out)``
or ``(N, W, C_out)``; ``kernel: (*window, C_in // groups, C_out)``, as for
``masked_conv``. Accumulation is in float32; outputs have the input's dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._core.args import is_int
from ..._core.history import Ring
from ...masks import Mask
from .spec import ConvSpec, make_spec

__all__ = ["DecodeSpec", "make_decode_spec", "init_cache", "update", "output", "step"]

UNITS = ("pixel", "row")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Everything static about decoding one masked-convolution layer.

    Attributes:
      mask: the normalised mask (window-shaped, or a full mask without channel-partial taps).
      spatial: the full input (= output) spatial shape, ``(L,)`` or ``(H, W)``. The
        first entry may be ``None``: a step never needs the length of the decoding order.
      offsets: per active tap, in raster order, the offset of the input it reads from the
        output position: ``tap * dilation - padding_lo`` per spatial dim.
      taps: the active taps themselves (indices into the kernel window), same order.
      padding: ``(lo, hi)`` per spatial dim (``lo + hi = dilation * (k - 1)``: same-size output).
      dilation: kernel dilation per spatial dim.
      groups: ``feature_group_count``.
      unit: ``"pixel"`` (one position per step) or ``"row"`` (2-D: one row per step).
      shift: at step ``p`` the input given is the one at position ``p - shift``.
      channel_groups: ``G > 1`` for sub-pixel steps (channel-grouped R/G/B masks): step
        ``s`` is channel group ``s % G`` of pixel ``s // G``.
      group_entries: sub-pixel steps only: per output channel group, the active
        ``(index into taps, input channels)`` pairs its outputs read.
    """

    mask: Mask
    spatial: tuple[int, ...]
    offsets: tuple[tuple[int, ...], ...]
    taps: tuple[tuple[int, ...], ...]
    padding: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]
    groups: int
    unit: str
    shift: int
    channel_groups: int = 1
    group_entries: tuple = ()

    @property
    def ndim(self) -> int:
        return len(self.spatial)

    @property
    def cache_spatial(self) -> tuple[int, ...]:
        """``(S,)`` ring-buffer steps (1-D) or ``(R, W)`` rows of the width (2-D).

        ``S`` and ``R`` are one more than the farthest the active taps reach back (in
        steps, or rows), so the slot of the oldest input an active tap reads is never
        overwritten before it is read.
        """
        reach = max(-o[0] for o in self.offsets)
        if self.ndim == 1:
            return (reach + 1,)
        return (reach + 1, self.spatial[1])

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """The distinct row offsets of the active taps (the cached rows a row step reads), for a 2-D spec."""
        return tuple(sorted({o[0] for o in self.offsets}))


def _reads_future(offset: tuple[int, ...], spec_unit: str, width: int | None, shift: int) -> bool:
    """Whether a tap at ``offset`` reads an input not yet given at the step that needs it."""
    if len(offset) == 1:
        return offset[0] > -shift
    if spec_unit == "row":
        return offset[0] > -shift
    # Raster order: the input at (i + dr, j + dc) comes dr * W + dc positions after (i, j).
    return offset[0] * width + offset[1] > -shift


def make_decode_spec(
    mask,
    spatial: Sequence[int],
    *,
    padding="SAME",
    dilation=1,
    strides=1,
    feature_group_count: int = 1,
    unit: str = "pixel",
    shift: int = 0,
    channel_groups: int | None = None,
) -> DecodeSpec:
    """Validates one layer's arguments (those of ``masked_conv``) for decoding.

    The convolution's arguments are checked by ``masked_conv``'s own validator
    (:func:`~maskconv_kernels.ops.masked_conv.spec.make_spec`, through
    :func:`_conv_spec`), so a bad one reads the same here as there; this function adds
    only what decoding needs: the step (``unit``, ``shift``, ``channel_groups``) and
    what a step cannot compute (strides, a resized output, taps that read ahead).

    Args:
      mask: static, shape ``window`` or the full kernel shape; as for ``masked_conv``.
      spatial: the input's spatial shape, ``(L,)`` or ``(H, W)``; the first entry may be
        ``None`` (only the width is needed). Decoding needs the output on the input's grid
        (stride 1, ``lo + hi = dilation * (k - 1)``).
      padding, dilation, strides, feature_group_count: as for ``masked_conv``.
      unit: ``"pixel"`` (1-D or 2-D) or ``"row"`` (2-D).
      shift: ``0`` (the input at ``p`` is given at step ``p``) or more (at step ``p`` the
        input at ``p - shift`` is given; the mask must not read later positions).
      channel_groups: ``G`` for sub-pixel steps with a full, channel-grouped mask (the
        original PixelCNN's R/G/B ordering, :func:`~maskconv_kernels.channel_grouped_mask`):
        ``C_in`` and ``C_out`` split into ``G`` contiguous groups, and step ``s`` takes
        input channel group ``s % G`` of pixel ``s // G`` (``(N, C_in // G)``) and gives
        output channel group ``s % G`` there (``(N, C_out // G)``). Pixel steps only.

    Raises:
      NotImplementedError: strides other than 1, 3-D layers, channel-partial (R/G/B) masks
        without ``channel_groups``.
      ValueError: the output grid is not the input's, or an active tap reads a position
        that is not yet given when its output is due; and whatever ``masked_conv`` raises
        for the convolution's arguments, in its words.
    """
    spatial = tuple(None if s is None and d == 0 else int(s) for d, s in enumerate(spatial))
    ndim = len(spatial)
    if ndim not in (1, 2):
        raise NotImplementedError(f"decoding supports 1-D and 2-D layers, got spatial shape {spatial}")
    if unit not in UNITS or (unit == "row" and ndim != 2):
        raise ValueError(f"unit must be 'pixel' (1-D or 2-D) or 'row' (2-D), got {unit!r} for {ndim}-D")
    if not is_int(shift) or shift < 0:
        raise ValueError(f"shift must be a non-negative int, got {shift!r}")
    conv = _conv_spec(mask, spatial, padding, dilation, strides, feature_group_count)
    if any(s != 1 for s in conv.strides):
        raise NotImplementedError(
            f"decoding steps one position at a time, so it needs strides=1; got strides={conv.strides}. "
            "A strided layer's outputs are not on the input's grid: run it with masked_conv instead"
        )
    mask, pads, dilation = conv.mask, conv.padding, conv.dilation
    if mask.partial_taps and channel_groups is None:
        raise NotImplementedError(
            f"mask has channel-partial taps {list(mask.partial_taps)} (an R/G/B channel-grouped mask): "
            "decoding it needs one step per channel group (sub-pixel steps): pass channel_groups=G "
            "(e.g. 3 for R, G, B)"
        )
    for d, ((lo, hi), k, dil) in enumerate(zip(pads, mask.window, dilation)):
        if lo + hi != dil * (k - 1):
            raise ValueError(
                f"decoding needs each output on its input's position, but padding {pads[d]} in spatial dim {d} "
                f"changes the size by {lo + hi - dil * (k - 1):+d}: use padding='SAME' "
                f"(or 'CAUSAL' for 1-D), or (lo, hi) pairs with lo + hi = dilation * (k - 1) = {dil * (k - 1)}"
            )
    taps = mask.active_taps
    if not taps:
        raise ValueError("mask has no active tap: the layer's output is its bias alone, there is nothing to decode")
    offsets = tuple(tuple(t * dil - lo for t, dil, (lo, _) in zip(tap, dilation, pads)) for tap in taps)
    if channel_groups is not None and channel_groups != 1:
        entries = _group_entries(mask, taps, offsets, channel_groups, unit, conv.groups, spatial[-1], shift)
        return DecodeSpec(mask, spatial, offsets, taps, pads, dilation, 1, unit, int(shift), channel_groups, entries)
    future = [t for t, o in zip(taps, offsets) if _reads_future(o, unit, spatial[-1], shift)]
    if future:
        hint = ""
        if unit == "pixel" and ndim == 2 and all(o[0] <= -shift for o in offsets):
            hint = " Its taps read whole rows above or the current row: decode it with unit='row'."
        raise ValueError(
            f"mask has active taps {future} that read inputs after the current position in decoding order "
            f"(unit={unit!r}, shift={shift}): a step could not compute the output from the inputs given so far."
            + hint
        )
    return DecodeSpec(mask, spatial, offsets, taps, pads, dilation, conv.groups, unit, int(shift))


def _conv_spec(mask, spatial: tuple, padding, dilation, strides, feature_group_count) -> ConvSpec:
    """The layer as ``masked_conv`` checks it: the :class:`ConvSpec` of one example of ``spatial``.

    Decoding is given no kernel, so its shape is read from the mask: a full mask is the
    kernel's shape ``(*window, C_in // groups, C_out)``; a window-shaped one gets one input
    and one output channel per group (the channel counts are the cache's and the kernel's
    business, checked when a step runs). An unknown first size (``None``) is taken as 1:
    the size-keeping paddings decoding accepts do not depend on it.
    """
    ndim = len(spatial)
    shape = tuple(mask.bits.shape if isinstance(mask, Mask) else np.shape(mask))
    if len(shape) not in (ndim, ndim + 2):
        raise ValueError(
            f"mask has shape {shape} but the spatial shape {spatial} has {ndim} dims: pass a mask of {ndim} dims "
            f"(the window, one bit per tap) or {ndim + 2} (the full kernel shape, (*window, C_in // groups, C_out))"
        )
    # An invalid feature_group_count is make_spec's to refuse, in its words; the shapes only need an int.
    groups = feature_group_count if is_int(feature_group_count) and feature_group_count >= 1 else 1
    kernel = shape if len(shape) == ndim + 2 else (*shape, 1, groups)
    x = (1, *(1 if s is None else s for s in spatial), kernel[-2] * groups)
    return make_spec(
        jax.ShapeDtypeStruct(x, jnp.float32), jax.ShapeDtypeStruct(kernel, jnp.float32), mask,
        strides=strides, padding=padding, dilation=dilation, feature_group_count=feature_group_count,
    )


def _group_entries(mask: Mask, taps, offsets, g: int, unit: str, groups, width, shift: int) -> tuple:
    """Per output channel group, the ``(tap index, input channels)`` pairs it reads; checks causality.

    Sub-step ``s = p * G + j`` computes output group ``j`` at pixel ``p``; the input
    channel ``ci`` at pixel ``p + offset`` is given at sub-step ``(p + offset) * G + ci // (C_in / G)``.
    """
    if not is_int(g) or g < 1:
        raise ValueError(f"channel_groups must be a positive int, got {g!r}")
    if unit != "pixel" or groups != 1 or not mask.is_full:
        raise NotImplementedError(
            "sub-pixel steps (channel_groups > 1) need unit='pixel', feature_group_count=1 and a full mask of "
            f"shape (*window, C_in, C_out); got unit={unit!r}, feature_group_count={groups}, mask {mask}"
        )
    c_in, c_out = mask.bits.shape[-2:]
    if c_in % g or c_out % g:
        raise ValueError(f"channel_groups={g} must divide C_in={c_in} and C_out={c_out}")
    cig, cog = c_in // g, c_out // g
    entries = []
    for j in range(g):
        group = []
        for t, (tap, offset) in enumerate(zip(taps, offsets)):
            bits = mask.bits[tap][:, j * cog : (j + 1) * cog]  # (C_in, C_out // G)
            if not (bits.all(axis=1) | ~bits.any(axis=1)).all():
                raise NotImplementedError(
                    f"output channel group {j} reads different input channels at tap {tap} for different output "
                    "channels: sub-pixel steps need every output channel of a group to read the same inputs"
                )
            cis = tuple(int(c) for c in np.flatnonzero(bits[:, 0])) if bits.size else ()
            raster = offset[0] * width + offset[1] if len(offset) == 2 else offset[0]
            late = [c for c in cis if raster * g + c // cig - j > -shift]
            if late:
                raise ValueError(
                    f"output channel group {j} reads input channels {late} at tap {tap}, which come after its "
                    f"sub-step (channel_groups={g}, shift={shift}): a step could not compute it from the inputs so far"
                )
            if cis:
                group.append((t, cis))
        entries.append(tuple(group))
    return tuple(entries)


def init_cache(spec: DecodeSpec, batch: int, c_in: int, dtype=jnp.float32) -> jax.Array:
    """An empty cache, ``(batch, *spec.cache_spatial, c_in)`` zeros of ``dtype``.

    Slots not yet written are never read as inputs: reads before the start of the
    sequence (or the image) select zero padding instead, so the initial values do not
    matter (the tests fill caches with NaN).
    """
    return jnp.zeros((batch, *spec.cache_spatial, c_in), dtype)


def _positions(position, batch: int) -> jax.Array:
    """``(1,)`` (one position for the whole batch) or ``(N,)`` (per example) int32 positions."""
    position = jnp.asarray(position, jnp.int32)
    if position.ndim > 1 or (position.ndim == 1 and position.shape[0] not in (1, batch)):
        raise ValueError(f"position must be a scalar or of shape ({batch},), got shape {position.shape}")
    return position.reshape(-1)


def _check_cache(spec: DecodeSpec, cache: jax.Array) -> None:
    if cache.ndim != spec.ndim + 2 or tuple(cache.shape[1:-1]) != spec.cache_spatial:
        raise ValueError(
            f"cache has shape {tuple(cache.shape)} but this layer's is (N, {', '.join(map(str, spec.cache_spatial))}, "
            "C_in): make it with init_cache(spec, ...)"
        )


def _slot(spec: DecodeSpec, q: jax.Array) -> tuple[jax.Array, ...]:
    """Cache indices (``(B,)`` each, after the batch dim) of the input at position ``q >= 0``.

    ``lax.div``/``lax.rem`` (C semantics) suffice for non-negative ints and cost less
    inside a loop than Python's floor semantics.
    """
    ring = Ring(spec.cache_spatial[0])  # rows (or positions) kept, circularly
    if spec.ndim == 2 and spec.unit == "pixel":
        width = spec.spatial[1]
        return (ring.index(lax.div(q, width)), lax.rem(q, width))
    return (ring.index(q),)


def update(spec: DecodeSpec, cache: jax.Array, x: jax.Array, position) -> jax.Array:
    """Writes the input given at step ``position`` (the input at ``position - shift``).

    Args:
      cache: ``(N, *spec.cache_spatial, C_in)``.
      x: ``(N, C_in)`` (pixel step) or ``(N, W, C_in)`` (row step), the cache's dtype.
      position: int scalar or ``(N,)``: the step (raster index for 2-D pixel steps, row
        index for row steps). Where ``position - shift < 0`` nothing is written.

    Returns:
      The updated cache.
    """
    _check_cache(spec, cache)
    n = cache.shape[0]
    q = _positions(position, n) - spec.shift
    valid = q >= 0
    x = x.astype(cache.dtype)
    if spec.channel_groups > 1:
        return _update_group(spec, cache, x, jnp.maximum(q, 0), valid)
    slot = _slot(spec, jnp.maximum(q, 0))
    if q.shape[0] == 1:
        # One position for the batch: a dynamic slice, not a scatter.
        starts = (0, *(i[0] for i in slot)) + (0,) * (cache.ndim - 1 - len(slot))
        sizes = (n,) + (1,) * len(slot) + cache.shape[1 + len(slot):]
        old = lax.dynamic_slice(cache, starts, sizes)
        new = jnp.where(valid[0], x.reshape(sizes), old)
        return lax.dynamic_update_slice(cache, new, starts)
    index = (jnp.arange(n), *slot)
    keep = valid.reshape((n,) + (1,) * (x.ndim - 1))
    return cache.at[index].set(jnp.where(keep, x, cache[index]))


def _update_group(spec: DecodeSpec, cache: jax.Array, x: jax.Array, q: jax.Array, valid: jax.Array) -> jax.Array:
    """Sub-pixel steps: writes ``x`` ``(N, C_in // G)`` as channel group ``q % G`` of pixel ``q // G``."""
    n, cg = cache.shape[0], cache.shape[-1] // spec.channel_groups
    slot = _slot(spec, lax.div(q, spec.channel_groups))
    start = lax.rem(q, spec.channel_groups) * cg
    if q.shape[0] == 1:
        starts = (0, *(i[0] for i in slot), start[0])
        sizes = (n,) + (1,) * len(slot) + (cg,)
        new = jnp.where(valid[0], x.reshape(sizes), lax.dynamic_slice(cache, starts, sizes))
        return lax.dynamic_update_slice(cache, new, starts)
    index = (jnp.arange(n)[:, None], *(i[:, None] for i in slot), start[:, None] + jnp.arange(cg)[None])
    return cache.at[index].set(jnp.where(valid[:, None], x, cache[index]))


def _group_output(spec: DecodeSpec, cache, kernel, s: jax.Array, precision) -> jax.Array:
    """Sub-pixel steps: ``(N, C_out // G)`` float32, output group ``s % G`` at pixel ``s // G``.

    Each group contracts only the (tap, input channel) entries its mask keeps; input
    channels of the current pixel not yet given are gathered but never multiplied.
    """
    g = spec.channel_groups
    values = _gather_taps(spec, cache, lax.div(jnp.maximum(s, 0), g))  # (N, T, C_in)
    cog = kernel.shape[-1] // g

    def group(j):
        pieces = spec.group_entries[j]
        if not pieces:
            return jnp.zeros((cache.shape[0], cog), jnp.float32)
        vals = jnp.concatenate([values[:, t, np.asarray(cis)] for t, cis in pieces], axis=1)  # (N, K)
        w = jnp.concatenate(
            [kernel[spec.taps[t]][np.asarray(cis), j * cog : (j + 1) * cog] for t, cis in pieces], axis=0
        )  # (K, C_out // G)
        return lax.dot_general(vals, w, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    j = lax.rem(jnp.maximum(s, 0), g)
    if s.shape[0] == 1:
        return lax.switch(j[0], [lambda j=j_: group(j) for j_ in range(g)])
    # Per-example groups: every group's output, each example's chosen by index (no arithmetic).
    return jnp.stack([group(k) for k in range(g)])[j, jnp.arange(cache.shape[0])]


def _gather_taps(spec: DecodeSpec, cache: jax.Array, p: jax.Array) -> jax.Array:
    """``(N, T, C_in)``: the input each active tap reads at output positions ``p`` ``(B,)``.

    Reads outside the sequence or image are zero padding, chosen by ``jnp.where``.
    """
    offsets = np.asarray(spec.offsets, np.int32)  # (T, ndim)
    if spec.ndim == 1:
        t = p[:, None] + offsets[None, :, 0]  # (B, T)
        valid = t >= 0
        index = (lax.rem(jnp.maximum(t, 0), spec.cache_spatial[0]),)
    else:
        width = spec.spatial[1]
        p = jnp.maximum(p, 0)[:, None]  # negative: not started (outputs unused)
        row = lax.div(p, width) + offsets[None, :, 0]
        col = lax.rem(p, width) + offsets[None, :, 1]
        # No tap reads a later row (make_decode_spec checks), so only the top edge pads rows.
        valid = (row >= 0) & (col >= 0) & (col < width)
        index = (lax.rem(jnp.maximum(row, 0), spec.cache_spatial[0]), jnp.clip(col, 0, width - 1))
    if p.shape[0] == 1:
        values = cache[(slice(None), *(i[0] for i in index))]  # (N, T, C_in)
    else:
        values = cache[(jnp.arange(cache.shape[0])[:, None], *index)]
    return jnp.where(valid[..., None], values, jnp.zeros((), values.dtype))


def _contract(values: jax.Array, kernel: jax.Array, spec: DecodeSpec, precision) -> jax.Array:
    """``(..., T, C_in) x kernel[active taps]`` -> ``(..., C_out)`` float32: the sum over active taps."""
    taps = tuple(np.asarray(spec.taps, np.int32).T)
    weights = kernel[taps]  # (T, C_in // G, C_out): the active taps' entries only
    g = spec.groups
    t, c_in = values.shape[-2:]
    c_out = weights.shape[-1]
    if g == 1:
        # One GEMM over (tap, channel) pairs: (..., T * C_in) @ (T * C_in, C_out).
        flat = values.reshape(*values.shape[:-2], t * c_in)
        return lax.dot_general(
            flat, weights.reshape(t * c_in, c_out), (((flat.ndim - 1,), (0,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        )
    values = values.reshape(*values.shape[:-1], g, c_in // g)
    weights = weights.reshape(t, c_in // g, g, c_out // g)
    y = jnp.einsum("...tgc,tcgd->...gd", values, weights, precision=precision, preferred_element_type=jnp.float32)
    return y.reshape(*y.shape[:-2], c_out)


def _pixel_output(spec, cache, kernel, p, precision) -> jax.Array:
    """``(N, C_out)`` float32: the sum over active taps of ``input(tap) @ kernel[tap]``."""
    return _contract(_gather_taps(spec, cache, p), kernel, spec, precision)


def _row_output(spec, cache, kernel, r, precision) -> jax.Array:
    """``(N, W, C_out)`` float32: the same sum for every pixel of row ``r``.

    Each active tap reads a cached row shifted by the tap's column; the width padding is
    real zeros around the row (``jnp.pad``), as in the full convolution.
    """
    n, width = cache.shape[0], spec.spatial[1]
    lo_w, hi_w = spec.padding[1]
    padded = {}
    for dr in spec.row_offsets:
        row = r + dr
        slot = lax.rem(jnp.maximum(row, 0), spec.cache_spatial[0])
        values = cache[:, slot[0]] if r.shape[0] == 1 else cache[jnp.arange(n), slot]  # (N, W, C_in)
        values = jnp.where((row >= 0)[:, None, None], values, jnp.zeros((), values.dtype))
        padded[dr] = jnp.pad(values, ((0, 0), (lo_w, hi_w), (0, 0)))
    shifted = [
        lax.slice_in_dim(padded[offset[0]], tap[1] * spec.dilation[1], tap[1] * spec.dilation[1] + width, axis=1)
        for tap, offset in zip(spec.taps, spec.offsets)
    ]
    return _contract(jnp.stack(shifted, 2), kernel, spec, precision)  # (N, W, T, C_in) -> (N, W, C_out)


def output(
    spec: DecodeSpec,
    cache: jax.Array,
    kernel: jax.Array,
    position,
    *,
    bias: jax.Array | None = None,
    precision=None,
) -> jax.Array:
    """The layer's output at step ``position``, from the cache alone.

    Args:
      cache: ``(N, *spec.cache_spatial, C_in)`` holding every input up to ``position - shift``.
      kernel: ``(*window, C_in // groups, C_out)``, the cache's dtype.
      position: int scalar or ``(N,)`` (traced is fine).
      bias: ``(C_out,)`` or ``None``.
      precision: ``lax.Precision`` of the products.

    Returns:
      ``(N, C_out)`` (pixel step) or ``(N, W, C_out)`` (row step), the cache's dtype.
    """
    _check_cache(spec, cache)
    if tuple(kernel.shape[:-2]) != spec.mask.window or kernel.shape[-2] * spec.groups != cache.shape[-1]:
        raise ValueError(
            f"kernel has shape {tuple(kernel.shape)} but the mask's window is {spec.mask.window} and the cache "
            f"holds {cache.shape[-1]} channels in {spec.groups} group(s): expected "
            f"({', '.join(map(str, spec.mask.window))}, {cache.shape[-1] // spec.groups}, C_out)"
        )
    p = _positions(position, cache.shape[0])
    if spec.channel_groups > 1:
        y = _group_output(spec, cache, kernel, p, precision)
        if bias is not None:
            j = lax.rem(jnp.maximum(p, 0), spec.channel_groups)
            y = y + bias.reshape(spec.channel_groups, -1)[j].astype(jnp.float32)
        return y.astype(cache.dtype)
    if spec.unit == "row":
        y = _row_output(spec, cache, kernel, p, precision)
    else:
        y = _pixel_output(spec, cache, kernel, p, precision)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(cache.dtype)


def step(
    spec: DecodeSpec,
    cache: jax.Array,
    x: jax.Array,
    kernel: jax.Array,
    position,
    *,
    bias: jax.Array | None = None,
    precision=None,
) -> tuple[jax.Array, jax.Array]:
    """One decoding step: :func:`update` with ``x``, then :func:`output` at ``position``.

    Returns:
      ``(y, cache)``: the output at ``position`` (``(N, C_out)`` or ``(N, W, C_out)``) and
      the updated cache.
    """
    cache = update(spec, cache, x, position)
    y = output(spec, cache, kernel, position, bias=bias, precision=precision)
    return y, cache
