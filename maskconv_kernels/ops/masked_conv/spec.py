"""The static description of one masked convolution, shared by every backend.

:func:`make_spec` validates the user's arguments once and turns them into a frozen,
hashable :class:`ConvSpec`; backends take a ``ConvSpec`` and never re-validate.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._core.args import FLOAT_DTYPES, as_operand, as_segment_ids, float_dtype, ints, is_int, padding_pairs
from ..._core.args import precision as _precision
from ...masks import Mask, as_mask
from .layout import Layout

# as_operand, as_segment_ids and FLOAT_DTYPES are the shared normalisers', re-exported.
__all__ = ["ConvSpec", "make_spec", "make_layout", "as_operand", "as_segment_ids", "dimension_numbers", "FLOAT_DTYPES"]

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

    Shapes, of the problem the backends compute: ``x: (N, *spatial, C_in)``, ``kernel:
    (*window, C_in // groups, C_out)``, ``out: (N, *out_spatial, C_out)``. ``layout`` maps
    the caller's arrays onto it (dimension order, input dilation, batch groups): there,
    ``spatial`` is the dilated input's and ``groups`` counts batch groups too.
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
    dtype: np.dtype  # the products': x's and the kernel's, the wider of the two when they differ
    x_dtype: np.dtype
    kernel_dtype: np.dtype
    layout: Layout
    segmented: bool = False  # segment_ids given: a tap reads only inputs of the output's segment

    @property
    def mixed(self) -> bool:
        """x and the kernel differ in dtype (16-bit activations with float32 weights, say)."""
        return self.x_dtype != self.kernel_dtype

    @property
    def window(self) -> tuple[int, ...]:
        return self.mask.window

    @property
    def ndim(self) -> int:
        return len(self.window)

    @property
    def out_spatial(self) -> tuple[int, ...]:
        """Empty (0) where the dilated window does not fit in the padded input, as in lax."""
        return tuple(
            max(0, (n + lo + hi - d * (k - 1) - 1) // s + 1)
            for n, (lo, hi), d, k, s in zip(self.in_spatial, self.padding, self.dilation, self.window, self.strides)
        )

    @property
    def dimension_numbers(self):
        return dimension_numbers(self.ndim)

    def resized(self, in_spatial, padding, *, kernel_shape=None, segmented: bool | None = None) -> "ConvSpec":
        """This convolution on another input size and padding, not checked again.

        For an op that checked one problem and runs others derived from it: a stream's
        chunk with its history before it, a transposed layer's phases, a recomputed head.
        ``kernel_shape``: ``(*window, C_in // groups, C_out')``, another window (every tap
        active; for a spec whose taps all are) or number of outputs; ``segmented``:
        whether this call passes segment ids (default: as checked).
        """
        mask, c_out = self.mask, self.c_out
        if kernel_shape is not None:
            *window, c_in, c_out = (int(k) for k in kernel_shape)
            every_tap = len(mask.active_taps) == mask.num_taps and not mask.is_full
            changed = tuple(window) != self.window or c_out != self.c_out
            if c_in != self.c_in // self.groups or (changed and not every_tap):
                raise ValueError(f"{self} takes no kernel of shape {tuple(kernel_shape)}: another window needs "
                                 "every tap active, and the input channels stay")
            if tuple(window) != self.window:
                mask = as_mask(np.ones(window, bool), kernel_shape)
        return dataclasses.replace(
            self, mask=mask, in_spatial=tuple(int(n) for n in in_spatial), padding=tuple(padding), c_out=c_out,
            segmented=self.segmented if segmented is None else bool(segmented),
        )

    def channels_last(self) -> "ConvSpec":
        """The problem the backends compute, without the caller's layout: one per problem, whatever its layout."""
        return dataclasses.replace(self, layout=Layout.channels_last(self.ndim))

    def flops(self, batch: int) -> int:
        """Multiply-adds over active entries only, times two."""
        per_pixel = self.mask.active_entries(self.c_in // self.groups, self.c_out)
        return 2 * batch * int(np.prod(self.out_spatial)) * per_pixel


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
    lhs_dilation=1,
    dimension_numbers=None,
    batch_group_count: int = 1,
    segmented: bool = False,
) -> ConvSpec:
    """Validates the arguments of :func:`maskconv_kernels.masked_conv` into a ``ConvSpec``.

    ``x`` and ``kernel`` may be anything with ``shape`` and ``dtype`` or array-likes
    (:func:`as_operand`). ``mask=None`` makes every tap active; ``None`` strides and
    dilations are 1, as lax's ``None`` dilations. ``segmented``: ``segment_ids`` are
    given (their values are checked by :func:`as_segment_ids`). Every error names the
    argument and what it accepts; those about channels also say how x and the kernel
    were read (channels-last unless ``dimension_numbers`` says otherwise). The shapes checked after ``dimension_numbers`` are those of the
    channels-last problem (:mod:`.layout`).
    """
    x, kernel = as_operand("x", x), as_operand("kernel", kernel)
    x_dtype, k_dtype = float_dtype("x must have", x.dtype), float_dtype("kernel must have", kernel.dtype)
    if len(kernel.shape) in (3, 4, 5) and len(x.shape) == len(kernel.shape) - 1:
        raise ValueError(_unbatched(tuple(x.shape), tuple(kernel.shape), dimension_numbers))
    if len(x.shape) not in (3, 4, 5):
        raise ValueError(
            f"x must be (N, *spatial, C_in) with 1, 2 or 3 spatial dims (rank 3-5), got shape {tuple(x.shape)}"
        )
    ndim = len(x.shape) - 2
    if len(kernel.shape) != ndim + 2:
        raise ValueError(
            f"kernel must be (*window, C_in // groups, C_out) with {ndim} window dims to match x of shape "
            f"{tuple(x.shape)}, got shape {tuple(kernel.shape)}"
        )
    # lax's None for the dilations (and, here, the strides) is 1 in every dim.
    strides, dilation, lhs_dilation = (1 if v is None else v for v in (strides, dilation, lhs_dilation))
    layout = make_layout(x.shape, kernel.shape, dimension_numbers, lhs_dilation=lhs_dilation,
                         batch_group_count=batch_group_count, feature_group_count=feature_group_count)
    read_as = _read_as(tuple(x.shape), tuple(kernel.shape), layout, dimension_numbers)
    x = jax.ShapeDtypeStruct(layout.x_shape(x.shape), x_dtype)
    kernel = jax.ShapeDtypeStruct(layout.kernel_shape(kernel.shape), k_dtype)
    # No mask: every tap active (a plain convolution, with the contract's other guarantees).
    mask = np.ones(kernel.shape[:-2], bool) if mask is None else layout.mask(mask)
    if any(k < 1 for k in kernel.shape[:-2]):
        raise ValueError(f"kernel window must be at least 1 in every spatial dim, got kernel shape {tuple(kernel.shape)}")
    groups = feature_group_count
    if not is_int(groups) or groups < 1:
        raise ValueError(f"feature_group_count must be a positive int, got {groups!r}")
    groups *= layout.batch_groups  # folded into feature groups (layout.py), validated by make_layout
    c_in, c_out = int(x.shape[-1]), int(kernel.shape[-1])
    if c_in < 1 or c_out < 1:
        raise ValueError(
            f"x and kernel need at least one channel each, got C_in={c_in} (x: {tuple(x.shape)}) and "
            f"C_out={c_out} (kernel: {tuple(kernel.shape)})"
        )
    if c_in % groups or c_out % groups:
        raise ValueError(
            f"feature_group_count={groups} must divide both C_in={c_in} and C_out={c_out} ({read_as})"
        )
    if kernel.shape[-2] * groups != c_in:
        axis = "kernel.shape[-2]" if layout.is_channels_last else f"kernel.shape[{layout.rhs[1]}]"
        raise ValueError(
            f"kernel has {kernel.shape[-2]} input channels but x has C_in={c_in} with feature_group_count="
            f"{groups}: expected {axis} == {c_in // groups} ({read_as})"
        )
    mask = as_mask(mask, tuple(kernel.shape))
    window = mask.window
    strides = ints("strides", strides, ndim)
    dilation = ints("dilation", dilation, ndim)
    in_spatial = tuple(int(n) for n in x.shape[1:-1])
    pads = padding_pairs(
        padding, window, strides=strides, dilation=dilation, in_spatial=in_spatial, lhs_dilation=layout.lhs_dilation
    )
    out_dtype = x_dtype if preferred_element_type is None else float_dtype("preferred_element_type must be", preferred_element_type)
    # Mixed inputs (bfloat16 activations, float32 weights) multiply in the wider dtype:
    # widening is exact, so every product is that of the values given.
    dtype = np.dtype(jnp.promote_types(x_dtype, k_dtype))
    acc_dtype = np.dtype(jnp.promote_types(jnp.float32, dtype))
    spec = ConvSpec(
        mask, in_spatial, c_in, c_out, strides, pads, dilation, int(groups), _precision(precision), out_dtype, acc_dtype,
        dtype, x_dtype, k_dtype, layout, bool(segmented),
    )
    if segmented:
        _check_segmented(spec)
    return spec


