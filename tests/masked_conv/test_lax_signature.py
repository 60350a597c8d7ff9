"""lax.conv_general_dilated's arguments on masked_conv: every layout, input dilation
(transposed convolution, against ``lax.conv_transpose``), ``"SAME_LOWER"``, batch groups
and empty outputs, against lax itself in float64 (``lax_oracle``). The exactness of these
paths is in ``test_exactness.py``; bad values in ``test_errors.py``; lax's own test grids,
replayed, in ``test_lax_suite.py``.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.implementations import suite_dtype
from support.numerics import random
from jax import lax
from support.lax_oracle import assert_matches_lax, dense_mask, lax_conv64
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import backends
from maskconv_kernels.ops.masked_conv.spec import make_spec

F32 = np.dtype("float32")
# A 4x5 window with 11 of its 20 taps active, in raster order (a PixelCNN-like mask on
# an even, non-square window), so a transposed spatial axis cannot go unnoticed.
MASK_4x5 = (np.arange(20) < 11).reshape(4, 5)


def _layout_case(lhs: str, rhs: str, out: str):
    """x, kernel and the window mask of one logical NCHW/OIHW problem, in the layout the strings give."""
    x = np.asarray(random(1, (2, 3, 9, 10)))  # NCHW
    k = np.asarray(random(2, (4, 3, 4, 5), scale=0.3))  # OIHW
    x = np.transpose(x, ["NCHW".index(c) for c in lhs])
    k = np.transpose(k, ["OIHW".index(c) for c in rhs])
    # The window mask follows the kernel's spatial axes in the kernel's order.
    mask = MASK_4x5 if rhs.index("H") < rhs.index("W") else MASK_4x5.T
    return jnp.asarray(x), jnp.asarray(k), mask


# The kernel's spec through every fourth of its 24 orders (it orders the window, and the
# mask with it), x's and the output's through every twelfth (their axes only move); a few
# in the README's command. (All 72 orders pass: run them with STEP = {"lhs": 1, "rhs": 1, "out": 1}.)
STEP = {"lhs": 12, "rhs": 4, "out": 12}
FAST_PERMUTED = {("lhs", "NHWC"), ("rhs", "HWIO"), ("rhs", "IWOH"), ("out", "CWNH")}
PERMUTED = [
    (which, "".join(p))
    for which, chars in (("lhs", "NCHW"), ("rhs", "OIHW"), ("out", "NCHW"))
    for i, p in enumerate(itertools.permutations(chars))
    if i % STEP[which] == 0 or (which, "".join(p)) in FAST_PERMUTED
]


@pytest.mark.parametrize(
    "which, order",
    tiered(PERMUTED, lambda p: p in FAST_PERMUTED, spread=True),
    ids=[f"{w}_{o}" for w, o in PERMUTED],
)
def test_every_dimension_order_lax_takes(which, order):
    specs = {**dict(lhs="NCHW", rhs="OIHW", out="NCHW"), which: order}
    x, k, mask = _layout_case(specs["lhs"], specs["rhs"], specs["out"])
    assert_matches_lax(x, k, mask, F32, grads=False, padding="SAME_LOWER", strides=(2, 1),
                       dimension_numbers=(specs["lhs"], specs["rhs"], specs["out"]))


def test_conv_dimension_numbers_with_spatial_dims_in_any_order():
    """A ``ConvDimensionNumbers`` may list the spatial axes out of order: strides and
    padding follow its order, a window mask the kernel's own."""
    dn = lax.ConvDimensionNumbers(lhs_spec=(0, 3, 2, 1), rhs_spec=(3, 2, 1, 0), out_spec=(0, 3, 2, 1))
    x, k = random(3, (2, 9, 10, 3)), random(4, (4, 5, 3, 2), scale=0.3)
    assert_matches_lax(x, k, MASK_4x5, F32, strides=(2, 1), padding=((1, 2), (0, 3)), dimension_numbers=dn)


def test_full_mask_in_the_kernels_layout():
    """A channel-partial mask of the kernel's shape, OIHW: the R/G/B ordering, transposed by the caller's layout only."""
    rgb = mk.channel_grouped_mask((3, 3), 3, 6, "A")  # (H, W, I, O)
    x, k = random(5, (2, 3, 7, 8)), random(6, (6, 3, 3, 3), scale=0.3)
    assert_matches_lax(x, k, np.transpose(rgb, (3, 2, 0, 1)), F32, grads=False, dimension_numbers=("NCHW", "OIHW", "NCHW"))


def test_batch_group_count_as_lax():
    """lax's batch groups: group g of the batch convolved with group g of the output channels."""
    x, k = random(7, (4, 3, 9, 10)), random(8, (6, 3, 4, 5), scale=0.3)
    assert_matches_lax(x, k, MASK_4x5, F32, batch_group_count=2, padding=((1, 2), (2, 0)), lhs_dilation=(1, 2),
                       dimension_numbers=("NCHW", "OIHW", "NCHW"))


# --------------------------------------------------------------------- transposed convolution


def _conv_of(f, x, k):
    """The ``conv_general_dilated`` that ``f(x, k)`` (a lax.conv_transpose) runs: its parameters."""
    eqns = [e for e in jax.make_jaxpr(f)(x, k).eqns if e.primitive.name == "conv_general_dilated"]
    assert len(eqns) == 1, eqns
    return eqns[0].params


