"""The Pallas backend: what it supports, the custom VJP wiring and the public function.

The forward, the input gradient and the weight gradient are three linear maps, each a
Pallas kernel under its own ``jax.custom_vjp`` whose backward is built from the other
two, so gradients of gradients run the same exact kernels (no XLA convolution, no
differentiation through a ``pallas_call``):

* ``y  = conv(x, k)``:   ``dx = conv_dx(dy, k)``,   ``dk = conv_dk(x, dy)``
* ``dx = conv_dx(dy, k)``: ``d dy = conv(ddx, k)``, ``dk = conv_dk(ddx, dy)``
* ``dk = conv_dk(x, dy)``: ``dx = conv_dx(dy, ddk)``, ``d dy = conv(x, ddk)``
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..spec import ConvSpec
from . import kernels
from .config import BlockSizes
from .kernels import Geometry, Piece

__all__ = ["masked_conv", "unsupported"]

_INT32_LIMIT = 2**31


def _platform_version() -> str:
    try:
        return jax.devices()[0].client.platform_version.lower()
    except Exception:  # pragma: no cover - no initialised backend
        return ""


def unsupported(spec: ConvSpec, platform: str, interpret: bool = False) -> str | None:
    """Why the Pallas kernels cannot run ``spec`` on ``platform`` (``None`` when they can)."""
    if spec.ndim == 3:
        return "3-D convolutions (the Pallas kernels are 1-D and 2-D; implementation=None uses xla)"
    if spec.groups > 1:
        return f"feature_group_count={spec.groups} (grouped convolutions; implementation=None uses xla)"
    if np.dtype(spec.acc_dtype) != np.float32:
        return f"{spec.acc_dtype} inputs (the kernels take float32, bfloat16 and float16)"
    if interpret:
        return None
    if platform != "gpu":
        return (
            f'platform "{platform}": the kernels lower through Triton for NVIDIA GPUs '
            "(pass interpret=True to run them on this platform in interpret mode)"
        )
    if "rocm" in _platform_version():
        return "ROCm GPUs (the kernels are tuned and tested for NVIDIA GPUs only)"
    return None


def masked_conv(
    x: jax.Array,
    kernel: jax.Array,
    spec: ConvSpec,
    *,
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
    platform: str | None = None,
) -> jax.Array:
    """Exact masked convolution by Pallas kernels that read active taps only.

    Args:
      x: ``[N, *spatial, C_in]`` with 1 or 2 spatial dims; float32, bfloat16 or float16.
      kernel: ``[*window, C_in, C_out]``, same dtype as ``x``.
      spec: the validated problem (:func:`maskconv_kernels.spec.make_spec`).
      interpret: run the kernels in Pallas interpret mode (any platform, slow).
      block_sizes: tile sizes; default :meth:`BlockSizes.get_default` for this problem.
      platform: the platform the call is lowered for, default ``jax.default_backend()``;
        ``"gpu"`` lowers for an NVIDIA GPU ahead of time on a machine without one.

    Returns:
      ``[N, *out_spatial, C_out]`` in ``spec.out_dtype``, accumulated in float32 (TF32
      products for float32 inputs unless ``spec.precision`` is ``HIGHEST``).

    Raises:
      NotImplementedError: :func:`unsupported` gives a reason, or an index would not fit int32.
    """
    reason = unsupported(spec, platform or jax.default_backend(), interpret)
    if reason is not None:
        raise NotImplementedError(f'implementation="pallas" does not support this problem: {reason}')
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(spec, x.dtype)
    elif not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    batch = x.shape[0]
    pixels = max(int(np.prod(spec.in_spatial)), int(np.prod(spec.out_spatial)))
    if batch * pixels >= _INT32_LIMIT:
        raise NotImplementedError(
            f'implementation="pallas" does not support this problem: N * pixels = {batch} * {pixels} '
            "does not fit the kernels' int32 pixel index; split the batch"
        )
    plan = _plan(spec, block_sizes, interpret)
    x2, k2 = x, kernel
    if spec.ndim == 1:  # a 1-D convolution is a 2-D one of height 1
        x2, k2 = x[:, None], kernel[None]
    y = _conv(x2, k2, plan, np.dtype(spec.out_dtype))
    return y[:, 0] if spec.ndim == 1 else y


# --------------------------------------------------------------------------- the static plan


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static the three kernels need; hashable, so it is a nondiff argument."""

    geometry: Geometry
    interpret: bool

    def padded_kernel(self, k):
        """``[KH, KW, C_in_pad, C_out_pad]``: channels zero-padded to whole tiles (the kernel is small)."""
        g = self.geometry
        return jnp.pad(k, ((0, 0), (0, 0), (0, g.c_in_pad - g.c_in), (0, g.c_out_pad - g.c_out)))


