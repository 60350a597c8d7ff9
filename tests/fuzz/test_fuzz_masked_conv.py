"""``masked_conv`` fuzzed: random valid problems against the float64 reference, on every backend.

A problem is a rank (1 to 3 spatial axes), window, mask (per tap or channel-partial, any
density, empty included), strides, dilation, feature groups, padding (the strings and
``(lo, hi)`` pairs, negative ones included), packed segments, and dtypes (16-bit, and on
``"xla"`` a kernel wider or narrower than x). Each must

* agree with :func:`masked_conv_reference` and its VJP within the result dtype's bound;
* keep the contract: a NaN put at inputs an output never reads (through a masked tap,
  off the window, in another segment) leaves that output's bits as they were, and the
  outputs that do read one are NaN; inputs that no output reads through an active tap,
  and masked kernel entries, get exactly 0.0 gradient.

One test per backend (progress shows). The fast tier runs ``"xla"`` with the loaded
profile's few examples; the slow tier the other strategies and the interpreted kernel
backends (:data:`~.common.SLOW_TIER_EXAMPLES` examples each), and ``"xla"`` again with the
long profile (:data:`~.common.LONG`).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from support.implementations import BACKENDS, SLOW_BACKENDS, SLOW_TIER_BACKENDS
from support.numerics import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels import masked_conv_reference
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference_vjp

from . import regressions
from .common import (
    BF16, F16, F32, bits, by_tier, slow_tier_settings, long_settings, magnitude, nan_positions, segment_layout,
)


def _call(name, x, k, mask, **args):
    b = BACKENDS[name]
    return mk.masked_conv(x, k, mask, **b.kwargs(**args))


def _takes(name, dtype=F32, ndim=2, mask_full=False, **args) -> bool:
    """Whether backend ``name`` runs a small problem of this kind (no compilation: its ``unsupported``)."""
    c = 2 * args.get("feature_group_count", 1)
    x = np.zeros((1, *(8,) * ndim, c), dtype)
    k = np.zeros((*(3,) * ndim, c // args.get("feature_group_count", 1), c), args.pop("kernel_dtype", dtype))
    mask = np.ones(k.shape, bool) if mask_full else np.ones(k.shape[:-2], bool)
    if mask_full:
        mask[..., 0, 0] = False  # channel-partial
    return BACKENDS[name].unsupported(x, k, mask, **args) is None


@st.composite
def problems(draw, name):
    """``(seed, x_shape, kernel_shape, x dtype, kernel dtype, mask bits, segment_ids, conv args)``."""
    b = BACKENDS[name]
    dtypes = [d for d in (F32, BF16, F16) if _takes(name, d)]
    dtype = draw(st.sampled_from(dtypes))
    kernel_dtype = dtype
    if _takes(name, dtype, kernel_dtype=F16 if dtype == F32 else F32) and draw(st.integers(0, 3)) == 0:
        kernel_dtype = draw(st.sampled_from([F16, BF16] if dtype == F32 else [F32]))
    ndim = draw(st.sampled_from([1, 2, 2, 3] if _takes(name, dtype, ndim=3) else [1, 2, 2]))
    window = tuple(draw(st.integers(1, 3 if ndim == 3 else 4)) for _ in range(ndim))
    groups = draw(st.sampled_from((1, 1, 2, 3))) if _takes(name, dtype, feature_group_count=2) else 1
    c_in = groups * draw(st.integers(1, 3))
    c_out = groups * draw(st.integers(1, 3))
    kernel_shape = (*window, c_in // groups, c_out)
    full = _takes(name, dtype, mask_full=True) and draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    density = draw(st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]))
    rng = np.random.default_rng(seed + 7)
    mask_bits = rng.random(kernel_shape if full else window) < density
    segmented = _takes(name, dtype, segmented=True) and draw(st.integers(0, 2)) == 0
    if segmented:  # an output on the input's grid: stride 1, size-preserving padding
        strides = (1,) * ndim
        padding = draw(st.sampled_from(["SAME", "SAME_LOWER"]))
    else:
        strides = tuple(draw(st.integers(1, 3 if _takes(name, dtype, strides=2) else 1)) for _ in range(ndim))
        padding = draw(st.one_of(
            st.sampled_from(["SAME", "SAME_LOWER", "VALID"] + (["CAUSAL"] if ndim == 1 else [])),
            st.tuples(*[st.tuples(st.integers(-1, 4), st.integers(-1, 4)) for _ in range(ndim)]),
        ))
    dilation = tuple(draw(st.integers(1, 3 if ndim < 3 else 2)) for _ in range(ndim))
    need = [d * (k - 1) + 1 for d, k in zip(dilation, window)]
    spread = 3 if ndim == 3 else 7
    spatial = tuple(draw(st.integers(n + 2, n + 2 + spread)) for n in need)  # room for -1 padding on both sides
    x_shape = (draw(st.integers(1, 2)), *spatial, c_in)
    ids = draw(segment_layout(x_shape[:-1])) if segmented else None
    args = dict(strides=strides, dilation=dilation, padding=padding, feature_group_count=groups)
    assume(b.unsupported(np.zeros(x_shape, dtype), np.zeros(kernel_shape, kernel_dtype), mask_bits,
                         segmented=segmented, **args) is None)
    return seed, x_shape, kernel_shape, dtype, kernel_dtype, mask_bits, ids, args


def check_problem(name, seed, x_shape, kernel_shape, dtype, kernel_dtype, mask_bits, ids, args):
    """The forward, both gradients, NaN isolation and exact zeros of one problem on backend ``name``."""
    x, k = random(seed, x_shape, dtype), random(seed + 1, kernel_shape, kernel_dtype)
    seg = {} if ids is None else dict(segment_ids=ids)
    ref = masked_conv_reference(x, k, mask_bits, **seg, **args)
    dy = random(seed + 2, ref.shape, dtype)
    rdx, rdk = masked_conv_reference_vjp(x, k, mask_bits, dy, **seg, **args)
    reduction = int(np.prod(kernel_shape[:-1]))
    pixels = int(np.prod(ref.shape[:-1]))

    y, vjp = jax.vjp(lambda x, k: _call(name, x, k, mask_bits, **seg, **args), x, k)
    assert y.dtype == dtype
    assert_close(y, ref, y.dtype, reduction, magnitude(x, k))
    dx, dk = vjp(dy)
    assert dx.dtype == x.dtype and dk.dtype == k.dtype
    assert_close(dx, rdx, dx.dtype, reduction * kernel_shape[-1], magnitude(dy, k))
    assert_close(dk, rdk, dk.dtype, pixels, magnitude(dy, x))

    # Exact zeros: masked kernel entries, and inputs no output reads through an active tap
    # (the reference's gradient of |kernel| with all-ones dy is positive exactly where one does).
    masked = ~np.broadcast_to(mask_bits.reshape(mask_bits.shape + (1,) * (len(kernel_shape) - mask_bits.ndim)),
                              kernel_shape)
    assert (np.asarray(dk, np.float64)[masked] == 0.0).all(), "a masked kernel entry got a gradient"
    reach, _ = masked_conv_reference_vjp(np.ones(x_shape), np.abs(np.asarray(k, np.float64)), mask_bits,
                                         np.ones(ref.shape), **seg, **args)
    unread = reach == 0
    assert (np.asarray(dx, np.float64)[unread] == 0.0).all(), "an input no output reads got a gradient"

    # NaN isolation: NaN at a few inputs; the reference (which skips what it does not read)
    # says which outputs read one. Those must be NaN, the others the clean bits.
    rng = np.random.default_rng(seed + 3)
    poison = nan_positions(rng, x_shape, int(rng.integers(1, 4)))
    if rng.random() < 0.5 and unread.any():  # at least one NaN where nothing reads it
        flat = np.flatnonzero(unread)
        poison.reshape(-1)[flat[rng.integers(0, flat.size)]] = True
    x_nan = np.where(poison, np.nan, np.asarray(x)).astype(dtype)
    reads = np.isnan(masked_conv_reference(x_nan, k, mask_bits, **seg, **args))
    y_nan = np.asarray(_call(name, x_nan, k, mask_bits, **seg, **args))
    np.testing.assert_array_equal(bits(y_nan[~reads]), bits(np.asarray(y)[~reads]),
                                  err_msg="a NaN reached an output that does not read it")
    assert np.isnan(y_nan[reads]).all(), "an output that reads a NaN is not NaN: a tap was dropped"


def _params():
    out = []
    for name in sorted(BACKENDS):
        marks = []
        if name in SLOW_TIER_BACKENDS:
            marks.append(pytest.mark.slow)
        if name in SLOW_BACKENDS:
            marks.append(pytest.mark.interpreted)
        out.append(pytest.param(name, id=name, marks=marks))
    return out


@pytest.mark.parametrize("name", by_tier(_params())[0])
@given(data=st.data())
def test_fuzz_masked_conv_matches_the_reference_and_keeps_the_contract(name, data):
    check_problem(name, *data.draw(problems(name)))


@pytest.mark.parametrize("name", by_tier(_params())[1])
@slow_tier_settings()
@given(data=st.data())
def test_fuzz_masked_conv_matches_the_reference_slow_tier(name, data):
    check_problem(name, *data.draw(problems(name)))


@pytest.mark.slow
@long_settings()
@given(data=st.data())
def test_fuzz_masked_conv_long_profile_xla(data):
    check_problem("xla", *data.draw(problems("xla")))


@pytest.mark.parametrize("case", regressions.param_list(regressions.MASKED_CONV, BACKENDS))
def test_fuzz_masked_conv_regressions(case):
    case.run(check_problem)
