"""Errors about x's layout say how x and the kernel were read and what to pass: channels-last
unless ``dimension_numbers`` says otherwise, and ``x[None]`` for a single example."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import maskconv_kernels as mk

MASK = mk.pixelcnn_mask((3, 3), "B")


def _message(**kwargs) -> str:
    with pytest.raises(ValueError) as info:
        mk.masked_conv(**kwargs)
    return str(info.value)


def test_channels_first_x_is_told_it_was_read_channels_last():
    """The new user's call: an NCHW x with an HWIO kernel, no dimension_numbers."""
    message = _message(x=jnp.ones((2, 5, 16, 16)), kernel=jnp.ones((3, 3, 5, 8)), mask=MASK)
    assert "kernel has 5 input channels but x has C_in=16" in message
    assert "x (2, 5, 16, 16) is read as (N, H, W, C_in)" in message
    assert "the kernel (3, 3, 5, 8) is read as (H, W, C_in // groups, C_out)" in message
    assert "channels-last" in message and "dimension_numbers=('NCHW', 'OIHW', 'NCHW')" in message


def test_channels_first_kernel_too_is_told_the_same():
    message = _message(x=jnp.ones((2, 5, 16, 16)), kernel=jnp.ones((8, 5, 3, 3)), mask=None)
    assert "read as (N, H, W, C_in)" in message and "dimension_numbers=('NCHW', 'OIHW', 'NCHW')" in message


def test_with_dimension_numbers_the_message_says_what_they_read():
    message = _message(x=jnp.ones((2, 3, 16, 16)), kernel=jnp.ones((8, 4, 3, 3)), mask=MASK,
                       dimension_numbers=("NCHW", "OIHW", "NCHW"))
    assert "expected kernel.shape[1] == 3" in message
    assert "x (2, 3, 16, 16) is read as (N, C_in, H, W)" in message
    assert "as dimension_numbers=('NCHW', 'OIHW', 'NCHW') gives" in message


def test_groups_that_do_not_divide_say_how_x_was_read():
    message = _message(x=jnp.ones((1, 3, 9, 9)), kernel=jnp.ones((3, 3, 1, 4)), mask=MASK, feature_group_count=2)
    assert "feature_group_count=2 must divide both C_in=9 and C_out=4" in message
    assert "is read as (N, H, W, C_in)" in message


@pytest.mark.parametrize("x_shape, k_shape, dimension_numbers, expected", [
    ((16, 16, 3), (3, 3, 3, 8), None,
     r"x needs a batch axis \(N, \*spatial, C_in\): x\[None\] gives one. x has shape \(16, 16, 3\), one axis short "
     r"of the kernel's \(3, 3, 3, 8\) \(2 window dims\)"),
    ((16, 3), (3, 3, 8), None, r"x needs a batch axis.*x\[None\] gives one.*\(1 window dim\)"),
    ((3, 16, 16), (8, 3, 3, 3), ("NCHW", "OIHW", "NCHW"),
     r"x needs a batch axis \(the N of dimension_numbers=\('NCHW', 'OIHW', 'NCHW'\)\): x\[None\] gives one"),
    ((16, 16, 3), (3, 3, 3, 8), ("HWCN", "HWIO", "HWCN"), r"jnp.expand_dims\(x, 3\) gives one"),
], ids=["2d", "1d", "nchw", "batch_last"])
def test_unbatched_x_is_told_to_add_a_batch_axis(x_shape, k_shape, dimension_numbers, expected):
    with pytest.raises(ValueError, match=expected):
        mk.masked_conv(jnp.ones(x_shape), jnp.ones(k_shape), np.ones(k_shape[:2] if len(k_shape) == 4 else (3,)),
                       dimension_numbers=dimension_numbers)
