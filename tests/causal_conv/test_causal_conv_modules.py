"""``CausalConv`` as a Flax linen, Flax nnx and Equinox module.

What the modules promise: the parameters of the framework's ``Conv`` of the same kernel
size (the same key draws the same values, and a ``Conv`` that was made causal by padding
its input by hand loads and gives its outputs, both within the float64 oracle's bound);
streams (linen's and nnx's ``"cache"``, Equinox's ``eqx.nn.State``) whose chunks,
concatenated, are the module's full pass: bit for bit for video layers on ``"xla"``
(where docs/causal_conv.md says XLA:CPU gives that), within the bound for 1-D audio;
packed clips; the stream's chunk-length error; the docs' Modules section runs as written.

Cheap on purpose: every video layer has one kernel shape per framework, so the
frameworks' random initialisers (a compilation per shape) run once; the other layers
take NumPy initialisers.
"""
from __future__ import annotations

import io
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.causal import bits, scale
from support.harness import PLATFORM
from support.numerics import assert_close, random

from maskconv_kernels.flax import CausalConv
from maskconv_kernels.flax import nnx as mk_nnx
from maskconv_kernels.ops.causal_conv import causal_conv_reference

F32 = np.dtype(np.float32)
# docs/causal_conv.md: "xla" streams video layers (3x3x3 and (3, 1, 1), strides 1 and 2,
# zeros and replicate) bit for bit on XLA:CPU, observed in how it blocks them; a GPU's
# GEMMs choose their blocking from the chunk's shape, and there the bound holds.
VIDEO_BIT_FOR_BIT = PLATFORM == "cpu"
PAD_MODES = {"zeros": "constant", "replicate": "edge"}  # jnp.pad's mode for the frames before frame 0
WAN = ((0, 1), (1, 5), (5, 9))  # Wan's chunks: 1 + 4 + 4 frames
VIDEO = (1, 9, 4, 3, 2)  # (N, T, H, W, C_in), for a 3x3x3 layer to 3 channels: kernel (3, 3, 3, 2, 3)
VIDEO_REDUCTION = 27 * 2 + 1  # taps x C_in, and the bias


def _equinox():
    eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install '.[equinox]'")
    from maskconv_kernels import equinox as mk_eqx

    return eqx, mk_eqx


def _numpy_init(seed, scale=0.5):
    """A Flax initialiser drawing NumPy normals: no random program to compile per shape."""
    return lambda key, shape, dtype=jnp.float32: random(seed, shape, dtype, scale)


def _causally_padded(x, context, padding_mode, time_axis=1):
    """``x`` with ``context`` frames before frame 0 (zeros or copies of it): what a non-causal conv reads."""
    pads = [(0, 0)] * x.ndim
    pads[time_axis] = (context, 0)
    return jnp.pad(x, pads, mode=PAD_MODES[padding_mode])


def _check_stream(streamed, full, expected, exact, reduction, bound_scale):
    """Concatenated chunks against the full pass: bit for bit where ``exact``, else both within the bound."""
    assert streamed.shape == full.shape
    if exact:
        np.testing.assert_array_equal(bits(streamed), bits(full))
    else:
        assert_close(streamed, expected, F32, reduction, bound_scale)
    assert_close(full, expected, F32, reduction, bound_scale)


# --------------------------------------------------------------------------- the Conv's checkpoint


@pytest.mark.parametrize("padding_mode", ["zeros", "replicate"])
def test_linen_holds_nn_conv_params_and_gives_its_outputs_on_the_padded_input(padding_mode):
    """Video, time stride 2: nn.Conv with time padding (0, 0) on x led by 2 frames of zeros or frame 0."""
    x = random(0, VIDEO)
    ours = CausalConv(3, (3, 3, 3), strides=(2, 1, 1), padding_mode=padding_mode)
    theirs = nn.Conv(3, (3, 3, 3), strides=(2, 1, 1), padding=((0, 0), (1, 1), (1, 1)))
    variables = theirs.init(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, ours.init(jax.random.key(0), x), variables)
    variables = jax.tree.map(lambda a: a + 0.25, variables)  # a nonzero bias, as a trained checkpoint has
    kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
    expected = causal_conv_reference(x, kernel, bias, strides=(2, 1, 1), padding_mode=padding_mode)
    bound_scale = scale(x, kernel) + 0.25
    assert_close(ours.apply(variables, x), expected, F32, VIDEO_REDUCTION, bound_scale)
    padded = _causally_padded(x, 2, padding_mode)
    assert_close(theirs.apply(variables, padded), expected, F32, VIDEO_REDUCTION, bound_scale)