TRANSPOSE_CASES = [
    # (x shape, kernel shape, strides, padding, rhs_dilation, dimension_numbers)
    ((2, 9, 3), (4, 3, 2), (2,), "SAME", None, ("NHC", "HIO", "NHC")),
    ((2, 10, 3), (3, 3, 2), (3,), "VALID", (2,), ("NHC", "HIO", "NHC")),
    ((2, 9, 10, 3), (4, 3, 3, 2), (2, 1), "SAME", None, ("NHWC", "HWIO", "NHWC")),
    ((1, 6, 7, 2), (3, 5, 2, 3), (2, 3), ((1, 2), (0, 1)), (1, 2), ("NHWC", "HWIO", "NHWC")),
    ((2, 3, 6, 5), (2, 3, 3, 4), (2, 2), "VALID", None, ("NCHW", "OIHW", "NCHW")),
]


@pytest.mark.parametrize("x_shape, k_shape, strides, padding, rhs_dilation, dn",
                         tiered(TRANSPOSE_CASES, lambda c: c is TRANSPOSE_CASES[0], spread=True),
                         ids=[f"{len(c[0]) - 2}d_s{''.join(map(str, c[2]))}_{c[3] if isinstance(c[3], str) else 'pairs'}_{c[5][0]}"
                              for c in TRANSPOSE_CASES])
def test_transposed_convolution_matches_lax_conv_transpose(x_shape, k_shape, strides, padding, rhs_dilation, dn):
    """``lax.conv_transpose`` is a convolution with ``lhs_dilation=strides``: the masked one
    given lax's own parameters (read from its jaxpr) equals it in float64, with gradients."""
    x, k = random(9, x_shape), random(10, k_shape, scale=0.3)
    mask = (np.arange(np.prod(k_shape)) % 3 != 1).reshape(k_shape)  # a full mask, in the kernel's layout
    transpose = lambda x, k: lax.conv_transpose(x, k, strides, padding, rhs_dilation=rhs_dilation, dimension_numbers=dn)
    p = _conv_of(transpose, x, k)
    assert any(d > 1 for d in p["lhs_dilation"])
    conv_args = dict(strides=p["window_strides"], padding=p["padding"], lhs_dilation=p["lhs_dilation"],
                     dilation=p["rhs_dilation"], dimension_numbers=p["dimension_numbers"])
    assert_matches_lax(x, k, mask, F32, **conv_args)
    with jax.enable_x64(True):
        x64, k64 = jnp.asarray(np.asarray(x, np.float64)), jnp.asarray(np.asarray(k, np.float64))
        expected = transpose(x64, k64 * dense_mask(mask, k.shape, p["dimension_numbers"]))
    np.testing.assert_allclose(lax_conv64(x, k, mask, **conv_args)[0], expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------- empty outputs


@pytest.mark.parametrize("implementation", mk.IMPLEMENTATIONS)
def test_empty_output_as_lax_gives_it_with_zero_size_gradients(implementation):
    """A VALID window that does not fit gives lax's zero-size output, on every backend."""
    dtype = suite_dtype(backends.get(implementation), interpret=True)
    if dtype is None:
        probe = make_spec(np.zeros((1, 4, 4, 2), np.float32), np.zeros((3, 3, 2, 2), np.float32), np.ones((3, 3)))
        pytest.skip(f'implementation="{implementation}" cannot run here: {backends.get(implementation).unsupported(probe, None, True)}')
    x, k = jnp.ones((1, 2, 1), dtype), jnp.ones((3, 1, 4), dtype)
    f = lambda x, k: mk.masked_conv(x, k, np.array([1, 0, 1]), padding="VALID", implementation=implementation,
                                    interpret=implementation != "xla")
    expected = lax.conv_general_dilated(x, k, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    y, (dx, dk) = jax.value_and_grad(lambda x, k: f(x, k).astype(np.float32).sum(), (0, 1))(x, k)
    assert f(x, k).shape == expected.shape == (1, 0, 4) and y == 0.0
    assert dx.shape == x.shape and dk.shape == k.shape and not np.asarray(dx).any() and not np.asarray(dk).any()


@pytest.mark.parametrize("x_shape, conv_args", [
    ((2, 3, 2, 9), dict(padding="VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    ((2, 3, 0, 9), dict(padding=((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))),  # all padding
    ((2, 3, 0, 9), dict(padding="SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    ((2, 3, 1, 9), dict(padding=((0, 0), (0, 0)), lhs_dilation=(2, 1), dimension_numbers=("NCHW", "OIHW", "NCHW"))),
], ids=["valid_too_small", "zero_height_padded", "zero_height_same", "dilated_one_row"])
def test_zero_size_and_all_padding_inputs_as_lax(x_shape, conv_args):
    """Empty outputs, and outputs that read padding only, whatever the layout."""
    x, k = random(11, x_shape), random(12, (4, 3, 3, 3), scale=0.3)
    g = assert_matches_lax(x, k, mk.pixelcnn_mask((3, 3), "B"), F32, **conv_args)
    assert g[0].shape == x.shape and g[1].shape == k.shape


def test_lax_dimension_numbers_default_is_channels_last():
    """``dimension_numbers=None`` is the library's channels-last default (lax's None is NCHW)."""
    x, k = random(13, (1, 6, 5, 2)), random(14, (3, 3, 2, 4))
    mask = mk.pixelcnn_mask((3, 3), "A")
    np.testing.assert_array_equal(
        mk.masked_conv(x, k, mask), mk.masked_conv(x, k, mask, dimension_numbers=("NHWC", "HWIO", "NHWC")))
