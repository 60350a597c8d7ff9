"""Mask builders and the normalised Mask type."""
from __future__ import annotations

import numpy as np
import pytest

import maskconv_kernels as mk
from maskconv_kernels.masks import as_mask


def test_pixelcnn_7x7_type_a_keeps_24_taps():
    m = mk.pixelcnn_mask((7, 7), "A")
    assert m.sum() == 24 and m[:3].all() and m[3, :3].all() and not m[3, 3:].any() and not m[4:].any()


def test_pixelcnn_type_b_adds_the_centre():
    a, b = mk.pixelcnn_mask((5, 5), "A"), mk.pixelcnn_mask((5, 5), "B")
    assert (b & ~a).sum() == 1 and b[2, 2]


def test_pixelcnn_3d_and_1d():
    assert mk.pixelcnn_mask((3, 3, 3), "A").sum() == 13
    np.testing.assert_array_equal(mk.pixelcnn_mask(5, "B"), [1, 1, 1, 0, 0])


@pytest.mark.parametrize("bad", [(4, 4), (3, 0)])
def test_pixelcnn_rejects_windows_without_a_centre(bad):
    with pytest.raises(ValueError, match="window"):
        mk.pixelcnn_mask(bad, "A")


def test_pixelcnn_rejects_unknown_type():
    with pytest.raises(ValueError, match="mask_type must be 'A'.*'C'"):
        mk.pixelcnn_mask((3, 3), "C")


def test_causal_mask():
    np.testing.assert_array_equal(mk.causal_mask(3), [1, 1, 0])
    np.testing.assert_array_equal(mk.causal_mask(3, include_current=False), [1, 0, 0])


def test_gated_stacks():
    np.testing.assert_array_equal(mk.vertical_stack_mask((3, 3)), [[1, 1, 1], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(mk.vertical_stack_mask((3, 2), "B"), [[1, 1], [1, 1], [0, 0]])
    np.testing.assert_array_equal(mk.horizontal_stack_mask((1, 3), "A"), [[1, 0, 0]])
    np.testing.assert_array_equal(mk.horizontal_stack_mask((3, 3), "B")[1], [1, 1, 0])


def test_channel_grouped_mask_rgb_ordering():
    m = mk.channel_grouped_mask((3, 3), 3, 6, "A")
    assert m.shape == (3, 3, 3, 6)
    centre = m[1, 1]
    # Output group 0 (R) sees nothing at the centre; G sees R; B sees R and G.
    assert not centre[:, :2].any()
    np.testing.assert_array_equal(centre[:, 2:4], [[1, 1], [0, 0], [0, 0]])
    np.testing.assert_array_equal(centre[:, 4:], [[1, 1], [1, 1], [0, 0]])
    assert mk.channel_grouped_mask((3, 3), 3, 6, "B")[1, 1].sum() == 2 * (1 + 2 + 3)


def test_terms_cover_every_active_entry_exactly_once():
    rng = np.random.default_rng(0)
    for bits_shape, kshape in [((3, 3), (3, 3, 2, 2)), ((5, 5, 3, 4), (5, 5, 3, 4)), ((2, 3, 4), (2, 3, 4, 1, 1)), ((7,), (7, 2, 3))]:
        bits = rng.random(bits_shape) < 0.5
        mask = as_mask(bits, kshape)
        c_in, c_out = kshape[-2:]
        covered = np.zeros((*mask.window, c_in, c_out), int)
        for t in mask.terms:
            ci = list(range(c_in)) if t.in_channels is None else list(t.in_channels)
            co = list(range(c_out)) if t.out_channels is None else list(t.out_channels)
            for tap in t.box.taps():
                covered[tap][np.ix_(ci, co)] += 1
        np.testing.assert_array_equal(covered, mask.dense(c_in, c_out).astype(int))


def test_pixelcnn_a_is_two_boxes():
    m = as_mask(mk.pixelcnn_mask((7, 7), "A"), (7, 7, 1, 1))
    assert [(t.box.start, t.box.size) for t in m.terms] == [((0, 0), (3, 7)), ((3, 0), (1, 3))]


def test_masks_hash_by_content():
    a = as_mask(mk.pixelcnn_mask((3, 3), "A"), (3, 3, 1, 1))
    b = as_mask(mk.pixelcnn_mask((3, 3), "A").astype(int), (3, 3, 1, 1))
    assert a == b and hash(a) == hash(b)
    assert a != as_mask(mk.pixelcnn_mask((3, 3), "B"), (3, 3, 1, 1))