def test_nnx_loads_nnx_conv_state_time_dilated():
    """Time dilation 2: 4 frames of context."""
    x = random(1, VIDEO)
    kw = dict(kernel_dilation=(2, 1, 1))
    theirs = nnx.Conv(2, 3, (3, 3, 3), padding=((0, 0), (1, 1), (1, 1)), rngs=nnx.Rngs(0), **kw)
    same_key = mk_nnx.CausalConv(2, 3, (3, 3, 3), rngs=nnx.Rngs(0), **kw)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(same_key, nnx.Param), nnx.state(theirs, nnx.Param))
    theirs.bias[...] = random(2, (3,), scale=0.5)
    ours = mk_nnx.CausalConv(2, 3, (3, 3, 3), rngs=nnx.Rngs(1), **kw)
    nnx.update(ours, nnx.state(theirs))
    kernel, bias = theirs.kernel[...], theirs.bias[...]
    expected = causal_conv_reference(x, kernel, bias, dilation=(2, 1, 1))
    bound_scale = scale(x, kernel) + 0.5
    assert_close(ours(x), expected, F32, VIDEO_REDUCTION, bound_scale)
    assert_close(theirs(_causally_padded(x, 4, "zeros")), expected, F32, VIDEO_REDUCTION, bound_scale)


# The Equinox video layer: (C_in, T, H, W) = (4, 9, 4, 3) to 6 channels, window (2, 3, 3), 2 groups.
EQX_ARGS, EQX_X = (3, 4, 6, (2, 3, 3)), (4, 9, 4, 3)
EQX_REDUCTION = 18 * 2 + 1


def _eqx_expected(x, weight, bias, **kw):
    """The float64 oracle for Equinox's layout: x ``(C_in, T, *spatial)``, weight ``(O, I, *window)``."""
    kernel = jnp.moveaxis(weight, (0, 1), (-1, -2))  # (*window, I, O)
    y = causal_conv_reference(jnp.moveaxis(x, 0, -1)[None], kernel, bias.reshape(-1), feature_group_count=2, **kw)
    return np.moveaxis(y[0], -1, 0), scale(x, kernel) + float(jnp.abs(bias).max())


@pytest.mark.slow  # test_equinox.py's serialised round trip is the fast tier's
def test_equinox_loads_a_serialised_eqx_conv():
    """Replicate (Equinox's spelling): ``eqx.tree_serialise_leaves`` of an eqx.nn.Conv read into the stream layer."""
    eqx, mk_eqx = _equinox()
    x = random(3, EQX_X)
    theirs = eqx.nn.Conv(*EQX_ARGS, padding=((0, 0), (1, 1), (1, 1)), groups=2, key=jax.random.key(0))
    same_key = mk_eqx.CausalConv(*EQX_ARGS, groups=2, padding_mode="REPLICATE", key=jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.leaves(same_key), jax.tree.leaves(theirs))
    theirs = eqx.tree_at(lambda m: m.bias, theirs, random(4, (6, 1, 1, 1), scale=0.5))
    ours, _ = eqx.nn.make_with_state(mk_eqx.CausalConv)(
        *EQX_ARGS, groups=2, padding_mode="replicate", stream=True, spatial_shape=(4, 3), key=jax.random.key(1))
    saved = io.BytesIO()
    eqx.tree_serialise_leaves(saved, theirs)
    saved.seek(0)
    ours = eqx.tree_deserialise_leaves(saved, ours)
    expected, bound_scale = _eqx_expected(x, theirs.weight, theirs.bias, padding_mode="replicate")
    assert_close(ours(x), expected, F32, EQX_REDUCTION, bound_scale)
    assert_close(theirs(_causally_padded(x, 1, "replicate")), expected, F32, EQX_REDUCTION, bound_scale)


# --------------------------------------------------------------------------- streams


