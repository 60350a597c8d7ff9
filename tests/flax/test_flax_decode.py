"""``MaskedConv(..., decode=True)``: Flax's decode convention, outputs equal to the full layer.

linen: ``init`` with a full-size input allocates the ``"cache"`` collection, then each
``apply(..., mutable=["cache"])`` consumes one position. nnx: ``init_cache`` then one
position per call. Every position's output is compared with the same module's full
forward pass (``decode=False``, same parameters).
"""
from __future__ import annotations

import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import TOLERANCE, assert_close, random
from flax import nnx

import maskconv_kernels as mk
from maskconv_kernels.flax import MaskedConv
from maskconv_kernels.flax import nnx as mk_nnx

N, H, W, C = 2, 5, 6, 4


class TwoLayers(nn.Module):
    """7x7 type A (fed the previous pixel when decoding), ReLU, 3x3 type B."""

    decode: bool = False

    @nn.compact
    def __call__(self, x):
        y = MaskedConv(C, (7, 7), mask=mk.pixelcnn_mask((7, 7), "A"), decode=self.decode, decode_shift=1)(x)
        return MaskedConv(C, (3, 3), mask=mk.pixelcnn_mask((3, 3), "B"), decode=self.decode)(nn.relu(y))


def _previous_pixels(x):
    """``(N, H*W, C)``: at step ``p`` the pixel ``p - 1`` (zeros at ``p = 0``, never read)."""
    flat = x.reshape(x.shape[0], -1, x.shape[-1])
    return jnp.concatenate([jnp.zeros_like(flat[:, :1]), flat[:, :-1]], 1)


@pytest.mark.slow  # test_decode.py's decode checks are the fast tier's
def test_linen_decode_equals_the_full_forward_at_every_position():
    x = random(0, (N, H, W, 2))
    params = TwoLayers().init(jax.random.key(0), x)["params"]
    expected = TwoLayers().apply({"params": params}, x)
    variables = TwoLayers(decode=True).init(jax.random.key(0), x)
    cache = variables["cache"]
    shapes = jax.tree_util.tree_map(jnp.shape, cache)
    assert shapes["Conv_0"]["cached_input"] == (N, 4, W, 2)  # 3 rows above + the current row
    assert shapes["Conv_1"]["cached_input"] == (N, 2, W, C)

    def body(cache, pixel):
        y, mutated = TwoLayers(decode=True).apply(
            {"params": params, "cache": cache}, pixel[:, None, None], mutable=["cache"]
        )
        return mutated["cache"], y[:, 0, 0]

    cache, ys = jax.lax.scan(body, cache, jnp.moveaxis(_previous_pixels(x), 1, 0))
    assert int(cache["Conv_1"]["cache_index"]) == H * W
    got = jnp.moveaxis(ys, 0, 1).reshape(expected.shape)
    assert_close(got, expected, np.float32, 6 * 3 * 3 * C, float(np.abs(expected).max()))


def test_linen_row_steps_for_a_vertical_stack():
    mask = mk.vertical_stack_mask((3, 3), "B")
    layer = MaskedConv(C, (3, 3), mask=mask, decode=True)
    x = random(1, (N, H, W, 3))
    variables = layer.init(jax.random.key(1), x)
    expected = MaskedConv(C, (3, 3), mask=mask).apply({"params": variables["params"]}, x)
    apply = jax.jit(lambda cache, row: layer.apply({**variables, "cache": cache}, row, mutable=["cache"]))
    cache, rows = variables["cache"], []
    for r in range(H):
        y, mutated = apply(cache, x[:, r : r + 1])
        cache = mutated["cache"]
        rows.append(y)
    assert int(cache["cache_index"]) == H * W  # counted in pixels: a row advances it by W
    assert_close(jnp.concatenate(rows, 1), expected, np.float32, 6 * 3, float(np.abs(expected).max()))


def test_linen_1d_causal_dilated():
    layer = MaskedConv(C, 2, padding="CAUSAL", kernel_dilation=4, mask=np.ones(2, bool), decode=True)
    x = random(2, (N, 20, 3))
    variables = layer.init(jax.random.key(2), x)
    assert variables["cache"]["cached_input"].shape == (N, 5, 3)  # (k - 1) * dilation + 1 steps
    expected = layer.clone(decode=False).apply({"params": variables["params"]}, x)

    def body(cache, xt):
        y, mutated = layer.apply({**variables, "cache": cache}, xt[:, None], mutable=["cache"])
        return mutated["cache"], y[:, 0]

    _, ys = jax.lax.scan(jax.jit(body), variables["cache"], jnp.moveaxis(x, 1, 0))
    assert_close(jnp.moveaxis(ys, 0, 1), expected, np.float32, 2 * 3, float(np.abs(expected).max()))


