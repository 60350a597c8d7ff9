"""``decode=True`` for the Flax modules: one position per call, on a ``"cache"`` collection.

Flax's convention (``nn.MultiHeadDotProductAttention(decode=True)``,
``nnx.MultiHeadAttention.init_cache``): the cache is allocated from a full-size input,
then every call consumes one position. Here the cache holds what
:mod:`maskconv_kernels.ops.masked_conv.decode` needs for the layer (``cached_input``, sized from the
mask's active taps) and the number of positions consumed so far (``cache_index``,
in raster order). Each call takes the input at one position and returns the layer's
output there:

* 1-D: ``(N, 1, C_in)`` -> ``(N, 1, C_out)``;
* 2-D, one pixel in raster order: ``(N, 1, 1, C_in)`` -> ``(N, 1, 1, C_out)``;
* 2-D, one row (for masks that read the current row on both sides, such as the gated
  PixelCNN's vertical stack): ``(N, 1, W, C_in)`` -> ``(N, 1, W, C_out)``; the index
  advances by ``W``.

With ``decode_shift=1`` the input given at position ``p`` is the one at ``p - 1`` (the
previous pixel, or the previous row for row steps): what the first layer of an
autoregressive model needs, whose output at ``p`` must not wait for the sample at ``p``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding

from maskconv_kernels.ops.masked_conv import decode
from maskconv_kernels.masks import Mask

__all__ = ["CACHE_FIELDS", "new_cache", "step"]

# The cache's Flax variables (linen's "cache" collection, nnx's Cache attributes), by name.
CACHE_FIELDS = ("cached_input", "cache_index")


def decode_spec(
    mask: Mask | None,
    kernel_shape,
    spatial,
    *,
    unit: str,
    shift: int,
    strides,
    padding,
    input_dilation,
    kernel_dilation,
    feature_group_count: int,
) -> decode.DecodeSpec:
    """The layer's :class:`maskconv_kernels.ops.masked_conv.decode.DecodeSpec`, from the module's fields."""
    window = tuple(kernel_shape[:-2])
    ndim = len(window)
    if mask is None:
        # Every tap active: fine for causal padding; SAME padding reads ahead, which the spec rejects.
        mask = Mask(window, np.ones(window, bool))
    if mask.partial_taps:
        raise NotImplementedError(
            "decode=True does not support channel-partial (R/G/B) masks in the Flax modules: sub-pixel steps "
            "exist in the functional API, maskconv_kernels.ops.masked_conv.decode.make_decode_spec(mask, "
            "spatial, channel_groups=G), which takes this module's kernel and bias"
        )
    if any(d != 1 for d in _per_dim(input_dilation, ndim)):
        raise NotImplementedError(f"decode=True supports input_dilation=1 only, got {input_dilation!r}")
    pads = canonicalize_padding(padding, ndim)
    if pads in ("CIRCULAR", "REFLECT"):
        raise NotImplementedError(
            f"decode=True does not support padding={padding!r}: it wraps or reflects future positions into the past"
        )
    return decode.make_decode_spec(
        mask,
        spatial,
        padding=pads,
        dilation=_per_dim(kernel_dilation, ndim),
        strides=_per_dim(strides, ndim),
        feature_group_count=feature_group_count,
        unit=unit,
        shift=shift,
    )


def init_spec(mask: Mask | None, kernel_shape, spatial, **fields) -> decode.DecodeSpec:
    """The spec checked when the cache is allocated: pixel steps, else (2-D) row steps.

    Both use the same cache; which one a call makes is decided by its input's shape.
    """
    try:
        return decode_spec(mask, kernel_shape, spatial, unit="pixel", **fields)
    except ValueError as pixel_error:
        if len(spatial) != 2:
            raise
        try:
            return decode_spec(mask, kernel_shape, spatial, unit="row", **fields)
        except ValueError:
            raise pixel_error from None


def _per_dim(value, ndim: int) -> tuple[int, ...]:
    value = 1 if value is None else value  # flax's sentinel for "1 in every dim"
    return (value,) * ndim if isinstance(value, int) else tuple(value)


def _check_full_input(shape, ndim: int):
    if len(shape) != ndim + 2:
        raise ValueError(
            f"decode=True takes inputs with exactly one batch dim, (N, *spatial, C_in) with {ndim} spatial dims; "
            f"got shape {tuple(shape)}"
        )


def cache_shape(input_shape, spec: decode.DecodeSpec) -> tuple[int, ...]:
    """``(N, *spec.cache_spatial, C_in)`` for a full-size input of ``input_shape``."""
    _check_full_input(input_shape, spec.ndim)
    return (input_shape[0], *spec.cache_spatial, input_shape[-1])


def unit_of(inputs_shape, cached_shape) -> str:
    """``"pixel"`` or ``"row"`` from the shape of one call's input in decode mode."""
    ndim = len(cached_shape) - 2
    expected = [(cached_shape[0], *(1,) * ndim, cached_shape[-1])]
    if ndim == 2:
        expected.append((cached_shape[0], 1, cached_shape[2], cached_shape[-1]))
    if tuple(inputs_shape) not in expected:
        raise ValueError(
            f"decode=True consumes one position per call: an input of shape {expected[0]} (one pixel)"
            + (f" or {expected[1]} (one row)" if ndim == 2 else "")
            + f" for this cache of shape {tuple(cached_shape)}; got {tuple(inputs_shape)}. Allocate the cache "
            "with a full-size input first (linen: init; nnx: init_cache)"
        )
    return "row" if ndim == 2 and inputs_shape[2] == cached_shape[2] and cached_shape[2] > 1 else "pixel"


