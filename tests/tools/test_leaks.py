"""The leak measurements (maskconv_kernels.leaks) that the report, the audit and the benchmarks share.

The allowed sets are checked against the float64 oracle's own gradients (a tap reaches
an input exactly when the oracle gives it gradient from a ones kernel), and the figures
on hand-made arrays where the answer is known.
"""
from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from maskconv_kernels import leaks
from maskconv_kernels.masks import causal_mask, pixelcnn_mask
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference, masked_conv_reference_vjp
from maskconv_kernels.ops.masked_conv.spec import make_spec

# (name, x shape, mask, conv arguments): strides, paddings, dilations, 1-D and 2-D, odd sizes.
CASES = [
    ("2d_B_same", (1, 7, 6, 1), pixelcnn_mask((3, 3), "B"), {}),
    ("2d_A_valid_stride2", (1, 9, 8, 1), pixelcnn_mask((5, 5), "A"), {"padding": "VALID", "strides": 2}),
    ("2d_A_dilated", (1, 9, 7, 1), pixelcnn_mask((3, 3), "A"), {"dilation": (2, 1)}),
    ("2d_explicit_pads", (1, 5, 6, 1), pixelcnn_mask((3, 3), "B"), {"padding": ((2, 0), (1, 3)), "strides": (1, 2)}),
    ("1d_causal_dilated", (1, 13, 1), np.ones(2, bool), {"padding": "CAUSAL", "dilation": 3}),
    ("1d_masked_same", (1, 11, 1), causal_mask(3), {"padding": "SAME", "dilation": 2}),
]


def _spec(x_shape, mask, args):
    return make_spec(np.zeros(x_shape, np.float32), np.zeros((*np.shape(mask), 1, 1), np.float32), mask, **args)


@pytest.mark.parametrize("name, x_shape, mask, args", CASES, ids=[c[0] for c in CASES])
def test_active_field_is_where_the_oracle_sends_gradient(name, x_shape, mask, args):
    spec = _spec(x_shape, mask, args)
    x = np.ones(x_shape)
    kernel = np.ones((*np.shape(mask), 1, 1))
    for out in itertools.product(*(range(n) for n in spec.out_spatial)):
        dy = np.zeros((1, *spec.out_spatial, 1))
        dy[(0, *out, 0)] = 1.0
        dx, _ = masked_conv_reference_vjp(x, kernel, mask, dy, **args)
        np.testing.assert_array_equal(leaks.active_field(spec, out), dx[0, ..., 0] > 0, err_msg=f"output {out}")


@pytest.mark.parametrize("name, x_shape, mask, args", CASES, ids=[c[0] for c in CASES])
def test_clean_outputs_are_those_the_oracle_keeps_finite(name, x_shape, mask, args):
    spec = _spec(x_shape, mask, args)
    rng = np.random.default_rng(0)
    for poisoned in (rng.random(spec.in_spatial) < 0.2, leaks.raster_future(spec.in_spatial, [n // 2 for n in
                                                                                               spec.in_spatial])):
        # The oracle skips masked taps, so NaN reaches exactly the outputs an active tap reads it through.
        x = np.where(poisoned, np.nan, 1.0)[None, ..., None]
        y = masked_conv_reference(x, np.ones((*np.shape(mask), 1, 1)), mask, **args)
        np.testing.assert_array_equal(leaks.clean_outputs(spec, poisoned), np.isfinite(y[0, ..., 0]))


def test_clean_outputs_names_the_shape_it_needs():
    spec = _spec((1, 5, 5, 1), pixelcnn_mask((3, 3), "B"), {})
    with pytest.raises(ValueError, match=r"poisoned has shape \(4, 5\).*\(5, 5\)"):
        leaks.clean_outputs(spec, np.zeros((4, 5), bool))


def test_input_dilation_is_refused_not_guessed():
    spec = make_spec(np.zeros((1, 5, 5, 1)), np.zeros((3, 3, 1, 1)), pixelcnn_mask((3, 3), "B"), lhs_dilation=2,
                     padding=((1, 1), (1, 1)))
    with pytest.raises(ValueError, match="lhs_dilation"):
        leaks.active_field(spec, (0, 0))


def test_raster_future_is_at_or_after_the_index():
    future = leaks.raster_future((3, 4), (1, 2))
    assert future.sum() == 12 - 6 and future[1, 2] and not future[1, 1] and future[2, 0]


def test_forbidden_gradient_reads_only_forbidden_entries():
    grad = np.array([[0.0, -3.0, np.nan], [1e-7, 0.0, 0.0]])
    forbidden = np.array([[True, False, False], [False, True, True]])
    assert leaks.forbidden_gradient(grad, forbidden) == 0.0  # the -3 and the NaN are allowed
    assert leaks.forbidden_gradient(grad, ~forbidden) != leaks.forbidden_gradient(grad, ~forbidden)  # NaN leaks
    assert leaks.forbidden_gradient(-grad[1:], np.ones((1, 3), bool)) == 1e-7  # magnitudes
    np.testing.assert_array_equal(leaks.forbidden_gradient(grad, ~forbidden, axis=1), [np.nan, 1e-7])
    assert leaks.forbidden_gradient(grad, False) == 0.0  # nothing forbidden: nothing leaks
    assert leaks.forbidden_gradient(jnp.full((2, 2), 5e-8, jnp.bfloat16), True) == float(jnp.bfloat16(5e-8))


def test_changed_elements_compares_bits():
    y = jnp.array([0.0, 1.0, jnp.nan, 2.0], jnp.float32)
    assert int(leaks.changed_elements(y, y)) == 0  # NaN equals itself bit for bit
    assert int(leaks.changed_elements(y, jnp.array([-0.0, 1.0, jnp.nan, 2.0]))) == 1  # -0.0 is another value
    other_nan = jnp.asarray(np.array([0x7FC00001], np.uint32).view(np.float32))[0]
    assert int(leaks.changed_elements(y, y.at[2].set(other_nan))) == 1  # another NaN payload
    ones = jnp.ones((2, 3, 4))
    assert leaks.changed_elements(ones, ones.at[1, 2].set(0), axis=(0, 2)).tolist() == [0, 0, 4]
    assert int(leaks.changed_elements(jnp.arange(4), jnp.arange(4) % 3)) == 1  # other dtypes as they are