def test_linen_decode_errors():
    layer = MaskedConv(C, (3, 3), mask=mk.pixelcnn_mask((3, 3), "B"), decode=True)
    x = random(3, (N, H, W, 2))
    variables = layer.init(jax.random.key(3), x)
    with pytest.raises(ValueError, match="one position per call"):
        layer.apply(variables, x[:, :2], mutable=["cache"])
    with pytest.raises(NotImplementedError, match="strides=1"):
        MaskedConv(C, (3, 3), strides=2, mask=mk.pixelcnn_mask((3, 3)), decode=True).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="after the current position"):
        MaskedConv(C, (3, 3), mask=np.ones((3, 3)), decode=True).init(jax.random.key(0), x)
    rgb = mk.channel_grouped_mask((3, 3), 3, 6, "A")
    with pytest.raises(NotImplementedError, match="channel_groups=G"):
        MaskedConv(6, (3, 3), mask=rgb, decode=True).init(jax.random.key(0), random(4, (N, H, W, 3)))


@pytest.mark.slow  # linen's is the fast tier's
def test_nnx_decode_equals_the_full_forward_at_every_position():
    first = mk_nnx.MaskedConv(2, C, (5, 5), mask=mk.pixelcnn_mask((5, 5), "A"), decode_shift=1, rngs=nnx.Rngs(0))
    second = mk_nnx.MaskedConv(C, C, (3, 3), mask=mk.pixelcnn_mask((3, 3), "B"), rngs=nnx.Rngs(1))
    x = random(4, (N, H, W, 2))
    expected = second(nn.relu(first(x)))
    with pytest.raises(ValueError, match="init_cache"):
        first(x[:, :1, :1], decode=True)
    first.init_cache(x.shape)
    second.init_cache((N, H, W, C))
    assert first.cached_input.shape == (N, 3, W, 2)

    @nnx.jit
    def decode_step(first, second, pixel):
        return second(nn.relu(first(pixel, decode=True)), decode=True)

    previous = _previous_pixels(x)
    ys = [decode_step(first, second, previous[:, p, None, None])[:, 0, 0] for p in range(H * W)]
    got = jnp.stack(ys, 1).reshape(expected.shape)
    assert int(second.cache_index[...]) == H * W
    assert_close(got, expected, np.float32, 6 * 3 * 3 * C, float(np.abs(expected).max()))


# --------------------------------------------------------------------------- the example's gated PixelCNN

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "pixelcnn"


@pytest.fixture(scope="module")
def example():
    """``examples/pixelcnn``'s model and samplers (flax and this package only)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import model
        import sampling
    finally:
        sys.path.remove(str(EXAMPLE))
    return model, sampling


@pytest.mark.slow
def test_example_decodes_rows_and_pixels_to_the_full_forward(example):
    model_mod, _ = example
    model = model_mod.GatedPixelCNN(levels=4, features=8, layers=3)
    n, h, w = 2, 5, 6
    levels = jax.random.randint(jax.random.key(0), (n, h, w), 0, 4)
    x = model_mod.to_input(levels, 4)
    variables = model.init(jax.random.key(1), x)
    expected = np.asarray(model.apply(variables, x))
    dec = model.clone(decode=True)
    params = variables["params"]
    flat = x.reshape(n, h * w, 1)

    @jax.jit
    def decoded(cache):
        def row(cache, i):
            previous_row = x[:, jnp.maximum(i - 1, 0)][:, None]  # row 0: ignored (decode_shift=1)
            v_pre, mutated = dec.apply({"params": params, "cache": cache}, previous_row, part="rows", mutable=["cache"])

            def pixel(cache, j):
                previous = flat[:, jnp.maximum(i * w + j - 1, 0)][:, None, None]
                v_at = tuple(jax.lax.dynamic_slice_in_dim(v, j, 1, axis=2) for v in v_pre)
                logits, mutated = dec.apply(
                    {"params": params, "cache": cache}, previous, part="pixel", v_pre=v_at, mutable=["cache"]
                )
                return mutated["cache"], logits[:, 0, 0]

            return jax.lax.scan(pixel, mutated["cache"], jnp.arange(w))

        return jax.lax.scan(row, cache, jnp.arange(h))[1]  # (H, W, N, levels)

    got = np.transpose(np.asarray(decoded(dec.init(jax.random.key(1), x)["cache"])), (2, 0, 1, 3))
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=TOLERANCE[np.dtype("float32")] * scale)


@pytest.mark.slow
def test_example_cached_samples_equal_naive_samples(example):
    model_mod, sampling = example
    model = model_mod.GatedPixelCNN(levels=4, features=8, layers=2)
    variables = model.init(jax.random.key(2), jnp.zeros((1, 5, 6, 1)))
    key = jax.random.key(3)
    naive = np.asarray(sampling.sample_naive(model, variables, key, 3, (5, 6)))
    cached = np.asarray(sampling.sample_cached(model, variables, key, 3, (5, 6)))
    np.testing.assert_array_equal(cached, naive)
    np.testing.assert_array_equal(np.asarray(sampling.resample_from_logits(model, variables, key, jnp.asarray(cached))), naive)
