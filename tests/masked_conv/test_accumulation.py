"""16-bit problems are accumulated in float32 across every piece and rounded once, in all three maps.

A mask that splits into several boxes (or channel pieces) is a sum of pieces; rounding
each piece's share to 16 bits before adding them (the xla backend's input gradient did,
by transposing at a 16-bit primal) loses whatever cancels between pieces. Each case runs
the forward, the input gradient and the weight gradient on every backend, against the
float64 reference under the per-dtype bound, and against ``lax.conv(kernel * mask)`` in
the same dtype, which rounds once: ours may not be much further from the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import TOLERANCE, assert_close, random
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels.masks import as_mask
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference, masked_conv_reference_vjp

HALF = [np.dtype(jnp.bfloat16), np.dtype(jnp.float16)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_input_gradient_keeps_what_cancels_between_pieces(conv, dtype):
    """The smallest case: a width-3 mask ``[1, 0, 1]`` is two one-tap pieces whose shares
    at position 1 are ``(1 + e)^2`` and ``-(1 + 2e)``: the gradient there is exactly
    ``e^2`` (``e`` the dtype's epsilon), which either share rounded to 16 bits loses."""
    eps = float(jnp.finfo(dtype).eps)
    x = jnp.zeros((1, 3, 1), dtype)
    kernel = jnp.asarray([1 + eps, 5.0, -(1 + 2 * eps)], dtype).reshape(3, 1, 1)
    mask = np.array([1, 0, 1], bool)
    cotangent = jnp.asarray([1.0, 0.0, 1 + eps], dtype).reshape(1, 3, 1)
    if conv.unsupported(x, kernel, mask) is not None:
        pytest.skip(f"{conv.name} does not run {dtype}: {conv.unsupported(x, kernel, mask)}")
    _, vjp = jax.vjp(lambda x: conv(x, kernel, mask), x)
    (dx,) = vjp(cotangent)
    assert dx.dtype == dtype
    np.testing.assert_array_equal(np.asarray(dx, np.float64).ravel(), [0.0, eps**2, 0.0])


def _two_or_more_pieces(window, seed):
    """A random window mask whose decomposition has at least two pieces."""
    rng = np.random.default_rng(seed)
    while True:
        bits = rng.random(window) < 0.6
        if len(as_mask(bits, (*window, 1, 1)).terms) >= 2:
            return bits


CASES = {
    "1d_k5_random": ((2, 23, 6), (5,), 5, _two_or_more_pieces((5,), 0), {}),
    "1d_k4_random_d2": ((2, 19, 4), (4,), 6, _two_or_more_pieces((4,), 1), {"dilation": 2}),
    "2d_k3_random": ((2, 9, 10, 8), (3, 3), 8, _two_or_more_pieces((3, 3), 2), {}),
    "2d_k5_random": ((1, 11, 9, 6), (5, 5), 7, _two_or_more_pieces((5, 5), 3), {}),
    "2d_k7A": ((1, 12, 12, 5), (7, 7), 6, mk.pixelcnn_mask((7, 7), "A"), {}),
    "2d_k5B": ((2, 8, 9, 6), (5, 5), 8, mk.pixelcnn_mask((5, 5), "B"), {}),
    "2d_k3_rgbB_full": ((1, 8, 7, 6), (3, 3), 9, mk.channel_grouped_mask((3, 3), 6, 9, "B"), {}),
    "2d_k5A_s2_VALID": ((1, 13, 12, 4), (5, 5), 5, mk.pixelcnn_mask((5, 5), "A"), {"strides": 2, "padding": "VALID"}),
}


def _maps(f, x, k, dy):
    y, vjp = jax.vjp(f, x, k)
    return (y, *vjp(dy.astype(y.dtype)))


def _error(actual, expected):
    return float(np.abs(np.asarray(actual, np.float64) - expected).max(initial=0.0))


# float16 in the slow tier: the same sums, rounded to a 10-bit mantissa instead of 7.
@pytest.mark.parametrize("dtype", [HALF[0], pytest.param(HALF[1], marks=pytest.mark.slow)], ids=str)
@pytest.mark.parametrize("name", tiered(sorted(CASES), lambda n: n in ("1d_k4_random_d2", "2d_k5_random", "2d_k3_rgbB_full",
                                                                      "2d_k5A_s2_VALID")))
def test_three_maps_round_once_on_multi_piece_masks(conv, name, dtype):
    x_shape, window, c_out, mask, kw = CASES[name]
    x = random(30, x_shape, dtype)
    k = random(31, (*window, x_shape[-1], c_out), dtype, scale=1 / np.sqrt(np.prod(window) * x_shape[-1]))
    reason = conv.unsupported(x, k, mask, **kw)
    if reason is not None:
        pytest.skip(f"{conv.name} does not run this case: {reason}")
    y_ref = masked_conv_reference(x, k, mask, **kw)
    dy = random(32, y_ref.shape, dtype)
    dx_ref, dk_ref = masked_conv_reference_vjp(x, k, mask, dy, **kw)
    ours = _maps(jax.jit(lambda x, k: conv(x, k, mask, **kw)), x, k, dy)
    lax_ = _maps(jax.jit(lambda x, k: mk.leaky_masked_conv(x, k, mask, **kw)), x, k, dy)

    scale = lambda a: float(np.abs(np.asarray(a, np.float64)).max())  # noqa: E731
    bits = np.asarray(mask, bool)
    taps = int(bits.any(axis=(-2, -1)).sum()) if bits.ndim > len(window) else int(bits.sum())
    reductions = (taps * x_shape[-1], taps * c_out, int(np.prod(y_ref.shape[:-1])))
    scales = (scale(x) * scale(k), scale(dy) * scale(k), scale(dy) * scale(x))
    for what, a, b, ref, reduction, s in zip(("y", "dx", "dk"), ours, lax_, (y_ref, dx_ref, dk_ref), reductions, scales):
        assert a.dtype == dtype, what
        assert_close(a, ref, dtype, reduction, s)
        # Rounded once from float32, as lax rounds: within twice lax's error, plus the
        # float32 sums' own rounding (a few float32 ulps of the scale).
        margin = TOLERANCE[np.dtype("float32")] * np.sqrt(reduction) * s
        assert _error(a, ref) <= 2 * _error(b, ref) + margin, (
            f"{what}: error {_error(a, ref):.3g} against lax.conv's {_error(b, ref):.3g} in {dtype}"
        )