def new_cache(mask: Mask | None, kernel_shape, input_shape, dtype, **fields) -> dict[str, jax.Array]:
    """The cache for full-size inputs of ``input_shape`` ``(N, *spatial, C_in)``, by variable name.

    ``cached_input``: zeros ``(N, *spec.cache_spatial, C_in)`` of ``dtype``;
    ``cache_index``: int32 ``0``. ``fields``: :func:`decode_spec`'s module fields.
    """
    spec = init_spec(mask, kernel_shape, tuple(input_shape[1:-1]), **fields)
    return {"cached_input": jnp.zeros(cache_shape(input_shape, spec), dtype), "cache_index": jnp.array(0, jnp.int32)}


def step(
    inputs: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    cache: dict[str, jax.Array],
    mask: Mask | None,
    *,
    precision,
    **fields,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One call in decode mode: ``(output shaped like inputs but C_out, the new cache)``.

    Args:
      inputs: ``(N, 1, C_in)``, ``(N, 1, 1, C_in)`` or ``(N, 1, W, C_in)``; its shape
        says whether this is a pixel or a row step (:func:`unit_of`).
      cache: :func:`new_cache`'s arrays, by variable name.
      fields: :func:`decode_spec`'s module fields.
    """
    cached, index = cache["cached_input"], cache["cache_index"]
    unit = unit_of(inputs.shape, cached.shape)
    spatial = (None, cached.shape[2]) if cached.ndim == 4 else (None,)
    spec = decode_spec(mask, kernel.shape, spatial, unit=unit, **fields)
    n, c_in = inputs.shape[0], inputs.shape[-1]
    if spec.unit == "row":
        width = spec.spatial[1]
        x = inputs.reshape(n, width, c_in)
        position, advance = index // width, width
    else:
        x = inputs.reshape(n, c_in)
        position, advance = index, 1
    y, cached = decode.step(spec, cached, x.astype(cached.dtype), kernel, position, bias=bias, precision=precision)
    return y.reshape(*inputs.shape[:-1], y.shape[-1]), {"cached_input": cached, "cache_index": index + advance}
