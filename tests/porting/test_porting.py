"""The Porting page's recipes (docs/porting.md) against faithful re-implementations of the layers they replace.

* MaxText's gated DeltaNet conv (:class:`support.maxtext.MaxTextShortConv`): gradients, and NaN
  in another packed document (values, the state and decoding: tests/flax/test_short_conv_ports.py);
* MaxText's Engram conv (:class:`support.maxtext.MaxTextEngramConv`): values, gradients,
  decoding, NaN in another packed document;
* Wan's causal conv3d (:class:`support.wan.WanCausalConv`): values, gradients, the stream from
  Wan's ``feat_cache``, NaN in another clip packed along time;
* Wan's resample layers' time convolutions (:class:`support.wan.WanTimeDownsample`,
  :class:`support.wan.WanTimeUpsample`), with the page's own recipe functions (its blocks run
  here): values and streams in Wan's schedules, gradients, NaN in later frames;
* LTX-2's causal conv3d (:class:`support.ltx2.LTX2CausalConv`): values, gradients, the stream,
  NaN in later frames.

Where the original packs documents or clips in one row, it is shown to leak (the NaN is put
where it reaches the original's outputs), so the port's clean outputs are a result, not a
given. Tolerances: :func:`support.numerics.assert_close`'s, from the dtype and the reduction.
"""
from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.causal import bits, scale
from support.ltx2 import LTX2CausalConv
from support.maxtext import MaxTextEngramConv, MaxTextShortConv, maxtext_segment_ids
from support.numerics import assert_close, random
from support.snippets import python_blocks
from support.wan import WanCausalConv, WanTimeDownsample, WanTimeUpsample, run_chunks

from maskconv_kernels.flax import nnx as mk_nnx
from maskconv_kernels.ops.causal_conv import causal_conv_stream_init

F32, BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "porting.md"
RECIPES = ("wan_downsample_time", "wan_downsample_time_stream", "wan_upsample_time", "wan_upsample_time_stream")


def _page_recipes() -> dict:
    """The page's recipe functions as written there: the imports and definitions of the blocks that
    define them (their demonstrations run in the docs' snippet tests)."""
    found = {}
    for _, code in python_blocks(PAGE):
        if any(f"def {name}(" in code for name in RECIPES):
            tree = ast.parse(code)
            tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))]
            namespace = {}
            exec(compile(tree, str(PAGE), "exec"), namespace)  # noqa: S102 - the page's own code
            found.update({name: namespace[name] for name in RECIPES if name in namespace})
    assert set(found) == set(RECIPES), f"the page defines {sorted(found)}, not {RECIPES}"
    return found


@pytest.fixture(scope="module")
def recipes():
    return _page_recipes()


def _two_documents(first: int, total: int, rows: int = 2):
    """MaxText's ids for rows of two documents: ``first`` tokens, then the rest."""
    return jnp.stack([maxtext_segment_ids([first, total - first], total)] * rows)


def _cotangent(out):
    return random(99, out.shape)


def _grads(call, layer, x):
    """``(dx, d_layer)`` of ``sum(call(layer, x) * cotangent)``: the layer's gradients as an ``nnx.State``."""
    cotangent = _cotangent(jax.eval_shape(lambda x: call(layer, x), x))
    return nnx.grad(lambda m, x: (call(m, x).astype(jnp.float32) * cotangent).sum(), argnums=(0, 1))(layer, x)[::-1]


def _fn_grads(f, x, kernel):
    """``(dx, dkernel)`` of ``sum(f(x, kernel) * cotangent)`` for a function of arrays (the page's recipes)."""
    cotangent = _cotangent(jax.eval_shape(f, x, kernel))
    return jax.grad(lambda x, k: (f(x, k).astype(jnp.float32) * cotangent).sum(), argnums=(0, 1))(x, kernel)


# --------------------------------------------------------------------------- MaxText: gated DeltaNet

def test_deltanet_gradients_match_maxtexts():
    D, K = 32, 4
    original = MaxTextShortConv(D, K, jnp.float32, rngs=nnx.Rngs(0))
    port = mk_nnx.ShortConv.from_conv(original.conv1d, activation="silu", padding_id=0)
    x = random(0, (2, 16, D))
    kernel = original.conv1d.kernel[...]  # (K, 1, D): the port's weight is its (K, D)
    assert_close(port(x), original(x), F32, K, scale(x, kernel))
    dx, d_port = _grads(lambda m, x: m(x), port, x)
    dx0, d_original = _grads(lambda m, x: m(x), original, x)
    assert_close(dx, dx0, F32, K, float(np.abs(kernel).max()) * 4)
    assert_close(d_port["weight"][...], d_original["conv1d"]["kernel"][...][:, 0, :], F32, 2 * 16,
                 float(np.abs(x).max()) * 4)


