"""Flax's own convolution tests, with the drop-in swapped in.

Ported from Flax's ``tests/linen/linen_linear_test.py`` (``test_conv``,
``test_multibatch_input_conv``, ``test_single_input_conv``,
``test_single_input_masked_conv``, ``test_group_conv``, ``test_circular_conv_*``,
``test_reflect_conv_*``, ``test_causal_conv1d``) and ``tests/nnx/nn/conv_test.py``
(``test_nnx_linen_conv_equivalence``): the same inputs, fields and expected values,
with ``nn.Conv`` / ``nnx.Conv`` replaced by ``maskconv_kernels.flax.linen.Conv`` /
``maskconv_kernels.flax.nnx.Conv``. Their products of parameters are sampled as lax's
grids are (``replay.py``).

Not ported: the ``nn.ConvLocal`` and ``ConvTranspose`` cases (the ``module=nn.ConvLocal``
half of the circular grids, ``test_conv_local``, ``test_*conv_transpose*``,
``test_nnx_linen_convtranspose_equivalence``): the library replaces ``Conv`` only.
"""
from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close
from flax import nnx
from jax import random
from jax.lax import Precision
from jax.nn import initializers
from support.replay import tiers

from maskconv_kernels.flax import linen as mk_linen
from maskconv_kernels.flax import nnx as mk_nnx

Conv = mk_linen.Conv  # what the tests below call nn.Conv