def _axes(shape: tuple[int, ...], spec: tuple[int, ...], names: tuple[str, ...]) -> str:
    """``shape`` with each axis named, as ``spec`` (lax's axis order: batch or out, channels, spatial) orders them."""
    named = [""] * len(shape)
    for axis, name in zip(spec, names):
        named[axis] = name
    return f"{tuple(shape)} is read as ({', '.join(named)})"


def _read_as(x_shape, kernel_shape, layout: Layout, value) -> str:
    """How x and the kernel were read, and how to give another layout: the tail of a channel error."""
    ndim = len(x_shape) - 2
    spatial = tuple(dimension_numbers(ndim)[0][1:-1])
    read = (
        f"x {_axes(x_shape, layout.lhs, ('N', 'C_in', *spatial))} and the kernel "
        f"{_axes(kernel_shape, layout.rhs, ('C_out', 'C_in // groups', *spatial))}"
    )
    if value is not None:
        return f"{read}, as dimension_numbers={value!r} gives"
    first = "".join(spatial)
    return (
        f"{read}: channels-last, the default; for another layout pass dimension_numbers as lax takes it, e.g. "
        f"dimension_numbers={('NC' + first, 'OI' + first, 'NC' + first)} for channels-first x and kernel"
    )


def _unbatched(x_shape, kernel_shape, value) -> str:
    """The error for an x one axis short of the kernel's rank: a single example, without its batch axis."""
    batch = 0
    if isinstance(value, lax.ConvDimensionNumbers):
        batch = int(value.lhs_spec[0])
    elif isinstance(value, (tuple, list)) and value and isinstance(value[0], str) and "N" in value[0]:
        batch = value[0].index("N")
    add = "x[None]" if batch == 0 else f"jnp.expand_dims(x, {batch})"
    layout = "(N, *spatial, C_in)" if value is None else f"(the N of dimension_numbers={value!r})"
    window = len(kernel_shape) - 2
    return (
        f"x needs a batch axis {layout}: {add} gives one. x has shape {x_shape}, one axis short of the kernel's "
        f"{kernel_shape} ({window} window dim{'s' if window > 1 else ''})"
    )