def test_deltanet_nan_in_another_document_reaches_nothing():
    D, K, L = 32, 4, 16
    original = MaxTextShortConv(D, K, rngs=nnx.Rngs(1))
    port = mk_nnx.ShortConv.from_conv(original.conv1d, activation="silu", padding_id=0)
    x, ids = random(1, (2, L, D), BF16), _two_documents(6, L)
    poisoned = x.at[:, :6].set(jnp.nan)
    leaked = np.isnan(np.asarray(original(poisoned)[:, 6:], np.float32))
    assert leaked.sum() == 2 * (K - 1) * D  # the original: the next document's first K - 1 tokens
    y = port(poisoned, ids)
    assert not np.isnan(np.asarray(y[:, 6:], np.float32)).any()
    np.testing.assert_array_equal(bits(y[:, 6:]), bits(original(x[:, 6:])))  # document 2 as if alone


# --------------------------------------------------------------------------- MaxText: Engram

def _engram():
    original = MaxTextEngramConv(8, kernel_size=4, dilation=3, hc_mult=2, rngs=nnx.Rngs(2))
    return original, mk_nnx.ShortConv.from_conv(original.conv, activation="silu", padding_id=0)


def _engram_port(original, port, x, ids=None):
    """The original layer with the port in place of ``act_fn(conv(x_flat))``."""
    return port(original.normed(x), ids).reshape(x.shape)


def test_engram_values_gradients_and_decoding():
    original, port = _engram()
    x = random(3, (2, 20, 2, 8))
    reduction = 4 + 1
    assert_close(_engram_port(original, port, x), original(x), F32, reduction, 4.0)

    dx, d_port = _grads(lambda m, x: _engram_port(original, m, x), port, x)
    dx0, d_original = _grads(lambda m, x: m(x), original, x)
    assert_close(dx, dx0, F32, 4 * 16, 8.0)  # through the norms: each input feeds 4 taps x 16 channels
    assert_close(d_port["weight"][...], d_original["conv"]["kernel"][...][:, 0, :], F32, 2 * 20, 8.0)

    port.init_cache((2, 20, 16))
    normed = original.normed(x)
    steps = [port(normed[:, t:t + 5], decode=True) for t in range(0, 20, 5)]  # prefill in chunks of 5
    assert_close(jnp.concatenate(steps, axis=1).reshape(x.shape), original(x), F32, reduction, 4.0)
    assert port.conv_state.shape == (2, 9, 16)  # (K - 1) * dilation inputs


def test_engram_nan_in_another_document_reaches_nothing():
    original, port = _engram()
    x, ids = random(4, (2, 24, 2, 8)), _two_documents(10, 24)
    poisoned = x.at[:, :10].set(jnp.nan)
    leaked = np.isnan(np.asarray(original(poisoned)[:, 10:]))
    assert leaked.sum() == 2 * 9 * 16  # the dilated window reaches 9 tokens back, into document 1
    y = _engram_port(original, port, poisoned, ids)
    assert not np.isnan(np.asarray(y[:, 10:])).any()
    assert_close(y[:, 10:], original(x[:, 10:]), F32, 5, 4.0)  # document 2 as if alone


# --------------------------------------------------------------------------- Wan: causal conv3d

def _wan(c_in=3, c_out=4, seed=5):
    wan = WanCausalConv(c_in, c_out, rngs=nnx.Rngs(seed))
    wan.conv.bias[...] = random(seed, (c_out,), scale=0.5)
    port = mk_nnx.CausalConv(c_in, c_out, (3, 3, 3), rngs=nnx.Rngs(seed + 1))
    port.kernel[...], port.bias[...] = wan.conv.kernel[...], wan.conv.bias[...]
    return wan, port