@pytest.mark.parametrize("use_bias", [True, False])
def test_conv(use_bias):
    x = jnp.ones((1, 8, 3))
    conv_module = Conv(features=4, use_bias=use_bias, kernel_size=(3,), padding="VALID",
                       kernel_init=initializers.ones, bias_init=initializers.ones)
    y, initial_params = conv_module.init_with_output(dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (3, 3, 4)
    np.testing.assert_allclose(y, np.full((1, 6, 4), 10.0 if use_bias else 9.0))


@pytest.mark.parametrize("use_bias", [True, False])
def test_multibatch_input_conv(use_bias):
    x = jnp.ones((2, 5, 8, 3))
    conv_module = Conv(features=4, use_bias=use_bias, kernel_size=(3,), padding="VALID",
                       kernel_init=initializers.ones, bias_init=initializers.ones)
    y, initial_params = conv_module.init_with_output(dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (3, 3, 4)
    np.testing.assert_allclose(y, np.full((2, 5, 6, 4), 10.0 if use_bias else 9.0))


def test_single_input_conv():
    x = jnp.ones((8, 3))
    conv_module = Conv(features=4, kernel_size=(3,), padding="VALID", kernel_init=initializers.ones,
                       bias_init=initializers.ones)
    y, initial_params = conv_module.init_with_output(dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (3, 3, 4)
    np.testing.assert_allclose(y, np.full((6, 4), 10.0))


def test_single_input_masked_conv():
    x = jnp.ones((8, 3))
    m = jnp.tril(jnp.ones((3, 3, 4)))
    conv_module = Conv(features=4, kernel_size=(3,), padding="VALID", mask=m, kernel_init=initializers.ones,
                       bias_init=initializers.ones)
    expected = jnp.array([[10.0, 7.0, 4.0, 1.0]] * 6)
    y, initial_params = conv_module.init_with_output(dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (3, 3, 4)
    np.testing.assert_allclose(y, expected)


def test_group_conv():
    x = jnp.ones((1, 8, 4))
    conv_module = Conv(features=4, kernel_size=(3,), feature_group_count=2, padding="VALID",
                       kernel_init=initializers.ones, bias_init=initializers.ones)
    y, initial_params = conv_module.init_with_output(dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (3, 2, 4)
    np.testing.assert_allclose(y, np.full((1, 6, 4), 7.0))


CIRCULAR_1D = [dict(n_batch=b, n_features=f, kernel_size=k, n_input_features=c, input_size=n)
               for b, f, k, c, n in itertools.product((1, 3), (1, 2), (1, 2, 3, 9), (1, 3), (1, 8, 16))]
CIRCULAR_2D = [dict(n_batch=b, n_features=f, kernel_lin_size=k, n_input_features=c, input_x_size=14, input_y_size=y)
               for b, f, k, c, y in itertools.product((1, 3), (1, 2, 10), (1, 2, 3, 9), (1, 5), (5, 10))]
_ids = lambda case: "_".join(f"{k}{v}" for k, v in case.items())


@pytest.mark.parametrize("case", tiers("test_circular_conv_1d_constant", CIRCULAR_1D, _ids, fast=1, slow=2))
def test_circular_conv_1d_constant(case):
    """Circular padding, all-ones filter and input: every output is ``n_input_features * kernel_size``."""
    x = jnp.ones((case["n_batch"], case["input_size"], case["n_input_features"]))
    conv_module = Conv(features=case["n_features"], kernel_size=(case["kernel_size"],), padding="CIRCULAR",
                       kernel_init=initializers.ones, bias_init=initializers.zeros)
    y, initial_params = conv_module.init_with_output(dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (case["kernel_size"], case["n_input_features"], case["n_features"])
    expected = np.full((case["n_batch"], case["input_size"], case["n_features"]),
                       case["kernel_size"] * case["n_input_features"])
    np.testing.assert_allclose(y, expected)


@pytest.mark.parametrize("case", tiers("test_circular_conv_2d_constant", CIRCULAR_2D, _ids, fast=1, slow=2))
def test_circular_conv_2d_constant(case):
    x = jnp.ones((case["n_batch"], case["input_x_size"], case["input_y_size"], case["n_input_features"]))
    k = case["kernel_lin_size"]
    conv_module = Conv(features=case["n_features"], kernel_size=(k, k), padding="CIRCULAR",
                       kernel_init=initializers.ones, bias_init=initializers.zeros)
    y, initial_params = conv_module.init_with_output(dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (k, k, case["n_input_features"], case["n_features"])
    expected = np.full((*x.shape[:-1], case["n_features"]), k * k * case["n_input_features"])
    np.testing.assert_allclose(y, expected)


def _custom(kernel, **fields):
    """``Conv`` with a given integer kernel on ``arange``-style inputs, as Flax's *_custom tests build it."""
    return Conv(features=1, kernel_init=lambda *_: kernel, bias_init=initializers.zeros, **fields)


def test_circular_conv_1d_custom():
    """Circular padding and a stride."""
    x = np.expand_dims(np.arange(1, 6), (0, 2))
    kernel = np.expand_dims(np.array((1, 2, 1)), (1, 2))
    y, initial_params = _custom(kernel, kernel_size=(3,), strides=(3,), padding="CIRCULAR").init_with_output(
        dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (3, 1, 1)
    np.testing.assert_allclose(y, np.expand_dims(np.array((5 + 2 * 1 + 2, 3 + 2 * 4 + 5)), (0, 2)))


def test_circular_conv_1d_dilation():
    """Circular padding and kernel dilation."""
    x = np.expand_dims(np.arange(1, 6), (0, 2))
    kernel = np.expand_dims(np.array((1, 2, 1)), (1, 2))
    y, _ = _custom(kernel, kernel_size=(3,), padding="CIRCULAR", kernel_dilation=(3,)).init_with_output(
        dict(params=random.key(0)), x)
    expected = (3 + 2 * 1 + 4, 4 + 2 * 2 + 5, 5 + 2 * 3 + 1, 1 + 2 * 4 + 2, 2 + 2 * 5 + 3)
    np.testing.assert_allclose(y, np.expand_dims(np.array(expected), (0, 2)))


def test_circular_conv_2d_custom():
    x = np.expand_dims(np.array(((1, 2, 3), (4, 5, 6), (7, 8, 9))), (0, 3))
    kernel = np.expand_dims(np.array(((0, 1, 0), (1, 2, 1), (0, 1, 0))), (2, 3))
    y, initial_params = _custom(kernel, kernel_size=(3, 3), padding="CIRCULAR").init_with_output(
        dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (3, 3, 1, 1)
    expected = (
        (2 * 1 + 7 + 2 + 4 + 3, 2 * 2 + 8 + 3 + 5 + 1, 2 * 3 + 9 + 1 + 6 + 2),
        (2 * 4 + 1 + 5 + 7 + 6, 2 * 5 + 2 + 6 + 8 + 4, 2 * 6 + 3 + 4 + 9 + 5),
        (2 * 7 + 4 + 8 + 1 + 9, 2 * 8 + 5 + 9 + 2 + 7, 2 * 9 + 6 + 7 + 3 + 8),
    )
    np.testing.assert_allclose(y, np.expand_dims(np.array(expected), (0, 3)))


def test_reflect_conv_1d_custom():
    """Reflection padding and a stride."""
    x = np.expand_dims(np.arange(1, 6), (0, 2))
    kernel = np.expand_dims(np.array((1, 2, 1)), (1, 2))
    y, initial_params = _custom(kernel, kernel_size=(3,), strides=(2,), padding="REFLECT").init_with_output(
        dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (3, 1, 1)
    np.testing.assert_allclose(y, np.expand_dims(np.array((2 + 2 * 1 + 2, 2 + 2 * 3 + 4, 4 + 2 * 5 + 4)), (0, 2)))


def test_reflect_conv_2d_custom():
    x = np.expand_dims(np.array(((1, 2, 3), (4, 5, 6), (7, 8, 9))), (0, 3))
    kernel = np.expand_dims(np.array(((0, 1, 0), (1, 2, 1), (0, 1, 0))), (2, 3))
    y, initial_params = _custom(kernel, kernel_size=(3, 3), padding="REFLECT").init_with_output(
        dict(params=random.key(0)), x)
    assert initial_params["params"]["kernel"].shape == (3, 3, 1, 1)
    expected = (
        (2 * 1 + 4 + 2 + 4 + 2, 2 * 2 + 5 + 3 + 5 + 1, 2 * 3 + 6 + 2 + 6 + 2),
        (2 * 4 + 1 + 5 + 7 + 5, 2 * 5 + 2 + 6 + 8 + 4, 2 * 6 + 3 + 5 + 9 + 5),
        (2 * 7 + 4 + 8 + 8 + 4, 2 * 8 + 5 + 9 + 5 + 7, 2 * 9 + 6 + 8 + 6 + 8),
    )
    np.testing.assert_allclose(y, np.expand_dims(np.array(expected), (0, 3)))


def test_causal_conv1d():
    x = jnp.ones((1, 8, 4))
    conv_module = Conv(features=4, kernel_size=(3,), padding="CAUSAL", kernel_init=initializers.ones,
                       bias_init=initializers.ones)
    y, _ = conv_module.init_with_output(dict(params=random.key(0)), x)
    expected = np.array([[[5.0] * 4, [9.0] * 4] + [[13.0] * 4] * 6])
    np.testing.assert_allclose(y, expected)
    assert y.shape == expected.shape


# --------------------------------------------------------------------- tests/nnx/nn/conv_test.py

NNX_LINEN = [
    dict(strides=s, padding=p, use_bias=b, use_mask=m, preferred_element_type=t)
    for s, p, b, m, t in itertools.product([None, (2, 3)], ["VALID", "CIRCULAR", "REFLECT", (4, 2)], [True, False],
                                           [False, True], [None, jnp.float32])
]


@pytest.mark.parametrize("case", tiers("test_nnx_linen_conv_equivalence", NNX_LINEN,
                                       lambda c: "_".join(f"{k}{v}" for k, v in c.items()), fast=1, slow=2))
def test_nnx_linen_conv_equivalence(case):
    """Our nnx module, given our linen module's parameters, gives the same outputs bit for bit;
    both agree with Flax's ``nn.Conv(mask=...)`` up to rounding. As in Flax's test, input
    dilation forces the padding to ``(4, 2)`` whatever the case names."""
    fields = dict(
        strides=case["strides"], padding=(4, 2), input_dilation=(2, 3), kernel_dilation=(2, 3), feature_group_count=3,
        use_bias=case["use_bias"], mask=jnp.tril(jnp.ones((7, 4, 1, 6))) if case["use_mask"] else None,
        dtype=jnp.float32, param_dtype=jnp.float16, precision=Precision.HIGHEST,
    )
    x = jnp.ones((24, 9, 3))
    model_nnx = mk_nnx.Conv(3, 6, (7, 4), preferred_element_type=case["preferred_element_type"], rngs=nnx.Rngs(42),
                            **fields)
    model = mk_linen.Conv(6, kernel_size=(7, 4), **fields)
    variables = model.init(jax.random.key(42), x)
    model_nnx.kernel[...] = variables["params"]["kernel"]
    if case["use_bias"]:
        model_nnx.bias[...] = variables["params"]["bias"]
    out_nnx, out = model_nnx(x), model.apply(variables, x)
    assert isinstance(out, jax.Array)
    np.testing.assert_array_equal(out, out_nnx)
    flax_out = nn.Conv(6, kernel_size=(7, 4), **fields).apply(variables, x)
    kernel = jnp.abs(variables["params"]["kernel"].astype(jnp.float32)).max()
    assert_close(out, flax_out, np.float32, 7 * 4, float(kernel) + 1.0, precision="highest")
