"""Decode caches: step-by-step outputs equal the full ``masked_conv`` at every position.

Each test runs a layer or a stack one position at a time inside ``lax.scan`` (the
position traced), from caches filled with NaN (a slot read before it is written, or a
masked tap read, would show), and compares every position's output with one full
forward pass. Tolerances come from the dtype and the reduction length
(``conftest.TOLERANCE``), as everywhere in the suite.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import TOLERANCE, assert_close, random
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import decode


def nan_cache(spec, batch, c_in, dtype=jnp.float32):
    return jnp.full((batch, *spec.cache_spatial, c_in), jnp.nan, dtype)


def full(x, kernel, mask, **kw):
    return mk.masked_conv(x, kernel, mask, implementation="xla", **kw)


# --------------------------------------------------------------------------- one layer, pixel steps

PIXEL_CASES = {
    "7x7A": (mk.pixelcnn_mask((7, 7), "A"), {}),
    "3x3B": (mk.pixelcnn_mask((3, 3), "B"), {}),
    "5x5B_dil2": (mk.pixelcnn_mask((5, 5), "B"), {"dilation": 2}),
    "hstack_1x5A": (mk.horizontal_stack_mask((1, 5), "A"), {}),
    "vstack_3x5A": (mk.vertical_stack_mask((3, 5), "A"), {}),
    "3x3B_groups2": (mk.pixelcnn_mask((3, 3), "B"), {"feature_group_count": 2}),
}
# The fast tier: the largest mask and a dilation; the slow tier adds the rest.
FAST_PIXEL_CASES = {"7x7A", "5x5B_dil2"}


@pytest.mark.parametrize(
    "name", tiered(sorted(PIXEL_CASES), lambda n: n in FAST_PIXEL_CASES)
)
def test_pixel_steps_equal_the_full_layer_at_every_position(name):
    mask, kw = PIXEL_CASES[name]
    n, h, w, c_in, c_out = 2, 5, 7, 4, 6
    groups = kw.get("feature_group_count", 1)
    x = random(0, (n, h, w, c_in))
    kernel = random(1, (*mask.shape, c_in // groups, c_out))
    spec = decode.make_decode_spec(mask, (h, w), **kw)
    expected = full(x, kernel, mask, **kw)

    def body(cache, p):
        y, cache = decode.step(spec, cache, x.reshape(n, h * w, c_in)[:, p], kernel, p)
        return cache, y

    _, ys = jax.lax.scan(body, nan_cache(spec, n, c_in), jnp.arange(h * w))
    got = jnp.moveaxis(ys, 0, 1).reshape(n, h, w, c_out)
    assert_close(got, expected, np.float32, int(mask.sum()) * c_in // groups, 1.0)


def test_cache_is_sized_from_the_active_taps():
    # 7x7 type A: three rows above plus the current row, of the image's width.
    assert decode.make_decode_spec(mk.pixelcnn_mask((7, 7), "A"), (28, 28)).cache_spatial == (4, 28)
    # A horizontal stack reads the current row only.
    assert decode.make_decode_spec(mk.horizontal_stack_mask((1, 5), "B"), (8, 8)).cache_spatial == (1, 8)
    # 1-D: (k - 1) * dilation + 1 steps.
    for d in (1, 2, 512):
        assert decode.make_decode_spec(np.ones(2, bool), (4096,), padding="CAUSAL", dilation=d).cache_spatial == (d + 1,)
    assert decode.make_decode_spec(np.ones(3, bool), (64,), padding="CAUSAL", dilation=8).cache_spatial == (17,)
    # A mask that drops the oldest tap needs a shorter buffer.
    assert decode.make_decode_spec(np.array([0, 1, 1], bool), (64,), padding="CAUSAL", dilation=4).cache_spatial == (5,)


# --------------------------------------------------------------------------- one layer, row steps


@pytest.mark.parametrize("mask_type", ["A", "B"])
def test_row_steps_equal_the_full_layer(mask_type):
    mask = mk.vertical_stack_mask((5, 3), mask_type)
    n, h, w, c_in, c_out = 2, 6, 5, 4, 6
    shift = 1 if mask_type == "A" else 0
    x = random(2, (n, h, w, c_in))
    kernel = random(3, (5, 3, c_in, c_out))
    spec = decode.make_decode_spec(mask, (h, w), unit="row", shift=shift)
    expected = full(x, kernel, mask)
    # Type A: at row r the newest input row is r - 1 (the row just completed).
    rows = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], 1) if shift else x

    def body(cache, r):
        y, cache = decode.step(spec, cache, rows[:, r], kernel, r)
        return cache, y

    _, ys = jax.lax.scan(body, nan_cache(spec, n, c_in), jnp.arange(h))
    assert_close(jnp.moveaxis(ys, 0, 1), expected, np.float32, int(mask.sum()) * c_in, 1.0)


# --------------------------------------------------------------------------- stacks


def _pixelcnn_params(c, layers):
    kernels = [random(10, (7, 7, 1, c), scale=0.3)]
    kernels += [random(11 + i, (3, 3, c, c), scale=0.3) for i in range(layers - 1)]
    return kernels


def _pixelcnn_full(x, kernels):
    """7x7 type A, then 3x3 type B layers with ReLU between."""
    y = full(x, kernels[0], mk.pixelcnn_mask((7, 7), "A"))
    for k in kernels[1:]:
        y = full(jax.nn.relu(y), k, mk.pixelcnn_mask((3, 3), "B"))
    return y


def test_pixelcnn_stack_decodes_to_the_full_forward_at_every_position():
    n, h, w, c = 2, 6, 9, 8
    kernels = _pixelcnn_params(c, 3)
    x = random(4, (n, h, w, 1))
    expected = _pixelcnn_full(x, kernels)
    first = decode.make_decode_spec(mk.pixelcnn_mask((7, 7), "A"), (h, w), shift=1)
    rest = decode.make_decode_spec(mk.pixelcnn_mask((3, 3), "B"), (h, w))
    flat = x.reshape(n, h * w, 1)
    # Sampling's order: at step p the newest pixel is p - 1 (zeros at p = 0, never read).
    previous = jnp.concatenate([jnp.zeros_like(flat[:, :1]), flat[:, :-1]], 1)

    def body(caches, p):
        y, c0 = decode.step(first, caches[0], previous[:, p], kernels[0], p)
        new = [c0]
        for cache, k in zip(caches[1:], kernels[1:]):
            y, cache = decode.step(rest, cache, jax.nn.relu(y), k, p)
            new.append(cache)
        return new, y

    caches = [nan_cache(first, n, 1)] + [nan_cache(rest, n, c) for _ in kernels[1:]]
    _, ys = jax.lax.scan(body, caches, jnp.arange(h * w))
    got = np.asarray(jnp.moveaxis(ys, 0, 1).reshape(n, h, w, c))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=TOLERANCE[np.dtype("float32")] * np.abs(expected).max())


def _gated_params(f, layers):
    p = {}
    for i in range(layers):
        k = 5 if i == 0 else 3
        c_in = 1 if i == 0 else f
        p[f"v{i}"] = random(20 + i, (k, k, c_in, 2 * f), scale=0.3)
        p[f"h{i}"] = random(40 + i, (1, k, c_in, 2 * f), scale=0.3)
        p[f"v_to_h{i}"] = random(60 + i, (2 * f, 2 * f), scale=0.3)
        p[f"h_out{i}"] = random(80 + i, (f, f), scale=0.3)
    return p


def _gate(a):
    value, gate = jnp.split(a, 2, axis=-1)
    return jnp.tanh(value) * jax.nn.sigmoid(gate)


def _masks(i):
    k = 5 if i == 0 else 3
    t = "A" if i == 0 else "B"
    return mk.vertical_stack_mask((k, k), t), mk.horizontal_stack_mask((1, k), t)


def _gated_full(x, p, layers):
    """The example's gated PixelCNN (vertical-to-horizontal link at the same position)."""
    v = h = x
    for i in range(layers):
        vm, hm = _masks(i)
        v_pre = full(v, p[f"v{i}"], vm)
        h_pre = full(h, p[f"h{i}"], hm) + v_pre @ p[f"v_to_h{i}"]
        v = _gate(v_pre)
        h_out = _gate(h_pre) @ p[f"h_out{i}"]
        h = h_out if i == 0 else h + h_out
    return h


