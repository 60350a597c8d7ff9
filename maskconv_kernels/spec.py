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

from .layout import Layout
from .masks import Mask, as_mask

__all__ = ["ConvSpec", "make_spec", "as_operand", "as_segment_ids", "dimension_numbers", "FLOAT_DTYPES"]

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

    def channels_last(self) -> "ConvSpec":
        """The problem the backends compute, without the caller's layout: one per problem, whatever its layout."""
        return dataclasses.replace(self, layout=Layout.channels_last(self.ndim))

    def flops(self, batch: int) -> int:
        """Multiply-adds over active entries only, times two."""
        per_pixel = self.mask.active_entries(self.c_in // self.groups, self.c_out)
        return 2 * batch * int(np.prod(self.out_spatial)) * per_pixel


def _is_int(value) -> bool:
    # bool is an int subclass, but strides=True is a mistake, not a stride of 1.
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _tuple(name: str, value, ndim: int) -> tuple[int, ...]:
    expected = f"{name} must be an int or a tuple of {ndim} ints"
    if _is_int(value):
        values = (value,) * ndim
    elif isinstance(value, (tuple, list)) and all(_is_int(v) for v in value):
        values = tuple(value)
    else:
        raise TypeError(f"{expected}, got {value!r}")
    if len(values) != ndim:
        raise ValueError(f"{expected}, got {value!r}")
    if any(v < 1 for v in values):
        raise ValueError(f"{name} must be positive, got {value!r}")
    return tuple(int(v) for v in values)


_PADDING_NAMES = "'SAME', 'SAME_LOWER', 'VALID', 'CAUSAL'"


def _padding(padding, in_spatial, window, strides, dilation, lhs_dilation) -> tuple[tuple[int, int], ...]:
    """``in_spatial``: the (dilated) input's; the pairs returned apply to it, as lax's do."""
    ndim = len(window)
    if isinstance(padding, str):
        if any(d > 1 for d in lhs_dilation):
            # lax.conv_general_dilated refuses this too: which output size is "SAME" for a
            # transposed convolution is a convention (lax.conv_transpose picks one).
            raise ValueError(
                f"padding={padding!r} is a string, which is not defined with lhs_dilation={lhs_dilation} "
                "(as in lax.conv_general_dilated): give one (lo, hi) pair per spatial dim, applied to the dilated input"
            )
        mode = padding.upper()
        if mode == "CAUSAL":
            if ndim != 1:
                raise ValueError(
                    f'padding="CAUSAL" is defined for 1-D convolutions only (as in flax), but the input has '
                    f"{ndim} spatial dims: use a causal mask with padding='SAME' instead"
                )
            return ((dilation[0] * (window[0] - 1), 0),)
        if mode not in ("SAME", "SAME_LOWER", "VALID"):
            raise ValueError(f"padding must be {_PADDING_NAMES} or (lo, hi) pairs, got {padding!r}")
        effective = [d * (k - 1) + 1 for d, k in zip(dilation, window)]
        return tuple((int(lo), int(hi)) for lo, hi in lax.padtype_to_pads(in_spatial, effective, strides, mode))
    expected = f"padding must be {_PADDING_NAMES} or one (lo, hi) pair of ints per spatial dim"
    try:
        pairs = tuple((lo, hi) for lo, hi in padding)
    except (TypeError, ValueError):
        raise ValueError(f"{expected}, got {padding!r}") from None
    if not all(_is_int(v) for pair in pairs for v in pair):
        raise TypeError(f"{expected}, got {padding!r}")
    pairs = tuple((int(lo), int(hi)) for lo, hi in pairs)
    if len(pairs) != ndim:
        raise ValueError(f"padding needs one (lo, hi) pair per spatial dim ({ndim}), got {padding!r}")
    if any(n + lo + hi < 0 for n, (lo, hi) in zip(in_spatial, pairs)):
        raise ValueError(
            f"padding {pairs} crops more than the input's spatial shape {in_spatial} holds (as lax, which "
            "refuses it too): a negative pad may remove at most the whole dim"
        )
    return pairs


# float64 runs on the xla backend when jax_enable_x64 is on; the kernels take the rest.
FLOAT_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64))
_DTYPE_NAMES = "float32, bfloat16 or float16; float64 with jax_enable_x64"


def as_operand(name: str, value):
    """``x`` or ``kernel`` as an array: jax arrays (and tracers) as they are, array-likes
    (NumPy arrays, nested lists, scalars) converted as ``jnp.asarray`` would."""
    if isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
        return value
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} must be an array or array-like of floats (a jax or NumPy array, nested lists), "
            f"got {type(value).__name__}: {e}"
        ) from None