def test_linen_decode_streams_wan_chunks_bit_for_bit():
    """Wan's 1 + 4 + 4 frames through a 3x3x3, time stride 2, replicate layer, each chunk a jitted apply."""
    x = random(5, VIDEO)
    layer = CausalConv(3, (3, 3, 3), strides=(2, 1, 1), padding_mode="replicate", implementation="xla", decode=True)
    variables = layer.init(jax.random.key(1), x[:, :1])
    assert jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), variables["cache"]) == {
        "frames": ((1, 2, 4, 3, 2), F32), "offset": ((), np.dtype(np.int32)), "started": ((), np.dtype(bool))}
    params = {"params": jax.tree.map(lambda a: a + 0.25, variables["params"])}
    full = layer.clone(decode=False).apply(params, x)
    step = jax.jit(lambda cache, chunk: layer.apply({**params, "cache": cache}, chunk, mutable=["cache"]))
    cache, ys = variables["cache"], []
    for start, stop in WAN:
        y, mutated = step(cache, x[:, start:stop])
        cache = mutated["cache"]
        ys.append(y)
    kernel, bias = params["params"]["kernel"], params["params"]["bias"]
    expected = causal_conv_reference(x, kernel, bias, strides=(2, 1, 1), padding_mode="replicate")
    _check_stream(jnp.concatenate(ys, axis=1), full, expected, VIDEO_BIT_FOR_BIT, VIDEO_REDUCTION,
                  scale(x, kernel) + 0.25)
    np.testing.assert_array_equal(bits(cache["frames"]), bits(x[:, 7:]))
    with pytest.raises(ValueError, match=r"causal_conv_stream: after the first chunk every chunk needs a multiple of "
                                         r"strides\[0\] = 2 frames .* got 3 frames"):
        layer.apply({**params, "cache": cache}, x[:, :3], mutable=["cache"])  # eager: the state is concrete


def test_nnx_decode_streams_a_video_layer_bit_for_bit_with_batch_dims():
    """Stride 1, 3x3x3, zeros; inputs with two batch dims (flattened into the state's N = 2 * 1)."""
    x = random(6, (2, *VIDEO))
    layer = mk_nnx.CausalConv(2, 3, (3, 3, 3), implementation="xla", rngs=nnx.Rngs(2))
    layer.bias[...] = random(7, (3,), scale=0.5)
    full = layer(x)
    with pytest.raises(ValueError, match=r"decode cache not initialized: call init_cache"):
        layer(x[:, :, :1], decode=True)
    layer.init_cache(x.shape)
    assert layer.frames.shape == (2, 2, 4, 3, 2) and layer.segment_ids is None
    ys = [layer(x[:, :, start:stop], decode=True) for start, stop in WAN]
    kernel = layer.kernel[...]
    expected = causal_conv_reference(x.reshape(2, *VIDEO[1:]), kernel, layer.bias[...]).reshape(full.shape)
    _check_stream(jnp.concatenate(ys, axis=2), full, expected, VIDEO_BIT_FOR_BIT, VIDEO_REDUCTION,
                  scale(x, kernel) + 0.5)


def test_linen_decode_streams_an_audio_layer_within_the_bound():
    """1-D audio, k 4, time stride 2: docs/causal_conv.md gives xla's 1-D streams the bound, not bits."""
    x = random(8, (2, 9, 3))
    layer = CausalConv(5, 4, strides=2, implementation="xla", kernel_init=_numpy_init(9), bias_init=_numpy_init(10),
                       decode=True)
    variables = layer.init(jax.random.key(0), x)
    assert variables["cache"]["frames"].shape == (2, 3, 3)
    full = layer.clone(decode=False).apply(variables, x)
    cache, ys = variables["cache"], []
    for start, stop in WAN:
        y, mutated = layer.apply({**variables, "cache": cache}, x[:, start:stop], mutable=["cache"])
        cache = mutated["cache"]
        ys.append(y)
    kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
    expected = causal_conv_reference(x, kernel, bias, strides=2)
    _check_stream(jnp.concatenate(ys, axis=1), full, expected, False, 4 * 3 + 1,
                  scale(x, kernel) + float(jnp.abs(bias).max()))


def test_equinox_streams_a_video_layer_bit_for_bit():
    """Wan's chunks through ``(x_chunk, state) -> (y_chunk, state)``, then the errors of a stream."""
    eqx, mk_eqx = _equinox()
    x = random(11, EQX_X)
    layer, state = eqx.nn.make_with_state(mk_eqx.CausalConv)(
        *EQX_ARGS, groups=2, stream=True, spatial_shape=(4, 3), implementation="xla", key=jax.random.key(0))
    layer = eqx.tree_at(lambda m: m.bias, layer, random(12, (6, 1, 1, 1), scale=0.5))
    assert layer.is_stateful() and len(jax.tree.leaves(layer)) == 2  # weight and bias: eqx.nn.Conv's leaves
    ys = []
    for start, stop in WAN:
        y, state = layer(x[:, start:stop], state)
        ys.append(y)
    expected, bound_scale = _eqx_expected(x, layer.weight, layer.bias)
    _check_stream(jnp.concatenate(ys, axis=1), layer(x), expected, VIDEO_BIT_FOR_BIT, EQX_REDUCTION, bound_scale)
    plain = mk_eqx.CausalConv(*EQX_ARGS, groups=2, key=jax.random.key(0))
    assert not plain.is_stateful()
    with pytest.raises(ValueError, match=r"holds no stream state: build it with stream=True"):
        plain(x, state)
    with pytest.raises(ValueError, match=r"stream=True needs spatial_shape, the chunks' 2 non-time spatial sizes"):
        mk_eqx.CausalConv(*EQX_ARGS, stream=True, key=jax.random.key(0))