def _gated_decode(x, p, layers):
    """Rows for the vertical stack (once per row), pixels for the horizontal stack."""
    n, hh, ww, _ = x.shape
    vspecs, hspecs = [], []
    for i in range(layers):
        vm, hm = _masks(i)
        vspecs.append(decode.make_decode_spec(vm, (hh, ww), unit="row", shift=int(i == 0)))
        hspecs.append(decode.make_decode_spec(hm, (hh, ww), shift=int(i == 0)))
    flat = x.reshape(n, hh * ww, 1)
    previous = jnp.concatenate([jnp.zeros_like(flat[:, :1]), flat[:, :-1]], 1)
    previous_row = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], 1)

    def pixel(carry, j, r, v_pres):
        hcaches = carry
        pos = r * ww + j
        h = previous[:, pos]
        new = []
        for i in range(layers):
            h_pre, cache = decode.step(hspecs[i], hcaches[i], h, p[f"h{i}"], pos)
            h_pre = h_pre + v_pres[i][:, j] @ p[f"v_to_h{i}"]
            h_out = _gate(h_pre) @ p[f"h_out{i}"]
            h = h_out if i == 0 else h + h_out
            new.append(cache)
        return new, h

    def row(carry, r):
        vcaches, hcaches = carry
        v = previous_row[:, r]
        v_pres, new_v = [], []
        for i in range(layers):
            v_pre, cache = decode.step(vspecs[i], vcaches[i], v, p[f"v{i}"], r)
            v = _gate(v_pre)
            v_pres.append(v_pre)
            new_v.append(cache)
        hcaches, hs = jax.lax.scan(lambda c, j: pixel(c, j, r, v_pres), hcaches, jnp.arange(ww))
        return (new_v, hcaches), hs

    f = p["h_out0"].shape[-1]
    vcaches = [nan_cache(s, n, 1 if i == 0 else f) for i, s in enumerate(vspecs)]
    hcaches = [nan_cache(s, n, 1 if i == 0 else f) for i, s in enumerate(hspecs)]
    _, hs = jax.lax.scan(row, (vcaches, hcaches), jnp.arange(hh))  # (H, W, N, f)
    return jnp.transpose(hs, (2, 0, 1, 3))


