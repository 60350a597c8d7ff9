"""``masked_conv(..., segment_ids=)``: packed documents, for every mask, rank and dtype.

A tap reads input ``q`` for output ``p`` only where ``ids[q] == ids[p] >= 0``. Checked
against the float64 reference, and directly as the contract: the gradient across
documents is exactly 0.0, NaN in one document changes no other's output bit, padding
outputs are zero and padding receives no gradient; under jit, vmap, grad, forward mode
and checkpoint. Also the depthwise path (``feature_group_count == C_in``) and mixed
x/kernel dtypes, which segmented sequence models use.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close, random
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference, masked_conv_reference_vjp
from maskconv_kernels.ops.masked_conv import xla

STRATEGIES = {"conv": xla.Config("conv"), "matmul": xla.Config("matmul")}


def _ids(seed, shape, documents=3, padding=True):
    """Random document ids: runs along the flattened positions of each example, some padding (-1)."""
    rng = np.random.default_rng(seed)
    n, positions = shape[0], int(np.prod(shape[1:]))
    ids = np.empty((n, positions), np.int32)
    for row in ids:
        cuts = np.sort(rng.choice(np.arange(1, positions), documents - 1, replace=False))
        row[:] = np.searchsorted(cuts, np.arange(positions), side="right")
        if padding:
            row[rng.random(positions) < 0.1] = -1
    return ids.reshape(shape)


CASES = {
    # name: (x shape, window, C_out, mask, groups, extra arguments)
    "1d_k4_causal": ((2, 19, 3), (4,), 5, np.ones(4), 1, {"padding": "CAUSAL"}),
    "1d_k5_random_d2": ((2, 23, 4), (5,), 3, np.array([1, 0, 1, 1, 0]), 1, {"dilation": 2}),
    "1d_depthwise_k4": ((3, 17, 6), (4,), 6, np.ones(4), 6, {"padding": "CAUSAL"}),
    "1d_depthwise_k3_x2_d3": ((2, 20, 4), (3,), 8, np.array([1, 1, 0]), 4, {"padding": "CAUSAL", "dilation": 3}),
    "2d_k5A": ((2, 7, 9, 3), (5, 5), 4, mk.pixelcnn_mask((5, 5), "A"), 1, {}),
    "2d_k3B_groups": ((1, 6, 8, 4), (3, 3), 6, mk.pixelcnn_mask((3, 3), "B"), 2, {}),
    "2d_depthwise_k3B": ((2, 6, 7, 5), (3, 3), 5, mk.pixelcnn_mask((3, 3), "B"), 5, {}),
    "2d_rgbB_full": ((1, 6, 6, 6), (3, 3), 6, mk.channel_grouped_mask((3, 3), 6, 6, "B"), 1, {}),
    "3d_k3A": ((1, 4, 5, 4, 2), (3, 3, 3), 3, mk.pixelcnn_mask((3, 3, 3), "A"), 1, {}),
}


def _case(name, dtype=np.float32, seed=0):
    x_shape, window, c_out, mask, groups, kw = CASES[name]
    kw = dict(kw, feature_group_count=groups)
    x = random(seed, x_shape, dtype)
    k = random(seed + 1, (*window, x_shape[-1] // groups, c_out), dtype, scale=0.5)
    return x, k, mask, _ids(seed + 2, x_shape[:-1]), kw


def _scale(a):
    return float(np.abs(np.asarray(a, np.float64)).max(initial=0.0))


# What CPUs run ("conv") on every case in the README's command; what GPUs run ("matmul")
# on a 1-D, a 2-D and a 3-D case there, on the others in the slow tier.
@pytest.mark.parametrize("name, strategy", tiered(
    [(n, s) for s in sorted(STRATEGIES) for n in sorted(CASES)],
    lambda c: c[1] == "conv" or c[0] in ("1d_k4_causal", "2d_rgbB_full", "3d_k3A"), spread=True,
))
def test_matches_the_segmented_reference(name, strategy):
    x, k, mask, ids, kw = _case(name)
    f = jax.jit(lambda x, k, ids: mk.masked_conv(x, k, mask, segment_ids=ids, config=STRATEGIES[strategy],
                                                 implementation="xla", **kw))
    y, vjp = jax.vjp(lambda x, k: f(x, k, ids), x, k)
    ref = masked_conv_reference(x, k, mask, segment_ids=ids, **kw)
    reduction = int(np.prod(k.shape[:-1]))
    assert_close(y, ref, np.float32, reduction, _scale(x) * _scale(k))
    dy = random(9, y.shape)
    dx, dk = vjp(dy)
    rdx, rdk = masked_conv_reference_vjp(x, k, mask, dy, segment_ids=ids, **kw)
    assert_close(dx, rdx, np.float32, reduction * k.shape[-1], _scale(dy) * _scale(k))
    assert_close(dk, rdk, np.float32, int(np.prod(y.shape[:-1])), _scale(dy) * _scale(x))


def _documents(ids):
    return [int(d) for d in np.unique(ids) if d >= 0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_value_crosses_a_document_boundary(name):
    """NaN in every position of one document (and in padding) leaves every other document's outputs bit-identical."""
    x, k, mask, ids, kw = _case(name, seed=3)
    f = jax.jit(lambda x: mk.masked_conv(x, k, mask, segment_ids=ids, **kw))
    clean = np.asarray(f(x))
    for doc in _documents(ids):
        poisoned = np.where(((ids == doc) | (ids < 0))[..., None], np.nan, np.asarray(x))
        y = np.asarray(f(jnp.asarray(poisoned)))
        others = (ids != doc)
        np.testing.assert_array_equal(y[others], clean[others])
        assert np.isnan(y[ids == doc]).any() or not np.asarray(mask).any()
    # Padding outputs are zero whatever the inputs.
    assert (clean[ids < 0] == 0).all()


