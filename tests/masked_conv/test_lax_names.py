"""``masked_conv`` takes ``lax.conv_general_dilated``'s keyword calls: its names
(``window_strides``, ``rhs_dilation``) beside the library's, its ``None`` dilations, and
``mask=None`` for every tap. A lax call with a mask added ports unchanged.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
from jax import lax
from support.lax_oracle import assert_matches_lax
from support.numerics import random

import maskconv_kernels as mk

F32 = np.dtype("float32")
MASK = mk.pixelcnn_mask((3, 3), "B")


def test_every_lax_keyword_is_a_masked_conv_keyword():
    """lax's keywords, past its two operands, are all masked_conv's (``out_sharding`` aside: the
    output's sharding follows the inputs' here, see parallel/)."""
    ours = set(inspect.signature(mk.masked_conv).parameters)
    theirs = set(list(inspect.signature(lax.conv_general_dilated).parameters)[2:]) - {"out_sharding"}
    assert theirs <= ours, sorted(theirs - ours)


def test_a_lax_keyword_call_ports_with_its_names():
    """The call written for lax, with ``mask=`` added, against lax itself in float64."""
    x, k = random(1, (2, 3, 11, 10)), random(2, (4, 3, 3, 3), scale=0.3)
    lax_call = dict(window_strides=(2, 1), padding=((1, 1), (2, 0)), lhs_dilation=None, rhs_dilation=(1, 2),
                    dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=1, batch_group_count=1,
                    precision=lax.Precision.HIGHEST, preferred_element_type=None)
    y = mk.masked_conv(x, k, MASK, **lax_call)
    spelt_here = {k: v for k, v in lax_call.items() if k not in ("window_strides", "rhs_dilation")}
    spelt_here.update(strides=lax_call["window_strides"], dilation=lax_call["rhs_dilation"])
    np.testing.assert_array_equal(y, mk.masked_conv(x, k, MASK, **spelt_here))
    assert_matches_lax(x, k, MASK, F32, grads=False, strides=(2, 1), padding=((1, 1), (2, 0)), dilation=(1, 2),
                       dimension_numbers=("NCHW", "OIHW", "NCHW"))


@pytest.mark.parametrize("ours, theirs", [("strides", "window_strides"), ("dilation", "rhs_dilation")])
def test_both_spellings_of_one_argument_is_a_type_error(ours, theirs):
    x, k = random(3, (1, 6, 6, 2)), random(4, (3, 3, 2, 2))
    with pytest.raises(TypeError, match=rf"got both {ours}=1 and {theirs}=\(1, 1\), which are one argument.*pass one"):
        mk.masked_conv(x, k, MASK, **{ours: 1, theirs: (1, 1)})


def test_none_strides_and_dilations_are_one_as_in_lax():
    x, k = random(5, (1, 7, 6, 2)), random(6, (3, 3, 2, 3))
    np.testing.assert_array_equal(
        mk.masked_conv(x, k, MASK, strides=None, dilation=None, lhs_dilation=None), mk.masked_conv(x, k, MASK))


def test_mask_none_is_every_tap_active():
    """``mask=None`` (or no mask) is the full window: the plain convolution, which lax computes."""
    x, k = random(7, (2, 8, 7, 3)), random(8, (3, 2, 3, 4), scale=0.3)
    full = np.ones((3, 2), bool)
    np.testing.assert_array_equal(mk.masked_conv(x, k, None), mk.masked_conv(x, k, full))
    np.testing.assert_array_equal(mk.masked_conv(x, k), mk.masked_conv(x, k, full))
    assert_matches_lax(x, k, full, F32, padding="VALID")
    # In any layout: the window is the kernel's, wherever its spatial axes are.
    xc, kc = x.transpose(0, 3, 1, 2), k.transpose(3, 2, 0, 1)
    np.testing.assert_array_equal(
        mk.masked_conv(xc, kc, dimension_numbers=("NCHW", "OIHW", "NCHW")),
        mk.masked_conv(x, k).transpose(0, 3, 1, 2))
