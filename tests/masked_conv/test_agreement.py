"""Every backend agrees with the float64 reference, forward and backward."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from support.implementations import BACKENDS
from support.numerics import DTYPES, assert_close, random
from support.cases import CASE_IDS, CASES
from support.tiers import tiered

from maskconv_kernels import masked_conv_reference
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference_vjp


def _inputs(case, dtype, seed=0):
    x = random(seed, case.x_shape, dtype)
    k = random(seed + 1, case.kernel_shape, dtype, scale=1 / np.sqrt(np.prod(case.kernel_shape[:-1])))
    return x, k


def _scale(a):
    return float(np.abs(np.asarray(a, np.float64)).max(initial=0.0))


SMOKE_CASES = [
    c for c in CASES if c.name in (
        "1d_N2_L16_C5_k3_CAUSAL_s2", "2d_N1_H12_W9_C3_k3B_s21_d2", "2d_N1_H7_W7_C6_k3_rgbA_full",
        "2d_N2_H17_W13_C3_k5A",  # stride 1, a window mask: what every kernel backend runs
    )
]


# The xla strategies whose suites are the slow tier's get two of the cases in the fast tier.
@pytest.mark.parametrize("name, case", tiered(
    [(n, c) for n in sorted(BACKENDS) for c in SMOKE_CASES],
    lambda nc: not nc[0].startswith("xla_") or nc[1] in SMOKE_CASES[1:3], spread=True,
), ids=lambda v: v if isinstance(v, str) else v.name)
def test_every_backend_smoke(name, case):
    """A 1-D, a strided and dilated 2-D and a channel-partial case on every backend, the interpreted kernels
    included: the fast tier's check of the kernels (the slow tier runs all the suites)."""
    conv = BACKENDS[name]
    x, k = _inputs(case, conv.dtype, seed=5)
    y, vjp = jax.vjp(lambda x, k: conv(x, k, case.mask, **case.conv_args), x, k)
    assert_close(y, masked_conv_reference(x, k, case.mask, **case.conv_args), conv.dtype, case.reduction(), _scale(x) * _scale(k))
    dy = random(6, y.shape, conv.dtype)
    dx, dk = vjp(dy)
    rdx, rdk = masked_conv_reference_vjp(x, k, case.mask, dy, **case.conv_args)
    assert_close(dx, rdx, conv.dtype, case.reduction() * case.kernel_shape[-1], _scale(dy) * _scale(k))
    assert_close(dk, rdk, conv.dtype, int(np.prod(y.shape[:-1])), _scale(dy) * _scale(x))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_matches_reference(conv, case):
    if conv.slow and not case.small:
        pytest.skip(f"{case.name} is too large for the interpret-mode backend {conv.name}")
    x, k = _inputs(case, conv.dtype)
    y = jax.jit(lambda x, k: conv(x, k, case.mask, **case.conv_args))(x, k)
    ref = masked_conv_reference(x, k, case.mask, **case.conv_args)
    assert y.dtype == x.dtype
    assert_close(y, ref, conv.dtype, case.reduction(), _scale(x) * _scale(k))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_match_reference(conv, case):
    if conv.slow and not case.small:
        pytest.skip(f"{case.name} is too large for the interpret-mode backend {conv.name}")
    x, k = _inputs(case, conv.dtype, seed=3)
    y, vjp = jax.vjp(lambda x, k: conv(x, k, case.mask, **case.conv_args), x, k)
    dy = random(7, y.shape, conv.dtype)
    dx, dk = jax.jit(vjp)(dy)
    rdx, rdk = masked_conv_reference_vjp(x, k, case.mask, dy, **case.conv_args)
    c_out = case.kernel_shape[-1]
    assert_close(dx, rdx, conv.dtype, case.reduction() * c_out, _scale(dy) * _scale(k))
    pixels = int(np.prod(y.shape[:-1]))
    assert_close(dk, rdk, conv.dtype, pixels, _scale(dy) * _scale(x))
    # Masked kernel entries: exactly zero, not merely small.
    masked = ~np.broadcast_to(
        np.asarray(case.mask, bool).reshape(case.mask.shape + (1,) * (len(case.kernel_shape) - case.mask.ndim)),
        case.kernel_shape,
    )
    assert (np.asarray(dk)[masked] == 0.0).all()


# bfloat16 in the README's command (float32 is test_forward_matches_reference's); the others in the slow tier.
@pytest.mark.parametrize("dtype", tiered(DTYPES, lambda d: d == np.dtype(jax.numpy.bfloat16)), ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c.small][::3], ids=lambda c: c.name)
def test_dtypes_accumulate_in_float32(conv, case, dtype):
    x, k = _inputs(case, dtype, seed=11)
    y = jax.jit(lambda x, k: conv(x, k, case.mask, **case.conv_args))(x, k)
    assert y.dtype == dtype
    ref = masked_conv_reference(x, k, case.mask, **case.conv_args)
    assert_close(y, ref, dtype, case.reduction(), _scale(x) * _scale(k))
    # float32 output from 16-bit inputs: rounding of the output is gone, only f32 sums remain.
    y32 = conv(x, k, case.mask, preferred_element_type=np.float32, **case.conv_args)
    assert y32.dtype == np.float32
    assert_close(y32, ref, np.float32, case.reduction(), _scale(x) * _scale(k), operands=dtype)


@pytest.mark.parametrize(
    "name, small_window, pads, mask_rows, mask_cols",
    [
        # PixelCNN++ (Salimans et al., 2017): down_shifted_conv2d, a 2x3 filter on an input
        # padded 1 row on top and 1 column on each side: a 3x3 window with the last row masked.
        ("down_shifted", (2, 3), ((1, 0), (1, 1)), slice(0, 2), slice(0, 3)),
        # down_right_shifted_conv2d: a 2x2 filter, padded on top and on the left.
        ("down_right_shifted", (2, 2), ((1, 0), (1, 0)), slice(0, 2), slice(0, 2)),
    ],
)
def test_matches_pixelcnn_pp_shifted_convolutions(conv, name, small_window, pads, mask_rows, mask_cols):
    x = random(20, (2, 9, 8, 5))
    small = random(21, (*small_window, 5, 6), scale=0.3)
    expected = jax.lax.conv_general_dilated(
        x, small, (1, 1), pads, dimension_numbers=("NHWC", "HWIO", "NHWC"), precision="highest"
    )
    # The same filter placed in the top-left of a 3x3 window, the rest masked (and poisoned:
    # a masked kernel entry is never read).
    kernel = np.full((3, 3, 5, 6), np.nan, np.float32)
    kernel[mask_rows, mask_cols] = small
    mask = np.zeros((3, 3), bool)
    mask[mask_rows, mask_cols] = True
    y = conv(x, jax.numpy.asarray(kernel), mask)
    assert_close(y, expected, np.float32, int(mask.sum()) * 5, _scale(x) * _scale(small))