@pytest.mark.parametrize("name", tiered(sorted(CASES), lambda n: n in sorted(CASES)[::2]))
def test_gradient_across_documents_is_exactly_zero(name):
    x, k, mask, ids, kw = _case(name, seed=4)
    y, vjp = jax.vjp(lambda x: mk.masked_conv(x, k, mask, segment_ids=ids, **kw), x)
    vjp = jax.jit(vjp)
    flat = ids.reshape(ids.shape[0], -1)
    for example in range(ids.shape[0]):
        # One output position per document: its input gradient vanishes outside that document.
        for doc in _documents(flat[example]):
            p = int(np.flatnonzero(flat[example] == doc)[-1])
            cotangent = np.zeros(y.shape, np.float32)
            cotangent[(example, *np.unravel_index(p, ids.shape[1:]))] = 1.0
            (g,) = vjp(jnp.asarray(cotangent))
            outside = np.asarray(ids) != doc
            assert (np.asarray(g)[outside] == 0.0).all()
    # Padding receives no gradient from anything.
    g = jax.grad(lambda x: mk.masked_conv(x, k, mask, segment_ids=ids, **kw).sum())(x)
    assert (np.asarray(g)[ids < 0] == 0.0).all()


@pytest.mark.slow  # each transform without segments is test_transforms.py's
def test_transforms_compose_with_segments():
    """vmap (ids mapped or shared), jvp, jacfwd = jacrev, checkpoint and grad of grad."""
    x, k, mask, ids, kw = _case("1d_depthwise_k4", seed=5)
    conv = lambda x, k, ids: mk.masked_conv(x, k, mask, segment_ids=ids, **kw)  # noqa: E731
    stacked_x, stacked_ids = jnp.stack([x, 2 * x]), jnp.stack([ids, ids[::-1]])
    batched = jax.vmap(conv, (0, None, 0))(stacked_x, k, stacked_ids)
    for i in range(2):
        np.testing.assert_array_equal(batched[i], conv(stacked_x[i], k, stacked_ids[i]))
    shared = jax.vmap(conv, (0, None, None))(stacked_x, k, ids)
    np.testing.assert_array_equal(shared[1], conv(stacked_x[1], k, ids))
    tx = random(6, x.shape)
    _, tangent = jax.jvp(lambda x: conv(x, k, ids), (x,), (tx,))
    np.testing.assert_allclose(tangent, conv(tx, k, ids), rtol=1e-6, atol=1e-6)  # linear in x
    small = x[:1, :6]
    jf = jax.jacfwd(lambda x: conv(x, k, ids[:1, :6]))(small)
    jr = jax.jacrev(lambda x: conv(x, k, ids[:1, :6]))(small)
    np.testing.assert_allclose(jf, jr, rtol=1e-6, atol=1e-7)
    plain = jax.grad(lambda k: (conv(x, k, ids) ** 2).sum())(k)
    remat = jax.grad(lambda k: (jax.checkpoint(conv)(x, k, ids) ** 2).sum())(k)
    np.testing.assert_allclose(remat, plain, rtol=1e-6)
    hvp = jax.grad(lambda k: jnp.tanh(jax.grad(lambda x: (conv(x, k, ids) ** 2).sum())(x)).sum())(k)
    assert np.isfinite(np.asarray(hvp)).all()


