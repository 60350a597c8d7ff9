"""``lax.conv_general_dilated(x, kernel * mask)`` in float64: the oracle for lax's arguments.

``masked_conv`` takes lax's layout arguments (``dimension_numbers``, ``lhs_dilation``,
``batch_group_count``, ``"SAME_LOWER"``); the float64 NumPy reference computes the
channels-last problem only. Here lax itself, in float64 on the same (rounded) inputs,
is the reference, and the mask is broadcast to the kernel's layout by lax's own
``conv_dimension_numbers``, not by the library's layout code. For finite inputs the
contract is equality up to rounding; the bounds are conftest's (the reduction length
per output, the kernel gradient's pixel count).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from support.numerics import assert_close
from jax import lax

import maskconv_kernels as mk

_CHANNELS_LAST = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}


def lax_dimension_numbers(x_shape, k_shape, dimension_numbers) -> lax.ConvDimensionNumbers:
    """What masked_conv's ``dimension_numbers`` means, as lax's object (``None``: channels-last)."""
    if dimension_numbers is None:
        dimension_numbers = _CHANNELS_LAST[len(x_shape) - 2]
    return lax.conv_dimension_numbers(x_shape, k_shape, dimension_numbers)


def dense_mask(mask, k_shape, dn: lax.ConvDimensionNumbers) -> np.ndarray:
    """The mask broadcast to the kernel's own shape: a window mask's axes are the kernel's
    spatial axes in the kernel's order."""
    bits = np.asarray(mask, bool)
    if bits.ndim == len(k_shape):
        return bits
    shape = [1] * len(k_shape)
    for axis, n in zip(sorted(dn.rhs_spec[2:]), bits.shape):
        shape[axis] = n
    return np.broadcast_to(bits.reshape(shape), k_shape)


def _lax_kwargs(x_shape, k_shape, conv_args) -> dict:
    ndim = len(x_shape) - 2
    tup = lambda v: (v,) * ndim if isinstance(v, int) else tuple(v)
    return dict(
        window_strides=tup(conv_args.get("strides", 1)),
        padding=conv_args.get("padding", "SAME"),
        lhs_dilation=tup(conv_args.get("lhs_dilation", 1)),
        rhs_dilation=tup(conv_args.get("dilation", 1)),
        dimension_numbers=lax_dimension_numbers(x_shape, k_shape, conv_args.get("dimension_numbers")),
        feature_group_count=conv_args.get("feature_group_count", 1),
        batch_group_count=conv_args.get("batch_group_count", 1),
        precision=lax.Precision.HIGHEST,
    )


def lax_conv64(x, k, mask, **conv_args):
    """``(y, vjp)`` of lax's masked convolution in float64, as jax.vjp gives them (the vjp traced when called)."""
    kwargs = _lax_kwargs(x.shape, k.shape, conv_args)
    m = dense_mask(mask, k.shape, kwargs["dimension_numbers"])
    conv = lambda x, k: lax.conv_general_dilated(x, k * m, **kwargs)
    x64, k64 = np.asarray(x, np.float64), np.asarray(k, np.float64)
    with jax.enable_x64(True):
        y = np.asarray(conv(x64, k64))

    def vjp64(dy):
        with jax.enable_x64(True):
            _, vjp = jax.vjp(conv, jnp.asarray(x64), jnp.asarray(k64))
            return tuple(np.asarray(g) for g in vjp(jnp.asarray(np.asarray(dy, np.float64))))

    return y, vjp64


def _max(a) -> float:
    return float(np.abs(np.asarray(a, np.float64)).max(initial=0.0))


def bounds(x, k, mask, dy, **conv_args) -> dict:
    """``(reduction, scale)`` of the output, the input gradient and the kernel gradient."""
    dn = lax_dimension_numbers(x.shape, k.shape, conv_args.get("dimension_numbers"))
    m = dense_mask(mask, k.shape, dn)
    o, i = dn.rhs_spec[:2]
    per_output = int(m.sum(axis=tuple(a for a in range(m.ndim) if a != o)).max(initial=0))
    per_input = int(m.sum(axis=tuple(a for a in range(m.ndim) if a != i)).max(initial=0))
    pixels = int(np.prod(dy.shape)) // k.shape[o]  # (example, output pixel) pairs a kernel entry sums over
    return {
        "y": (per_output, _max(x) * _max(k)),
        "dx": (per_input, _max(dy) * _max(k)),
        "dk": (pixels, _max(dy) * _max(x)),
    }


def assert_matches_lax(x, k, mask, dtype, seed=0, grads=True, **conv_args):
    """masked_conv's output (and, with ``grads``, both gradients of ``<y, dy>``) equal lax's
    in float64. Returns the gradients ``(dx, dk)``, or ``None``.

    Without gradients the call is eager: cases that differ in their layout only share the
    backends' compiled problem.
    """
    expected, vjp64 = lax_conv64(x, k, mask, **conv_args)
    dy = jnp.asarray(np.random.default_rng(seed).standard_normal(expected.shape).astype(np.float32), dtype)
    if grads:
        def ours(x, k, dy):
            y, vjp = jax.vjp(lambda x, k: mk.masked_conv(x, k, mask, **conv_args), x, k)
            return y, vjp(dy)

        y, g = jax.jit(ours)(x, k, dy)
    else:
        y, g = mk.masked_conv(x, k, mask, **conv_args), None
    assert y.shape == expected.shape and y.dtype == dtype, (y.shape, y.dtype, expected.shape)
    b = bounds(x, k, mask, dy, **conv_args)
    assert_close(y, expected, dtype, *b["y"])
    if grads:
        dx, dk = vjp64(dy)
        assert_close(g[0], dx, dtype, *b["dx"])
        assert_close(g[1], dk, dtype, *b["dk"])
    return g


def assert_jvp_matches_lax(x, k, mask, dtype, seed=1, **conv_args):
    """Forward mode: masked_conv's JVP equals lax's in float64, ``conv(tx, k) + conv(x, tk)`` (bilinear)."""
    rng = np.random.default_rng(seed)
    tx, tk = (jnp.asarray(rng.standard_normal(a.shape).astype(np.float32), dtype) for a in (x, k))
    f = lambda x, k: mk.masked_conv(x, k, mask, **conv_args)
    _, t = jax.jit(lambda x, k, tx, tk: jax.jvp(f, (x, k), (tx, tk)))(x, k, tx, tk)
    expected = lax_conv64(tx, k, mask, **conv_args)[0] + lax_conv64(x, tk, mask, **conv_args)[0]
    reduction = bounds(x, k, mask, expected, **conv_args)["y"][0]
    assert_close(t, expected, dtype, reduction, _max(tx) * _max(k) + _max(x) * _max(tk))
