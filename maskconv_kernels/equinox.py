"""Equinox modules: ``equinox.nn.Conv`` with an exact mask.

``Conv`` (also ``MaskedConv``) and ``Conv1d``, ``Conv2d``, ``Conv3d`` subclass
``equinox.nn.Conv``, so code that looks modules up by type still finds them. They have
its fields, plus two static ones, ``mask`` and ``implementation``; the same parameters
from the same key (Equinox's own initialisation runs); and the same leaves (``weight``,
``bias``), so ``eqx.tree_serialise_leaves`` of one loads into the other. Channels-first
and unbatched, as Equinox's: ``x: (C_in, *spatial)``, ``weight: (C_out, C_in // groups,
*kernel_size)`` (``jax.vmap`` over a batch folds into the convolution's batch).

Equinox has no masked convolution; the usual one is ``eqx.nn.Conv`` with ``weight *
mask``, which reads every tap, so ``0 * NaN`` under a masked tap reaches the output.
These call :func:`maskconv_kernels.masked_conv` with ``dimension_numbers`` for
Equinox's layout: masked taps are never read. Needs the ``equinox`` extra; the core
package does not import equinox.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maskconv_kernels._core.args import as_segment_ids
from maskconv_kernels._extras import require
from maskconv_kernels.masks import Mask, as_mask
from maskconv_kernels.ops.masked_conv import masked_conv
from maskconv_kernels.ops.masked_conv.layout import Layout

eqx = require("equinox", "equinox", "maskconv_kernels.equinox")

__all__ = ["Conv", "MaskedConv", "Conv1d", "Conv2d", "Conv3d"]

_PAD_MODES = {"REFLECT": "reflect", "REPLICATE": "edge", "CIRCULAR": "wrap"}


def _dimension_numbers(ndim: int) -> tuple[str, str, str]:
    """Equinox's layout, lax's default: ``("NCHW", "OIHW", "NCHW")`` in 2-D."""
    spatial = "DHW"[-ndim:]
    return ("NC" + spatial, "OI" + spatial, "NC" + spatial)


def _static_mask(mask, kernel_size: tuple[int, ...], weight_shape: tuple[int, ...]) -> Mask | None:
    """``mask`` (shape ``kernel_size``, or ``weight_shape``: Equinox's ``(O, I, *kernel_size)``) as a hashable Mask."""
    if mask is None or isinstance(mask, Mask):
        return None if mask is None else as_mask(mask, (*kernel_size, *weight_shape[1::-1]))
    shape = tuple(np.shape(mask))
    if shape not in (kernel_size, weight_shape):
        raise ValueError(
            f"mask has shape {shape} but kernel_size is {kernel_size}: pass a mask of shape {kernel_size} (one bit "
            f"per tap) or of the weight's shape {weight_shape} (out_channels, in_channels // groups, *kernel_size)"
        )
    layout = Layout.channels_first(len(kernel_size))
    return as_mask(layout.mask(mask), layout.kernel_shape(weight_shape))


class Conv(eqx.nn.Conv):
    """Exact masked convolution, a drop-in replacement for ``equinox.nn.Conv``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import maskconv_kernels as mk
        >>> from maskconv_kernels import equinox as mk_eqx
        >>> conv = mk_eqx.Conv2d(1, 4, 3, padding=1, mask=mk.pixelcnn_mask((3, 3), "A"), key=jax.random.key(0))
        >>> conv.weight.shape
        (4, 1, 3, 3)
        >>> x = jnp.ones((1, 8, 8)).at[:, 4, 4].set(jnp.nan)   # (C_in, H, W)
        >>> bool(jnp.isnan(conv(x)[:, 4, 4]).any())
        False

    Args:
      num_spatial_dims, in_channels, out_channels, kernel_size, stride, padding,
      dilation, groups, use_bias, padding_mode, dtype, key: as in ``equinox.nn.Conv``
        (padding ``"SAME"``, ``"SAME_LOWER"``, ``"VALID"``, ints or ``(lo, hi)`` pairs;
        ``padding_mode`` ``"ZEROS"``, ``"REFLECT"``, ``"REPLICATE"`` or ``"CIRCULAR"``).
        ``dtype``: float32, bfloat16, float16 (float64 with ``jax_enable_x64``); complex
        is not supported.
      mask: static 0/1 or bools of shape ``kernel_size`` (one bit per tap) or of the
        weight's shape ``(out_channels, in_channels // groups, *kernel_size)``
        (channel-partial taps); stored as a hashable :class:`maskconv_kernels.Mask`.
        ``None`` makes every tap active.
      implementation: ``None`` (best backend for the platform) or one of
        :data:`maskconv_kernels.IMPLEMENTATIONS`.
    """

    mask: Mask | None = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)

    def __init__(
        self,
        num_spatial_dims: int,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: str | int | Sequence[int] | Sequence[tuple[int, int]] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        use_bias: bool = True,
        padding_mode: str = "ZEROS",
        dtype=None,
        *,
        mask=None,
        implementation: str | None = None,
        key: jax.Array,
    ):
        super().__init__(
            num_spatial_dims, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, use_bias,
            padding_mode, dtype, key=key,
        )
        self.mask = _static_mask(mask, self.kernel_size, self.weight.shape)
        self.implementation = implementation

    def __call__(
        self, x: jax.Array, *, segment_ids: jax.Array | None = None, key: jax.Array | None = None
    ) -> jax.Array:
        """``x: (in_channels, *spatial)`` -> ``(out_channels, *out_spatial)``; ``key`` is ignored, as in Equinox.

        ``segment_ids``: ``None``, or integers ``(*spatial)``: packed documents, as
        :func:`maskconv_kernels.masked_conv` takes them (``jax.vmap`` both over a batch).
        No tap crosses a document boundary; negative ids are padding, where the
        convolution is zero (the output is the bias). Needs an output on the input's grid
        (stride 1 and a size-keeping padding: ``"SAME"``, or ``(k - 1) // 2`` and ``k // 2``
        per side) and ``padding_mode="ZEROS"``: the other modes copy values across the
        border (wrapped, mirrored or repeated), positions that no document owns.
        """
        del key
        if x.ndim != self.num_spatial_dims + 1:
            raise ValueError(
                f"Input to Conv needs to have rank {self.num_spatial_dims + 1} ((in_channels, *spatial), unbatched, "
                f"as equinox.nn.Conv), but input has shape {x.shape}: vmap over a batch"
            )
        if segment_ids is not None:
            segment_ids = self._segment_ids(segment_ids, x.shape)
        padding = self.padding
        if self.padding_mode != "ZEROS":
            x, padding = self._pad(x), "VALID"
        mask = self.mask if self.mask is not None else np.ones(self.kernel_size, bool)
        y = masked_conv(
            x[None], self.weight, mask, strides=self.stride, padding=padding, dilation=self.dilation,
            feature_group_count=self.groups, dimension_numbers=_dimension_numbers(self.num_spatial_dims),
            implementation=self.implementation, segment_ids=segment_ids,
        )[0]
        return y + self.bias if self.use_bias else y

    def _segment_ids(self, segment_ids, x_shape) -> jax.Array:
        """``(*spatial)`` ids for ``x (in_channels, *spatial)``, batched as ``masked_conv`` takes them."""
        if self.padding_mode != "ZEROS":
            raise ValueError(
                f"segment_ids with padding_mode={self.padding_mode!r}: that mode fills the border with copies of "
                "values (wrapped, mirrored or repeated), which belong to no position of a document; use "
                "padding_mode='ZEROS'"
            )
        what = "x's spatial shape (x is (in_channels, *spatial), unbatched)"
        return as_segment_ids(segment_ids, tuple(x_shape[1:]), what)[None]

    def _pad(self, x: jax.Array) -> jax.Array:
        """Equinox's non-zero padding modes: copies of real values, so no masked tap is read after it."""
        if isinstance(self.padding, str):
            window = tuple(d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation))
            pads = lax.padtype_to_pads(x.shape[1:], window, self.stride, self.padding)
        else:
            pads = list(self.padding)
        return jnp.pad(x, [(0, 0), *pads], _PAD_MODES[self.padding_mode])


MaskedConv = Conv


def _fixed_rank(ndim: int) -> type[Conv]:
    """``Conv`` with ``num_spatial_dims=ndim``, as ``equinox.nn.Conv{ndim}d``."""

    class ConvNd(Conv):
        def __init__(
            self,
            in_channels: int,
            out_channels: int,
            kernel_size: int | Sequence[int],
            stride: int | Sequence[int] = 1,
            padding: str | int | Sequence[int] | Sequence[tuple[int, int]] = 0,
            dilation: int | Sequence[int] = 1,
            groups: int = 1,
            use_bias: bool = True,
            padding_mode: str = "ZEROS",
            dtype=None,
            *,
            mask=None,
            implementation: str | None = None,
            key: jax.Array,
        ):
            super().__init__(
                ndim, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, use_bias,
                padding_mode, dtype, mask=mask, implementation=implementation, key=key,
            )

    ConvNd.__name__ = ConvNd.__qualname__ = f"Conv{ndim}d"
    ConvNd.__doc__ = f"As :class:`Conv` with ``num_spatial_dims={ndim}``: the drop-in for ``equinox.nn.Conv{ndim}d``."
    return ConvNd


Conv1d, Conv2d, Conv3d = (_fixed_rank(n) for n in (1, 2, 3))