def test_equinox_chunk_length_error_in_a_strided_stream():
    eqx, mk_eqx = _equinox()
    x = random(13, EQX_X)
    layer, state = eqx.nn.make_with_state(mk_eqx.CausalConv)(
        *EQX_ARGS, stride=(2, 1, 1), groups=2, stream=True, spatial_shape=(4, 3), key=jax.random.key(0))
    _, state = layer(x[:, :1], state)
    with pytest.raises(ValueError, match=r"causal_conv_stream: after the first chunk every chunk needs a multiple of "
                                         r"strides\[0\] = 2 frames .* got 3 frames"):
        layer(x[:, 1:4], state)


# --------------------------------------------------------------------------- packed clips


def _clips(shape):
    """Two clips and a padding tail along time (axis 1): ids ``(N, T, *spatial)``."""
    ids = np.zeros(shape, np.int32)
    ids[:, 4:] = 1
    ids[:, 8:] = -1
    return jnp.asarray(ids)


@pytest.mark.slow  # Equinox's packed clips are the fast tier's
def test_linen_and_nnx_pack_clips_in_the_full_pass_and_the_stream():
    x = random(14, (2, 10, 4, 2))
    ids = _clips(x.shape[:-1])
    inits = dict(kernel_init=_numpy_init(15), bias_init=_numpy_init(16))
    linen = CausalConv(3, (3, 3), implementation="xla", **inits)
    variables = linen.init(jax.random.key(0), x)
    kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
    expected = causal_conv_reference(x, kernel, bias, segment_ids=ids)
    reduction, bound_scale = 9 * 2 + 1, scale(x, kernel) + float(jnp.abs(bias).max())
    packed = linen.apply(variables, x, ids)
    assert_close(packed, expected, F32, reduction, bound_scale)
    assert not np.asarray(packed[:, 8:]).any()  # padding frames: zero, not the bias
    layer = mk_nnx.CausalConv(2, 3, (3, 3), implementation="xla", rngs=nnx.Rngs(0), **inits)
    layer.init_cache(x.shape, segmented=True)
    assert layer.segment_ids.shape == (2, 2, 4)
    chunks = ((0, 1), (1, 5), (5, 10))  # the second clip starts inside a chunk
    streamed = jnp.concatenate([layer(x[:, a:b], ids[:, a:b], decode=True) for a, b in chunks], axis=1)
    assert_close(streamed, expected, F32, reduction, bound_scale)
    with pytest.raises(ValueError, match=r"segment_ids must be given with every chunk of a stream or with none"):
        layer(x[:, :2], decode=True)


def test_equinox_packs_clips():
    _, mk_eqx = _equinox()
    x = random(17, EQX_X)
    ids = _clips((1, *EQX_X[1:]))[0]
    layer = mk_eqx.CausalConv(*EQX_ARGS, groups=2, implementation="xla", key=jax.random.key(0))
    expected, bound_scale = _eqx_expected(x, layer.weight, layer.bias, segment_ids=ids[None])
    assert_close(layer(x, segment_ids=ids), expected, F32, EQX_REDUCTION, bound_scale)
    with pytest.raises(ValueError, match=r"segment_ids take padding_mode='zeros'"):
        mk_eqx.CausalConv(*EQX_ARGS, groups=2, padding_mode="replicate", key=jax.random.key(0))(x, segment_ids=ids)


# --------------------------------------------------------------------------- the docs


@pytest.mark.slow  # three frameworks' random initialisers, compiled for the page's shapes
def test_the_docs_modules_section_runs():
    """docs/causal_conv.md's "Modules" examples, as a reader would paste them (each block on its own)."""
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "causal_conv.md").read_text()
    section = page.split("### Modules (Flax, Equinox)")[1].split("\n### ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    for block in blocks:
        if "equinox" in block:
            _equinox()
        exec(compile(block, "docs/causal_conv.md", "exec"), {})