def _plan(spec: ConvSpec, blocks: BlockSizes, interpret: bool) -> _Plan:
    lift = (lambda t: (1, *t)) if spec.ndim == 1 else tuple
    lift_tap = (lambda t: (0, *t)) if spec.ndim == 1 else tuple
    # The mask's own decomposition into dense pieces (masks.Mask.terms): boxes of taps,
    # each active for a set of (input, output) channels; a piece per tap of each box.
    pieces = sorted(
        (
            Piece(
                lift_tap(tap),
                None if term.in_channels is None else _runs(term.in_channels),
                None if term.out_channels is None else _runs(term.out_channels),
            )
            for term in spec.mask.terms
            for tap in term.box.taps()
        ),
        key=lambda p: p.tap,  # raster order: neighbouring taps read neighbouring memory
    )
    highest = _is_highest(spec.precision)
    geometry = Geometry(
        in_hw=lift(spec.in_spatial),
        out_hw=lift(spec.out_spatial),
        window=lift(spec.window),
        strides=lift(spec.strides),
        dilation=lift(spec.dilation),
        pad_lo=tuple(lo for lo, _ in spec.padding) if spec.ndim == 2 else (0, spec.padding[0][0]),
        c_in=spec.c_in,
        c_out=spec.c_out,
        pieces=tuple(pieces),
        taps=tuple(lift_tap(t) for t in spec.mask.active_taps),
        highest=highest,
        blocks=blocks,
    )
    return _Plan(geometry, interpret)


def _runs(channels) -> tuple[tuple[int, int], ...]:
    """Sorted channel indices as maximal ``(start, stop)`` runs: ``(0, 1, 2, 5)`` -> ``((0, 3), (5, 6))``."""
    runs: list[list[int]] = []
    for c in channels:
        if runs and runs[-1][1] == c:
            runs[-1][1] = c + 1
        else:
            runs.append([c, c + 1])
    return tuple((a, b) for a, b in runs)


def _is_highest(precision) -> bool:
    if precision is None:
        return False
    values = precision if isinstance(precision, tuple) else (precision,)
    return any(p == lax.Precision.HIGHEST for p in values)


def _common(a, b):
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


# --------------------------------------------------------------------------- the three linear maps


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv(x, k, plan: _Plan, out_dtype):
    """``y: [N, OH, OW, C_out]`` from ``x: [N, H, W, C_in]``, ``k: [KH, KW, C_in, C_out]``."""
    g = plan.geometry
    if not g.taps:
        return jnp.zeros((x.shape[0], *g.out_hw, g.c_out), out_dtype)
    x, k = _common(x, k)
    return kernels.forward(x, plan.padded_kernel(k), g, out_dtype, plan.interpret)


def _conv_fwd(x, k, plan, out_dtype):
    return _conv(x, k, plan, out_dtype), (x, k)


def _conv_bwd(plan, out_dtype, residuals, dy):
    x, k = residuals
    return _conv_dx(dy, k, plan, np.dtype(x.dtype)), _conv_dk(x, dy, plan, np.dtype(k.dtype))


_conv.defvjp(_conv_fwd, _conv_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv_dx(dy, k, plan: _Plan, dx_dtype):
    """``dx: [N, H, W, C_in]`` from ``dy: [N, OH, OW, C_out]``: the transpose of ``_conv`` in ``x``."""
    g = plan.geometry
    if not g.taps:
        return jnp.zeros((dy.shape[0], *g.in_hw, g.c_in), dx_dtype)
    dy, k = _common(dy, k)
    return kernels.input_grad(dy, plan.padded_kernel(k), g, dx_dtype, plan.interpret)


def _conv_dx_fwd(dy, k, plan, dx_dtype):
    return _conv_dx(dy, k, plan, dx_dtype), (dy, k)


def _conv_dx_bwd(plan, dx_dtype, residuals, ddx):
    dy, k = residuals
    return _conv(ddx, k, plan, np.dtype(dy.dtype)), _conv_dk(ddx, dy, plan, np.dtype(k.dtype))


_conv_dx.defvjp(_conv_dx_fwd, _conv_dx_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv_dk(x, dy, plan: _Plan, dk_dtype):
    """``dk: [KH, KW, C_in, C_out]``, exactly zero on masked entries (never computed)."""
    g = plan.geometry
    kh, kw = g.window
    zeros = jnp.zeros((g.c_in, g.c_out), dk_dtype)
    if not g.taps:
        return jnp.zeros((kh, kw, g.c_in, g.c_out), dk_dtype)
    x, dy = _common(x, dy)
    active = kernels.weight_grad(x, dy, g, dk_dtype, plan.interpret)
    index = {tap: i for i, tap in enumerate(g.taps)}
    dk = jnp.stack(
        [active[index[(i, j)]] if (i, j) in index else zeros for i in range(kh) for j in range(kw)]
    ).reshape(kh, kw, g.c_in, g.c_out)
    return dk


def _conv_dk_fwd(x, dy, plan, dk_dtype):
    return _conv_dk(x, dy, plan, dk_dtype), (x, dy)


def _conv_dk_bwd(plan, dk_dtype, residuals, ddk):
    x, dy = residuals
    return _conv_dx(dy, ddk, plan, np.dtype(x.dtype)), _conv(x, ddk, plan, np.dtype(dy.dtype))


_conv_dk.defvjp(_conv_dk_fwd, _conv_dk_bwd)
