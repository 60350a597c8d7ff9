"""What the Flax (linen, nnx) and Equinox convolution modules do around ``masked_conv``, written once.

Each framework's module is a face over these: its own fields, parameters and layout,
and the same rules for what the frameworks share:

- the mask is fixed when the module is built (:func:`concrete_mask`): which taps are
  read is static, so a traced mask is refused with how to make it concrete;
- padding modes that fill the border with copies of values (``"CIRCULAR"``,
  ``"REFLECT"``, Equinox's ``"REPLICATE"``) are a ``jnp.pad`` before the convolution
  (:func:`pad_with_copies`): copies of real values, so no masked tap is read after it;
- segment ids refuse those modes (:func:`refuse_segment_ids_with_copies`): the copies
  belong to no position of a document.

Framework-free: neither Flax nor Equinox is imported here.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = ["COPY_MODES", "concrete_mask", "pad_with_copies", "refuse_segment_ids_with_copies"]

# Padding modes as the frameworks spell them, and jnp.pad's name for each.
COPY_MODES = {"CIRCULAR": "wrap", "REFLECT": "reflect", "REPLICATE": "edge"}


def concrete_mask(mask, framework_conv: str) -> None:
    """Raises ``TypeError`` for a traced mask; ``framework_conv`` names the module it replaces."""
    if isinstance(mask, jax.core.Tracer):
        raise TypeError(
            "mask is a traced value (built with jax.numpy inside a jitted init, nnx.eval_shape or another "
            "transform?): which taps are read is fixed when the module is built, so the mask must be concrete. "
            "Build it with NumPy (np.tril, np.broadcast_to, ...) or under jax.ensure_compile_time_eval(). "
            f"({framework_conv} multiplies the kernel by its mask, so it takes a traced one; this module never "
            "reads a masked tap.)"
        )


def pad_with_copies(x: jax.Array, pads: Sequence[tuple[int, int]], mode: str, first_spatial_axis: int) -> jax.Array:
    """``x`` padded by ``mode`` (a key of :data:`COPY_MODES`), ``pads`` on the spatial axes
    that start at ``first_spatial_axis``; the other axes (batch, channels) unpadded."""
    widths = [(0, 0)] * x.ndim
    widths[first_spatial_axis:first_spatial_axis + len(pads)] = [tuple(p) for p in pads]
    return jnp.pad(x, widths, COPY_MODES[mode.upper()])


def refuse_segment_ids_with_copies(argument: str, mode: str, zeros: str) -> None:
    """Raises ``ValueError`` for segment ids under a copying padding mode.

    ``argument``: the module's name for the mode (``"padding"``, ``"padding_mode"``);
    ``zeros``: how to pad with zeros instead, in the module's words.
    """
    raise ValueError(
        f"segment_ids with {argument}={mode!r}: that padding fills each row's border with copies of values "
        "(wrapped, mirrored or repeated), which belong to no position of a document: a document at one end would "
        f"read another's values or copies of its own; pad with zeros ({zeros}), where no tap leaves its document"
    )
