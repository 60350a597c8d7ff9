"""States in and out of ``causal_conv``'s streams and modules (issue 48, frictions 3, 5 and 7).

* :func:`causal_conv_stream_init` with ``frames=`` adopts a cache of past frames (Wan's
  ``feat_cache``) as a started :class:`CausalConvState`: the stream from it equals the
  stream that produced those frames, and a faithful re-implementation of Wan's cached
  causal conv (:class:`support.wan.WanCausalConv`) within the float32 bound;
* the ``CausalConv`` modules' full pass takes ``initial_state`` and returns the final
  state (linen, nnx, Equinox), and their caches adopt a state (nnx ``init_cache(state=)``,
  linen ``CausalConv.cache_from_state``, Equinox ``state.set``);
* ``padding="CAUSAL"`` means what ``nn.Conv`` means on a 1-D layer and is refused, with
  the fix, where the layer has other axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.causal import bits, scale
from support.numerics import assert_close, random
from support.wan import WanCausalConv

import maskconv_kernels as mk
from maskconv_kernels.flax import CausalConv
from maskconv_kernels.flax import nnx as mk_nnx
from maskconv_kernels.ops.causal_conv import causal_conv_stream_init

F32, BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
VIDEO = (1, 9, 4, 3, 2)  # (N, T, H, W, C_in): Wan's 1 + 4 + 4 frames
KERNEL = (3, 3, 3, 2, 3)


def _stream(x, chunks, state, kernel, **kw):
    ys = []
    for start, stop in chunks:
        y, state = mk.causal_conv_stream(x[:, start:stop], state, kernel, **kw)
        ys.append(y)
    return jnp.concatenate(ys, axis=1), state


# --------------------------------------------------------------------------- friction 7: adopting a cache

def test_a_wan_feat_cache_becomes_a_stream_state():
    """Wan decodes 1 + 4 + 4 frames with its cache; the port adopts Wan's cache after the first
    chunk and streams the rest: the same outputs (two convolution algorithms: within float32's bound)."""
    x = random(0, VIDEO)
    wan = WanCausalConv(2, 3, rngs=nnx.Rngs(0))
    wan.conv.bias[...] = random(1, (3,), scale=0.5)
    expected, _ = wan.decode([x[:, :1], x[:, 1:5], x[:, 5:]])
    kernel, bias = wan.conv.kernel[...], wan.conv.bias[...]
    feat_cache = WanCausalConv.next_cache(x[:, :1])  # one frame: the first chunk's
    state = causal_conv_stream_init(x[:, 1:5], kernel, frames=feat_cache)
    assert bool(state.started) and state.frames.shape == (1, 2, 4, 3, 2)
    y, _ = _stream(x, [(1, 5), (5, 9)], state, kernel, bias=None)
    y = y + bias
    assert_close(y, expected[:, 1:], F32, 27 * 2 + 1, scale(x, kernel) + 0.5)

    layer = mk_nnx.CausalConv(2, 3, (3, 3, 3), rngs=nnx.Rngs(0))
    layer.kernel[...], layer.bias[...] = kernel, bias
    layer.init_cache(state=causal_conv_stream_init(x[:, 1:5], kernel, frames=WanCausalConv.next_cache(x[:, 1:5], feat_cache)))
    assert_close(layer(x[:, 5:], decode=True), expected[:, 5:], F32, 27 * 2 + 1, scale(x, kernel) + 0.5)


@pytest.mark.parametrize("padding_mode", ["zeros", "replicate"])
def test_adopted_frames_continue_the_stream_that_left_them(padding_mode):
    """However many frames the cache holds, the state is the one the stream itself left, bit for bit."""
    x, k = random(2, VIDEO), random(3, KERNEL)
    kw = dict(padding_mode=padding_mode)
    _, after_one = mk.causal_conv_stream(x[:, :1], None, k, **kw)
    _, after_five = mk.causal_conv_stream(x[:, 1:5], after_one, k, **kw)
    for frames, expected in ((x[:, :1], after_one), (x[:, :5], after_five), (x[:, 3:5], after_five)):
        state = causal_conv_stream_init(x[:, :1], k, frames=frames, **kw)
        np.testing.assert_array_equal(bits(state.frames), bits(expected.frames))
        assert bool(state.started) and int(state.offset) == int(expected.offset) == 0
        y, _ = mk.causal_conv_stream(x[:, 5:], state, k, **kw)
        y_expected, _ = mk.causal_conv_stream(x[:, 5:], expected, k, **kw)
        np.testing.assert_array_equal(bits(y), bits(y_expected))


def test_adopted_frames_in_another_layout_with_clips_and_an_offset():
    x, k = random(4, (2, 8, 3), F32), random(5, (3, 3, 4), F32)  # audio, channels-last
    dn = ("NCH", "OIH", "NCH")
    xc, kc = jnp.moveaxis(x, -1, 1), jnp.transpose(k, (2, 1, 0))
    state = causal_conv_stream_init(xc[:, :, :2], kc, dimension_numbers=dn, frames=xc[:, :, 3:5])
    np.testing.assert_array_equal(bits(state.frames), bits(x[:, 3:5]))  # kept channels-last
    ids = jnp.asarray(np.repeat([[0, 1]], [5, 3], axis=1).repeat(2, 0).astype(np.int32))
    packed = causal_conv_stream_init(x[:, :1], k, segment_ids=ids[:, :1], frames=x[:, 4:5],
                                     frames_segment_ids=ids[:, 4:5])
    assert packed.segment_ids.tolist() == [[-1, 0], [-1, 0]]
    y, _ = mk.causal_conv_stream(x[:, 5:], packed, k, segment_ids=ids[:, 5:])
    np.testing.assert_array_equal(bits(y), bits(mk.causal_conv_stream(x[:, 5:], None, k, segment_ids=ids[:, 5:])[0]))
    strided = causal_conv_stream_init(x[:, :2], k, strides=2, frames=x[:, :3], offset=1)
    _, expected = mk.causal_conv_stream(x[:, :3], None, k, strides=2)  # 3 frames: the next output 1 frame in
    assert int(strided.offset) == int(expected.offset) == 1
    np.testing.assert_array_equal(bits(mk.causal_conv_stream(x[:, 3:7], strided, k, strides=2)[0]),
                                  bits(mk.causal_conv_stream(x[:, 3:7], expected, k, strides=2)[0]))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(frames=jnp.zeros((1, 2, 4, 3, 2), BF16)), TypeError, r"frames must have the chunk's dtype float32, got bfloat16"),
    (dict(frames=jnp.zeros((1, 2, 4, 4, 2))), ValueError, r"frames must be \(N, F', \*spatial, C_in\) channels-last = "
                                                           r"\(1, 2, 4, 3, 2\), got \(1, 2, 4, 4, 2\)"),
    (dict(frames=jnp.zeros((1, 2, 4, 3, 2)), offset=1), ValueError, r"offset must be an int in \[0, strides\[0\]\) = \[0, 1\)"),
    (dict(frames=jnp.zeros((1, 2, 4, 3, 2)), segment_ids=jnp.zeros((1, 1, 4, 3), jnp.int32)), ValueError,
     r"a packed stream \(segment_ids\) needs frames_segment_ids"),
    (dict(offset=1), ValueError, r"frames_segment_ids and offset describe adopted frames: pass frames with them"),
], ids=["dtype", "shape", "offset", "clips", "no_frames"])
def test_adopting_frames_of_another_layer_says_what_is_wrong(kwargs, error, match):
    with pytest.raises(error, match=f"causal_conv_stream_init: {match}"):
        causal_conv_stream_init(jnp.zeros(VIDEO[:1] + (1,) + VIDEO[2:]), jnp.zeros(KERNEL), **kwargs)


