"""MaxText's gated DeltaNet short convolution ported onto ``ShortConv`` (issue 48, frictions 1-5 and 7).

Against :class:`support.maxtext.MaxTextShortConv`, a faithful re-implementation of the
original (``nnx.Conv(feature_group_count=D, padding="CAUSAL", use_bias=False,
dtype=bfloat16)``, SiLU in float32, a ``(B, K - 1, D)`` conv state):

* ``from_conv`` computes what the converted layer computed, in its dtype (it rounds its
  float32 kernel to bfloat16 first; a converter that kept the float32 weight differed in a
  third of the outputs), for ``nnx.Conv``, ``nn.Conv`` and the library's own ``CausalConv``;
* ``padding_id=0`` reads MaxText's packed ids, and the final state is the unpadded row's;
* the full pass takes MaxText's conv state as ``initial_state`` and returns the next one;
* ``init_cache(state=...)`` (nnx) and the ``"cache"`` collection (linen) adopt it for decoding;
* ``padding="CAUSAL"`` is accepted, and every padding a ``ShortConv`` cannot mean refused.

Outputs are compared bit for bit in bfloat16: the two compute the same products (bfloat16
values, exact in float32) and differ only in the order XLA's convolution adds the ``K``
taps in float32, which moves a bfloat16 output in about one case in four million (measured
on 16.7M outputs), none at these sizes and seeds.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.maxtext import MaxTextShortConv, maxtext_segment_ids
from support.numerics import assert_close, random

from maskconv_kernels import causal_conv1d
from maskconv_kernels.flax import CausalConv, ShortConv, from_conv_params
from maskconv_kernels.flax import nnx as mk_nnx

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype("float32")
B, L, D, K = 3, 24, 64, 4


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_bits(actual, expected):
    assert np.dtype(actual.dtype) == np.dtype(expected.dtype), (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(_bits(actual), _bits(expected))


def _maxtext(dtype=jnp.bfloat16):
    return MaxTextShortConv(D, K, dtype, rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------- friction 2: converters

def test_nnx_from_conv_computes_maxtexts_conv_bit_for_bit_in_bfloat16():
    original = _maxtext()
    port = mk_nnx.ShortConv.from_conv(original.conv1d, activation="silu")
    assert port.arithmetic == "nn_conv" and port.dtype == jnp.bfloat16 and port.param_dtype == jnp.float32
    x = random(0, (B, L, D))  # float32 activations, cast to bfloat16 by both
    _assert_bits(port(x), original(x))
    plain = mk_nnx.ShortConv.from_conv(original.conv1d)
    _assert_bits(plain(x), original.conv1d(x))
    # The float32 weight against bfloat16 inputs (the converter before) is another computation.
    wide = mk_nnx.ShortConv(D, K, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    wide.weight[...] = port.weight[...]
    assert (np.asarray(wide(x)) != np.asarray(original.conv1d(x))).mean() > 0.1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_nnx_from_conv_with_a_bias_rounds_as_nnx_conv(dtype):
    """``nnx.Conv`` rounds its convolution, then adds its bias in its dtype: a second rounding, kept."""
    conv = nnx.Conv(D, D, K, feature_group_count=D, padding="CAUSAL", dtype=dtype, rngs=nnx.Rngs(1))
    conv.bias[...] = random(1, (D,))
    port = mk_nnx.ShortConv.from_conv(conv, activation="silu")
    x = random(2, (B, L, D))
    expected = jax.nn.silu(conv(x).astype(jnp.float32)).astype(dtype)
    if dtype == jnp.bfloat16:
        _assert_bits(port(x), expected)
    else:  # float32: XLA's convolution adds the taps in its own order
        scale = float(np.abs(conv.bias[...]).max() + K * np.abs(x).max() * np.abs(conv.kernel[...]).max())
        assert_close(port(x), expected, F32, K + 1, scale)
    ids = np.tile(np.repeat([0, 1, -1], [10, 10, 4]), (B, 1)).astype(np.int32)
    assert not np.asarray(port(x, ids))[ids < 0].any()  # padding outputs stay zeros, bias and all


def test_linen_from_conv_computes_nn_conv_bit_for_bit():
    conv = nn.Conv(D, (K,), feature_group_count=D, padding="CAUSAL", use_bias=False, dtype=jnp.bfloat16)
    x = random(3, (B, L, D))
    conv_variables = conv.init(jax.random.key(0), x)
    port = ShortConv.from_conv(conv, name="conv1d")
    assert (port.name, port.arithmetic, port.dtype, port.use_bias) == ("conv1d", "nn_conv", jnp.bfloat16, False)
    _assert_bits(port.apply(from_conv_params(conv_variables), x), conv.apply(conv_variables, x))


@pytest.mark.parametrize("use_bias", [False, True])
def test_from_conv_of_the_librarys_own_causal_conv(use_bias):
    """A 1-D depthwise ``CausalConv`` (nnx and linen) converts, and the ``ShortConv`` computes what it computed."""
    layer = mk_nnx.CausalConv(D, D, K, feature_group_count=D, kernel_dilation=2, use_bias=use_bias,
                              dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
    if use_bias:
        layer.bias[...] = random(4, (D,))
    port = mk_nnx.ShortConv.from_conv(layer)
    assert (port.arithmetic, port.dilation, port.use_bias) == ("promote", 2, use_bias)
    x = random(5, (B, L, D))
    _assert_bits(port(x), layer(x))

    linen_layer = CausalConv(D, K, feature_group_count=D, use_bias=use_bias, dtype=jnp.bfloat16)
    variables = linen_layer.init(jax.random.key(3), x)
    _assert_bits(ShortConv.from_conv(linen_layer).apply(from_conv_params(variables), x),
                 linen_layer.apply(variables, x))


@pytest.mark.parametrize("make, match", [
    (lambda: mk_nnx.CausalConv(D, D, K, feature_group_count=D, padding_mode="replicate", rngs=nnx.Rngs(0)),
     r"padding_mode='zeros'.*keep the CausalConv"),
    (lambda: mk_nnx.CausalConv(D, D, K, strides=2, feature_group_count=D, rngs=nnx.Rngs(0)), r"needs stride 1"),
    (lambda: mk_nnx.CausalConv(D, D, (K, 3), feature_group_count=D, rngs=nnx.Rngs(0)),
     r"a depthwise 1-D convolution.*kernel_size \(4, 3\)"),
    (lambda: mk_nnx.CausalConv(D, D, K, rngs=nnx.Rngs(0)), r"a depthwise 1-D.*feature_group_count=1"),
], ids=["replicate", "strided", "2d", "dense"])
def test_from_conv_refuses_a_causal_conv_it_cannot_compute(make, match):
    with pytest.raises(ValueError, match=match):
        mk_nnx.ShortConv.from_conv(make())


# --------------------------------------------------------------------------- friction 1: MaxText's packing

def _packed():
    """Three right-padded MaxText rows: two documents, one document, one shorter than the state."""
    lengths = [(9, 7), (20,), (11, 2)]
    return jnp.stack([maxtext_segment_ids(n, L) for n in lengths]), [sum(n) for n in lengths]


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_padding_id_zero_reads_maxtext_ids_and_the_state_is_the_unpadded_rows(api):
    original = _maxtext()
    ids, real = _packed()
    x = np.array(random(6, (B, L, D), BF16))
    x[np.asarray(ids) == 0] = np.nan  # padding is never read
    if api == "nnx":
        port = mk_nnx.ShortConv.from_conv(original.conv1d, activation="silu", padding_id=0)
        y, state = port(x, ids, return_final_state=True)
    else:
        port = ShortConv(K, use_bias=False, activation="silu", dtype=jnp.bfloat16, padding_id=0, arithmetic="nn_conv")
        params = {"params": {"weight": original.conv1d.kernel[...][:, 0, :]}}
        y, state = port.apply(params, x, ids, return_final_state=True)
    assert not np.asarray(y)[np.asarray(ids) == 0].any()
    for b, n in enumerate(real):
        row = jnp.asarray(x[b:b + 1, :n])
        last = int(np.asarray(ids)[b, n - 1])
        doc = row[:, np.asarray(ids)[b, :n] == last]  # the row's last document, alone
        if doc.shape[1] >= K - 1:
            _, expected = original.prefill(doc)
        else:  # shorter than the state: zeros before its start, as after a cold prefill
            expected = jnp.concatenate([jnp.zeros((1, K - 1 - doc.shape[1], D), doc.dtype), doc], axis=1)
        _assert_bits(state[b:b + 1], expected)
        start = n - doc.shape[1]
        _assert_bits(y[b:b + 1, start:n], original(doc))  # each document as the original runs it alone


# --------------------------------------------------------------------------- frictions 3 and 7: states

def test_nnx_full_pass_continues_maxtexts_state_and_hands_on_the_next():
    original = _maxtext()
    port = mk_nnx.ShortConv.from_conv(original.conv1d, activation="silu")
    x = random(7, (B, L, D), BF16)
    full = original(x)
    head, state = original.prefill(x[:, :10])
    y, after = port(x[:, 10:], initial_state=state, return_final_state=True)
    _assert_bits(y, full[:, 10:])
    _assert_bits(after, original.prefill(x)[1])


def test_nnx_decode_adopts_maxtexts_conv_state():
    original = _maxtext()
    port = mk_nnx.ShortConv.from_conv(original.conv1d, activation="silu")
    x = random(8, (B, L, D), BF16)
    _, state = original.prefill(x[:, :9])
    port.init_cache(state=state)
    assert port.conv_state.dtype == BF16
    got, expected = [], []
    for t in range(9, L, 5):
        got.append(port(x[:, t:t + 5], decode=True))
        y, state = original.decode(x[:, t:t + 5], state)
        expected.append(y)
    _assert_bits(jnp.concatenate(got, axis=1), jnp.concatenate(expected, axis=1))
    _assert_bits(port.conv_state[...], state)
    with pytest.raises(ValueError, match=r"adopts a state \(N, \(kernel_size - 1\) \* dilation, features\) = \(N, 3, 64\)"):
        port.init_cache(state=state[:, 1:])
    with pytest.raises(ValueError, match="no input_shape or dtype"):
        port.init_cache((B, L, D), state=state)


def test_linen_full_pass_and_decode_from_maxtexts_state():
    original = _maxtext()
    port = ShortConv(K, use_bias=False, activation="silu", dtype=jnp.bfloat16, arithmetic="nn_conv")
    params = {"weight": original.conv1d.kernel[...][:, 0, :]}
    x = random(9, (B, L, D), BF16)
    _, state = original.prefill(x[:, :12])
    y, after = port.apply({"params": params}, x[:, 12:], initial_state=state, return_final_state=True)
    _assert_bits(y, original(x)[:, 12:])
    _assert_bits(after, original.prefill(x)[1])

    decoding = port.clone(decode=True)
    cache = {"conv_state": state}  # the "cache" collection is the state: adopted as it is
    y, mutated = decoding.apply({"params": params, "cache": cache}, x[:, 12:13], mutable=["cache"])
    expected, state = original.decode(x[:, 12:13], state)
    _assert_bits(y, expected)
    _assert_bits(mutated["cache"]["conv_state"], state)
    with pytest.raises(ValueError, match="initial_state and return_final_state are for the full pass"):
        decoding.apply({"params": params, "cache": cache}, x[:, 12:13], initial_state=state, mutable=["cache"])


def test_full_pass_state_arguments_match_the_function():
    """``initial_state`` and ``return_final_state`` are :func:`causal_conv1d`'s, bit for bit, packing included."""
    layer = mk_nnx.ShortConv(D, K, dilation=2, activation="silu", rngs=nnx.Rngs(3))
    x, state = random(10, (B, L, D)), random(11, (B, 2 * (K - 1), D))
    ids = np.tile(np.repeat([2, 5], [14, 10]), (B, 1)).astype(np.int32)
    got = layer(x, ids, initial_state=state, return_final_state=True)
    expected = causal_conv1d(x, layer.weight[...], layer.bias[...], segment_ids=ids, initial_state=state,
                             return_final_state=True, activation="silu", dilation=2)
    for a, b in zip(got, expected):
        _assert_bits(a, b)
    layer.init_cache((B, L, D))
    with pytest.raises(ValueError, match="initial_state and return_final_state are for the full pass"):
        layer(x[:, :1], decode=True, return_final_state=True)


