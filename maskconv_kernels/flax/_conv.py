"""What ``flax.linen.Conv`` and ``flax.nnx.Conv`` do around the convolution, shared by both modules.

:class:`Layer` is a ``Conv`` module's fields, read from either module; its full pass
and its decode steps (:mod:`._decode`) are written here once, so each module only says
where its parameters and its cache live.

Batch dims and padding modes are handled exactly as flax 0.12 handles them
(``flax/linen/linear.py``, ``_Conv.__call__``), so that a module here is ``nn.Conv``
with ``lax.conv_general_dilated(x, kernel * mask)`` replaced by
:func:`maskconv_kernels.masked_conv`, which takes the input dilation as lax does.
Everything done to the input before the convolution (wrap or reflect padding) is a copy
of real values, so masked taps are still never read.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding

from maskconv_kernels._core.args import as_segment_ids
from maskconv_kernels._modules import concrete_mask, pad_with_copies, refuse_segment_ids_with_copies
from maskconv_kernels.flax import _decode
from maskconv_kernels.masks import Mask, as_mask
from maskconv_kernels.ops.masked_conv import masked_conv

__all__ = ["Layer", "static_mask", "conv", "kernel_size_tuple"]


def kernel_size_tuple(kernel_size: int | Sequence[int]) -> tuple[int, ...]:
    return (kernel_size,) if isinstance(kernel_size, int) else tuple(int(k) for k in kernel_size)


def static_mask(mask, kernel_size, features: int) -> Mask | None:
    """Normalises a module's ``mask`` field into a hashable :class:`Mask`, or ``None``.

    The input channel count may be unknown until the module is called, so the window and
    ``features`` (the output channels) are checked here; the input channel dim of a full
    mask is checked against the kernel then.
    """
    if mask is None:
        return None
    concrete_mask(mask, "flax's Conv")
    window = kernel_size_tuple(kernel_size)
    shape = tuple(mask.bits.shape if isinstance(mask, Mask) else np.shape(mask))
    if shape == window:
        return as_mask(mask, (*window, 1, 1))
    if len(shape) == len(window) + 2 and shape[:-2] == window:
        if shape[-1] != features:
            raise ValueError(
                f"mask has the full kernel shape {shape} but features (the output channels) is {features}: its "
                f"last dim must be {features}, or pass a mask of shape {window} (one bit per tap)"
            )
        return as_mask(mask, shape)
    raise ValueError(
        f"mask has shape {shape} but kernel_size is {window}: pass a mask of shape {window} (one bit per "
        f"tap) or ({', '.join(map(str, window))}, C_in // feature_group_count, features) (the full kernel shape)"
    )


@dataclasses.dataclass(frozen=True)
class Layer:
    """A masked ``Conv`` module's static fields: the linen and nnx modules' attributes of these names.

    ``mask`` is the normalised :class:`Mask` (or ``None``: every tap active);
    ``preferred_element_type`` is nnx's only (linen's is ``None``).
    """

    mask: Mask | None
    strides: Any
    padding: Any
    input_dilation: Any
    kernel_dilation: Any
    feature_group_count: int
    precision: Any
    preferred_element_type: Any
    implementation: str | None
    decode_shift: int

    @classmethod
    def of(cls, module, **values) -> "Layer":
        """The fields as ``module``'s attributes of the same names, but those given in ``values``."""
        names = [f.name for f in dataclasses.fields(cls) if f.name not in values]
        return cls(**{name: getattr(module, name) for name in names}, **values)

    def __call__(self, inputs: jax.Array, kernel: jax.Array, bias: jax.Array | None, segment_ids=None) -> jax.Array:
        """The full pass: :func:`conv` with these fields."""
        return conv(
            inputs,
            kernel,
            self.mask,
            strides=self.strides,
            padding=self.padding,
            input_dilation=self.input_dilation,
            kernel_dilation=self.kernel_dilation,
            feature_group_count=self.feature_group_count,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            implementation=self.implementation,
            bias=bias,
            segment_ids=segment_ids,
        )

    def new_cache(self, input_shape, kernel_shape, dtype) -> dict[str, jax.Array]:
        """The decode cache's arrays by variable name (:data:`._decode.CACHE_FIELDS`) for
        full-size inputs ``(N, *spatial, C_in)``, checked for decoding first."""
        return _decode.new_cache(self.mask, kernel_shape, tuple(input_shape), dtype, **self._decode_fields())

    def decode_step(
        self, inputs: jax.Array, kernel: jax.Array, bias: jax.Array | None, segment_ids, cache: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One position in decode mode: ``(output, new cache)`` (:func:`._decode.step`)."""
        if segment_ids is not None:
            raise ValueError("segment_ids is for full inputs: a decode step continues one sequence per example")
        if self.preferred_element_type is not None:
            raise NotImplementedError(
                "decode=True gives outputs in the cache's dtype; preferred_element_type is not supported there"
            )
        return _decode.step(inputs, kernel, bias, cache, self.mask, precision=self.precision, **self._decode_fields())

    def _decode_fields(self) -> dict:
        return dict(
            shift=self.decode_shift, strides=self.strides, padding=self.padding, input_dilation=self.input_dilation,
            kernel_dilation=self.kernel_dilation, feature_group_count=self.feature_group_count,
        )


def conv(
    inputs: jax.Array,
    kernel: jax.Array,
    mask: Mask | None,
    *,
    strides,
    padding,
    input_dilation,
    kernel_dilation,
    feature_group_count: int,
    precision,
    preferred_element_type=None,
    implementation: str | None,
    bias: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """``nn.Conv``'s convolution and bias with ``kernel * mask`` made exact.

    Args:
      inputs: ``(*batch_dims, *spatial, C_in)``; no batch dim, or several, as in flax.
      kernel: ``(*window, C_in // feature_group_count, C_out)``, the dtype of ``inputs``.
      mask: the normalised mask, or ``None`` for a plain convolution (every tap active).
      bias: ``(C_out,)`` or ``None``.
      segment_ids: ``None``, or integers of ``inputs``' shape without its channels,
        ``(*batch_dims, *spatial)``: packed documents, as :func:`masked_conv` takes them
        (batch dims flattened and restored with the inputs'). Not with ``"CIRCULAR"`` or
        ``"REFLECT"`` padding, which copy values across the border of a row: a document
        there would read another's values, or mirror images of its own that are not
        positions of the input.
    """
    window = tuple(kernel.shape[:-2])
    ndim = len(window)
    if mask is None:
        mask = Mask(window, np.ones(window, bool))
    else:
        mask = as_mask(mask, kernel.shape)

    def broadcast(value):
        value = 1 if value is None else value  # flax's sentinel for "1 in every dim"
        return (value,) * ndim if isinstance(value, int) else tuple(value)

    strides = broadcast(strides)
    input_dilation = broadcast(input_dilation)
    kernel_dilation = broadcast(kernel_dilation)

    num_batch_dims = inputs.ndim - (ndim + 1)
    pads = canonicalize_padding(padding, ndim)
    if segment_ids is not None:
        segment_ids = _check_segment_ids(segment_ids, inputs.shape, pads)
    if num_batch_dims != 1:
        batch_shape = inputs.shape[:num_batch_dims]
        inputs = jnp.reshape(inputs, (-1, *inputs.shape[num_batch_dims:]))
        if segment_ids is not None:
            segment_ids = jnp.reshape(segment_ids, (-1, *segment_ids.shape[num_batch_dims:]))

    if pads in ("CIRCULAR", "REFLECT"):
        dilated = [(k - 1) * d + 1 for k, d in zip(window, kernel_dilation)]
        inputs = pad_with_copies(inputs, [((k - 1) // 2, k // 2) for k in dilated], pads, 1)
        pads = "VALID"

    if any(d != 1 for d in input_dilation) and isinstance(pads, str):
        # lax.conv_general_dilated (hence nn.Conv) refuses this too.
        raise ValueError(
            f"padding={padding!r} is a string, which is not defined with input_dilation={input_dilation}: "
            "give the padding as (lo, hi) pairs, one per spatial dim (they apply to the dilated input)"
        )

    y = masked_conv(
        inputs,
        kernel,
        mask,
        strides=strides,
        padding=pads,
        dilation=kernel_dilation,
        lhs_dilation=input_dilation,
        feature_group_count=feature_group_count,
        precision=precision,
        preferred_element_type=preferred_element_type,
        implementation=implementation,
        segment_ids=segment_ids,
    )
    if num_batch_dims != 1:
        y = jnp.reshape(y, (*batch_shape, *y.shape[1:]))
    if bias is not None:
        y += bias.reshape((1,) * (y.ndim - 1) + bias.shape)
    return y


def _check_segment_ids(segment_ids, inputs_shape, pads) -> jax.Array:
    """``segment_ids`` of ``inputs``' shape without channels, with a padding that copies no values."""
    if pads in ("CIRCULAR", "REFLECT"):
        refuse_segment_ids_with_copies("padding", pads, "'SAME', 'CAUSAL' or explicit pairs")
    what = "the inputs' shape without their channels, (*batch_dims, *spatial)"
    return as_segment_ids(segment_ids, tuple(inputs_shape[:-1]), what)
