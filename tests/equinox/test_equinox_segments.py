"""The Equinox drop-in with ``segment_ids``: exactly ``masked_conv`` with them, unbatched and vmapped.

The module's output is compared bit for bit with :func:`maskconv_kernels.masked_conv` on
Equinox's layout (``("NCH", "OIH", "NCH")``-style dimension numbers, one example) plus the
bias; then through ``jax.vmap`` over a batch, a NaN in one document reaching no other
and an exactly-zero gradient across documents; the padding modes that fill the border
with copies are refused with segment ids.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import random
from support.tiers import tiered

import maskconv_kernels as mk

eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install '.[equinox]'")
mk_eqx = pytest.importorskip("maskconv_kernels.equinox")

IDS_1D = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, -1, -1, 4, 4], np.int32)

GAP = np.array([1, 0, 1], bool)
CASES = [
    # (name, constructor, x shape (C_in, *spatial), segment ids, mask)
    ("1d_k4_causal_depthwise", lambda key: mk_eqx.Conv1d(4, 4, 4, padding=((3, 0),), groups=4, key=key),
     (4, 14), IDS_1D, None),
    ("1d_k3_same_gap", lambda key: mk_eqx.Conv1d(3, 5, 3, padding="SAME", mask=GAP, key=key), (3, 14), IDS_1D, GAP),
    ("2d_k3_A_pad1", lambda key: mk_eqx.Conv2d(2, 3, 3, padding=1, mask=mk.pixelcnn_mask((3, 3), "A"), key=key),
     (2, 5, 6), np.repeat(np.arange(5), 6).reshape(5, 6) // 2, mk.pixelcnn_mask((3, 3), "A")),
]


def _expected(conv, x, ids, mask):
    ndim = conv.num_spatial_dims
    spatial = "DHW"[-ndim:]
    y = mk.masked_conv(x[None], conv.weight, mask, strides=conv.stride, padding=conv.padding, dilation=conv.dilation,
                       feature_group_count=conv.groups, dimension_numbers=("NC" + spatial, "OI" + spatial, "NC" + spatial),
                       segment_ids=jnp.asarray(ids)[None])[0]
    return y + conv.bias


@pytest.mark.parametrize(
    "name, make, x_shape, ids, mask", tiered(CASES, lambda c: c is CASES[0], spread=True), ids=[c[0] for c in CASES],
)
def test_equinox_conv_with_segment_ids_is_masked_conv(name, make, x_shape, ids, mask):
    conv = make(jax.random.key(0))
    x = random(1, x_shape)
    y = conv(x, segment_ids=ids)
    np.testing.assert_array_equal(y, _expected(conv, x, ids, mask))
    assert not np.array_equal(y, conv(x))  # the ids change something


def test_vmapped_packed_batch_is_exact():
    """A batch of packed rows through jax.vmap: no value and no gradient crosses a document."""
    conv = mk_eqx.Conv1d(4, 4, 3, padding=((2, 0),), groups=4, key=jax.random.key(1))
    x = random(2, (3, 4, 14))
    ids = jnp.stack([jnp.asarray(IDS_1D), jnp.asarray(IDS_1D[::-1]), jnp.zeros(14, jnp.int32)])
    apply = eqx.filter_jit(jax.vmap(lambda x, ids: conv(x, segment_ids=ids)))
    doc = np.asarray(ids) == 2
    poisoned = jnp.where(doc[:, None, :], jnp.nan, x)
    outside = np.broadcast_to(~doc[:, None, :], x.shape)
    np.testing.assert_array_equal(np.asarray(apply(poisoned, ids))[outside], np.asarray(apply(x, ids))[outside])
    dx = jax.grad(lambda x: jnp.where(doc[:, None, :], apply(x, ids), 0.0).sum())(x)
    assert not np.asarray(dx)[outside].any()


@pytest.mark.parametrize("mode", ["REFLECT", "REPLICATE", "CIRCULAR"])
def test_padding_modes_that_copy_values_are_refused(mode):
    conv = mk_eqx.Conv1d(2, 3, 3, padding=1, padding_mode=mode, key=jax.random.key(0))
    with pytest.raises(ValueError, match=f"segment_ids with padding_mode='{mode}'.*padding_mode='ZEROS'"):
        conv(jnp.ones((2, 8)), segment_ids=jnp.zeros(8, jnp.int32))


def test_segment_ids_shape_error_names_the_spatial_shape():
    conv = mk_eqx.Conv2d(2, 3, 3, padding=1, key=jax.random.key(0))
    expected = r"segment_ids must have x's spatial shape \(x is \(in_channels, \*spatial\), unbatched\) = \(5, 6\)"
    with pytest.raises(ValueError, match=expected + r", got \(1, 5, 6\)"):
        conv(jnp.ones((2, 5, 6)), segment_ids=jnp.zeros((1, 5, 6), jnp.int32))
