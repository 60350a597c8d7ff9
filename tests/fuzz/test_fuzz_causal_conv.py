"""``causal_conv`` and ``causal_conv_stream`` fuzzed against the float64 references, on every implementation.

A problem is a rank (audio, spectrogram, video: 0 to 2 axes after time), window, strides
and dilation per axis, the other axes' padding (strings and pairs, negative ones
included), ``padding_mode``, feature groups, packed clips (``segment_ids``), a bias, and
dtypes. Checks:

* ``full``: the output against :func:`causal_conv_reference`; the gradients (x, kernel,
  bias) against :func:`masked_conv_reference_vjp` of the same convolution written as a
  masked one (time padded ``((k_T - 1) * d_T, 0)``, or led by copies of frame 0), all
  within the result dtype's bound. Contract: the cotangent is cut after a random output
  frame, and every input that no kept output reads (later frames, other clips, pixels off
  the window) gets exactly 0.0; NaN at random inputs reaches exactly the outputs that
  read them (the others keep their bits).
* ``stream``: random chunk schedules (a first chunk of any length, later ones multiples of
  the time stride) through ``causal_conv_stream``: concatenated, the full pass's outputs,
  bit for bit on the kernel backends (their reduction order is fixed by tiles), within
  the bound on ``"xla"`` (both against the reference).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume
from hypothesis import strategies as st
from support import harness
from support.causal import IMPLS
from support.numerics import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels import masked_conv_reference
from maskconv_kernels.ops.causal_conv import causal_conv_reference
from maskconv_kernels.ops.causal_conv.reference import _resolved
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference_vjp

from . import regressions
from .common import BF16, F16, F32, bits, chunk_schedule, fuzz_tests, magnitude, nan_positions, segment_layout

PARAMS = harness.params(IMPLS)


def _unsupported(name, x_shape, k_shape, dtype, segmented=False, **kw):
    ids = np.zeros(x_shape[:-1], np.int32) if segmented else None
    return IMPLS[name].unsupported(np.zeros(x_shape, dtype), np.zeros(k_shape, dtype), None, segment_ids=ids, **kw)


@st.composite
def problems(draw, name):
    """``(seed, x_shape, kernel_shape, dtype, bias, segment_ids, keyword arguments)``."""
    probe = lambda dtype=F32, rank=3, **kw: _unsupported(  # noqa: E731
        name, (1, 6, *(5,) * (rank - 3), 2 * kw.get("feature_group_count", 1)),
        (2, *(3,) * (rank - 3), 2, 2 * kw.get("feature_group_count", 1)), dtype, **kw) is None
    dtype = draw(st.sampled_from([d for d in (F32, BF16, F16) if probe(d)]))
    rank = draw(st.sampled_from([r for r in (3, 4, 5) if probe(dtype, r)]))
    ndim = rank - 2
    groups = draw(st.sampled_from((1, 1, 2))) if probe(dtype, feature_group_count=2) else 1
    segmented = probe(dtype, segmented=True) and draw(st.integers(0, 2)) == 0
    window = (draw(st.integers(1, 4)), *(draw(st.integers(1, 3)) for _ in range(ndim - 1)))
    if segmented:  # clips: stride 1, "SAME" on the other axes, zeros before frame 0
        strides, padding, padding_mode = (1,) * ndim, "SAME", "zeros"
    else:
        strides = (draw(st.integers(1, 3 if probe(dtype, strides=2) else 1)),
                   *(draw(st.integers(1, 2 if probe(dtype, strides=2) else 1)) for _ in range(ndim - 1)))
        padding = draw(st.one_of(st.sampled_from(["SAME", "VALID"]),
                                 st.tuples(*[st.tuples(st.integers(-1, 3), st.integers(-1, 3)) for _ in range(ndim - 1)])))
        padding_mode = draw(st.sampled_from(["zeros", "replicate"]))
    dilation = tuple(draw(st.integers(1, 3 if ndim < 3 else 2)) for _ in range(ndim))
    frames = draw(st.integers(1, 12 if ndim < 3 else 7))
    spatial = tuple(draw(st.integers(d * (k - 1) + 3, d * (k - 1) + (6 if ndim < 3 else 4)))
                    for d, k in zip(dilation[1:], window[1:]))
    c_in, c_out = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    x_shape = (draw(st.integers(1, 2)), frames, *spatial, c_in)
    k_shape = (*window, c_in // groups, c_out)
    kw = dict(strides=strides, dilation=dilation, padding=padding, padding_mode=padding_mode,
              feature_group_count=groups)
    assume(_unsupported(name, x_shape, k_shape, dtype, segmented, **kw) is None)
    ids = draw(segment_layout(x_shape[:-1])) if segmented else None
    return draw(st.integers(0, 2**16)), x_shape, k_shape, str(dtype), draw(st.booleans()), ids, kw


def _inputs(seed, x_shape, k_shape, dtype, bias):
    dtype = np.dtype(dtype)
    x, k = random(seed, x_shape, dtype), random(seed + 1, k_shape, dtype, scale=0.5)
    b = random(seed + 2, (k_shape[-1],), dtype, scale=0.5) if bias else None
    return x, k, b


def _as_masked(x, k, kw):
    """The causal convolution as a masked one: ``(x', masked_conv_reference's arguments)``, and how to fold dx' back."""
    window, s, d, pads = _resolved(np.asarray(x), np.asarray(k), kw["strides"], kw["dilation"], kw["padding"])
    context = (window[0] - 1) * d[0]
    x = np.asarray(x, np.float64)
    args = dict(strides=s, dilation=d, feature_group_count=kw["feature_group_count"])
    if kw["padding_mode"] == "replicate":
        x_ext = np.concatenate([np.repeat(x[:, :1], context, axis=1), x], axis=1)
        args["padding"] = ((0, 0), *pads)

        def fold(dx_ext):
            dx = dx_ext[:, context:].copy()
            dx[:, 0] += dx_ext[:, : context + 1].sum(axis=1) - dx_ext[:, context]
            return dx

        return x_ext, args, fold
    args["padding"] = ((context, 0), *pads)
    return x, args, lambda dx: dx


