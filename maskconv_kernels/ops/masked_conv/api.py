"""The public entry point: :func:`masked_conv`, its validation and the choice of backend.

Backends are records in :mod:`.backends`; the three linear maps every backend computes,
with their derivatives, batching and per-platform lowering, are :mod:`.maps`. ``implementation=None`` chooses a backend per platform
*when the function is lowered* (the first of ``PREFERENCE`` that supports the problem
there; ``"xla"`` supports everything), so one exported artifact can hold the ``xla`` path
for CPU and the GPU kernels for cuda.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..._core.args import as_operand, as_segment_ids
from ..._core.errors import OpError
from ..._moved import warn
from . import backends as _backends
from . import maps
from .backends import IMPLEMENTATIONS, PREFERENCE
from .spec import make_spec

__all__ = ["masked_conv", "run", "IMPLEMENTATIONS", "PREFERENCE", "implementation_for"]

OP = OpError("masked_conv")

# Old implementation names, accepted with a DeprecationWarning until _moved.REMOVED_IN.
_RENAMED = {"pallas": "pallas_triton"}


def implementation_for(spec, platform: str | None = None, interpret: bool = False) -> str:
    """The backend ``implementation=None`` lowers ``spec`` with for ``platform`` (default: jax's).

    ``platform``: a lowering platform (``"cpu"``, ``"cuda"``, ``"tpu"``, ...) or jax's
    ``"gpu"``. The choice is among that platform's :data:`PREFERENCE`; ``interpret=True``
    runs it in its interpreter and never brings in another platform's kernels.
    """
    return _backends.choose(spec, _backends.lowering_platform(platform), interpret).name


def _one_spelling(name: str, value, lax_name: str, lax_value):
    """``value`` or ``lax_value``: one argument under its name here and lax's; ``None`` is "not given"."""
    if value is not None and lax_value is not None:
        raise TypeError(
            f"masked_conv() got both {name}={value!r} and {lax_name}={lax_value!r}, which are one argument "
            f"({lax_name} is lax.conv_general_dilated's name for {name}): pass one of them"
        )
    return lax_value if value is None else value


def masked_conv(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
    mask=None,
    *,
    strides=None,
    padding="SAME",
    dilation=None,
    lhs_dilation=None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    dimension_numbers=None,
    precision=None,
    preferred_element_type=None,
    implementation: str | None = None,
    interpret: bool = False,
    config=None,
    segment_ids: jax.typing.ArrayLike | None = None,
    window_strides=None,
    rhs_dilation=None,
) -> jax.Array:
    """Exact masked convolution: masked taps are never read.

    Args:
      x: ``(N, *spatial, C_in)`` with 1, 2 or 3 spatial dims (or the order
        ``dimension_numbers`` gives); float32, bfloat16 or float16 (float64 with
        ``jax_enable_x64``, on the xla backend). Array-likes (NumPy arrays, nested lists)
        are converted as ``jnp.asarray`` would.
      kernel: ``(*window, C_in // feature_group_count, C_out)`` (or the order
        ``dimension_numbers`` gives). Its dtype may differ from ``x``'s: products are
        taken in the wider dtype (widening is exact), the output has ``x``'s dtype and each
        gradient its operand's. A wider kernel (bfloat16 activations, float32 weights) runs
        on the ``xla`` backend and keeps float32 weight gradients. A narrower one (float16
        or bfloat16 weights, float32 ``x``) is read as ``kernel.astype(x.dtype)`` before a
        backend is chosen, so the output is that of float32 weights, bit for bit, on every
        backend; only its gradient is rounded, once, to the kernel's dtype (float16
        overflows to inf beyond 65504). For a float32 weight gradient, pass
        ``kernel.astype(x.dtype)``.
      mask: static bools or 0/1 of shape ``window`` (one bit per tap; the kernel's spatial
        dims in the kernel's order) or the kernel's shape (channel-partial taps). Must not
        be traced. ``None`` (the default): every tap is active, as in the Flax and Equinox
        modules.
      strides: int or one int per spatial dim (``None``: 1); lax's ``window_strides``.
      padding: ``"SAME"``, ``"SAME_LOWER"``, ``"VALID"``, ``"CAUSAL"`` (1-D only, as in
        flax: output t sees inputs up to t) or one ``(lo, hi)`` pair per spatial dim. Pairs
        apply to the dilated input; strings need ``lhs_dilation=1``, as in lax.
      dilation: kernel dilation, int or one int per spatial dim (``None``: 1); lax's
        ``rhs_dilation``.
      lhs_dilation: input dilation, int or one int per spatial dim (``None``: 1): ``d - 1`` zeros
        between input pixels, so a transposed convolution (computed on the dilated input,
        the zeros included).
      feature_group_count, batch_group_count: as in ``lax.conv_general_dilated`` (at most
        one above 1); the output has ``N // batch_group_count`` examples.
      dimension_numbers: ``None`` (channels-last, as above; lax's ``None`` is NCHW/OIHW),
        a ``lax.ConvDimensionNumbers``, or three strings as lax takes them, e.g.
        ``("NCHW", "OIHW", "NCHW")``. The backends compute channels-last; other layouts are
        transposed in and out (``maskconv_kernels.ops.masked_conv.layout``).
      precision: ``lax.Precision`` (or its name) for the products; ``"highest"`` gives
        IEEE float32 products on GPUs (no TF32) and TPUs (no bfloat16 passes). ``None``:
        what ``jax.default_matmul_precision`` sets, as for ``lax.conv``.
      preferred_element_type: output dtype; defaults to ``x.dtype``. Accumulation is in
        float32 for every input dtype narrower than that.
      implementation: ``None`` (per platform, when lowered: the first backend of
        ``PREFERENCE`` that supports the problem there) or one of ``IMPLEMENTATIONS``.
      interpret: run kernel backends in interpret mode (for tests on CPU). With
        ``implementation="xla"`` there is no kernel to interpret: a ``UserWarning`` says
        so and the call runs as with ``interpret=False``.
      config: the named implementation's frozen ``Config`` (its module's, e.g.
        ``maskconv_kernels.ops.masked_conv.pallas_triton.Config``), or ``None`` for its
        heuristic.
      segment_ids: ``None``, or integers of x's shape without its channels (``(N,
        *spatial)`` channels-last; traced values welcome): packed documents. A tap reads
        input ``q`` for output ``p`` only where ``segment_ids[q] == segment_ids[p]``; a
        negative id marks padding, whose outputs are zero and which receives no gradient.
        Selected, never multiplied, so no value (NaN included) crosses a segment boundary.
        Needs an output on the input's grid (stride 1, a size-preserving padding, no input
        dilation or batch groups).
      window_strides, rhs_dilation: ``lax.conv_general_dilated``'s names for ``strides``
        and ``dilation``, so that its keyword calls port unchanged; give one spelling of
        each. lax's other keywords are spelt as here.

    Returns:
      ``(N // batch_group_count, *out_spatial, C_out)``, in the order ``dimension_numbers``
      gives; zero-size where the window does not fit, as in lax. For finite inputs it
      equals ``lax.conv_general_dilated(x, kernel * mask, ...)`` up to rounding. Always: outputs do
      not depend on inputs reachable only through masked taps (or in another segment),
      whose gradient is exactly 0.0, and the gradient of masked kernel entries is exactly 0.0.

    Raises:
      ValueError, TypeError: bad arguments (the message names the argument); TypeError
        for both spellings of one argument (``strides`` and ``window_strides``, say).
      NotImplementedError: the requested implementation does not support this problem
        (when called), or cannot run on a platform the function is lowered for (when
        lowered; e.g. a GPU backend lowered for CPU without ``interpret=True``).
    """
    with OP.words():
        strides = _one_spelling("strides", strides, "window_strides", window_strides)
        dilation = _one_spelling("dilation", dilation, "rhs_dilation", rhs_dilation)
        x, kernel = as_operand("x", x), as_operand("kernel", kernel)
        kernel = _widened(kernel, x.dtype)
        spec = make_spec(
            x, kernel, mask, strides=strides, padding=padding, dilation=dilation,
            feature_group_count=feature_group_count, precision=precision,
            preferred_element_type=preferred_element_type, lhs_dilation=lhs_dilation,
            dimension_numbers=dimension_numbers, batch_group_count=batch_group_count, segmented=segment_ids is not None,
        )
        layout = spec.layout
        if segment_ids is not None:
            segment_ids = layout.segment_ids(as_segment_ids(segment_ids, layout.segment_ids_shape(x.shape)))
    if implementation in _RENAMED:
        warn(f'implementation="{implementation}"', f'implementation="{_RENAMED[implementation]}"', stacklevel=2)
        implementation = _RENAMED[implementation]
    # The problem alone here; the platform when the function is lowered.
    backend, interpret = _backends.REGISTRY.resolve(spec, implementation, interpret, config)
    y = run(spec.channels_last(), layout.x(x), layout.kernel(kernel), backend=backend, interpret=interpret,
            config=config, segment_ids=segment_ids)
    return layout.output(y)


def _widened(kernel: jax.Array, x_dtype) -> jax.Array:
    """A kernel narrower than x (float16 or bfloat16 weights, float32 x) as x's dtype: the
    same program as float32 weights then, whichever backend runs it (the kernels take one
    dtype), and autodiff rounds the weight gradient to the kernel's dtype once."""
    floating = jnp.issubdtype(kernel.dtype, jnp.floating) and jnp.issubdtype(x_dtype, jnp.floating)
    if floating and kernel.dtype != x_dtype and jnp.promote_types(kernel.dtype, x_dtype) == x_dtype:
        return kernel.astype(x_dtype)
    return kernel


def run(spec, x, kernel, *, backend, interpret: bool, config, segment_ids=None) -> jax.Array:
    """A checked convolution: what :func:`masked_conv` runs after its checks, and what ops
    built on it (``causal_conv``) run on the problems they checked themselves.

    Args:
      spec: a channels-last :class:`~.spec.ConvSpec`, checked (:func:`~.spec.make_spec`,
        or :meth:`~.spec.ConvSpec.resized` from one).
      x, kernel: channels-last arrays of ``spec``'s shapes and dtypes.
      backend: the implementation's record (checked against ``spec``), or ``None`` to
        choose one per platform when lowered.
      interpret, config: as checked.
      segment_ids: ``(N, *spatial)`` integers when ``spec.segmented``, else ``None``.

    Returns:
      ``(N, *spec.out_spatial, C_out)`` in ``spec.out_dtype``.
    """
    if 0 in spec.out_spatial:
        # The window does not fit (VALID, say): lax's zero-size output, nothing read, and
        # zero-size gradients, since the zeros do not depend on x or the kernel.
        return jnp.zeros((x.shape[0], *spec.out_spatial, spec.c_out), spec.out_dtype)
    return maps.masked_conv(x, kernel, spec, backend=backend, interpret=interpret, config=config,
                            segment_ids=segment_ids)
