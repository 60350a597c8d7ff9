"""Leak measurements: what an output must not read, and how much of it gets through.

The leak report (``python -m maskconv_kernels``), the causality audit
(:mod:`maskconv_kernels.audit`) and the benchmarks (:mod:`maskconv_kernels.bench`) measure
leaks with these primitives, so a figure means the same wherever it is printed:

* the allowed set of a convolution's output, from the mask's active taps, strides,
  padding and dilation: :func:`active_field` (the inputs one output reads) and
  :func:`clean_outputs` (the outputs that read none of a set of inputs);
* :func:`forbidden_gradient`: the largest ``|gradient|`` at inputs outside the allowed
  set; exactly ``0.0`` when nothing leaks, NaN when a gradient there is NaN;
* :func:`changed_elements`: how many output elements differ, bit for bit, between a clean
  run and one whose forbidden inputs were poisoned (NaN, another value); :func:`bits`
  gives the bit patterns it compares, so NaN payloads and signed zeros count too.

Only NumPy and ``jax.numpy``: nothing here depends on how a convolution is computed.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["active_field", "clean_outputs", "raster_future", "forbidden_gradient", "bits", "changed_elements"]

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _tap_reads(spec, tap: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The input each output reads through ``tap``: int ``(*out_spatial, d)`` and its bool in-bounds mask.

    Output ``o`` reads input ``o * stride - pad_lo + tap * dilation`` on each spatial
    axis (padding reads nothing), as ``lax.conv_general_dilated`` does with
    ``lhs_dilation=1``.
    """
    if any(d > 1 for d in spec.layout.lhs_dilation):
        raise ValueError(f"the allowed set of a convolution with lhs_dilation={spec.layout.lhs_dilation} is not "
                         "computed here: pass a spec without input dilation")
    grids = np.meshgrid(*(np.arange(n) for n in spec.out_spatial), indexing="ij")
    pos = np.stack([o * s - lo + t * d for o, s, (lo, _), t, d in
                    zip(grids, spec.strides, spec.padding, tap, spec.dilation)], -1)
    inside = ((pos >= 0) & (pos < np.asarray(spec.in_spatial))).all(-1)
    return pos, inside


def active_field(spec, out_index: Sequence[int]) -> np.ndarray:
    """bool ``spec.in_spatial``: the inputs that output ``out_index`` reads through an active tap.

    ``spec`` is a :class:`~maskconv_kernels.ops.masked_conv.spec.ConvSpec`. A tap with
    some active channels counts as active (a channel-grouped mask reads that pixel).
    Every input outside this set must get exactly zero gradient from the output.
    """
    field = np.zeros(spec.in_spatial, bool)
    out_index = tuple(int(i) for i in out_index)
    for tap in spec.mask.active_taps:
        pos, inside = _tap_reads(spec, tap)
        if inside[out_index]:
            field[tuple(pos[out_index])] = True
    return field


def clean_outputs(spec, poisoned: np.ndarray) -> np.ndarray:
    """bool ``spec.out_spatial``: the outputs that read no ``poisoned`` input through an active tap.

    ``poisoned`` is bool ``spec.in_spatial``. These outputs must stay bit-identical when
    the poisoned inputs become NaN or inf: only masked taps (or none) reach them.
    """
    poisoned = np.asarray(poisoned, bool)
    if poisoned.shape != tuple(spec.in_spatial):
        raise ValueError(f"poisoned has shape {poisoned.shape}; it marks inputs, so it needs the input's spatial "
                         f"shape {tuple(spec.in_spatial)}")
    reached = np.zeros(spec.out_spatial, bool)
    for tap in spec.mask.active_taps:
        pos, inside = _tap_reads(spec, tap)
        clipped = np.where(inside[..., None], pos, 0)
        reached |= inside & poisoned[tuple(np.moveaxis(clipped, -1, 0))]
    return ~reached


def raster_future(shape: Sequence[int], index: Sequence[int]) -> np.ndarray:
    """bool ``shape``: the positions at or after ``index`` in raster (row-major) order."""
    order = np.arange(int(np.prod(shape))).reshape(tuple(shape))
    return order >= order[tuple(index)]


def forbidden_gradient(grad, forbidden, axis=None):
    """The largest ``|grad|`` where ``forbidden`` is True: the gradient that leaks.

    Args:
      grad: gradients (any float dtype; read as float64), or their absolute values.
      forbidden: bool, broadcastable to ``grad``: the inputs the output must not see.
      axis: reduce over these axes (``None``: all), as ``np.max`` does.

    Returns:
      float64 (a Python float when ``axis`` is None): ``0.0`` when every forbidden
      gradient is exactly zero (or nothing is forbidden), NaN when one of them is NaN
      (a NaN gradient leaks too), else the largest magnitude.
    """
    g = np.abs(np.asarray(grad, np.float64))
    forbidden = np.broadcast_to(np.asarray(forbidden, bool), g.shape)
    there = np.where(forbidden, g, 0.0)
    largest = np.max(np.where(np.isnan(there), 0.0, there), axis=axis, initial=0.0)
    out = np.where(np.isnan(there).any(axis=axis), np.nan, largest)
    return float(out) if axis is None else out


def bits(y: jax.Array) -> jax.Array:
    """Floats as unsigned ints of their bit patterns (other dtypes unchanged): equality is bit equality."""
    if jnp.issubdtype(y.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(y, _UINT[jnp.dtype(y.dtype).itemsize])
    return y


def changed_elements(y: jax.Array, reference: jax.Array, axis=None) -> jax.Array:
    """int: the elements of ``y`` whose bits differ from ``reference``'s, summed over ``axis`` (``None``: all).

    Runs on the device (inside ``jit`` too); only the counts need to come back.
    """
    return jnp.sum(bits(jnp.asarray(y)) != bits(jnp.asarray(reference)), axis=axis)