# --------------------------------------------------------------------------- friction 5: padding="CAUSAL"

@pytest.mark.parametrize("padding", ["CAUSAL", "causal", ((6, 0),), [(6, 0)]], ids=["CAUSAL", "lower", "pairs", "list"])
def test_short_conv_takes_the_causal_padding_a_flax_conv_had(padding):
    assert ShortConv(K, dilation=2, padding=padding).padding == padding
    assert mk_nnx.ShortConv(D, K, dilation=2, padding=padding, rngs=nnx.Rngs(0)).padding == padding


@pytest.mark.parametrize("padding", ["SAME", "VALID", ((3, 3),), ((3, 0),), 1], ids=str)
def test_short_conv_refuses_a_padding_it_cannot_mean(padding):
    match = r"ShortConv is causal: padding must be 'CAUSAL'.*\(\(6, 0\),\).*MaskedConv"
    with pytest.raises(ValueError, match=match):
        ShortConv(K, dilation=2, padding=padding)
    with pytest.raises(ValueError, match=match):
        mk_nnx.ShortConv(D, K, dilation=2, padding=padding, rngs=nnx.Rngs(0))


def test_unknown_arithmetic_is_refused():
    with pytest.raises(ValueError, match=r"arithmetic must be one of \('wide', 'promote', 'nn_conv'\)"):
        ShortConv(K, arithmetic="bf16")