def test_wan_conv_values_gradients_and_stream_from_its_cache():
    wan, port = _wan()
    x = random(6, (1, 9, 5, 4, 3))
    kernel, bias = wan.conv.kernel[...], wan.conv.bias[...]
    bound = (27 * 3 + 1, scale(x, kernel) + 0.5)
    assert_close(port(x), wan(x), F32, *bound)

    dx, d_port = _grads(lambda m, x: m(x), port, x)
    dx0, d_wan = _grads(lambda m, x: m(x), wan, x)
    assert_close(dx, dx0, F32, 27 * 4, 4 * float(np.abs(kernel).max()))
    assert_close(d_port["kernel"][...], d_wan["conv"]["kernel"][...], F32, 9 * 5 * 4, 4 * float(np.abs(x).max()))
    assert_close(d_port["bias"][...], d_wan["conv"]["bias"][...], F32, 9 * 5 * 4, 4.0)

    expected, _ = wan.decode([x[:, :1], x[:, 1:5], x[:, 5:]])  # Wan's 1 + 4 + 4, with its feat_cache
    port.init_cache(x.shape)
    head = port(x[:, :1], decode=True)
    feat_cache = WanCausalConv.next_cache(x[:, 1:5], WanCausalConv.next_cache(x[:, :1]))
    port.init_cache(state=causal_conv_stream_init(x[:, 5:], kernel, frames=feat_cache))  # adopted mid-stream
    tail = port(x[:, 5:], decode=True)
    assert_close(head, expected[:, :1], F32, *bound)
    assert_close(tail, expected[:, 5:], F32, *bound)


def test_wan_conv_nan_in_another_packed_clip_reaches_nothing():
    wan, port = _wan(seed=7)
    x = random(8, (1, 10, 5, 4, 3))
    clips = jnp.asarray(np.broadcast_to(np.repeat([0, 1], 5)[None, :, None, None], x.shape[:-1]).astype(np.int32))
    poisoned = x.at[:, :5].set(jnp.nan)
    leaked = np.isnan(np.asarray(wan(poisoned)[:, 5:]))
    assert leaked.sum() == 2 * 5 * 4 * 4  # the original: clip 1's first two frames read clip 0's last
    y = port(poisoned, clips)
    assert not np.isnan(np.asarray(y[:, 5:])).any()
    assert_close(y[:, 5:], wan(x[:, 5:]), F32, 27 * 3 + 1, scale(x, port.kernel[...]) + 0.5)


# --------------------------------------------------------------------------- Wan: resample's time convolutions

def _schedule(x, lengths):
    starts = np.cumsum([0, *lengths])
    return [x[:, a:b] for a, b in zip(starts[:-1], starts[1:])]


def _stream(step, chunks, kernel, bias):
    ys, state = [], None
    for chunk in chunks:
        y, state = step(chunk, state, kernel, bias)
        ys.append(y)
    return jnp.concatenate(ys, axis=1)


def _wan_case(wan, seed: int, x_shape, lengths):
    """``(kernel, bias, x, chunks, expected)`` of one of Wan's time resamplers: its bias
    drawn nonzero (``seed``), ``x`` (``seed + 1``) in chunks of ``lengths`` frames, and the
    module's own outputs on them."""
    conv = wan.time_conv.conv
    conv.bias[...] = random(seed, conv.bias[...].shape, scale=0.5)
    x = random(seed + 1, x_shape)
    chunks = _schedule(x, lengths)
    expected, _ = run_chunks(wan, chunks)
    return conv.kernel[...], conv.bias[...], x, chunks, expected


@pytest.mark.parametrize("lengths", [(1, 4, 4), (1, 2, 2, 2, 2), (3, 2, 4)], ids=["1+4+4", "1+2x4", "3+2+4"])
def test_wan_downsample_recipe(recipes, lengths):
    wan = WanTimeDownsample(4, rngs=nnx.Rngs(9))
    kernel, bias, x, chunks, expected = _wan_case(wan, 9, (2, 9, 3, 4, 4), lengths)
    bound = (3 * 4 + 1, scale(x, kernel) + 0.5)
    assert_close(_stream(recipes["wan_downsample_time_stream"], chunks, kernel, bias), expected, F32, *bound)
    if lengths[0] != 1:
        return  # the whole-clip recipe is Wan's encoder's: a first chunk of one frame
    full = recipes["wan_downsample_time"](x, kernel, bias)
    assert_close(full, expected, F32, *bound)
    np.testing.assert_array_equal(bits(full[:, 0]), bits(x[:, 0]))  # frame 0 passes unconvolved

    dx, dk = _fn_grads(lambda x, k: recipes["wan_downsample_time"](x, k, bias), x, kernel)
    dx0, d_wan = _grads(lambda m, x: run_chunks(m, _schedule(x, lengths))[0], wan, x)
    assert_close(dx, dx0, F32, 3 * 4 + 1, 4 * float(np.abs(kernel).max()) + 4)
    assert_close(dk, d_wan["time_conv"]["conv"]["kernel"][...], F32, 2 * 4 * 3 * 4, 4 * float(np.abs(x).max()))

    cut = 5  # NaN from frame 5 on: outputs 0 to 2 read frames up to 4
    poisoned = recipes["wan_downsample_time"](x.at[:, cut:].set(jnp.nan), kernel, bias)
    np.testing.assert_array_equal(bits(poisoned[:, :3]), bits(full[:, :3]))
    assert np.isnan(np.asarray(poisoned[:, 3:])).all()


