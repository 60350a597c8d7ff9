"""What the fuzzers share: dtypes, segment layouts, chunk schedules, bounds, NaN probes, time limits.

Every bound is :func:`support.numerics.assert_close`'s: the result's dtype's TOLERANCE times
the square root of the reduction length times the magnitude of its terms, never tuned to
a case. Inputs are drawn as seeds (NumPy's generator, :func:`support.numerics.random`), so
a failing example prints a handful of integers that reproduce it.
"""
from __future__ import annotations

import contextlib
import os
import signal

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

__all__ = [
    "F32", "BF16", "F16", "LONG", "SLOW_TIER_EXAMPLES", "long_settings", "slow_tier_settings", "by_tier", "magnitude", "segment_layout", "chunk_schedule", "nan_positions",
    "bits", "time_limit", "fuzz_tests",
]

F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)

# The long profile: what the slow tier runs on the xla implementations (the fast tier runs
# the loaded profile's few, 3 by default): MASKCONV_FUZZ_EXAMPLES examples, 30 unless set
# (.ci/run's slow tier, within its time budget: about 1.3 s an example on the 2-core VM).
# The long runs reported in the docs set it to 100 (400 for masked_conv) on this machine.
LONG = int(os.environ.get("MASKCONV_FUZZ_EXAMPLES", "30"))
# The implementations in the slow tier (kernels in an interpreter, the xla strategies no
# platform defaults to) run MASKCONV_FUZZ_SLOW_TIER_EXAMPLES examples (5 unless set) under
# any profile: an interpreted example takes seconds to tens of seconds, so the ci
# profile's 40 would hold .ci/run's slow tiers for an hour.
SLOW_TIER_EXAMPLES = int(os.environ.get("MASKCONV_FUZZ_SLOW_TIER_EXAMPLES", "5"))


def long_settings(scale: float = 1.0):
    """``@settings`` of a long-profile test: :data:`LONG` examples (times ``scale``), the profile's others."""
    return settings(settings.default, max_examples=max(1, int(LONG * scale)))


def slow_tier_settings():
    """``@settings`` of a slow-tier implementation's test: :data:`SLOW_TIER_EXAMPLES` examples, the profile's others."""
    return settings(settings.default, max_examples=SLOW_TIER_EXAMPLES)


def by_tier(params) -> tuple[list, list]:
    """``params`` split: those of the fast tier, and those marked ``slow``."""
    slow = [p for p in params if any(m.name == "slow" for m in p.marks)]
    return [p for p in params if p not in slow], slow


def fuzz_tests(property_, params, long_name: str = "xla", long_scale: float = 1.0):
    """Three tests of ``property_(name, data)``: one per implementation of ``params`` with the
    loaded profile (the fast tier's few examples), one per slow-tier implementation with
    :data:`SLOW_TIER_EXAMPLES` examples, and one on ``long_name`` with the long
    profile (:data:`LONG` examples), in the slow tier."""
    fast, slow = by_tier(params)

    @pytest.mark.parametrize("name", fast)
    @given(data=st.data())
    def per_implementation(name, data):
        property_(name, data)

    @pytest.mark.parametrize("name", slow or [pytest.param(None, marks=pytest.mark.skip(
        reason="no slow-tier implementation here"))])
    @slow_tier_settings()
    @given(data=st.data())
    def per_slow_tier_implementation(name, data):
        property_(name, data)

    @pytest.mark.slow
    @long_settings(long_scale)
    @given(data=st.data())
    def long_profile(data):
        property_(long_name, data)

    return per_implementation, per_slow_tier_implementation, long_profile


def magnitude(*arrays) -> float:
    """The product of the arrays' largest magnitudes (float64): the scale of one product of terms."""
    out = 1.0
    for a in arrays:
        out *= float(np.abs(np.asarray(a, np.float64)).max(initial=0.0))
    return out


def bits(a) -> np.ndarray:
    """The raw bits of an array, for bit-for-bit comparisons (NaN equal to NaN, -0.0 not 0.0)."""
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@st.composite
def segment_layout(draw, shape, kind=None):
    """Integer ids of ``shape`` (batch first): packed documents along the flattened positions
    of each example, random ids per position (any layout), or a single document; negative
    ids (padding) sprinkled in or trailing."""
    kind = kind or draw(st.sampled_from(["runs", "runs", "random", "one"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    n, per = shape[0], int(np.prod(shape[1:]))
    if kind == "random":
        ids = rng.integers(-1, 3, size=(n, per))
    elif kind == "one":
        ids = np.full((n, per), int(rng.integers(0, 5)))
    else:
        ids = np.empty((n, per), np.int64)
        for row in ids:
            cuts = np.sort(rng.choice(np.arange(1, max(per, 2)), size=min(int(rng.integers(0, 4)), per - 1), replace=False))
            starts = rng.permutation(10)[: len(cuts) + 1]  # ids need not increase
            row[:] = starts[np.searchsorted(cuts, np.arange(per), side="right")]
            if rng.random() < 0.3:  # trailing padding
                row[per - int(rng.integers(1, per + 1)) :] = -1
            if rng.random() < 0.2:  # a padding position inside
                row[int(rng.integers(0, per))] = -1
    return ids.reshape(shape).astype(np.int32)


@st.composite
def chunk_schedule(draw, length: int, stride: int = 1, first_any: bool = True, max_chunks: int = 4):
    """Chunk lengths summing to at most ``length``: a first chunk of any length >= 1
    (``first_any``), later ones multiples of ``stride``."""
    chunks, used = [], 0
    if length < 1:
        return chunks
    first = draw(st.integers(1, length)) if first_any else stride * draw(st.integers(1, max(1, length // stride)))
    if first > length:
        return chunks
    chunks.append(first)
    used = first
    while length - used >= stride and len(chunks) < max_chunks:
        if draw(st.integers(0, 5)) == 0:
            break
        k = draw(st.integers(1, (length - used) // stride))
        chunks.append(k * stride)
        used += k * stride
    return chunks


def nan_positions(rng: np.random.Generator, shape, count: int) -> np.ndarray:
    """A bool array of ``shape``: ``count`` random True entries (channels included)."""
    flat = np.zeros(int(np.prod(shape)), bool)
    flat[rng.choice(flat.size, size=min(count, flat.size), replace=False)] = True
    return flat.reshape(shape)


class Hang(Exception):
    """Raised by :func:`time_limit` when a call runs past its limit."""


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fails a call that runs longer than ``seconds`` (SIGALRM, main thread: pytest's and xdist's)."""

    def alarm(signum, frame):
        raise Hang(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
