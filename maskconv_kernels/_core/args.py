"""The argument normalisers every API shares: ints, paddings, float dtypes, precisions, operands
and segment ids. Each error names the argument and what it accepts.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "is_int", "ints", "padding_pairs", "PADDING_NAMES", "FLOAT_DTYPES", "float_dtype", "precision", "as_operand",
    "as_segment_ids", "segment_ids_of_positions",
]


def is_int(value) -> bool:
    """An int, NumPy's included; not a bool (``strides=True`` is a mistake, not a stride of 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def ints(name: str, value, ndim: int) -> tuple[int, ...]:
    """``value`` (an int, or a tuple or list of ``ndim`` ints, all positive) as ``ndim`` ints."""
    expected = f"{name} must be an int or a tuple of {ndim} ints"
    if is_int(value):
        values = (value,) * ndim
    elif isinstance(value, (tuple, list)) and all(is_int(v) for v in value):
        values = tuple(value)
    else:
        raise TypeError(f"{expected}, got {value!r}")
    if len(values) != ndim:
        raise ValueError(f"{expected}, got {value!r}")
    if any(v < 1 for v in values):
        raise ValueError(f"{name} must be positive, got {value!r}")
    return tuple(int(v) for v in values)


PADDING_NAMES = ("SAME", "SAME_LOWER", "VALID", "CAUSAL")


def padding_pairs(
    padding,
    window: Sequence[int],
    *,
    strides: Sequence[int] | None = None,
    dilation: Sequence[int] | None = None,
    in_spatial: Sequence[int] | None = None,
    lhs_dilation: Sequence[int] | None = None,
    names: Sequence[str] = PADDING_NAMES,
) -> tuple[tuple[int, int], ...]:
    """One ``(lo, hi)`` pair per spatial dim, as ``lax.conv_general_dilated`` applies them.

    Args:
      padding: one of ``names`` (``"SAME"``, ``"SAME_LOWER"``, ``"VALID"``; ``"CAUSAL"``,
        1-D only, as in flax: output t sees inputs up to t) or one ``(lo, hi)`` pair of ints
        per spatial dim.
      window: the kernel window.
      strides, dilation: per spatial dim (default 1).
      in_spatial: the (dilated) input's spatial shape. ``None``: unknown, which only a
        stride-1 string padding allows (its pads do not depend on the size).
      lhs_dilation: input dilation per dim: strings are refused above 1, as in lax.
      names: the strings this caller accepts.
    """
    ndim = len(window)
    strides = tuple(strides or (1,) * ndim)
    dilation = tuple(dilation or (1,) * ndim)
    quoted = ", ".join(repr(n) for n in names)
    if isinstance(padding, str):
        if lhs_dilation is not None and any(d > 1 for d in lhs_dilation):
            # lax.conv_general_dilated refuses this too: which output size is "SAME" for a
            # transposed convolution is a convention (lax.conv_transpose picks one).
            raise ValueError(
                f"padding={padding!r} is a string, which is not defined with lhs_dilation={tuple(lhs_dilation)} "
                "(as in lax.conv_general_dilated): give one (lo, hi) pair per spatial dim, applied to the dilated input"
            )
        mode = padding.upper()
        if mode not in names:
            raise ValueError(f"padding must be {quoted} or (lo, hi) pairs, got {padding!r}")
        if mode == "CAUSAL":
            if ndim != 1:
                raise ValueError(
                    f'padding="CAUSAL" is defined for 1-D convolutions only (as in flax), but the input has '
                    f"{ndim} spatial dims: use a causal mask with padding='SAME' instead"
                )
            return ((dilation[0] * (window[0] - 1), 0),)
        effective = [d * (k - 1) + 1 for d, k in zip(dilation, window)]
        if in_spatial is None:
            if any(s != 1 for s in strides):
                raise ValueError(f"padding={padding!r} with strides {strides} depends on the input's size")
            in_spatial = effective  # stride 1: the pads do not depend on the size
        return tuple((int(lo), int(hi)) for lo, hi in lax.padtype_to_pads(in_spatial, effective, strides, mode))
    expected = f"padding must be {quoted} or one (lo, hi) pair of ints per spatial dim"
    try:
        pairs = tuple((lo, hi) for lo, hi in padding)
    except (TypeError, ValueError):
        raise ValueError(f"{expected}, got {padding!r}") from None
    if not all(is_int(v) for pair in pairs for v in pair):
        raise TypeError(f"{expected}, got {padding!r}")
    pairs = tuple((int(lo), int(hi)) for lo, hi in pairs)
    if len(pairs) != ndim:
        raise ValueError(f"padding needs one (lo, hi) pair per spatial dim ({ndim}), got {padding!r}")
    if in_spatial is not None and any(n + lo + hi < 0 for n, (lo, hi) in zip(in_spatial, pairs)):
        raise ValueError(
            f"padding {pairs} crops more than the input's spatial shape {tuple(in_spatial)} holds (as lax, which "
            "refuses it too): a negative pad may remove at most the whole dim"
        )
    return pairs


# float64 runs on the xla backend when jax_enable_x64 is on; the kernels take the rest.
FLOAT_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64))
_DTYPE_NAMES = "float32, bfloat16 or float16; float64 with jax_enable_x64"