def _check_segmented(spec: ConvSpec) -> None:
    """Segment ids name the input's positions; output ``p`` has the segment of input ``p``."""
    layout = spec.layout
    if layout.batch_groups > 1 or any(d > 1 for d in layout.lhs_dilation):
        raise ValueError(
            "segment_ids take an undilated input without batch groups (they name its positions), got "
            f"lhs_dilation={layout.lhs_dilation} and batch_group_count={layout.batch_groups}"
        )
    if any(s != 1 for s in spec.strides) or spec.out_spatial != spec.in_spatial:
        raise ValueError(
            "segment_ids need an output on the input's grid (output p has the segment of input p): strides 1 and "
            f"a padding that keeps the spatial shape ('SAME', 'CAUSAL' or pads summing to the dilated window - 1), "
            f"got strides {spec.strides} and padding {spec.padding}, which give {spec.out_spatial} from "
            f"{spec.in_spatial}"
        )


def make_layout(
    x_shape, kernel_shape, dimension_numbers=None, *, lhs_dilation=1, batch_group_count: int = 1,
    feature_group_count: int = 1,
) -> Layout:
    """Validates lax's layout arguments (:mod:`.layout`) for operands of these shapes (ranks checked)."""
    ndim = len(x_shape) - 2
    lhs, rhs, out = _dimension_numbers(dimension_numbers, tuple(x_shape), tuple(kernel_shape))
    lhs_dilation = ints("lhs_dilation", lhs_dilation, ndim)
    g = batch_group_count
    if not is_int(g) or g < 1:
        raise ValueError(f"batch_group_count must be a positive int, got {g!r}")
    if g > 1:
        n, c, i, o = x_shape[lhs[0]], x_shape[lhs[1]], kernel_shape[rhs[1]], kernel_shape[rhs[0]]
        if feature_group_count != 1:
            raise ValueError(
                f"batch_group_count={g} and feature_group_count={feature_group_count}: at most one may be above 1, "
                "as in lax.conv_general_dilated"
            )
        if n % g or o % g or i != c:
            raise ValueError(
                f"batch_group_count={g} must divide the batch N={n} and C_out={o}, and the kernel's input channels "
                f"({i}) must be x's C_in={c} (as in lax.conv_general_dilated: {g} groups of N / {g} examples, each "
                f"convolved with C_out / {g} of the kernel's output channels)"
            )
    return Layout(lhs, rhs, out, lhs_dilation, int(g))


def _dimension_numbers(value, x_shape, kernel_shape) -> tuple[tuple[int, ...], ...]:
    """``(lhs, rhs, out)`` axis orders, as lax's ``ConvDimensionNumbers`` holds them."""
    rank = len(x_shape)
    if value is None:
        default = Layout.channels_last(rank - 2)
        return default.lhs, default.rhs, default.out
    spatial = dimension_numbers(rank - 2)[0][1:-1]
    expected = (
        f"dimension_numbers must be None (channels-last, {dimension_numbers(rank - 2)}), a lax.ConvDimensionNumbers, "
        f"or three strings of length {rank} as lax.conv_general_dilated takes, e.g. "
        f"{('NC' + spatial, 'OI' + spatial, 'NC' + spatial)}"
    )
    if isinstance(value, lax.ConvDimensionNumbers):
        specs = tuple(tuple(int(a) for a in spec) for spec in value)
        if any(sorted(spec) != list(range(rank)) for spec in specs):
            raise ValueError(f"{expected}; a ConvDimensionNumbers must order all {rank} axes in each spec, got {value}")
        return specs
    if not (isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(s, str) for s in value)):
        raise TypeError(f"{expected}, got {value!r}")
    try:
        return tuple(tuple(spec) for spec in lax.conv_dimension_numbers(x_shape, kernel_shape, tuple(value)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{expected}, got {value!r}: {e}") from None