def as_segment_ids(segment_ids, shape) -> jax.Array:
    """``segment_ids`` checked: integers of ``shape``, x's without its channels (``(N, *spatial)``
    channels-last); traced values welcome.

    Raises:
      TypeError: not an array of integers.
      ValueError: not one id per position of ``x``.
    """
    ids = segment_ids
    if not isinstance(ids, (jax.Array, jax.ShapeDtypeStruct)):
        try:
            ids = jnp.asarray(ids)
        except (TypeError, ValueError):
            raise TypeError(f"segment_ids must be an array of integers, got {type(segment_ids).__name__}") from None
    dtype = np.dtype(ids.dtype)
    if dtype.kind not in "iu":
        raise TypeError(
            f"segment_ids must hold integers (a document id per position, negative for padding), got dtype {dtype}"
        )
    if dtype.kind == "u" and dtype.itemsize >= 4:
        # Positions outside the input are padding, id -1 as every signed dtype spells it;
        # an unsigned id would wrap it to a real one.
        raise TypeError(f"segment_ids must be signed integers (negative ids mark padding), got {dtype}: use int32")
    expected = tuple(shape)
    if tuple(ids.shape) != expected:
        raise ValueError(
            f"segment_ids must have x's shape without its channels, (N, *spatial) = {expected}, got {tuple(ids.shape)}"
        )
    return ids.astype(np.int32) if dtype.kind == "u" else ids


def _float_dtype(subject: str, dtype) -> np.dtype:
    """``subject``: what the error says, e.g. ``"x must have"``."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{subject} a floating dtype ({_DTYPE_NAMES}), got {dtype!r}") from None
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{subject} a floating dtype ({_DTYPE_NAMES}), got {dtype}")
    return dtype


def _precision(precision):
    """``None``, a ``lax.Precision``, its name, or a pair of them (one per operand)."""
    def one(p):
        if isinstance(p, lax.Precision):
            return p
        if isinstance(p, str):
            if p.upper() in lax.Precision.__members__:
                return lax.Precision[p.upper()]
            try:  # lax's own aliases ("float32", "tensorfloat32", ...)
                return lax.Precision(p)
            except ValueError:
                pass
        names = ", ".join(repr(m.lower()) for m in lax.Precision.__members__)
        raise ValueError(f"precision must be None, a lax.Precision, one of {names}, or a pair of them, got {precision!r}")

    if precision is None:
        return None
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        return (one(precision[0]), one(precision[1]))
    return one(precision)


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
    (:func:`as_operand`). ``segmented``: ``segment_ids`` are given (their values are
    checked by :func:`as_segment_ids`). Every error names the argument and what it
    accepts. The shapes checked after ``dimension_numbers`` are those of the
    channels-last problem (:mod:`maskconv_kernels.layout`).
    """
    x, kernel = as_operand("x", x), as_operand("kernel", kernel)
    x_dtype, k_dtype = _float_dtype("x must have", x.dtype), _float_dtype("kernel must have", kernel.dtype)
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
    layout = _layout(x.shape, kernel.shape, dimension_numbers, lhs_dilation, batch_group_count, feature_group_count)
    x = jax.ShapeDtypeStruct(layout.x_shape(x.shape), x_dtype)
    kernel = jax.ShapeDtypeStruct(layout.kernel_shape(kernel.shape), k_dtype)
    mask = layout.mask(mask)
    if any(k < 1 for k in kernel.shape[:-2]):
        raise ValueError(f"kernel window must be at least 1 in every spatial dim, got kernel shape {tuple(kernel.shape)}")
    groups = feature_group_count
    if not _is_int(groups) or groups < 1:
        raise ValueError(f"feature_group_count must be a positive int, got {groups!r}")
    groups *= layout.batch_groups  # folded into feature groups (layout.py), validated by _layout
    c_in, c_out = int(x.shape[-1]), int(kernel.shape[-1])
    if c_in < 1 or c_out < 1:
        raise ValueError(
            f"x and kernel need at least one channel each, got C_in={c_in} (x: {tuple(x.shape)}) and "
            f"C_out={c_out} (kernel: {tuple(kernel.shape)})"
        )
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
    pads = _padding(padding, in_spatial, window, strides, dilation, layout.lhs_dilation)
    out_dtype = x_dtype if preferred_element_type is None else _float_dtype("preferred_element_type must be", preferred_element_type)
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


def _layout(x_shape, kernel_shape, value, lhs_dilation, batch_group_count, feature_group_count) -> Layout:
    """Validates lax's layout arguments (:mod:`maskconv_kernels.layout`) for operands of these shapes."""
    ndim = len(x_shape) - 2
    lhs, rhs, out = _dimension_numbers(value, tuple(x_shape), tuple(kernel_shape))
    lhs_dilation = _tuple("lhs_dilation", lhs_dilation, ndim)
    g = batch_group_count
    if not _is_int(g) or g < 1:
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