def test_gated_stack_decodes_to_the_full_forward_at_every_position():
    n, h, w, f, layers = 2, 7, 6, 8, 3
    p = _gated_params(f, layers)
    x = random(5, (n, h, w, 1))
    expected = np.asarray(_gated_full(x, p, layers))
    got = np.asarray(jax.jit(_gated_decode, static_argnums=2)(x, p, layers))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=TOLERANCE[np.dtype("float32")] * np.abs(expected).max())


@pytest.mark.slow
def test_gated_decode_ignores_the_future():
    """A NaN at and after each pixel leaves that pixel's decoded output unchanged (exactly)."""
    n, h, w, f, layers = 1, 5, 5, 4, 2
    p = _gated_params(f, layers)
    x = random(6, (n, h, w, 1))
    decoded = jax.jit(_gated_decode, static_argnums=2)
    clean = np.asarray(decoded(x, p, layers))
    for pos in (0, 7, 12, 24):
        future = (np.arange(h * w) >= pos).reshape(1, h, w, 1)
        out = np.asarray(decoded(jnp.where(future, jnp.nan, x), p, layers))
        np.testing.assert_array_equal(out.reshape(n, h * w, f)[:, : pos + 1], clean.reshape(n, h * w, f)[:, : pos + 1])


# --------------------------------------------------------------------------- 1-D (WaveNet)


def _wavenet_params(c, dilations):
    return [
        (random(100 + i, (2, c, 2 * c), scale=0.4), random(200 + i, (c, c), scale=0.4)) for i in range(len(dilations))
    ]


def _wavenet_full(x, params, dilations):
    """Residual gated layers, kernel 2, causal padding, the given dilations."""
    h = x
    for (k, res), d in zip(params, dilations):
        h = h + _gate(full(h, k, np.ones(2, bool), padding="CAUSAL", dilation=d)) @ res
    return h


def _wavenet_decode(x, params, dilations, positions):
    """``positions``: ``(steps, N)`` per-sequence positions (negative: not started)."""
    n, _, c = x.shape
    specs = [decode.make_decode_spec(np.ones(2, bool), (x.shape[1],), padding="CAUSAL", dilation=d) for d in dilations]

    def body(caches, pos):
        h = x[jnp.arange(n), jnp.maximum(pos, 0)]
        new = []
        for (k, res), spec, cache in zip(params, specs, caches):
            y, cache = decode.step(spec, cache, h, k, pos)
            h = h + _gate(y) @ res
            new.append(cache)
        return new, h

    caches = [nan_cache(s, n, c) for s in specs]
    return jax.lax.scan(body, caches, positions)[1]  # (steps, N, C)


