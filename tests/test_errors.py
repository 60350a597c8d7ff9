"""Bad input gets an error that names the argument, what was expected and what was given."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskconv_kernels as mk

X = jnp.ones((1, 8, 8, 4))
K = jnp.ones((3, 3, 4, 6))
M = mk.pixelcnn_mask((3, 3), "B")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(x=jnp.ones((8, 4))), ValueError, r"x must be \(N, \*spatial, C_in\).*\(8, 4\)"),
        (dict(kernel=jnp.ones((3, 4, 6))), ValueError, r"kernel must be .* 2 window dims.*\(3, 4, 6\)"),
        (dict(kernel=jnp.ones((3, 3, 5, 6))), ValueError, r"kernel has 5 input channels but x has C_in=4"),
        (dict(mask=np.ones((2, 3))), ValueError, r"mask has shape \(2, 3\) but the kernel window is \(3, 3\)"),
        (dict(mask=np.full((3, 3), 0.5)), ValueError, r"mask must hold only 0 and 1.*0\.5"),
        (dict(mask=np.full((3, 3), 2)), ValueError, r"mask must hold only 0 and 1"),
        (dict(mask=np.array([["a"] * 3] * 3)), TypeError, r"mask must hold bools or 0/1 numbers"),
        (dict(x=jnp.ones((1, 8, 8, 4), jnp.int32), kernel=jnp.ones((3, 3, 4, 6), jnp.int32)), TypeError, r"x must have a floating dtype.*int32"),
        (dict(kernel=jnp.ones((3, 3, 4, 6), jnp.bfloat16)), TypeError, r"same dtype.*float32.*bfloat16"),
        (dict(strides=0), ValueError, r"strides must be positive, got 0"),
        (dict(strides=(1, 2, 3)), ValueError, r"strides must be an int or a tuple of 2 ints"),
        (dict(dilation=-1), ValueError, r"dilation must be positive"),
        (dict(padding="FULL"), ValueError, r"padding must be 'SAME', 'VALID', 'CAUSAL'.*'FULL'"),
        (dict(padding="CAUSAL"), ValueError, r"CAUSAL.*1-D.*2 spatial dims"),
        (dict(padding=((1, 1),)), ValueError, r"one \(lo, hi\) pair per spatial dim \(2\)"),
        (dict(feature_group_count=3), ValueError, r"feature_group_count=3 must divide both C_in=4 and C_out=6"),
        (dict(feature_group_count=0), ValueError, r"feature_group_count must be a positive int"),
        (dict(implementation="cudnn"), ValueError, r"implementation must be None or one of .*'cudnn'"),
        (dict(x=jnp.ones((1, 2, 2, 4)), padding="VALID"), ValueError, r"output would be empty"),
        (dict(preferred_element_type=jnp.int32), TypeError, r"preferred_element_type must be a floating dtype"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input(kwargs, error, match):
    args = dict(x=X, kernel=K, mask=M) | kwargs
    with pytest.raises(error, match=match):
        mk.masked_conv(args.pop("x"), args.pop("kernel"), args.pop("mask"), **args)


def test_traced_mask_says_why_masks_are_static():
    with pytest.raises(TypeError, match=r"mask must be static.*decided when it is traced"):
        jax.jit(lambda m: mk.masked_conv(X, K, m))(jnp.ones((3, 3)))


def test_all_false_mask_is_valid_and_gives_zeros():
    y, (dx, dk) = jax.value_and_grad(lambda x, k: mk.masked_conv(x, k, np.zeros((3, 3))).sum(), (0, 1))(X, K)
    assert y == 0.0 and not np.asarray(dx).any() and not np.asarray(dk).any()


def test_concrete_jax_array_mask_is_accepted():
    np.testing.assert_array_equal(mk.masked_conv(X, K, jnp.asarray(M)), mk.masked_conv(X, K, M))
