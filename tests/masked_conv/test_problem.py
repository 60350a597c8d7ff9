"""The kernel-facing problem every kernel backend reads, built once per spec."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv.kernel_problem import kernel_problem, scatter_taps, sum_in_order
from maskconv_kernels.ops.masked_conv.spec import make_spec


def _spec(x_shape, k_shape, mask, **kw):
    return make_spec(np.zeros(x_shape, np.float32), np.zeros(k_shape, np.float32), mask, **kw)


def test_a_1d_problem_is_the_2d_one_of_height_1():
    p = kernel_problem(_spec((2, 17, 3), (5, 3, 4), mk.causal_mask(5), padding="CAUSAL", strides=2, dilation=3))
    assert p.lifted
    assert p.in_hw == (1, 17) and p.window == (1, 5) and p.strides == (1, 2) and p.dilation == (1, 3)
    assert p.pad_lo == (0, 12)
    assert p.taps == ((0, 0), (0, 1), (0, 2)) and p.tap_run == 0  # the centre and the past
    assert p.x_shape(2) == (2, 1, 17, 3) and p.kernel_shape() == (1, 5, 3, 4)


def test_active_taps_in_raster_order_and_the_run_found_once_on_the_mask():
    mask = mk.pixelcnn_mask((7, 7), "A")
    p = kernel_problem(_spec((1, 9, 9, 2), (7, 7, 2, 2), mask))
    assert p.taps == tuple(map(tuple, np.argwhere(mask)))
    assert p.tap_run == 0 == mk.Mask((7, 7), np.asarray(mask, bool)).raster_run
    scattered = np.array([[1, 0, 1], [0, 1, 0]], bool)
    assert kernel_problem(_spec((1, 5, 5, 2), (2, 3, 2, 2), scattered)).tap_run is None


def test_the_problem_is_built_once_per_spec():
    spec = _spec((1, 6, 6, 2), (3, 3, 2, 2), mk.pixelcnn_mask((3, 3), "B"))
    assert kernel_problem(spec) is kernel_problem(_spec((1, 6, 6, 2), (3, 3, 2, 2), mk.pixelcnn_mask((3, 3), "B")))


def test_channel_partial_taps_are_pieces_and_plain_taps_keep_their_run():
    mask = mk.channel_grouped_mask((3, 3), 6, 6, "A")
    p = kernel_problem(_spec((1, 5, 5, 6), (3, 3, 6, 6), mask))
    assert p.has_partial_taps
    assert p.plain_taps == ((0, 0), (0, 1), (0, 2), (1, 0)) and p.plain_tap_run == 0
    assert {piece.tap for piece in p.pieces if piece.is_partial} == {(1, 1)}


def test_weight_gradient_scatter_leaves_masked_taps_exactly_zero_and_sums_splits_in_order():
    mask = np.array([[1, 0, 1], [0, 1, 0]], bool)
    p = kernel_problem(_spec((1, 5, 5, 2), (2, 3, 2, 3), mask))
    parts = jnp.arange(2 * 3 * 2 * 3, dtype=jnp.float32).reshape(2, 3, 2, 3)
    dense = np.asarray(scatter_taps(sum_in_order(parts), p))
    assert dense.shape == (2, 3, 2, 3)
    assert (dense[~mask] == 0.0).all()
    np.testing.assert_array_equal(dense[mask], np.asarray(parts[0] + parts[1]))