def _check_wavenet(dilations, length, c=4):
    params = _wavenet_params(c, dilations)
    x = random(7, (2, length, c))
    expected = np.asarray(_wavenet_full(x, params, dilations))
    steps = jnp.broadcast_to(jnp.arange(length)[:, None], (length, 2))
    got = np.moveaxis(np.asarray(jax.jit(_wavenet_decode, static_argnums=2)(x, params, dilations, steps)), 0, 1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=TOLERANCE[np.dtype("float32")] * np.abs(expected).max())


def test_dilated_stack_decodes_to_the_full_forward():
    _check_wavenet((1, 2, 4, 8, 16, 32), 100)


@pytest.mark.slow
def test_wavenet_dilations_up_to_512_decode_to_the_full_forward():
    _check_wavenet(tuple(2**i for i in range(10)), 1100)


def test_per_sequence_positions_like_cache_seqlens():
    """Two sequences in one batch, the second started 5 steps later (continuous batching)."""
    dilations, length, c, late = (1, 2, 4, 8), 40, 4, 5
    params = _wavenet_params(c, dilations)
    x = random(8, (2, length, c))
    expected = np.asarray(_wavenet_full(x, params, dilations))
    steps = np.arange(length + late)
    positions = jnp.asarray(np.stack([np.minimum(steps, length - 1), steps - late], 1))
    got = np.asarray(jax.jit(_wavenet_decode, static_argnums=2)(x, params, dilations, positions))
    tol = dict(rtol=1e-5, atol=TOLERANCE[np.dtype("float32")] * np.abs(expected).max())
    np.testing.assert_allclose(got[:length, 0], expected[0], **tol)
    np.testing.assert_allclose(got[late:, 1], expected[1], **tol)


@pytest.mark.parametrize("unit", ["pixel", pytest.param("row", marks=pytest.mark.slow)])
def test_per_example_positions_in_2d(unit):
    """The second image starts 3 steps later: per-example positions, pixel and row steps."""
    mask = mk.pixelcnn_mask((3, 3), "B") if unit == "pixel" else mk.vertical_stack_mask((3, 3), "B")
    n, h, w, c_in, c_out, late = 2, 4, 5, 3, 4, 3
    x = random(12, (n, h, w, c_in))
    kernel = random(13, (3, 3, c_in, c_out))
    spec = decode.make_decode_spec(mask, (h, w), unit=unit)
    expected = np.asarray(full(x, kernel, mask))
    steps = h * w if unit == "pixel" else h
    seq = x.reshape(n, h * w, c_in) if unit == "pixel" else x  # (N, steps, ...)
    positions = np.stack([np.minimum(np.arange(steps + late), steps - 1), np.arange(steps + late) - late], 1)

    def body(cache, pos):
        xs = seq[jnp.arange(n), jnp.maximum(pos, 0)]
        y, cache = decode.step(spec, cache, xs, kernel, pos)
        return cache, y

    _, ys = jax.lax.scan(body, nan_cache(spec, n, c_in), jnp.asarray(positions))
    ys = np.asarray(ys)  # (steps + late, N, c_out) or (steps + late, N, W, c_out)
    got = [ys[:steps, 0], ys[late:, 1]]
    for b in range(n):
        assert_close(got[b].reshape(h, w, c_out), expected[b], np.float32, int(mask.sum()) * c_in, 1.0)


# --------------------------------------------------------------------------- sub-pixel steps (R/G/B)


def _sub_pixel_scan(spec, kernel, inputs, n, c_in, bias=None, per_example=False):
    """Sub-steps ``s = p * G + j`` over a whole image; ``inputs[:, s]`` is what step ``s`` is given."""

    def body(cache, s):
        position = jnp.full((n,), s) if per_example else s  # per-example: the gather/scatter path
        y, cache = decode.step(spec, cache, inputs[:, s], kernel, position, bias=bias)
        return cache, y

    _, ys = jax.lax.scan(body, nan_cache(spec, n, c_in), jnp.arange(inputs.shape[1]))
    return jnp.moveaxis(ys, 0, 1)  # (N, H * W * G, C_out // G)