# --------------------------------------------------------------------------- friction 3: the modules' states

def test_linen_full_pass_states_and_adopted_cache():
    x = random(6, VIDEO)
    layer = CausalConv(3, (3, 3, 3), strides=(2, 1, 1), padding_mode="replicate")
    variables = layer.init(jax.random.key(0), x)
    full = layer.apply(variables, x)
    y0, state = layer.apply(variables, x[:, :5], return_final_state=True)
    y1, final = layer.apply(variables, x[:, 5:], initial_state=state, return_final_state=True)
    expected_state = mk.causal_conv_stream(x, None, variables["params"]["kernel"], strides=(2, 1, 1),
                                           padding_mode="replicate")[1]
    np.testing.assert_array_equal(bits(final.frames), bits(expected_state.frames))
    assert_close(jnp.concatenate([y0, y1], axis=1), full, F32, 27 * 2, scale(x, variables["params"]["kernel"]))
    decoding = layer.clone(decode=True)
    cache = CausalConv.cache_from_state(state)
    assert set(cache) == {"frames", "offset", "started"}
    y, _ = decoding.apply({**variables, "cache": cache}, x[:, 5:], mutable=["cache"])
    np.testing.assert_array_equal(bits(y), bits(y1))
    with pytest.raises(ValueError, match=r"initial_state and return_final_state are for the full pass"):
        decoding.apply({**variables, "cache": cache}, x[:, 5:], initial_state=state, mutable=["cache"])


