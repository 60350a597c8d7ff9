"""Tolerances from the dtype and the reduction length, random inputs, second-order checks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import maskconv_kernels as mk

__all__ = [
    "TOLERANCE", "DTYPES", "pass_roundoff", "tolerance", "random", "assert_close", "assert_same_bits",
    "second_order", "assert_second_order_close",
]


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

# A TPU's MXU multiplies bfloat16: a float32 (or float16) product is made of bfloat16
# passes, as many as the precision asks for. One pass (DEFAULT) rounds each
# operand to bfloat16 (8 significant bits, unit roundoff u = 2^-8), so a product is off
# by at most (1 + u)^2 - 1 ~ 2u = 2^-7 of |x| |k|. Three passes (HIGH: x = hi + lo, each
# a bfloat16, hi*hi + hi*lo + lo*hi) drop lo*lo and lo's own rounding, each at most
# u^2 = 2^-16 of the product: 3 u^2 < 2^-14. Six passes (HIGHEST) are float32 products,
# which TOLERANCE already covers. The accumulation is float32 in every case. Float64 is
# not an MXU type: XLA:TPU computes it in software, within TOLERANCE's 2^-49 (the spatial
# padding suite's float64 checks hold there on a v5e).
_PASS_ROUNDOFF = {lax.Precision.DEFAULT: 2.0**-7, lax.Precision.HIGH: 2.0**-14, lax.Precision.HIGHEST: 0.0}
# Names jax_default_matmul_precision takes besides lax.Precision's (jax >= 0.5's dot algorithms).
_ALGORITHMS = {"BF16_BF16_F32": "default", "BF16_BF16_F32_X3": "high", "TF32_TF32_F32": "high",
               "BF16_BF16_F32_X6": "highest", "F32_F32_F32": "highest"}


def _precision_in_force(precision) -> lax.Precision:
    """``precision`` (a ``lax.Precision``, its name, a pair of them, or ``None``: the one
    ``jax_default_matmul_precision`` sets, itself ``None`` for DEFAULT) as one ``lax.Precision``:
    of a pair, the one of fewer passes (the operand rounded most sets the error)."""
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if precision is None:
        return lax.Precision.DEFAULT
    if isinstance(precision, (tuple, list)):
        return max((_precision_in_force(p) for p in precision), key=_PASS_ROUNDOFF.get)
    if isinstance(precision, str):
        name = _ALGORITHMS.get(precision.upper(), precision.lower())
        try:
            return lax.Precision(name)
        except ValueError:
            return lax.Precision.DEFAULT  # an algorithm not named here: assume the fewest passes
    return lax.Precision(precision)


def pass_roundoff(dtype, precision=None, backend: str | None = None) -> float:
    """Relative error of one product that the matrix unit adds for ``dtype`` operands at
    ``precision`` (``None``: the precision in force) on ``backend`` (``None``: jax's default),
    beyond IEEE products: 0.0 but on a TPU below ``HIGHEST`` for float32 and float16 operands.

    CPU dots are IEEE whatever the precision. On GPUs the suites ask for ``HIGHEST``
    (:class:`support.harness.Implementation`); TF32 (the GPU default for float32) is not
    modelled here, so GPU bounds are today's whatever the precision.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend != "tpu" or np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float16)):
        return 0.0  # IEEE products; bfloat16 operands, exact in a bfloat16 pass; float64, not on the MXU
    return _PASS_ROUNDOFF[_precision_in_force(precision)]


def tolerance(dtype, reduction: int, precision=None, backend: str | None = None, operands=None) -> float:
    """Error bound, per unit of ``max|x| * max|kernel|``, of a sum of ``reduction`` products in ``dtype``
    (of ``operands``, their dtype where it is not the result's: 16-bit inputs summed into float32).

    ``TOLERANCE[dtype] * sqrt(reduction)``, plus, where the products are not IEEE
    (:func:`pass_roundoff`: a TPU below ``HIGHEST``), ``pass_roundoff * sqrt(reduction)``:
    each product's rounding is at most ``pass_roundoff`` of its magnitude, itself at most
    the scale, and the roundings of independent operands have zero mean, so their sum
    grows as sqrt(reduction), the model TOLERANCE's float32 entries use too (the worst
    case, every rounding of one sign, would be ``reduction`` times; the inputs are random).
    The same on CPUs whatever ``precision``: TOLERANCE's.
    """
    per_term = TOLERANCE[np.dtype(dtype)] + pass_roundoff(dtype if operands is None else operands, precision, backend)
    return per_term * np.sqrt(max(reduction, 1))


def random(key, shape, dtype=np.float32, scale=1.0):
    """Standard normal values, drawn in float32 by NumPy and cast (never zeros).

    NumPy, not jax.random, which compiles once per shape: a second or more per case.
    """
    values = np.random.default_rng(key).standard_normal(shape).astype(np.float32) * np.float32(scale)
    return jnp.asarray(values.astype(dtype))  # cast by NumPy (ml_dtypes): no convert to compile either


def assert_close(actual, expected, dtype, reduction: int, scale: float, precision=None, operands=None):
    """``|actual - expected| <= tolerance(dtype, reduction, precision, operands=operands) * scale`` everywhere, no NaN.

    ``precision``: what ``actual``'s products ran at (``None``: the precision in force);
    ``operands``: their dtype, where it is not ``dtype``.
    """
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.isfinite(actual).all(), "non-finite values in the result"
    bound = tolerance(dtype, reduction, precision, operands=operands) * scale
    err = np.abs(actual - expected).max(initial=0.0)
    assert err <= bound, f"max error {err:.3g} exceeds {bound:.3g} (reduction {reduction}, scale {scale:.3g})"


def assert_same_bits(actual, expected):
    """The same bits where ``expected`` is a number, a NaN where it is a NaN.

    A NaN's sign and payload are not part of a result (IEEE leaves them to the operation),
    and NumPy's own NaN matching skips 16-bit dtypes it does not know: on a TPU host's NumPy,
    ``assert_array_equal`` called two bfloat16 NaNs different.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, actual.dtype,
                                                                                expected.shape, expected.dtype)
    nan = np.isnan(expected.astype(np.float64))
    np.testing.assert_array_equal(np.isnan(actual.astype(np.float64)), nan, err_msg="NaNs in other places")
    bits = np.dtype(f"u{actual.dtype.itemsize}")
    np.testing.assert_array_equal(actual.view(bits)[~nan], expected.view(bits)[~nan], err_msg="other bits")


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
    # On the host's CPU: a TPU has no float64 arithmetic (there this reference came out NaN).
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        x64, k64 = jnp.asarray(np.asarray(x, np.float64)), jnp.asarray(np.asarray(k, np.float64))
        expected = second_order(leaky, x64, k64, mask)
        inner = lambda k: jax.grad(lambda x: (leaky(x, k, mask) ** 2).sum())(jnp.abs(x64))
        magnitude = jax.grad(lambda k: inner(k).sum())(jnp.abs(k64))
        expected, magnitude = np.asarray(expected), np.asarray(magnitude)
    taps = int(bits.sum()) if bits.ndim == k.ndim - 2 else int(bits.any(axis=(-2, -1)).sum())
    pixels = int(np.prod(x.shape[:-1]))
    reduction = taps * k.shape[-2] + taps * k.shape[-1] + pixels
    assert_close(actual, expected, dtype, reduction, float(magnitude.max()))