@pytest.mark.parametrize(
    "mask_type, per_example",
    [
        ("B", False),  # the fast tier: type A runs in the stack test below
        pytest.param("A", False, marks=pytest.mark.slow),
        pytest.param("A", True, marks=pytest.mark.slow),
        pytest.param("B", True, marks=pytest.mark.slow),
    ],
    ids=["B_one_position", "A_one_position", "A_per_example", "B_per_example"],
)
def test_sub_pixel_steps_equal_the_full_channel_grouped_layer(mask_type, per_example):
    n, h, w, c_in, c_out, g = 2, 4, 5, 6, 9, 3
    mask = mk.channel_grouped_mask((5, 5), c_in, c_out, mask_type)
    x = random(14, (n, h, w, c_in))
    kernel = random(15, (5, 5, c_in, c_out))
    bias = random(16, (c_out,))
    expected = full(x, kernel, mask) + bias
    spec = decode.make_decode_spec(mask, (h, w), channel_groups=g)
    inputs = x.reshape(n, h * w * g, c_in // g)  # sub-step s: channel group s % G of pixel s // G
    got = _sub_pixel_scan(spec, kernel, inputs, n, c_in, bias, per_example).reshape(n, h, w, c_out)
    assert_close(got, expected, np.float32, 25 * c_in, 2.0)


@pytest.mark.slow  # a stack of the sub-pixel layers the fast tier decodes one at a time
def test_sub_pixel_stack_type_a_then_b():
    """The original PixelCNN's R/G/B stack: the first layer is given the previous sub-sample."""
    n, h, w, c, g = 2, 4, 4, 6, 3
    m1, m2 = mk.channel_grouped_mask((5, 5), 3, c, "A"), mk.channel_grouped_mask((3, 3), c, c, "B")
    k1, k2 = random(17, (5, 5, 3, c), scale=0.3), random(18, (3, 3, c, c), scale=0.3)
    x = random(19, (n, h, w, 3))
    expected = np.asarray(full(jax.nn.relu(full(x, k1, m1)), k2, m2))
    s1 = decode.make_decode_spec(m1, (h, w), channel_groups=g, shift=1)
    s2 = decode.make_decode_spec(m2, (h, w), channel_groups=g)
    sub = x.reshape(n, h * w * g, 1)
    previous = jnp.concatenate([jnp.zeros_like(sub[:, :1]), sub[:, :-1]], 1)

    def body(caches, s):
        y, c1 = decode.step(s1, caches[0], previous[:, s], k1, s)
        y, c2 = decode.step(s2, caches[1], jax.nn.relu(y), k2, s)
        return (c1, c2), y

    _, ys = jax.lax.scan(body, (nan_cache(s1, n, 3), nan_cache(s2, n, c)), jnp.arange(h * w * g))
    got = np.asarray(jnp.moveaxis(ys, 0, 1).reshape(n, h, w, c))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=TOLERANCE[np.dtype("float32")] * np.abs(expected).max())


def test_sub_pixel_errors():
    mask = mk.channel_grouped_mask((3, 3), 3, 6, "B")
    with pytest.raises(ValueError, match="sub-step"):
        decode.make_decode_spec(mask, (8, 8), channel_groups=3, shift=1)  # type B reads the group it is given
    with pytest.raises(NotImplementedError, match="unit='pixel'"):
        decode.make_decode_spec(mask, (8, 8), channel_groups=3, unit="row")
    with pytest.raises(ValueError, match="must divide"):
        decode.make_decode_spec(mask, (8, 8), channel_groups=4)


# --------------------------------------------------------------------------- dtypes, tracing, errors


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_pixel_steps_in_16_bit_dtypes(dtype):
    mask = mk.pixelcnn_mask((5, 5), "B")
    n, h, w, c_in, c_out = 2, 4, 5, 8, 8
    x = random(9, (n, h, w, c_in), dtype)
    kernel = random(10, (5, 5, c_in, c_out), dtype)
    spec = decode.make_decode_spec(mask, (h, w))
    expected = full(x, kernel, mask)

    def body(cache, p):
        y, cache = decode.step(spec, cache, x.reshape(n, h * w, c_in)[:, p], kernel, p)
        return cache, y

    _, ys = jax.lax.scan(body, nan_cache(spec, n, c_in, dtype), jnp.arange(h * w))
    got = jnp.moveaxis(ys, 0, 1).reshape(n, h, w, c_out)
    assert got.dtype == dtype
    assert_close(got, expected, dtype, int(mask.sum()) * c_in, 1.0)


