"""``ShortConv`` (linen and nnx): Mamba / gated DeltaNet's short convolution as a Flax module.

Parameters (names, shapes, dtypes, PyTorch's initialisation bounds), the forward pass
equal to :func:`causal_conv1d` with those parameters, and ``decode=True`` in Flax's
decode convention: prefill and one-token steps give the full forward's outputs bit for
bit, with and without a pool of slots (``state_indices``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import random
from flax import nnx

from maskconv_kernels.flax import ShortConv
from maskconv_kernels.flax import nnx as mk_nnx
from maskconv_kernels.ops.causal_conv1d import PAD_SLOT_ID, causal_conv1d

N, L, D, WIDTH = 2, 13, 256, 4
# The full pass that decoding reproduces bit for bit: on a TPU the kernels' (decoding runs
# them; a full pass this short runs XLA's, which adds the bias after the taps and takes
# jax.nn.silu: within rounding there, docs/design/fma_contraction.md), elsewhere the default.
FULL_PASS = "pallas_mosaic_tpu" if jax.default_backend() == "tpu" else None
BF16 = np.dtype(jnp.bfloat16)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _check_torch_init(values, width):
    """``uniform(±1/sqrt(width))``: inside the bounds and spread over them (``D * width`` draws)."""
    values = np.asarray(values, np.float64)
    bound = 1 / np.sqrt(width)
    assert np.abs(values).max() <= bound
    assert values.max() > 0.8 * bound and values.min() < -0.8 * bound
    assert abs(values.std() - bound / np.sqrt(3)) < 0.15 * bound  # a uniform's std


# --------------------------------------------------------------------------- linen

def test_linen_params_and_pytorch_initialisation():
    layer = ShortConv(kernel_size=WIDTH, activation="silu")
    variables = layer.init(jax.random.key(0), jnp.ones((N, L, D)))
    assert jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), variables) == {
        "params": {"weight": ((WIDTH, D), jnp.float32), "bias": ((D,), jnp.float32)}
    }
    _check_torch_init(variables["params"]["weight"], WIDTH)
    _check_torch_init(variables["params"]["bias"], WIDTH)
    plain = ShortConv(kernel_size=3, use_bias=False, param_dtype=jnp.bfloat16)
    plain = plain.init(jax.random.key(0), jnp.ones((1, 4, 8)))
    assert jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), plain) == {"params": {"weight": ((3, 8), BF16)}}
    assert "cache" not in variables


@pytest.mark.parametrize("x_dtype", [np.dtype(np.float32), BF16], ids=str)
def test_linen_forward_is_causal_conv1d(x_dtype):
    layer = ShortConv(kernel_size=WIDTH, activation="silu", dilation=2)
    x = random(0, (N, L, D), x_dtype)
    ids = np.array([[0] * 6 + [1] * 7, [3] * 10 + [-1] * 3], np.int32)
    params = layer.init(jax.random.key(1), x)["params"]
    got = jax.jit(lambda p, x: layer.apply({"params": p}, x, ids))(params, x)
    expected = jax.jit(
        lambda w, b, x: causal_conv1d(x, w, b, segment_ids=ids, activation="silu", dilation=2)
    )(params["weight"], params["bias"], x)
    assert got.dtype == x_dtype
    np.testing.assert_array_equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("x_dtype", [np.dtype(np.float32), BF16], ids=str)
def test_linen_decode_prefill_then_steps_equal_the_full_forward_bit_for_bit(x_dtype):
    """``init`` allocates the cache; a 5-token prefill, then one token per call in a
    ``lax.scan``; against the full pass decoding reproduces (``FULL_PASS``)."""
    x = random(2, (N, L, D), x_dtype)
    layer = ShortConv(kernel_size=WIDTH, activation="silu", decode=True)
    variables = layer.init(jax.random.key(3), x)
    assert jax.tree_util.tree_map(jnp.shape, variables["cache"]) == {"conv_state": (N, WIDTH - 1, D)}
    assert variables["cache"]["conv_state"].dtype == x_dtype and not variables["cache"]["conv_state"].any()
    params = variables["params"]
    expected = ShortConv(kernel_size=WIDTH, activation="silu", implementation=FULL_PASS).apply({"params": params}, x)

    def call(cache, tokens):
        y, mutated = layer.apply({"params": params, "cache": cache}, tokens, mutable=["cache"])
        return mutated["cache"], y

    cache, prefill = jax.jit(call)(variables["cache"], x[:, :5])
    cache, steps = jax.lax.scan(lambda c, t: call(c, t[:, None]), cache, jnp.moveaxis(x[:, 5:], 1, 0))
    got = jnp.concatenate([prefill, jnp.moveaxis(steps[:, :, 0], 0, 1)], axis=1)
    np.testing.assert_array_equal(_bits(got), _bits(expected))
    np.testing.assert_array_equal(_bits(cache["conv_state"]), _bits(x[:, L - WIDTH + 1 :]))


def test_linen_decode_over_a_pool_with_state_indices():
    """A cache of 5 slots (allocated from a batch of 5); two requests in slots 4 and 1, one
    padding row. Against the full pass decoding reproduces (``FULL_PASS``)."""
    layer = ShortConv(kernel_size=WIDTH, decode=True)
    variables = layer.init(jax.random.key(4), jnp.zeros((5, L, D)))
    x = random(5, (N, L, D))
    expected = ShortConv(kernel_size=WIDTH, implementation=FULL_PASS).apply({"params": variables["params"]}, x)
    slots = jnp.array([4, PAD_SLOT_ID, 1], jnp.int32)
    rows = jnp.stack([x[0], jnp.zeros_like(x[0]), x[1]])

    @jax.jit
    def call(cache, tokens):
        y, mutated = layer.apply(
            {"params": variables["params"], "cache": cache}, tokens, state_indices=slots, mutable=["cache"]
        )
        return mutated["cache"], y

    cache, ys = variables["cache"], []
    for t in range(L):
        cache, y = call(cache, rows[:, t : t + 1])
        ys.append(y)
    got = jnp.concatenate(ys, axis=1)
    np.testing.assert_array_equal(_bits(got[jnp.array([0, 2])]), _bits(expected))
    assert not np.asarray(got[1]).any()
    assert not np.asarray(cache["conv_state"][jnp.array([0, 2, 3])]).any()  # slots no row named


def test_linen_decode_arguments_are_for_decode_steps_only():
    x = random(6, (N, L, D))
    layer = ShortConv(kernel_size=WIDTH)
    variables = layer.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="are for decode steps"):
        layer.apply(variables, x, state_indices=jnp.arange(N, dtype=jnp.int32))
    decoding = ShortConv(kernel_size=WIDTH, decode=True)
    variables = decoding.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="segment_ids is for full sequences"):
        decoding.apply(variables, x[:, :1], jnp.zeros((N, 1), jnp.int32), mutable=["cache"])
    with pytest.raises(ValueError, match="give the full-size input shape"):
        decoding.init(jax.random.key(0), x[0])


# --------------------------------------------------------------------------- nnx

def test_nnx_state_and_pytorch_initialisation():
    layer = mk_nnx.ShortConv(D, WIDTH, activation="silu", rngs=nnx.Rngs(0))
    params = nnx.state(layer, nnx.Param)
    assert jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), nnx.to_pure_dict(params)) == {
        "weight": ((WIDTH, D), jnp.float32), "bias": ((D,), jnp.float32)
    }
    _check_torch_init(layer.weight[...], WIDTH)
    _check_torch_init(layer.bias[...], WIDTH)
    assert not nnx.to_pure_dict(nnx.state(layer, nnx.Cache))
    layer.init_cache((3, L, D))
    cache = nnx.to_pure_dict(nnx.state(layer, nnx.Cache))
    shapes = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), cache)
    assert shapes == {"conv_state": ((3, WIDTH - 1, D), jnp.float32)}
    plain = mk_nnx.ShortConv(8, 2, use_bias=False, rngs=nnx.Rngs(0))
    assert set(nnx.to_pure_dict(nnx.state(plain, nnx.Param))) == {"weight"}


def test_nnx_forward_is_causal_conv1d_and_decode_equals_it_bit_for_bit():
    # XLA's composition: bit for bit on every platform (a TPU's default decode step is its
    # kernel, within rounding of it: docs/serving.md).
    layer = mk_nnx.ShortConv(D, WIDTH, activation="silu", dilation=2, implementation="xla", rngs=nnx.Rngs(1))
    x = random(7, (N, L, D), BF16)
    expected = jax.jit(lambda w, b, x: causal_conv1d(x, w, b, activation="silu", dilation=2))(
        layer.weight[...], layer.bias[...], x
    )
    np.testing.assert_array_equal(_bits(nnx.jit(lambda m, x: m(x))(layer, x)), _bits(expected))
    with pytest.raises(ValueError, match="init_cache"):
        layer(x[:, :1], decode=True)
    layer.init_cache(x.shape, BF16)
    assert layer.conv_state.shape == (N, 2 * (WIDTH - 1), D)

    @nnx.jit
    def step(layer, tokens):
        return layer(tokens, decode=True)

    got = jnp.concatenate([step(layer, x[:, :3])] + [step(layer, x[:, t : t + 1]) for t in range(3, L)], axis=1)
    np.testing.assert_array_equal(_bits(got), _bits(expected))
    np.testing.assert_array_equal(_bits(layer.conv_state[...]), _bits(x[:, L - 2 * (WIDTH - 1) :]))


def test_nnx_errors_name_what_to_do():
    layer = mk_nnx.ShortConv(8, WIDTH, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="features=8"):
        layer(jnp.ones((1, 5, 9)))
    with pytest.raises(ValueError, match="are for decode steps"):
        layer(jnp.ones((1, 5, 8)), has_initial_state=jnp.array([False]))
    layer.init_cache((1, 5, 8))
    with pytest.raises(TypeError, match="conv_state must have x's dtype bfloat16, got float32"):
        layer(jnp.ones((1, 1, 8), jnp.bfloat16), decode=True)
