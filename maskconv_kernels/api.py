"""The public entry point: :func:`masked_conv`, its validation and backend dispatch."""
from __future__ import annotations

import jax

from . import xla
from .spec import make_spec

__all__ = ["masked_conv", "IMPLEMENTATIONS"]

# Tried in order by implementation=None; each entry says whether it applies.
IMPLEMENTATIONS = ("xla",)


def masked_conv(
    x: jax.Array,
    kernel: jax.Array,
    mask,
    *,
    strides=1,
    padding="SAME",
    dilation=1,
    feature_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
    implementation: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Exact masked convolution, channels-last: masked taps are never read.

    Args:
      x: ``(N, *spatial, C_in)`` with 1, 2 or 3 spatial dims; float32, bfloat16 or float16.
      kernel: ``(*window, C_in // feature_group_count, C_out)``, same dtype as ``x``.
      mask: static bools or 0/1 of shape ``window`` (one bit per tap) or the full kernel
        shape (channel-partial taps). Must not be traced.
      strides: int or one int per spatial dim.
      padding: ``"SAME"``, ``"VALID"``, ``"CAUSAL"`` (1-D only, as in flax: output t sees
        inputs up to t) or one ``(lo, hi)`` pair per spatial dim.
      dilation: kernel dilation, int or one int per spatial dim.
      feature_group_count: as in ``lax.conv_general_dilated``.
      precision: ``lax.Precision`` (or its name) for the products; ``"highest"`` gives
        IEEE float32 products on GPUs (no TF32).
      preferred_element_type: output dtype; defaults to ``x.dtype``. Accumulation is in
        float32 for every input dtype narrower than that.
      implementation: ``None`` (the best available for the platform), or ``"xla"``.
      interpret: run Pallas kernels in interpret mode (for tests on CPU).

    Returns:
      ``(N, *out_spatial, C_out)``. For finite inputs it equals
      ``lax.conv_general_dilated(x, kernel * mask, ...)`` up to rounding. Always: outputs do
      not depend on inputs reachable only through masked taps, whose gradient is exactly
      0.0, and the gradient of masked kernel entries is exactly 0.0.
    """
    spec = make_spec(
        x, kernel, mask, strides=strides, padding=padding, dilation=dilation,
        feature_group_count=feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type,
    )
    if implementation is None:
        implementation = "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    del interpret  # Used by the kernel backends.
    return xla.masked_conv(x, kernel, spec)
