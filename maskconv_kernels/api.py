"""The public entry point: :func:`masked_conv`, its validation and backend dispatch.

A backend is a module with two functions:

* ``unsupported(spec: ConvSpec, platform: str, interpret: bool) -> str | None``: why it
  cannot run this problem on this platform (``None`` when it can);
* ``masked_conv(x, kernel, spec, *, interpret: bool) -> jax.Array``.

``implementation=None`` tries ``PREFERENCE`` in order and takes the first backend that
supports the problem; ``"xla"`` supports everything, so it is the fallback.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from .sharding import partitioned_masked_conv
from .spec import as_operand, make_spec

__all__ = ["masked_conv", "IMPLEMENTATIONS", "implementation_for"]

# name -> module holding the backend; imported on first use, so optional
# dependencies (triton, jax-triton) are only needed by those who ask for them.
_MODULES = {
    "pallas": "maskconv_kernels.pallas",
    "triton": "maskconv_kernels.triton",
    "xla": "maskconv_kernels.xla",
}
IMPLEMENTATIONS = tuple(_MODULES)
# Tried in order by implementation=None.
PREFERENCE = ("pallas", "xla")


def _backend(name: str):
    return importlib.import_module(_MODULES[name])


def implementation_for(spec, platform: str | None = None, interpret: bool = False) -> str:
    """The backend ``implementation=None`` picks for ``spec`` on ``platform`` (default: jax's)."""
    platform = platform or jax.default_backend()
    for name in PREFERENCE:
        if _backend(name).unsupported(spec, platform, interpret) is None:
            return name
    raise AssertionError("the xla backend supports every problem")  # pragma: no cover


def masked_conv(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
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
      x: ``(N, *spatial, C_in)`` with 1, 2 or 3 spatial dims; float32, bfloat16 or float16
        (float64 with ``jax_enable_x64``, on the xla backend). Array-likes (NumPy arrays,
        nested lists) are converted as ``jnp.asarray`` would.
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
      implementation: ``None`` (the best backend that supports the problem on this
        platform) or one of ``IMPLEMENTATIONS``.
      interpret: run kernel backends in interpret mode (for tests on CPU).

    Returns:
      ``(N, *out_spatial, C_out)``. For finite inputs it equals
      ``lax.conv_general_dilated(x, kernel * mask, ...)`` up to rounding. Always: outputs do
      not depend on inputs reachable only through masked taps, whose gradient is exactly
      0.0, and the gradient of masked kernel entries is exactly 0.0.

    Raises:
      ValueError, TypeError: bad arguments (the message names the argument).
      NotImplementedError: the requested implementation does not support this problem.
    """
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True or False, got {interpret!r}")
    x, kernel = as_operand("x", x), as_operand("kernel", kernel)
    spec = make_spec(
        x, kernel, mask, strides=strides, padding=padding, dilation=dilation,
        feature_group_count=feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type,
    )
    if implementation is None:
        implementation = implementation_for(spec, interpret=interpret)
    elif implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    else:
        reason = _backend(implementation).unsupported(spec, jax.default_backend(), interpret)
        if reason is not None:
            raise NotImplementedError(f'implementation="{implementation}" does not support this problem: {reason}')
    if x.shape[0] == 0:  # an empty batch: nothing to compute (the kernels' grids cannot be empty)
        return jnp.zeros((0, *spec.out_spatial, spec.c_out), spec.out_dtype)
    # Kernel backends are custom calls XLA cannot partition: this wraps them so a
    # batch-sharded x stays sharded under jit (see maskconv_kernels/sharding.py).
    return partitioned_masked_conv(implementation, _backend(implementation), x, kernel, spec, interpret=interpret)