@pytest.mark.parametrize("dtype", [np.dtype(jnp.bfloat16), np.dtype(jnp.float16)], ids=str)
def test_mixed_dtypes_take_the_wider_products(dtype):
    """16-bit x with a float32 kernel: x's dtype out, each gradient in its operand's dtype, float32 sums."""
    x, k, mask, ids, kw = _case("1d_depthwise_k4", seed=7)
    x = x.astype(dtype)
    y, vjp = jax.vjp(lambda x, k: mk.masked_conv(x, k, mask, segment_ids=ids, **kw), x, k)
    assert y.dtype == dtype
    ref = masked_conv_reference(x, k, mask, segment_ids=ids, **kw)
    assert_close(y, ref, dtype, 4, _scale(x) * _scale(k))
    dy = random(8, y.shape, dtype)
    dx, dk = vjp(dy)
    assert (dx.dtype, dk.dtype) == (dtype, np.float32)
    rdx, rdk = masked_conv_reference_vjp(x, k, mask, dy, segment_ids=ids, **kw)
    assert_close(dx, rdx, dtype, 4, _scale(dy) * _scale(k))
    # The weight gradient is float32: only the float32 sums' rounding remains.
    assert_close(dk, rdk, np.float32, int(np.prod(y.shape[:-1])), _scale(dy) * _scale(x))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(segment_ids=np.zeros((2, 19), np.float32)), TypeError, r"segment_ids must hold integers"),
        (dict(segment_ids=np.zeros((2, 18), np.int32)), ValueError, r"segment_ids must have x's shape.*\(2, 19\)"),
        (dict(segment_ids=np.zeros((2, 19), np.int32), strides=2), ValueError, r"segment_ids need an output on the input's grid"),
        (dict(segment_ids=np.zeros((2, 19), np.int32), padding="VALID"), ValueError, r"segment_ids need an output"),
        (dict(segment_ids="abc"), TypeError, r"segment_ids must be an array of integers"),
        (dict(segment_ids=np.zeros((2, 19), np.uint32)), TypeError, r"segment_ids must be signed integers.*int32"),
    ],
)
def test_bad_segment_ids_say_what_is_wrong(change, error, match):
    x, k = random(0, (2, 19, 3)), random(1, (4, 3, 5))
    with pytest.raises(error, match=match):
        mk.masked_conv(x, k, np.ones(4), **change)


def test_kernel_backends_decline_segments_and_none_falls_back_to_xla():
    from maskconv_kernels.ops.masked_conv import api, backends
    from maskconv_kernels.ops.masked_conv.spec import make_spec

    x, k, mask, ids, kw = _case("2d_k5A")
    spec = make_spec(x, k, mask, segmented=True, **kw)
    for name in ("pallas_triton", "pallas_mosaic_gpu", "triton"):
        assert "segment_ids" in backends.get(name).unsupported(spec, "cuda")
    assert api.implementation_for(spec, "cuda") == "xla"


def test_small_unsigned_ids_are_ids():
    x, k, mask, ids, kw = _case("1d_k4_causal")
    ids = np.where(ids < 0, 7, ids)
    np.testing.assert_array_equal(
        mk.masked_conv(x, k, mask, segment_ids=ids.astype(np.uint8), **kw),
        mk.masked_conv(x, k, mask, segment_ids=ids.astype(np.int32), **kw),
    )


def test_segment_ids_follow_x_layout_without_its_channels():
    """With dimension_numbers, the ids have x's axes less the channel one (NCHW: (N, H, W))."""
    x, k, mask, ids, kw = _case("2d_k5A", seed=12)
    expected = mk.masked_conv(x, k, mask, segment_ids=ids, **kw)
    nchw = mk.masked_conv(
        jnp.transpose(x, (0, 3, 1, 2)), jnp.transpose(k, (3, 2, 0, 1)), mask, segment_ids=ids,
        dimension_numbers=("NCHW", "OIHW", "NCHW"), **kw,
    )
    np.testing.assert_array_equal(jnp.transpose(nchw, (0, 2, 3, 1)), expected)
    hwnc = mk.masked_conv(
        jnp.transpose(x, (1, 2, 0, 3)), k, mask, segment_ids=np.transpose(ids, (1, 2, 0)),
        dimension_numbers=("HWNC", "HWIO", "NHWC"), **kw,
    )
    np.testing.assert_array_equal(hwnc, expected)
    with pytest.raises(ValueError, match=r"segment_ids take an undilated input"):
        mk.masked_conv(x, k, mask, segment_ids=np.zeros((2, 13, 17), np.int32), lhs_dilation=2,
                       padding=((2, 2), (2, 2)))