def test_one_trace_for_every_position():
    spec = decode.make_decode_spec(mk.pixelcnn_mask((3, 3), "B"), (4, 4))
    kernel = random(11, (3, 3, 2, 2))
    traces = []

    @jax.jit
    def f(cache, x, p):
        traces.append(1)
        return decode.step(spec, cache, x, kernel, p)

    cache = decode.init_cache(spec, 1, 2)
    for p in range(16):
        _, cache = f(cache, jnp.ones((1, 2)), p)
    assert len(traces) == 1


def test_errors_say_what_is_unsupported():
    with pytest.raises(NotImplementedError, match="strides=1"):
        decode.make_decode_spec(mk.pixelcnn_mask((3, 3)), (8, 8), strides=2)
    with pytest.raises(NotImplementedError, match="channel_groups=G"):
        decode.make_decode_spec(mk.channel_grouped_mask((3, 3), 3, 6, "A"), (8, 8))
    with pytest.raises(ValueError, match="unit='row'"):
        decode.make_decode_spec(mk.vertical_stack_mask((3, 3), "B"), (8, 8))
    with pytest.raises(ValueError, match="shift=1"):
        decode.make_decode_spec(mk.pixelcnn_mask((3, 3), "B"), (8, 8), shift=1)
    with pytest.raises(ValueError, match="lo \\+ hi"):
        decode.make_decode_spec(mk.pixelcnn_mask((3, 3)), (8, 8), padding="VALID")
    with pytest.raises(ValueError, match="after the current position"):
        decode.make_decode_spec(np.ones(3, bool), (16,))  # SAME and a symmetric kernel read ahead
    with pytest.raises(ValueError, match="feature_group_count must be a positive int"):
        decode.make_decode_spec(mk.pixelcnn_mask((3, 3)), (8, 8), feature_group_count=0)
    with pytest.raises(NotImplementedError, match="1-D and 2-D"):
        decode.make_decode_spec(mk.pixelcnn_mask((3, 3, 3)), (4, 4, 4))
    spec = decode.make_decode_spec(mk.pixelcnn_mask((3, 3)), (8, 8))
    with pytest.raises(ValueError, match="make it with init_cache"):
        decode.step(spec, jnp.zeros((1, 3, 8, 2)), jnp.zeros((1, 2)), jnp.zeros((3, 3, 2, 4)), 0)
    with pytest.raises(ValueError, match="expected \\(3, 3, 2, C_out\\)"):
        decode.step(spec, decode.init_cache(spec, 1, 2), jnp.zeros((1, 2)), jnp.zeros((5, 5, 2, 4)), 0)


BAD_CONV_ARGUMENTS = {
    "strides0": {"strides": 0},
    "strides_rank": {"strides": (1,)},
    "dilation_str": {"dilation": "2"},
    "groups0": {"feature_group_count": 0},
    "padding_name": {"padding": "FULL"},
    "padding_rank": {"padding": ((1, 1),)},
    "padding_causal_2d": {"padding": "CAUSAL"},
    "padding_crops": {"padding": ((-9, 0), (1, 1))},
}


@pytest.mark.parametrize("name", sorted(BAD_CONV_ARGUMENTS))
def test_conv_arguments_are_refused_in_masked_convs_words(name):
    """One validator: decoding checks the convolution's arguments through masked_conv's ConvSpec."""
    kw, mask = BAD_CONV_ARGUMENTS[name], mk.pixelcnn_mask((3, 3), "B")
    with pytest.raises((TypeError, ValueError)) as decoding:
        decode.make_decode_spec(mask, (8, 8), **kw)
    with pytest.raises(decoding.type, match=re.escape(str(decoding.value))):
        full(jnp.ones((1, 8, 8, 2)), jnp.ones((3, 3, 2, 2)), mask, **kw)


def test_a_mask_of_neither_the_window_nor_the_kernel_rank_is_refused():
    with pytest.raises(ValueError, match=r"mask has shape \(3,\) but the spatial shape \(8, 8\) has 2 dims"):
        decode.make_decode_spec(np.ones(3, bool), (8, 8))
    with pytest.raises(ValueError, match=r"mask has shape \(3, 3, 2\) .* 2 dims \(the window, one bit per tap\) or 4"):
        decode.make_decode_spec(np.ones((3, 3, 2), bool), (8, 8))