def check_full(name, seed, x_shape, k_shape, dtype, bias, ids, kw):
    impl = IMPLS[name]
    x, k, b = _inputs(seed, x_shape, k_shape, dtype, bias)
    seg = {} if ids is None else dict(segment_ids=ids)
    ref = causal_conv_reference(x, k, b, **kw, **seg)
    reduction = int(np.prod(k_shape[:-1])) + 1
    scale = magnitude(x, k) + (magnitude(b) if b is not None else 0.0)
    f = lambda x, k, b: mk.causal_conv(x, k, b, **kw, **seg, **impl.kwargs())  # noqa: E731
    y, vjp = jax.vjp(f, x, k, b)
    assert y.dtype == x.dtype
    assert_close(y, ref, y.dtype, reduction, scale)
    # The same convolution written as a masked one (an independent oracle of the gradients).
    x_ext, margs, fold = _as_masked(x, k, kw)
    ones = np.ones(k_shape[:-2], bool)
    as_masked = masked_conv_reference(x_ext, k, ones, **margs, **seg) + (0.0 if b is None else np.asarray(b, np.float64))
    if ids is not None:
        as_masked = np.where((ids >= 0)[..., None], as_masked, 0.0)
    np.testing.assert_allclose(as_masked, ref, rtol=1e-12, atol=1e-12)  # the two oracles agree

    rng = np.random.default_rng(seed + 3)
    cut = int(rng.integers(0, y.shape[1]))  # outputs after frame `cut` get no cotangent: their inputs' gradients are 0.0
    dy = np.asarray(random(seed + 4, y.shape, x.dtype)).copy()
    dy[:, cut + 1:] = 0
    if ids is not None:
        dy = np.where((ids >= 0)[..., None], dy, 0).astype(x.dtype)  # padding outputs are zeros, whatever dy
    dx, dk, db = vjp(jnp.asarray(dy))
    rdx, rdk = masked_conv_reference_vjp(x_ext, k, ones, dy, **margs, **seg)
    rdx = fold(rdx)
    pixels = int(np.prod(y.shape[:-1]))
    assert dx.dtype == x.dtype and dk.dtype == k.dtype
    assert_close(dx, rdx, dx.dtype, reduction * k_shape[-1], magnitude(dy, k))
    assert_close(dk, rdk, dk.dtype, pixels, magnitude(dy, x))
    if b is not None:
        assert_close(db, np.asarray(dy, np.float64).reshape(-1, k_shape[-1]).sum(0), db.dtype, pixels, magnitude(dy))
    live = np.ones(y.shape[:-1], bool) if ids is None else ids >= 0
    dy_reach = np.zeros(y.shape)
    dy_reach[:, : cut + 1] = live[:, : cut + 1, ..., None]
    reach = fold(masked_conv_reference_vjp(np.abs(x_ext), np.abs(np.asarray(k, np.float64)), ones, dy_reach, **margs,
                                           **seg)[0])
    assert (np.asarray(dx, np.float64)[reach == 0] == 0.0).all(), "an input no kept output reads got a gradient"
    if cut + 1 < y.shape[1]:
        first_unread = (cut * kw["strides"][0]) + 1
        assert (np.asarray(dx, np.float64)[:, first_unread:] == 0.0).all(), "a later frame got a gradient"

    # NaN isolation.
    poison = nan_positions(rng, x_shape, int(rng.integers(1, 4)))
    x_nan = np.where(poison, np.nan, np.asarray(x)).astype(x.dtype)
    reads = np.isnan(causal_conv_reference(x_nan, k, b, **kw, **seg))
    y_nan = np.asarray(f(x_nan, k, b))
    np.testing.assert_array_equal(bits(y_nan[~reads]), bits(np.asarray(y)[~reads]),
                                  err_msg="a NaN reached an output that does not read it")
    assert np.isnan(y_nan[reads]).all(), "an output that reads a NaN is not NaN"