def float_dtype(subject: str, dtype) -> np.dtype:
    """``dtype`` checked to be one of :data:`FLOAT_DTYPES`; ``subject`` starts the error, e.g. ``"x must have"``."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{subject} a floating dtype ({_DTYPE_NAMES}), got {dtype!r}") from None
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{subject} a floating dtype ({_DTYPE_NAMES}), got {dtype}")
    return dtype


# jax_default_matmul_precision's dot-algorithm names (jax >= 0.5) as the lax.Precision they ask for.
# The others (8- and 16-bit dots) leave each platform's default (None).
_ALGORITHMS = {"BF16_BF16_F32": lax.Precision.DEFAULT, "BF16_BF16_F32_X3": lax.Precision.HIGH,
               "TF32_TF32_F32": lax.Precision.HIGH, "BF16_BF16_F32_X6": lax.Precision.HIGHEST,
               "BF16_BF16_F32_X9": lax.Precision.HIGHEST, "TF32_TF32_F32_X3": lax.Precision.HIGHEST,
               "F32_F32_F32": lax.Precision.HIGHEST, "F64_F64_F64": lax.Precision.HIGHEST}


def _default_precision():
    """``jax_default_matmul_precision`` as a ``lax.Precision``, or ``None`` (unset, or a
    dot algorithm without one)."""
    value = jax.config.jax_default_matmul_precision
    if value is None:
        return None
    if value.upper() in _ALGORITHMS:
        return _ALGORITHMS[value.upper()]
    try:
        return lax.Precision(value)  # "default", "high", "highest" and lax's aliases ("float32", ...)
    except ValueError:
        return None


def precision(value):
    """``None``, a ``lax.Precision``, its name (or lax's aliases), or a pair of them (one per operand).

    ``None`` is the precision ``jax.default_matmul_precision`` (or
    ``JAX_DEFAULT_MATMUL_PRECISION``) sets where the call is traced, as ``lax.conv`` and
    ``jnp.dot`` read it; ``None`` where it is unset (each platform's default). The kernels see
    what ``lax`` would: on a TPU, float32 products at ``"highest"`` under that setting.
    """
    if value is None:
        return _default_precision()

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
        raise ValueError(f"precision must be None, a lax.Precision, one of {names}, or a pair of them, got {value!r}")

    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (one(value[0]), one(value[1]))
    return one(value)


def as_operand(name: str, value):
    """An operand as an array: jax arrays (and tracers) as they are, array-likes (NumPy
    arrays, nested lists, scalars) converted as ``jnp.asarray`` would."""
    if isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
        return value
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} must be an array or array-like of floats (a jax or NumPy array, nested lists), "
            f"got {type(value).__name__}: {e}"
        ) from None


def as_segment_ids(
    segment_ids, shape, what: str = "x's shape without its channels, (N, *spatial)", name: str = "segment_ids"
) -> jax.Array:
    """``segment_ids`` checked: integers of ``shape`` (``what`` names it in the error, ``name`` the argument); traced values welcome.

    8- and 16-bit unsigned ids are taken as int32; 32- and 64-bit unsigned ones are refused
    (a position outside the input is padding, id -1, which they would wrap to a real id).

    Raises:
      TypeError: not an array of integers.
      ValueError: not one id per position.
    """
    ids = segment_ids
    if not isinstance(ids, (jax.Array, jax.ShapeDtypeStruct)):
        try:
            ids = jnp.asarray(ids)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be an array of integers, got {type(segment_ids).__name__}") from None
    dtype = np.dtype(ids.dtype)
    if dtype.kind not in "iu":
        raise TypeError(
            f"{name} must hold integers (a document id per position, negative for padding), got dtype {dtype}"
        )
    if dtype.kind == "u" and dtype.itemsize >= 4:
        raise TypeError(f"{name} must be signed integers (negative ids mark padding), got {dtype}: use int32")
    expected = tuple(shape)
    if tuple(ids.shape) != expected:
        raise ValueError(f"{name} must have {what} = {expected}, got {tuple(ids.shape)}")
    return ids.astype(np.int32) if dtype.kind == "u" else ids


def segment_ids_of_positions(positions, shape, what: str) -> jax.Array:
    """Packing by positions, as RecurrentGemma's ``segment_pos`` and MaxText's positions
    describe it, as segment ids: ``int32`` of ``shape``.

    ``positions[b, t]`` is token ``t``'s position in its document: ``0`` starts a new
    document (anywhere, not only after a change of id), a negative position is padding
    (a left-padded prompt's). Document ``k`` of a row (counted from 1; 0 is the document
    the row continues, whose inputs a state holds) gets id ``k``, padding ``-1``: the
    running count of starts along axis 1. Positions other than 0 are not read otherwise:
    ``[3, 4, 5]`` continues a document, as ``[7, 8, 9]`` does.

    Raises:
      TypeError, ValueError: as :func:`as_segment_ids`, naming ``positions``.
    """
    positions = as_segment_ids(positions, shape, what, name="positions")
    starts = jnp.cumsum((positions == 0).astype(jnp.int32), axis=1)
    return jnp.where(positions < 0, -1, starts)

