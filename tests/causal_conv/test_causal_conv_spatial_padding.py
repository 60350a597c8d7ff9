"""``spatial_padding_mode``: the axes after time padded with copies of each frame's pixels (issue 48, friction 6).

LTX-2's decoder (``LTX2VideoCausalConv3d(spatial_padding_mode="reflect")``) reflects its
spatial axes and repeats frame 0 as its time padding. Checked here, for ``"reflect"``,
``"replicate"`` and ``"circular"``:

* the definition, against ``jnp.pad`` of time then of the other axes (``mode=...``) and
  ``lax.conv_general_dilated`` with ``VALID``, all in float64; in float32 against the
  float64 oracle (:func:`causal_conv_reference`, which gathers the copied pixel by index);
* exactness along time: NaN or inf from a frame on changes no earlier output bit, and the
  gradient of earlier outputs into those frames is exactly 0.0 (a copy is a pixel of the
  same frame);
* streams equal the full pass within the documented bound, their state holding the frames
  unpadded (``causal_conv_stream_init`` and the modules' caches take the unpadded shape);
* the modules (linen, nnx, Equinox) compute the function's values;
* the errors name the fix.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from support.causal import bits, scale
from support.numerics import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels.flax import CausalConv
from maskconv_kernels.flax import nnx as mk_nnx
from maskconv_kernels.ops.causal_conv import (
    SPATIAL_PADDING_MODES, causal_conv_reference, causal_conv_stream_init, causal_conv_transpose_reference,
)

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
MODES = [m for m in SPATIAL_PADDING_MODES if m != "zeros"]
NUMPY = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}

# name: (x shape, window, C_out, keywords). Awkward sizes on purpose: a pad as wide as the
# frame (reflect then mirrors again, as jnp.pad does), strides and dilations on the other axes.
LAYERS = {
    "video_T7_5x4_k333": ((2, 7, 5, 4, 3), (3, 3, 3), 4, {}),
    "video_T9_4x6_k333_s2_replicate": ((1, 9, 4, 6, 2), (3, 3, 3), 3, dict(strides=(2, 1, 1), padding_mode="replicate")),
    "spec_T8_F6_k2x3_d1x2_pairs": ((2, 8, 6, 2), (2, 3), 3, dict(padding=((3, 1),), dilation=(1, 2))),
    "spec_T6_F5_k3x3_s1x2_groups2": ((1, 6, 5, 4), (3, 3), 4, dict(strides=(1, 2), feature_group_count=2)),
    "video_T5_3x3_k255_pad_2": ((1, 5, 3, 3, 2), (2, 5, 5), 2, dict(padding_mode="replicate")),
    "spec_T4_F2_k1x3_pad_3": ((1, 4, 2, 2), (1, 3), 2, dict(padding=((3, 0),))),
}


def _kernel_shape(x_shape, window, c_out, kw):
    return (*window, x_shape[-1] // kw.get("feature_group_count", 1), c_out)


def _inputs(seed, name, dtype=F32):
    x_shape, window, c_out, kw = LAYERS[name]
    x = random(seed, x_shape, dtype)
    k = random(seed + 1, _kernel_shape(x_shape, window, c_out, kw), dtype, scale=0.5)
    b = random(seed + 2, (c_out,), dtype, scale=0.5)
    return x, k, b, kw


def _reduction(k) -> int:
    return int(np.prod(k.shape[:-1])) + 1


def _padded_lax_conv(x, k, b, mode, *, strides=1, dilation=1, padding="SAME", padding_mode="zeros",
                     feature_group_count=1):
    """What a port writes today: ``jnp.pad`` of time (zeros or frame 0), of the other axes by
    ``mode``, then ``lax.conv_general_dilated`` with ``VALID`` (float64 in, float64 out)."""
    ndim = x.ndim - 2
    window = k.shape[:-2]
    strides = (strides,) * ndim if isinstance(strides, int) else tuple(strides)
    dilation = (dilation,) * ndim if isinstance(dilation, int) else tuple(dilation)
    if isinstance(padding, str):
        effective = [d * (w - 1) + 1 for d, w in zip(dilation[1:], window[1:])]
        pads = lax.padtype_to_pads(x.shape[2:-1], effective, strides[1:], padding)
    else:
        pads = list(padding)
    context = (window[0] - 1) * dilation[0]
    x = jnp.pad(x, [(0, 0), (context, 0)] + [(0, 0)] * ndim, mode="edge" if padding_mode == "replicate" else "constant")
    x = jnp.pad(x, [(0, 0), (0, 0), *pads, (0, 0)], mode=NUMPY[mode])
    spatial = "DHW"[-ndim:]
    y = lax.conv_general_dilated(x, k, strides, "VALID", rhs_dilation=dilation, feature_group_count=feature_group_count,
                                 dimension_numbers=(f"N{spatial}C", f"{spatial}IO", f"N{spatial}C"),
                                 precision=lax.Precision.HIGHEST)
    return y + b


# --------------------------------------------------------------------------- the definition

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LAYERS))
def test_matches_jnp_pad_and_lax_conv_in_float64(name, mode):
    x, k, b, kw = _inputs(0, name)
    with jax.enable_x64(True):
        x, k, b = (jnp.asarray(a, jnp.float64) for a in (x, k, b))
        y = mk.causal_conv(x, k, b, spatial_padding_mode=mode, **kw)
        expected = _padded_lax_conv(x, k, b, mode, **kw)
        assert y.dtype == jnp.float64 and y.shape == expected.shape
        assert_close(y, expected, F64, _reduction(k), scale(x, k) + 0.5)
        oracle = causal_conv_reference(x, k, b, spatial_padding_mode=mode, **kw)
        assert_close(oracle, expected, F64, _reduction(k), scale(x, k) + 0.5)


@pytest.mark.parametrize("mode", MODES)
def test_float32_and_channels_first_against_the_oracle(mode):
    x, k, b, kw = _inputs(1, "video_T9_4x6_k333_s2_replicate")
    expected = causal_conv_reference(x, k, b, spatial_padding_mode=mode, **kw)
    y = mk.causal_conv(x, k, b, spatial_padding_mode=mode, **kw)
    assert_close(y, expected, F32, _reduction(k), scale(x, k) + 0.5)
    dn = ("NCDHW", "OIDHW", "NCDHW")
    y_cf = mk.causal_conv(jnp.moveaxis(x, -1, 1), jnp.transpose(k, (4, 3, 0, 1, 2)), b, dimension_numbers=dn,
                          spatial_padding_mode=mode, **kw)
    np.testing.assert_array_equal(bits(jnp.moveaxis(y_cf, 1, -1)), bits(y))


@pytest.mark.parametrize("mode", MODES)
def test_zeros_is_the_default_and_a_layer_without_padding_copies_nothing(mode):
    x, k, b, kw = _inputs(2, "video_T7_5x4_k333")
    np.testing.assert_array_equal(bits(mk.causal_conv(x, k, b, spatial_padding_mode="zeros")),
                                  bits(mk.causal_conv(x, k, b)))
    assert (np.asarray(mk.causal_conv(x, k, b, spatial_padding_mode=mode))
            != np.asarray(mk.causal_conv(x, k, b))).any()  # the border differs from zeros
    np.testing.assert_array_equal(bits(mk.causal_conv(x, k, b, padding="VALID", spatial_padding_mode=mode)),
                                  bits(mk.causal_conv(x, k, b, padding="VALID")))
    audio = random(3, (2, 9, 3))  # no other axis: the mode has nothing to pad
    np.testing.assert_array_equal(bits(mk.causal_conv(audio, k[:, 1, 1], spatial_padding_mode=mode)),
                                  bits(mk.causal_conv(audio, k[:, 1, 1])))


@pytest.mark.parametrize("mode", MODES)
def test_transposed_matches_the_oracle_and_streams(mode):
    x = random(4, (1, 5, 6, 2))
    k, b = random(5, (3, 3, 2, 3), scale=0.5), random(6, (3,), scale=0.5)
    kw = dict(strides=2, spatial_padding_mode=mode, padding_mode="replicate")
    y = mk.causal_conv_transpose(x, k, b, **kw)
    expected = causal_conv_transpose_reference(x, k, b, **kw)
    assert_close(y, expected, F32, 2 * 3 + 1, scale(x, k) + 0.5)
    ys, state = [], None
    for chunk in (x[:, :2], x[:, 2:3], x[:, 3:]):
        y_chunk, state = mk.causal_conv_transpose_stream(chunk, state, k, b, **kw)
        ys.append(y_chunk)
    assert state.frames.shape == (1, 1, 6, 2)  # unpadded
    assert_close(jnp.concatenate(ys, axis=1), expected, F32, 2 * 3 + 1, scale(x, k) + 0.5)


# --------------------------------------------------------------------------- exactness along time

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["video_T7_5x4_k333", "video_T9_4x6_k333_s2_replicate", "spec_T8_F6_k2x3_d1x2_pairs"])
def test_later_frames_never_reach_earlier_outputs(name, mode):
    x, k, b, kw = _inputs(7, name)
    kw = dict(kw, spatial_padding_mode=mode)
    s = kw.get("strides", (1,))[0]
    cut = x.shape[1] // 2
    seen = (cut - 1) // s + 1  # outputs t with t * s < cut read frames before the cut only
    clean = mk.causal_conv(x, k, b, **kw)
    for value in (np.nan, np.inf):
        poisoned = mk.causal_conv(x.at[:, cut:].set(value), k, b, **kw)
        np.testing.assert_array_equal(bits(poisoned[:, :seen]), bits(clean[:, :seen]))
        assert not np.isfinite(np.asarray(poisoned[:, seen:])).all()  # the poison is there to be kept out
    cotangent = random(8, clean[:, :seen].shape)
    dx = np.asarray(jax.grad(lambda x: (mk.causal_conv(x, k, b, **kw)[:, :seen] * cotangent).sum())(x))
    assert (dx[:, cut:] == 0.0).all() and np.isfinite(dx).all()
    # The border's copies carry gradient back to the pixels they copy: the float64 reference's.
    with jax.enable_x64(True):
        x64, k64, b64, c64 = (jnp.asarray(a, jnp.float64) for a in (x, k, b, cotangent))
        dx64 = jax.grad(lambda x: (_padded_lax_conv(x, k64, b64, mode, **LAYERS[name][3])[:, :seen] * c64).sum())(x64)
    assert_close(dx, dx64, F32, k.shape[-1] * int(np.prod(k.shape[:-2])), float(np.abs(cotangent).max() * np.abs(k).max()))


@pytest.mark.parametrize("mode", MODES)
def test_nan_in_a_later_frame_of_a_stream_never_reaches_an_earlier_chunk(mode):
    """The stream pads each chunk's frames (and its history's) by themselves: a NaN chunk after
    clean ones changes none of their outputs, and the state it leaves holds no padding."""
    x, k, b, kw = _inputs(9, "video_T9_4x6_k333_s2_replicate")
    kw = dict(kw, spatial_padding_mode=mode)
    y0, state = mk.causal_conv_stream(x[:, :5], None, k, b, **kw)
    y1, _ = mk.causal_conv_stream(jnp.full_like(x[:, 5:], jnp.nan), state, k, b, **kw)
    np.testing.assert_array_equal(bits(y0), bits(mk.causal_conv(x[:, :5], k, b, **kw)))
    assert np.isnan(np.asarray(y1)).all()


# --------------------------------------------------------------------------- streams

def _stream(x, chunks, k, b, state=None, **kw):
    ys, start = [], 0
    for length in chunks:
        y, state = mk.causal_conv_stream(x[:, start:start + length], state, k, b, **kw)
        ys.append(y)
        start += length
    return jnp.concatenate(ys, axis=1), state


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, schedules", [
    ("video_T9_4x6_k333_s2_replicate", ([1, 4, 4], [1, 2, 2, 2, 2], [3, 6])),  # Wan's and LTX's 1 + 4k
    ("video_T7_5x4_k333", ([1, 3, 3], [1] * 7, [4, 3])),
    ("spec_T8_F6_k2x3_d1x2_pairs", ([1, 7], [2, 2, 2, 2])),
], ids=["video_s2_replicate", "video", "spec_dilated_pairs"])
def test_a_stream_equals_the_full_pass(name, schedules, mode):
    """Within twice the dtype's bound (docs/causal_conv.md: two XLA programs, each within the
    bound of the float64 result); the state holds the last frames as they were given."""
    x, k, b, kw = _inputs(10, name)
    kw = dict(kw, spatial_padding_mode=mode)
    full = mk.causal_conv(x, k, b, **kw)
    expected = causal_conv_reference(x, k, b, **kw)
    context = (k.shape[0] - 1) * kw.get("dilation", (1,))[0]
    for chunks in schedules:
        streamed, state = _stream(x, chunks, k, b, **kw)
        assert streamed.shape == full.shape
        assert_close(streamed, expected, F32, _reduction(k), scale(x, k) + 0.5)
        assert_close(streamed, full, F32, _reduction(k), 2 * (scale(x, k) + 0.5))
        np.testing.assert_array_equal(bits(state.frames), bits(x[:, x.shape[1] - context:]))


@pytest.mark.parametrize("mode", MODES)
def test_init_takes_the_unpadded_chunk_and_adopts_a_cache_of_unpadded_frames(mode):
    x, k, b, kw = _inputs(11, "video_T7_5x4_k333")
    kw = dict(kw, spatial_padding_mode=mode)
    fresh = causal_conv_stream_init(jax.ShapeDtypeStruct((2, 1, 5, 4, 3), x.dtype), k, **kw)
    assert fresh.frames.shape == (2, 2, 5, 4, 3)
    y_fresh, _ = mk.causal_conv_stream(x[:, :3], fresh, k, b, **kw)
    np.testing.assert_array_equal(bits(y_fresh), bits(mk.causal_conv_stream(x[:, :3], None, k, b, **kw)[0]))
    _, left = mk.causal_conv_stream(x[:, :3], None, k, b, **kw)
    adopted = causal_conv_stream_init(x[:, 3:], k, frames=x[:, 1:3], **kw)  # a port's cache of the last two frames
    np.testing.assert_array_equal(bits(mk.causal_conv_stream(x[:, 3:], adopted, k, b, **kw)[0]),
                                  bits(mk.causal_conv_stream(x[:, 3:], left, k, b, **kw)[0]))


# --------------------------------------------------------------------------- modules

@pytest.mark.parametrize("mode", MODES)
def test_the_modules_compute_the_function_and_cache_unpadded_frames(mode):
    x = random(12, (1, 9, 4, 6, 2))
    kw = dict(strides=(2, 1, 1), padding_mode="replicate", spatial_padding_mode=mode)

    linen = CausalConv(3, (3, 3, 3), **kw)
    variables = linen.init(jax.random.key(0), x)
    kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
    expected = mk.causal_conv(x, kernel, bias, **kw)
    np.testing.assert_array_equal(bits(linen.apply(variables, x)), bits(expected))
    decoding = linen.clone(decode=True)
    cache = decoding.init(jax.random.key(0), x[:, :1])["cache"]
    assert cache["frames"].shape == (1, 2, 4, 6, 2)
    ys = []
    for chunk in (x[:, :1], x[:, 1:5], x[:, 5:]):
        y, mutated = decoding.apply({**variables, "cache": cache}, chunk, mutable=["cache"])
        cache = mutated["cache"]
        ys.append(y)
    assert_close(jnp.concatenate(ys, axis=1), expected, F32, 2 * 27, 2 * scale(x, kernel))

    layer = mk_nnx.CausalConv(2, 3, (3, 3, 3), rngs=nnx.Rngs(0), **kw)
    layer.kernel[...], layer.bias[...] = kernel, bias
    np.testing.assert_array_equal(bits(layer(x)), bits(expected))
    layer.init_cache(x.shape)
    assert layer.frames.shape == (1, 2, 4, 6, 2)
    streamed = jnp.concatenate([layer(c, decode=True) for c in (x[:, :1], x[:, 1:5], x[:, 5:])], axis=1)
    assert_close(streamed, expected, F32, 2 * 27, 2 * scale(x, kernel))


@pytest.mark.parametrize("mode", ["REFLECT", "circular"])
def test_equinox_takes_the_mode_in_its_spelling(mode):
    eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install '.[equinox]'")
    from maskconv_kernels import equinox as mk_eqx

    layer, state = eqx.nn.make_with_state(mk_eqx.CausalConv)(3, 2, 3, 3, padding_mode="REPLICATE",
                                                             spatial_padding_mode=mode, stream=True,
                                                             spatial_shape=(4, 6), key=jax.random.key(0))
    assert layer.spatial_padding_mode == mode.lower()
    x = jnp.moveaxis(random(13, (1, 9, 4, 6, 2))[0], -1, 0)  # (C, T, H, W)
    expected = mk.causal_conv(x[None], layer.weight, layer.bias.reshape(-1), padding_mode="replicate",
                              spatial_padding_mode=mode.lower(), dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))[0]
    np.testing.assert_array_equal(bits(layer(x)), bits(expected))
    ys = []
    for chunk in (x[:, :1], x[:, 1:5], x[:, 5:]):
        y, state = layer(chunk, state)
        ys.append(y)
    assert_close(jnp.concatenate(ys, axis=1), expected, F32, 2 * 27, 2 * scale(x, layer.weight))


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("mode, match", [
    ("edge", r"spatial_padding_mode pads the axes after time.*got 'edge' \(jnp.pad's 'edge' is 'replicate'"),
    ("REFLECT", r"got 'REFLECT': the modes are lower-case, 'reflect'"),
    ("symmetric", r"'zeros' \(the default\), 'reflect', 'replicate' or 'circular'.*got 'symmetric'"),
], ids=["edge", "upper", "symmetric"])
def test_an_unknown_mode_names_the_ones_there_are(mode, match):
    x, k, b, kw = _inputs(14, "video_T7_5x4_k333")
    with pytest.raises(ValueError, match=f"causal_conv: .*{match}"):
        mk.causal_conv(x, k, spatial_padding_mode=mode)
    with pytest.raises(ValueError, match=f"causal_conv_stream: .*{match}"):
        mk.causal_conv_stream(x, None, k, spatial_padding_mode=mode)


def test_clips_and_crops_are_refused_with_the_fix():
    x, k, b, kw = _inputs(15, "video_T7_5x4_k333")
    ids = jnp.zeros(x.shape[:-1], jnp.int32)
    with pytest.raises(ValueError, match=r"causal_conv: segment_ids take spatial_padding_mode='zeros', got 'reflect'.*"
                                         r"run the clips one by one"):
        mk.causal_conv(x, k, segment_ids=ids, spatial_padding_mode="reflect")
    with pytest.raises(ValueError, match=r"spatial_padding_mode='circular' pads with copies.*negative pad.*crop x first"):
        mk.causal_conv(x, k, padding=((1, -1), (1, 1)), spatial_padding_mode="circular")
    # A window of one pixel pads nothing: clips take any mode there.
    k1 = k[:, 1:2, 1:2]
    np.testing.assert_array_equal(bits(mk.causal_conv(x, k1, segment_ids=ids, spatial_padding_mode="reflect")),
                                  bits(mk.causal_conv(x, k1, segment_ids=ids)))
