"""Two references that are not ours: the float64 oracle and the leaky baseline.

* :func:`masked_conv_reference` is an independent float64 NumPy implementation (a
  loop over taps, no shared code with any backend). Tests compare against it.
* :func:`leaky_masked_conv` is what everyone runs today,
  ``lax.conv_general_dilated(x, kernel * mask)`` (what ``flax.linen.Conv(mask=...)``
  does). It is the speed baseline and the subject of the leak report; it is not exact.
"""
from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
from jax import lax

from .spec import ConvSpec, make_spec

__all__ = ["masked_conv_reference", "masked_conv_reference_vjp", "leaky_masked_conv"]


def masked_conv_reference(x, kernel, mask, *, segment_ids=None, **conv_args) -> np.ndarray:
    """Float64 masked convolution in NumPy: ``sum over active entries of x * kernel``.

    Takes the arguments of :func:`maskconv_kernels.masked_conv` except ``implementation``
    and the layout ones (``dimension_numbers``, ``lhs_dilation``, ``batch_group_count``):
    it is the oracle of the channels-last problem the backends compute. Masked entries are
    skipped (not multiplied by zero), and so are inputs of another segment, so it is exact
    for non-finite inputs too. Returns a float64 ``(N, *out_spatial, C_out)`` array.
    """
    spec = _channels_last_spec(x, kernel, mask, conv_args, segment_ids)
    kernel = np.asarray(kernel, np.float64)
    xp = _padded(np.asarray(x, np.float64), spec)
    out = np.zeros((x.shape[0], *spec.out_spatial, spec.c_out))
    for tap, view, gi, co, active in _products(xp, spec, segment_ids):
        out[..., co] += view[..., active] @ kernel[tap][active - gi * (spec.c_in // spec.groups), co]
    return out


def masked_conv_reference_vjp(x, kernel, mask, dy, *, segment_ids=None, **conv_args) -> tuple[np.ndarray, np.ndarray]:
    """Float64 gradients ``(dx, dkernel)`` of ``sum(masked_conv(x, kernel) * dy)``.

    Masked kernel entries and inputs reachable only through masked taps (or from other
    segments) get no contribution at all, so they are exactly 0.0.
    """
    spec = _channels_last_spec(x, kernel, mask, conv_args, segment_ids)
    kernel = np.asarray(kernel, np.float64)
    dy = np.asarray(dy, np.float64)
    xp = _padded(np.asarray(x, np.float64), spec)
    dxp = np.zeros_like(xp)
    dk = np.zeros(kernel.shape)
    cig = spec.c_in // spec.groups
    for tap, view, gi, co, active in _products(xp, spec, segment_ids):
        dk[tap][active - gi * cig, co] += np.tensordot(dy[..., co], view[..., active], axes=dy.ndim - 1)
        same = _same_segment(tap, spec, segment_ids)
        dxp[(*_window_slices(tap, spec), active)] += np.where(same, dy[..., co, None] * kernel[tap][active - gi * cig, co], 0.0)
    return _unpadded(dxp, spec, x.shape), dk


def _channels_last_spec(x, kernel, mask, conv_args, segment_ids) -> ConvSpec:
    spec = make_spec(x, kernel, mask, segmented=segment_ids is not None, **conv_args)
    if not spec.layout.is_channels_last:
        raise ValueError(
            "the float64 reference computes channels-last problems without input dilation or batch groups: for "
            "dimension_numbers, lhs_dilation or batch_group_count, compare with lax.conv_general_dilated in float64"
        )
    return spec


def _same_segment(tap, spec, segment_ids):
    """Bool ``(N, *out_spatial, 1)``: where ``tap`` may read (its input in the output's segment, not padding)."""
    if segment_ids is None:
        return np.ones((1,) * (spec.ndim + 2), bool)
    ids = np.asarray(segment_ids)[..., None]
    padded = _padded(ids, spec, fill=-1)
    return (padded[_window_slices(tap, spec)] == ids) & (ids >= 0)


def _padded(x, spec, fill=0):
    pos = [(0, 0)] + [(max(lo, 0), max(hi, 0)) for lo, hi in spec.padding] + [(0, 0)]
    xp = np.pad(x, pos, constant_values=fill)
    # Negative padding crops.
    crop = tuple(slice(max(-lo, 0), xp.shape[1 + i] - max(-hi, 0)) for i, (lo, hi) in enumerate(spec.padding))
    return xp[(slice(None), *crop)]


def _unpadded(dxp, spec, shape):
    dx = np.zeros(shape)
    src, dst = [], []
    for i, (lo, hi) in enumerate(spec.padding):
        n = shape[1 + i]
        # Padded coordinate p holds input coordinate p - lo.
        first, last = max(lo, 0), min(lo + n, dxp.shape[1 + i])
        src.append(slice(first, last))
        dst.append(slice(first - lo, last - lo))
    dx[(slice(None), *dst)] = dxp[(slice(None), *src)]
    return dx


def _window_slices(tap, spec):
    return (slice(None),) + tuple(
        slice(t * d, t * d + (o - 1) * s + 1, s)
        for t, d, o, s in zip(tap, spec.dilation, spec.out_spatial, spec.strides)
    )


def _products(xp, spec, segment_ids=None):
    """Yields ``(tap, input view, group, out channel, active input channels)``; the view is
    zero (selected) where the tap's input lies in another segment."""
    cig, cog = spec.c_in // spec.groups, spec.c_out // spec.groups
    dense = spec.mask.dense(cig, spec.c_out)
    for tap in itertools.product(*(range(k) for k in spec.window)):
        if not dense[tap].any():
            continue
        view = np.where(_same_segment(tap, spec, segment_ids), xp[_window_slices(tap, spec)], 0.0)
        for co in range(spec.c_out):
            gi = co // cog
            active = gi * cig + np.flatnonzero(dense[tap][:, co])
            if active.size:
                yield tap, view, gi, co, active


def leaky_masked_conv(
    x,
    kernel,
    mask,
    *,
    strides=1,
    padding="SAME",
    dilation=1,
    feature_group_count=1,
    precision=None,
    preferred_element_type=None,
):
    """``lax.conv_general_dilated(x, kernel * mask)``: the usual, inexact masked convolution."""
    spec = make_spec(
        x, kernel, mask, strides=strides, padding=padding, dilation=dilation,
        feature_group_count=feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return _leaky(x, kernel, spec)


def _leaky(x, kernel, spec: ConvSpec):
    m = jnp.asarray(spec.mask.dense(spec.c_in // spec.groups, spec.c_out), kernel.dtype)
    return lax.conv_general_dilated(
        x,
        kernel * m,
        window_strides=spec.strides,
        padding=spec.padding,
        rhs_dilation=spec.dilation,
        dimension_numbers=spec.dimension_numbers,
        feature_group_count=spec.groups,
        precision=spec.precision,
        preferred_element_type=None if spec.out_dtype == x.dtype else spec.out_dtype,
    )
