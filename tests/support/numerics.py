"""Tolerances from the dtype and the reduction length, random inputs, second-order checks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import maskconv_kernels as mk

__all__ = ["TOLERANCE", "DTYPES", "random", "assert_close", "second_order", "assert_second_order_close"]


# Error bound per unit of sqrt(reduction length) * max|x| * max|kernel|. The reference
# is float64 on the same (rounded) inputs, so what remains is the accumulation in
# float32 (a few ulps, 2^-23 each) and, for 16-bit outputs, the final rounding of the
# output (half an ulp: 2^-9 for bfloat16, 2^-11 for float16), doubled for margin.
# TF32 products (GPU default precision) would need 2^-10; CPU dots are IEEE.
TOLERANCE = {
    np.dtype("float64"): 2.0**-49,  # jax_enable_x64, xla backend: float64 throughout, the same few ulps (2^-52 each)
    np.dtype("float32"): 2.0**-20,
    np.dtype(jax.numpy.bfloat16): 2.0**-7,
    np.dtype("float16"): 2.0**-9,
}

DTYPES = [np.dtype("float32"), np.dtype(jax.numpy.bfloat16), np.dtype("float16")]


def random(key, shape, dtype=np.float32, scale=1.0):
    """Standard normal values, drawn in float32 by NumPy and cast (never zeros).

    NumPy, not jax.random, which compiles once per shape: a second or more per case.
    """
    values = np.random.default_rng(key).standard_normal(shape).astype(np.float32) * np.float32(scale)
    return jnp.asarray(values.astype(dtype))  # cast by NumPy (ml_dtypes): no convert to compile either


def assert_close(actual, expected, dtype, reduction: int, scale: float):
    """``|actual - expected| <= TOLERANCE[dtype] * sqrt(reduction) * scale`` everywhere, no NaN."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.isfinite(actual).all(), "non-finite values in the result"
    bound = TOLERANCE[np.dtype(dtype)] * np.sqrt(max(reduction, 1)) * scale
    err = np.abs(actual - expected).max(initial=0.0)
    assert err <= bound, f"max error {err:.3g} exceeds {bound:.3g} (reduction {reduction}, scale {scale:.3g})"


def second_order(conv, x, k, mask):
    """``d/dk sum(tanh(d/dx sum(conv(x, k)^2)))``: reverse over reverse through ``conv``."""
    inner = lambda k: jax.grad(lambda x: (conv(x, k, mask) ** 2).sum())(x)
    return jax.grad(lambda k: jnp.tanh(inner(k)).sum())(k)


def assert_second_order_close(actual, x, k, mask, dtype=np.float32, **conv_args):
    """``actual`` against :func:`second_order` of the leaky baseline in float64.

    Bound: the roundings (in ``dtype``) of three chained sums (the output over active taps x
    C_in, the input gradient over active taps x C_out, the kernel gradient over pixels)
    add up, each relative to the sum of |terms|. That sum is bounded by the same
    computation on |x|, |k| with tanh' (at most 1) replaced by 1: every product then
    adds with the sign it has in absolute value.
    """
    bits = np.asarray(mask, bool)
    leaky = lambda x, k, m: mk.leaky_masked_conv(x, k, m, precision="highest", **conv_args)
    with jax.enable_x64(True):
        x64, k64 = jnp.asarray(x, jnp.float64), jnp.asarray(k, jnp.float64)
        expected = second_order(leaky, x64, k64, mask)
        inner = lambda k: jax.grad(lambda x: (leaky(x, k, mask) ** 2).sum())(jnp.abs(x64))
        magnitude = jax.grad(lambda k: inner(k).sum())(jnp.abs(k64))
        expected, magnitude = np.asarray(expected), np.asarray(magnitude)
    taps = int(bits.sum()) if bits.ndim == k.ndim - 2 else int(bits.any(axis=(-2, -1)).sum())
    pixels = int(np.prod(x.shape[:-1]))
    reduction = taps * k.shape[-2] + taps * k.shape[-1] + pixels
    assert_close(actual, expected, dtype, reduction, float(magnitude.max()))
