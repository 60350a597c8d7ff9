"""Depthwise masked convolutions as shifted elementwise products, and segment selects.

A depthwise convolution (``feature_group_count == C_in``: each output channel reads one
input channel) has no reduction over channels, so there is no GEMM to feed: it is a
sum, over the active taps, of the input shifted by the tap times that tap's weights.
This is the short causal convolution of sequence models (Mamba, gated DeltaNet, Hyena:
width 2 to 4, thousands of channels), where an im2col buffer or a batched dot with one
tiny GEMM per channel (what a grouped convolution lowers to) costs ten times the
memory traffic the problem needs. Here the forward and, by transposition, the input
gradient are elementwise (XLA fuses the shifts, products and sum into one pass); the
weight gradient is one reduction over batch and positions per active tap, in the
accumulation dtype. Masked taps are never read: there is no product for them.

Segment ids (packed documents) select, never multiply: tap ``t`` of output ``p`` reads
input ``q`` only where ``ids[q] == ids[p] >= 0`` (:func:`segment_selects`); the same
selects serve the xla backend's im2col GEMMs for every other mask and rank.

Everything here is pure JAX, linear in ``x`` and in the kernel, and computed in the
accumulation dtype by the caller (:mod:`.conv` transposes it for the gradients).
Shapes: ``x: (N, *spatial, C)``, ``kernel: (*window, 1, C * m)`` (``m`` the channel
multiplier: output channel ``o`` reads input channel ``o // m``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..spec import ConvSpec

__all__ = ["is_depthwise", "forward", "tap_view", "segment_selects"]


def is_depthwise(spec: ConvSpec) -> bool:
    """Each output channel reads exactly one input channel, and there are several."""
    return spec.groups == spec.c_in > 1


def tap_view(xp: jax.Array, tap: tuple[int, ...], spec: ConvSpec) -> jax.Array:
    """What ``tap`` reads for every output: ``(N, *out_spatial, C)`` from the padded input.

    ``xp`` is the input padded by ``spec.padding`` (a negative pad crops): tap ``k`` of
    output ``o`` reads padded position ``o * stride + k * dilation``.
    """
    start = (0, *(k * d for k, d in zip(tap, spec.dilation)), 0)
    limit = (
        xp.shape[0],
        *(s + (o - 1) * st + 1 for s, o, st in zip(start[1:-1], spec.out_spatial, spec.strides)),
        xp.shape[-1],
    )
    return lax.slice(xp, start, limit, (1, *spec.strides, 1))


def _pad(a: jax.Array, spec: ConvSpec, value) -> jax.Array:
    """``a`` (``(N, *spatial, ...)``) padded by ``spec.padding`` in its spatial dims."""
    rest = ((0, 0, 0),) * (a.ndim - 1 - spec.ndim)
    return lax.pad(a, jnp.asarray(value, a.dtype), ((0, 0, 0), *((lo, hi, 0) for lo, hi in spec.padding), *rest))


def segment_selects(segment_ids: jax.Array, spec: ConvSpec):
    """``tap -> bool (N, *spatial, 1)``: where tap ``tap`` of each output may read its input.

    True where the input the tap reads is in the output's segment and that segment is not
    padding (a negative id). Positions outside the input are padding. The output grid is
    the input's (``make_spec`` checks it), so output ``p`` has the segment of input ``p``.
    """
    ids = segment_ids[..., None]
    padded = _pad(ids, spec, -1)
    own = ids >= 0

    def select(tap):
        return (tap_view(padded, tap, spec) == ids) & own

    return select


def forward(x: jax.Array, kernel: jax.Array, spec: ConvSpec, segment_ids=None) -> jax.Array:
    """``(N, *out_spatial, C * m)``: the sum over active taps of shifted ``x`` times the tap's weights.

    ``x`` and ``kernel`` in the accumulation dtype, which the result keeps. A window mask
    is summed over its active taps in raster order; a full mask (taps active for some
    output channels only) over its pieces, each on its own channels.
    """
    m = spec.c_out // spec.c_in
    xp = _pad(x, spec, 0)
    select = None if segment_ids is None else segment_selects(segment_ids, spec)

    def product(tap, channels):
        v = tap_view(xp, tap, spec)
        if select is not None:
            v = jnp.where(select(tap), v, jnp.zeros((), v.dtype))
        if m > 1:
            v = jnp.repeat(v, m, axis=-1)
        w = kernel[(*tap, 0)]
        if channels is not None:
            v, w = jnp.take(v, jnp.asarray(channels), axis=-1), w[jnp.asarray(channels)]
        return v * w

    if not spec.mask.is_full:
        taps = spec.mask.active_taps
        out = product(taps[0], None)
        for tap in taps[1:]:
            out = out + product(tap, None)
        return out
    out = jnp.zeros((x.shape[0], *spec.out_spatial, spec.c_out), x.dtype)
    for term in spec.mask.terms:
        for tap in term.box.taps():
            y = product(tap, term.out_channels)
            out = out + y if term.out_channels is None else out.at[..., jnp.asarray(term.out_channels)].add(y)
    return out
