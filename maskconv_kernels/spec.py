"""The static description of one masked convolution, shared by every backend.

:func:`make_spec` validates the user's arguments once and turns them into a frozen,
hashable :class:`ConvSpec`; backends take a ``ConvSpec`` and never re-validate.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from .masks import Mask, as_mask

__all__ = ["ConvSpec", "make_spec", "dimension_numbers"]

_DIMENSION_NUMBERS = {
    1: ("NWC", "WIO", "NWC"),
    2: ("NHWC", "HWIO", "NHWC"),
    3: ("NDHWC", "DHWIO", "NDHWC"),
}


def dimension_numbers(ndim: int):
    """``lax.conv_general_dilated`` dimension numbers for channels-last, ``ndim`` spatial dims."""
    return _DIMENSION_NUMBERS[ndim]


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """Everything static about a masked convolution.

    Shapes: ``x: (N, *spatial, C_in)``, ``kernel: (*window, C_in // groups, C_out)``,
    ``out: (N, *out_spatial, C_out)``.
    """

    mask: Mask
    in_spatial: tuple[int, ...]
    c_in: int
    c_out: int
    strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]
    groups: int
    precision: lax.Precision | tuple | None
    out_dtype: np.dtype
    acc_dtype: np.dtype

    @property
    def window(self) -> tuple[int, ...]:
        return self.mask.window

    @property
    def ndim(self) -> int:
        return len(self.window)

    @property
    def out_spatial(self) -> tuple[int, ...]:
        return tuple(
            (n + lo + hi - d * (k - 1) - 1) // s + 1
            for n, (lo, hi), d, k, s in zip(self.in_spatial, self.padding, self.dilation, self.window, self.strides)
        )

    @property
    def dimension_numbers(self):
        return dimension_numbers(self.ndim)

    def flops(self, batch: int) -> int:
        """Multiply-adds over active entries only, times two."""
        per_pixel = self.mask.active_entries(self.c_in // self.groups, self.c_out)
        return 2 * batch * int(np.prod(self.out_spatial)) * per_pixel


def _tuple(name: str, value, ndim: int) -> tuple[int, ...]:
    values = (value,) * ndim if isinstance(value, (int, np.integer)) else tuple(value)
    if len(values) != ndim or not all(isinstance(v, (int, np.integer)) for v in values):
        raise ValueError(f"{name} must be an int or a tuple of {ndim} ints, got {value!r}")
    if any(v < 1 for v in values):
        raise ValueError(f"{name} must be positive, got {value!r}")
    return tuple(int(v) for v in values)


def _padding(padding, in_spatial, window, strides, dilation) -> tuple[tuple[int, int], ...]:
    ndim = len(window)
    if isinstance(padding, str):
        mode = padding.upper()
        if mode == "CAUSAL":
            if ndim != 1:
                raise ValueError(
                    f'padding="CAUSAL" is defined for 1-D convolutions only (as in flax), but the input has '
                    f"{ndim} spatial dims: use a causal mask with padding='SAME' instead"
                )
            return ((dilation[0] * (window[0] - 1), 0),)
        if mode not in ("SAME", "VALID"):
            raise ValueError(f"padding must be 'SAME', 'VALID', 'CAUSAL' or (lo, hi) pairs, got {padding!r}")
        effective = [d * (k - 1) + 1 for d, k in zip(dilation, window)]
        return tuple(lax.padtype_to_pads(in_spatial, effective, strides, mode))
    try:
        pairs = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        raise ValueError(f"padding must be 'SAME', 'VALID', 'CAUSAL' or (lo, hi) pairs, got {padding!r}") from None
    if len(pairs) != ndim:
        raise ValueError(f"padding needs one (lo, hi) pair per spatial dim ({ndim}), got {padding!r}")
    return pairs


def _dtype(name: str, value) -> np.dtype:
    dtype = np.dtype(value.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype (float32, bfloat16, float16), got {dtype}")
    return dtype


def make_spec(
    x,
    kernel,
    mask,
    *,
    strides=1,
    padding="SAME",
    dilation=1,
    feature_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
) -> ConvSpec:
    """Validates the arguments of :func:`maskconv_kernels.masked_conv` into a ``ConvSpec``."""
    x_dtype, k_dtype = _dtype("x", x), _dtype("kernel", kernel)
    if x_dtype != k_dtype:
        raise TypeError(f"x and kernel must have the same dtype, got x: {x_dtype} and kernel: {k_dtype}")
    if x.ndim not in (3, 4, 5):
        raise ValueError(
            f"x must be (N, *spatial, C_in) with 1, 2 or 3 spatial dims (rank 3-5), got shape {tuple(x.shape)}"
        )
    ndim = x.ndim - 2
    if kernel.ndim != ndim + 2:
        raise ValueError(
            f"kernel must be (*window, C_in // groups, C_out) with {ndim} window dims to match x of shape "
            f"{tuple(x.shape)}, got shape {tuple(kernel.shape)}"
        )
    groups = feature_group_count
    if not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"feature_group_count must be a positive int, got {groups!r}")
    c_in, c_out = int(x.shape[-1]), int(kernel.shape[-1])
    if c_in % groups or c_out % groups:
        raise ValueError(
            f"feature_group_count={groups} must divide both C_in={c_in} and C_out={c_out}"
        )
    if kernel.shape[-2] * groups != c_in:
        raise ValueError(
            f"kernel has {kernel.shape[-2]} input channels but x has C_in={c_in} with feature_group_count="
            f"{groups}: expected kernel.shape[-2] == {c_in // groups}"
        )
    mask = as_mask(mask, tuple(kernel.shape))
    window = mask.window
    strides = _tuple("strides", strides, ndim)
    dilation = _tuple("dilation", dilation, ndim)
    in_spatial = tuple(int(n) for n in x.shape[1:-1])
    pads = _padding(padding, in_spatial, window, strides, dilation)
    if preferred_element_type is None:
        out_dtype = x_dtype
    else:
        out_dtype = np.dtype(preferred_element_type)
        if not jnp.issubdtype(out_dtype, jnp.floating):
            raise TypeError(f"preferred_element_type must be a floating dtype, got {out_dtype}")
    if isinstance(precision, str):
        precision = lax.Precision(precision)
    acc_dtype = np.dtype(jnp.promote_types(jnp.float32, x_dtype))
    spec = ConvSpec(
        mask, in_spatial, c_in, c_out, strides, pads, dilation, int(groups), precision, out_dtype, acc_dtype
    )
    if any(n < 1 for n in spec.out_spatial):
        raise ValueError(
            f"the output would be empty: input spatial shape {in_spatial} with padding {pads} is smaller than "
            f"the dilated window {tuple(d * (k - 1) + 1 for d, k in zip(dilation, window))}"
        )
    return spec