def test_nnx_full_pass_states_with_batch_dims():
    x = random(7, (2,) + VIDEO)
    layer = mk_nnx.CausalConv(2, 3, (3, 3, 3), rngs=nnx.Rngs(1))
    y0, state = layer(x[:, :, :4], return_final_state=True)
    assert state.frames.shape == (2, 2, 4, 3, 2)  # the batch dims flattened
    y1 = layer(x[:, :, 4:], initial_state=state)
    layer.init_cache(state=state)
    np.testing.assert_array_equal(bits(layer(x[:, :, 4:], decode=True)), bits(y1))
    assert_close(jnp.concatenate([y0, y1], axis=2), layer(x), F32, 27 * 2, scale(x, layer.kernel[...]))
    with pytest.raises(ValueError, match=r"init_cache\(state=...\) adopts the state as it is: pass state alone"):
        layer.init_cache(x.shape, state=state)
    with pytest.raises(TypeError, match=r"state must be a CausalConvState.*got dict"):
        layer.init_cache(state={"frames": state.frames})


def test_equinox_full_pass_states():
    eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install '.[equinox]'")
    from maskconv_kernels import equinox as mk_eqx

    x = jnp.moveaxis(random(8, VIDEO)[0], -1, 0)  # (C, T, H, W), one example
    layer, fresh = eqx.nn.make_with_state(mk_eqx.CausalConv)(3, 2, 3, 3, stream=True, spatial_shape=(4, 3),
                                                             key=jax.random.key(0))
    y0, state = layer(x[:, :5], return_final_state=True)
    y1 = layer(x[:, 5:], initial_state=state)
    streamed = fresh.set(layer.state_index, state)  # adopted into the layer's eqx.nn.State
    y_stream, _ = layer(x[:, 5:], streamed)
    np.testing.assert_array_equal(bits(y_stream), bits(y1))
    assert_close(jnp.concatenate([y0, y1], axis=1), layer(x), F32, 27 * 2, scale(x, layer.weight))
    with pytest.raises(ValueError, match=r"pass an eqx.nn.State .* or initial_state / return_final_state"):
        layer(x, fresh, return_final_state=True)


# --------------------------------------------------------------------------- friction 5: padding="CAUSAL"

def test_causal_padding_on_a_1d_layer_is_the_layer():
    x, k = random(9, (2, 11, 3), F32), random(10, (4, 3, 5), F32)
    np.testing.assert_array_equal(bits(mk.causal_conv(x, k, padding="CAUSAL")), bits(mk.causal_conv(x, k)))
    layer = CausalConv(5, 4, padding="CAUSAL")
    variables = layer.init(jax.random.key(0), x)
    np.testing.assert_array_equal(bits(layer.apply(variables, x)), bits(CausalConv(5, 4).apply(variables, x)))
    nnx_layer = mk_nnx.CausalConv(3, 5, 4, padding="causal", rngs=nnx.Rngs(0))
    assert nnx_layer(x).shape == (2, 11, 5)


def test_causal_padding_with_other_axes_names_the_fix():
    match = r"padding='CAUSAL' is nn.Conv's padding of a 1-D convolution's time axis.*other 2 spatial axes.*'SAME'"
    with pytest.raises(ValueError, match=match):
        mk.causal_conv(random(11, VIDEO), random(12, KERNEL), padding="CAUSAL")
    layer = mk_nnx.CausalConv(2, 3, (3, 3, 3), padding="CAUSAL", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        layer(random(11, VIDEO))