def check_stream(name, seed, x_shape, k_shape, dtype, bias, ids, kw, chunks):
    impl = IMPLS[name]
    x, k, b = _inputs(seed, x_shape, k_shape, dtype, bias)
    total = sum(chunks)
    ys, state, start = [], None, 0
    for n in chunks:
        seg = {} if ids is None else dict(segment_ids=ids[:, start:start + n])
        y, state = mk.causal_conv_stream(x[:, start:start + n], state, k, b, **kw, **seg, **impl.kwargs())
        ys.append(np.asarray(y))
        start += n
    streamed = np.concatenate(ys, axis=1)
    seg = {} if ids is None else dict(segment_ids=ids[:, :total])
    full = np.asarray(mk.causal_conv(x[:, :total], k, b, **kw, **seg, **impl.kwargs()))
    assert streamed.shape == full.shape
    if impl.exact_stream:
        np.testing.assert_array_equal(bits(streamed), bits(full))
    else:
        expected = causal_conv_reference(x[:, :total], k, b, **kw, **seg)
        reduction = int(np.prod(k_shape[:-1])) + 1
        scale = magnitude(x, k) + (magnitude(b) if b is not None else 0.0)
        assert_close(streamed, expected, streamed.dtype, reduction, scale)
        assert_close(full, expected, full.dtype, reduction, scale)


CHECKS = {"full": check_full, "stream": check_stream}


def _full(name, data):
    check_full(name, *data.draw(problems(name)))


def _stream(name, data):
    problem = data.draw(problems(name))
    x_shape, kw = problem[1], problem[-1]
    chunks = data.draw(chunk_schedule(x_shape[1], kw["strides"][0], max_chunks=4))
    check_stream(name, *problem, chunks)


test_fuzz_causal_conv_matches_the_reference_and_keeps_the_contract, \
    test_fuzz_causal_conv_matches_the_reference_slow_tier, \
    test_fuzz_causal_conv_long_profile_xla = fuzz_tests(_full, PARAMS)
test_fuzz_causal_conv_stream_chunks_equal_the_full_pass, \
    test_fuzz_causal_conv_stream_chunks_slow_tier, \
    test_fuzz_causal_conv_stream_long_profile_xla = fuzz_tests(_stream, PARAMS)


@pytest.mark.parametrize("case", regressions.param_list(regressions.CAUSAL_CONV, IMPLS))
def test_fuzz_causal_conv_regressions(case):
    case.run(CHECKS)