@pytest.mark.parametrize("lengths", [(1,) * 6, (1, 2, 3), (1, 5)], ids=["decoder", "1+2+3", "1+5"])
def test_wan_upsample_recipe(recipes, lengths):
    wan = WanTimeUpsample(3, rngs=nnx.Rngs(11))
    kernel, bias, x, chunks, expected = _wan_case(wan, 11, (2, 6, 3, 4, 3), lengths)
    assert expected.shape[1] == 1 + 2 * 5
    bound = (3 * 3 + 1, scale(x, kernel) + 0.5)
    assert_close(_stream(recipes["wan_upsample_time_stream"], chunks, kernel, bias), expected, F32, *bound)
    full = recipes["wan_upsample_time"](x, kernel, bias)
    assert_close(full, expected, F32, *bound)
    np.testing.assert_array_equal(bits(full[:, 0]), bits(x[:, 0]))  # the first chunk skips the convolution

    dx, dk = _fn_grads(lambda x, k: recipes["wan_upsample_time"](x, k, bias), x, kernel)
    dx0, d_wan = _grads(lambda m, x: run_chunks(m, _schedule(x, lengths))[0], wan, x)
    assert_close(dx, dx0, F32, 3 * 6 + 1, 4 * float(np.abs(kernel).max()) + 4)
    assert_close(dk, d_wan["time_conv"]["conv"]["kernel"][...], F32, 2 * 5 * 3 * 4, 4 * float(np.abs(x).max()))

    poisoned = recipes["wan_upsample_time"](x.at[:, 3:].set(jnp.nan), kernel, bias)
    np.testing.assert_array_equal(bits(poisoned[:, :5]), bits(full[:, :5]))  # frames 0, then 1 and 2 doubled
    assert np.isnan(np.asarray(poisoned[:, 5:])).all()


# --------------------------------------------------------------------------- LTX-2: causal conv3d

def _ltx2(stride=1, seed=13):
    original = LTX2CausalConv(3, 4, 3, stride=stride, spatial_padding_mode="reflect", rngs=nnx.Rngs(seed))
    original.conv.bias[...] = random(seed, (4,), scale=0.5)
    port = mk_nnx.CausalConv(3, 4, (3, 3, 3), strides=stride, padding=1, padding_mode="replicate",
                             spatial_padding_mode="reflect", kernel_init=nnx.initializers.xavier_uniform(),
                             rngs=nnx.Rngs(seed))
    assert (np.asarray(port.kernel[...]) == np.asarray(original.conv.kernel[...])).all()  # the same draw
    port.bias[...] = original.conv.bias[...]
    return original, port


@pytest.mark.parametrize("stride", [1, 2], ids=["s1", "s2"])
def test_ltx2_values_gradients_and_stream(stride):
    original, port = _ltx2(stride)
    x = random(14, (1, 9, 6, 5, 3))
    kernel = original.conv.kernel[...]
    bound = (27 * 3 + 1, scale(x, kernel) + 0.5)
    y = port(x)
    assert y.shape == original(x).shape
    assert_close(y, original(x), F32, *bound)

    dx, d_port = _grads(lambda m, x: m(x), port, x)
    dx0, d_original = _grads(lambda m, x: m(x), original, x)
    assert_close(dx, dx0, F32, 27 * 4 * 3, 4 * float(np.abs(kernel).max()))
    assert_close(d_port["kernel"][...], d_original["conv"]["kernel"][...], F32, 9 * 6 * 5, 4 * float(np.abs(x).max()))

    port.init_cache(x.shape)  # the chunks' own shape: no padded frames are kept
    assert port.frames.shape == (1, 2, 6, 5, 3)
    chunks = [port(c, decode=True) for c in _schedule(x, (1, 4, 4))]
    assert_close(jnp.concatenate(chunks, axis=1), original(x), F32, *bound)


def test_ltx2_nan_in_later_frames_reaches_no_earlier_output():
    original, port = _ltx2()
    x = random(15, (1, 9, 6, 5, 3))
    clean = port(x)
    poisoned = port(x.at[:, 4:].set(jnp.nan))
    np.testing.assert_array_equal(bits(poisoned[:, :4]), bits(clean[:, :4]))
    assert np.isnan(np.asarray(poisoned[:, 4:])).all()
    cotangent = random(16, clean[:, :4].shape)
    dx = jax.grad(lambda x: (port(x)[:, :4] * cotangent).sum())(x)
    assert (np.asarray(dx[:, 4:]) == 0.0).all() and np.abs(np.asarray(dx[:, :4])).max() > 0
