"""A depthwise ``nn.Conv`` checkpoint loads into ``ShortConv``: ``from_conv_params`` (linen) and
``ShortConv.from_conv`` (nnx) keep the outputs of the convolution they replace.

The linen case is a real round trip: a Mamba-style block (input projection, depthwise
causal ``nn.Conv`` named ``conv1d``, SiLU) is initialised and serialised with
``flax.serialization``; the block rewritten with ``ShortConv`` restores those bytes,
converts the ``conv1d`` subtree and gives the same outputs, within the float32 tolerance
of a sum of ``W`` products and a bias (the two compute it by different algorithms).
"""
from __future__ import annotations

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.numerics import assert_close, random

from maskconv_kernels.flax import ShortConv, from_conv_params
from maskconv_kernels.flax import nnx as mk_nnx

F32 = np.dtype("float32")
D, W = 8, 4


class MambaMixer(nn.Module):
    """The convolution part of a Mamba mixer: ``silu(conv1d(in_proj(x)))``, ``conv1d`` as the model wrote it."""

    short_conv: bool
    dilation: int = 1

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D, name="in_proj")(x)
        if self.short_conv:
            return ShortConv(W, dilation=self.dilation, activation="silu", name="conv1d")(h)
        conv = nn.Conv(D, (W,), feature_group_count=D, padding=(((W - 1) * self.dilation, 0),),
                       kernel_dilation=self.dilation, name="conv1d")
        return nn.silu(conv(h))


def _bound_scale(h, weight, bias) -> float:
    """``max |bias| + W max |h| max |weight|``: the size of the sums both sides compute."""
    return float(np.abs(bias).max() + W * np.abs(h).max() * np.abs(weight).max())


@pytest.mark.parametrize("dilation", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_checkpoint_of_a_depthwise_nn_conv_loads_into_short_conv(dilation):
    x = random(1, (2, 19, 5))
    old = MambaMixer(short_conv=False, dilation=dilation)
    variables = old.init(jax.random.key(0), x)
    checkpoint = flax.serialization.to_bytes(variables)

    restored = flax.serialization.from_bytes(variables, checkpoint)
    params = dict(restored["params"])
    params["conv1d"] = from_conv_params(params["conv1d"])
    new = MambaMixer(short_conv=True, dilation=dilation)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, new.init(jax.random.key(1), x)["params"])

    proj = params["in_proj"]
    h = x @ proj["kernel"] + proj["bias"]
    scale = _bound_scale(h, params["conv1d"]["weight"], params["conv1d"]["bias"])
    assert_close(new.apply({"params": params}, x), old.apply(variables, x), F32, W + 1, scale)


def test_from_conv_params_keeps_the_nesting_and_the_values():
    kernel, bias = random(2, (W, 1, D)), random(3, (D,))
    converted = from_conv_params({"params": {"kernel": kernel, "bias": bias}})
    assert set(converted) == {"params"} and set(converted["params"]) == {"weight", "bias"}
    np.testing.assert_array_equal(converted["params"]["weight"], kernel[:, 0, :])
    np.testing.assert_array_equal(converted["params"]["bias"], bias)
    assert set(from_conv_params({"kernel": kernel})) == {"weight"}  # use_bias=False


@pytest.mark.parametrize("params, match", [
    ({"kernel": jnp.ones((W, 2, D))}, r"kernel must be a depthwise 1-D convolution's \(W, 1, D\).*\(4, 2, 8\)"),
    ({"kernel": jnp.ones((3, 3, 1, D))}, r"\(W, 1, D\).*got shape \(3, 3, 1, 8\)"),
    ({"kernel": jnp.ones((W, 1, D)), "bias": jnp.ones((D + 1,))}, r"bias must be \(D,\) = \(8,\), got \(9,\)"),
    ({"weight": jnp.ones((W, D))}, r"takes a depthwise nn.Conv's parameters.*got keys \['weight'\]"),
], ids=["grouped", "2d", "bias", "short_conv_params"])
def test_from_conv_params_errors(params, match):
    with pytest.raises(ValueError, match=match):
        from_conv_params(params)


@pytest.mark.parametrize("padding, dilation", [("CAUSAL", 1), (((6, 0),), 2)])
def test_nnx_short_conv_from_a_depthwise_nnx_conv(padding, dilation):
    conv = nnx.Conv(D, D, W, feature_group_count=D, padding=padding, kernel_dilation=dilation, rngs=nnx.Rngs(0))
    conv.bias[...] = random(4, (D,))  # nnx.Conv starts its bias at zero
    short = mk_nnx.ShortConv.from_conv(conv)
    assert short.weight.shape == (W, D) and short.dilation == dilation
    x = random(5, (3, 17, D))
    assert_close(short(x), conv(x), F32, W + 1, _bound_scale(x, conv.kernel[...], conv.bias[...]))
    silu = mk_nnx.ShortConv.from_conv(conv, activation="silu")
    assert_close(silu(x), nnx.silu(conv(x)), F32, W + 1, _bound_scale(x, conv.kernel[...], conv.bias[...]))


@pytest.mark.parametrize("conv, match", [
    (lambda: nnx.Conv(D, D, W, feature_group_count=D, padding="SAME", rngs=nnx.Rngs(0)),
     r"a causal padding, 'CAUSAL' or \(\(3, 0\),\), got 'SAME'"),
    (lambda: nnx.Conv(D, D, W, feature_group_count=2, padding="CAUSAL", rngs=nnx.Rngs(0)),
     r"a depthwise 1-D convolution.*feature_group_count=2"),
    (lambda: nnx.Conv(D, D, W, strides=2, feature_group_count=D, padding="CAUSAL", rngs=nnx.Rngs(0)),
     r"stride 1, no input dilation and no mask"),
], ids=["same", "grouped", "strided"])
def test_nnx_from_conv_refuses_what_short_conv_does_not_compute(conv, match):
    with pytest.raises(ValueError, match=match):
        mk_nnx.ShortConv.from_conv(conv())
