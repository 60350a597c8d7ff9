"""``causal_conv1d`` and ``causal_conv1d_update`` fuzzed against the float64 references, on every implementation.

A problem is a batch, length, width, dilation, channels, bias, activation, packing (none,
``segment_ids`` or ``positions``, padding included), an initial state, and dtypes (16-bit
activations, float32 weights with 16-bit activations as Mamba keeps them). Checks:

* ``full``: the output against :func:`causal_conv1d_reference` within the dtype's bound,
  the final state equal to the reference's (copies); the gradients (x, weight, bias,
  initial state) against gradients built from the same reference (the op is linear in
  x and the state before bias and activation: unit probes give its matrix); an input or
  state entry no output reads gets exactly 0.0; NaN at random inputs and state entries
  reaches exactly the outputs that read them (the others keep their bits).
* ``chunks``: the sequence cut in random chunks, each run with the previous chunk's final
  state (documents by ``positions``, which say whether a chunk's first token continues
  the state's document), equals the full pass within rounding, and the last final state
  the full pass's.
* ``update``: decode replay through ``causal_conv1d_update``: random pools (linear or
  circular), slots (a permutation, pad rows), ``has_initial_state``, tokens per call (one
  token as ``(B, D)`` too); each call's outputs against
  :func:`causal_conv1d_update_reference` and the whole replay against the full pass of
  each row's sequence; the pool after each call equal to the reference's, bit for bit.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from support import harness, short_conv
from support.numerics import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels.ops.causal_conv1d.reference import causal_conv1d_reference, causal_conv1d_update_reference

from . import regressions
from .common import BF16, F16, F32, bits, chunk_schedule, fuzz_tests, magnitude, nan_positions

# Interpreted kernels at their default tiles: the shared suite runs them at small ones.
IMPLS = {name: dataclasses.replace(impl, config=None) for name, impl in short_conv.IMPLS.items()}
PARAMS = harness.params(IMPLS)


def _kw(name):
    return dict(implementation=IMPLS[name].implementation, interpret=IMPLS[name].interpret)


def _ids_of_positions(positions):
    return np.where(positions < 0, -1, np.cumsum(positions == 0, axis=1)).astype(np.int32)


@st.composite
def packing(draw, batch, length, trailing_only=False):
    """``(kind, ids or positions)``: none, segment ids (runs, any order of ids, padding), or positions
    (a row may continue a document, documents start anywhere, padding; only trailing with ``trailing_only``)."""
    kind = draw(st.sampled_from(["none", "segment_ids", "positions"] if not trailing_only else ["none", "positions"]))
    if kind == "none":
        return kind, None
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if kind == "segment_ids":
        ids = np.empty((batch, length), np.int32)
        for row in ids:
            cuts = np.sort(rng.choice(np.arange(1, max(length, 2)), min(int(rng.integers(0, 4)), max(length - 1, 0)),
                                      replace=False))
            row[:] = rng.permutation(20)[np.searchsorted(cuts, np.arange(length), side="right")]
            if rng.random() < 0.3:
                row[length - int(rng.integers(1, length + 1)):] = -1
            if rng.random() < 0.2:
                row[int(rng.integers(0, length))] = -1
        return kind, ids
    positions = np.empty((batch, length), np.int32)
    for row in positions:
        p = int(rng.integers(0, 6)) if rng.random() < 0.6 else 0  # continues a document, or starts one
        for t in range(length):
            if t and rng.random() < 0.15:
                p = 0
            row[t] = p
            p += 1
        if rng.random() < 0.3:
            row[length - int(rng.integers(1, length + 1)):] = -1
        if not trailing_only and rng.random() < 0.2:
            row[int(rng.integers(0, length))] = -1
    return kind, positions


@st.composite
def problems(draw, name, max_length=24):
    """A full-pass problem: ``(seed, shapes and flags, packing)`` as a dict of plain values."""
    x_dtype = draw(st.sampled_from(_x_dtypes(name)))
    w_dtype = x_dtype if x_dtype == F32 or draw(st.booleans()) else F32
    return dict(
        seed=draw(st.integers(0, 2**16)), batch=draw(st.integers(1, 3)), length=draw(st.integers(1, max_length)),
        dim=draw(st.integers(1, 12)), width=draw(st.integers(1, 5)), dilation=draw(st.integers(1, 3)),
        bias=draw(st.booleans()), activation=draw(st.sampled_from([None, "silu", "swish"])),
        state=draw(st.booleans()), x_dtype=str(x_dtype), w_dtype=str(w_dtype),
    )


def _inputs(p):
    x_dtype, w_dtype = np.dtype(p["x_dtype"]), np.dtype(p["w_dtype"])
    s = p["seed"]
    x = random(s, (p["batch"], p["length"], p["dim"]), x_dtype)
    w = random(s + 1, (p["width"], p["dim"]), w_dtype, scale=0.5)
    b = random(s + 2, (p["dim"],), w_dtype, scale=0.5) if p["bias"] else None
    state_len = (p["width"] - 1) * p["dilation"]
    state = random(s + 3, (p["batch"], state_len, p["dim"]), x_dtype) if p["state"] else None
    return x, w, b, state


def _reference_args(kind, pack, state):
    """The reference's segment ids and state for a packing (positions: the state is not read in a row that starts a document)."""
    if kind == "none":
        return None, state
    if kind == "segment_ids":
        return pack, state
    ids = _ids_of_positions(pack)
    if state is not None:
        state = np.where((ids[:, :1] == 1)[..., None], 0.0, np.asarray(state, np.float64))
    return ids, state


def _matrix(x_shape, w, ids, state_len, dilation, has_state):
    """``R (B, L, S + L, D)``: the output before bias and activation is ``sum_q R[b, l, q, d] * xe[b, q, d]``
    (``xe``: the state then x), from the reference on unit probes (depthwise: every channel at once)."""
    batch, length, dim = x_shape
    rows = []
    for b in range(batch):
        probes = np.zeros((state_len + length, state_len + length, dim))
        probes[np.arange(state_len + length), np.arange(state_len + length)] = 1.0
        seg = None if ids is None else np.broadcast_to(ids[b], (state_len + length, length))
        y = causal_conv1d_reference(probes[:, state_len:], w, segment_ids=seg, dilation=dilation,
                                    initial_state=probes[:, :state_len] if has_state else None)
        rows.append(np.moveaxis(y, 0, 1))  # (L, probes, D)
    return np.stack(rows)


def check_full(name, p, kind, pack):
    x, w, b, state = _inputs(p)
    x_dtype = x.dtype
    state_len = (p["width"] - 1) * p["dilation"]
    pk = {} if kind == "none" else {kind: pack}
    kw = dict(activation=p["activation"], dilation=p["dilation"], **pk)
    ref_ids, ref_state = _reference_args(kind, pack, state)
    ry, rfinal = causal_conv1d_reference(x, w, b, segment_ids=ref_ids, initial_state=ref_state,
                                         activation=p["activation"], dilation=p["dilation"], return_final_state=True)

    def f(x, w, b, state):
        return mk.causal_conv1d(x, w, b, initial_state=state, return_final_state=True, **kw, **_kw(name))

    (y, final), vjp = jax.vjp(f, x, w, b, state)
    assert y.dtype == x_dtype and final.dtype == x_dtype and final.shape == (p["batch"], state_len, p["dim"])
    scale = magnitude(x, w) * p["width"] + (magnitude(b) if b is not None else 0.0) + 1.0
    assert_close(y, ry, x_dtype, p["width"], scale)
    if kind != "positions" or state is None:  # positions: the final state of a state not read is the library's choice
        np.testing.assert_array_equal(np.asarray(final, np.float64), rfinal)  # copies, not sums

    # Gradients, from the reference: y = act(pre), pre = R xe + bias, linear in xe.
    dy = random(p["seed"] + 4, y.shape, x_dtype)
    dx, dw, db, dstate = vjp((dy, jnp.zeros_like(final)))
    xe = np.concatenate([np.zeros((p["batch"], state_len, p["dim"])) if ref_state is None
                         else np.asarray(ref_state, np.float64), np.asarray(x, np.float64)], axis=1)
    R = _matrix(x.shape, np.asarray(w, np.float64), ref_ids, state_len, p["dilation"], True)
    pre = np.einsum("blqd,bqd->bld", R, xe) + (0.0 if b is None else np.asarray(b, np.float64))
    sig = 1.0 / (1.0 + np.exp(-pre))
    g = np.asarray(dy, np.float64) * ((sig * (1 + pre * (1 - sig))) if p["activation"] else 1.0)
    if ref_ids is not None:
        g = np.where((ref_ids >= 0)[..., None], g, 0.0)
    dxe = np.einsum("blqd,bld->bqd", R, g)
    grad_scale = magnitude(dy) * max(1.0, magnitude(x)) * max(1.0, magnitude(w)) * (p["width"] + 1)
    bl = p["batch"] * p["length"]
    assert_close(dx, dxe[:, state_len:], dx.dtype, p["width"], grad_scale)
    unit_w = np.eye(p["width"])[:, :, None] * np.ones(p["dim"])  # tap t alone, weight 1
    dw_ref = np.stack([(causal_conv1d_reference(xe[:, state_len:], unit_w[t], segment_ids=ref_ids,
                                                initial_state=xe[:, :state_len], dilation=p["dilation"]) * g).sum((0, 1))
                       for t in range(p["width"])])
    assert dw.dtype == w.dtype
    assert_close(dw, dw_ref, dw.dtype, bl, grad_scale)
    if b is not None:
        assert_close(db, g.sum((0, 1)), db.dtype, bl, grad_scale)
    reached = (R != 0).any(axis=1)  # (B, S + L, D): some output reads it
    assert (np.asarray(dx, np.float64)[~reached[:, state_len:]] == 0.0).all(), "an input no output reads got a gradient"
    if state is not None:
        assert dstate.dtype == x_dtype
        s_reached = reached[:, :state_len]
        if kind == "positions":  # a row starting a document does not read its state
            s_reached = s_reached & (ref_ids[:, :1] != 1)[..., None]
        assert_close(dstate, np.where(s_reached, dxe[:, :state_len], 0.0), dstate.dtype, p["width"], grad_scale)
        assert (np.asarray(dstate, np.float64)[~s_reached] == 0.0).all(), "a state entry no output reads got a gradient"

    # NaN isolation: NaN at random inputs (and state entries); the reference says which outputs read them.
    rng = np.random.default_rng(p["seed"] + 5)
    x_nan = np.where(nan_positions(rng, x.shape, int(rng.integers(1, 4))), np.nan, np.asarray(x)).astype(x_dtype)
    s_nan = None
    if state is not None:
        s_nan = np.where(nan_positions(rng, state.shape, int(rng.integers(0, 3))), np.nan, np.asarray(state))
        s_nan = s_nan.astype(x_dtype)
    _, ref_s_nan = _reference_args(kind, pack, s_nan)
    reads = np.isnan(causal_conv1d_reference(x_nan, w, b, segment_ids=ref_ids, initial_state=ref_s_nan,
                                             activation=p["activation"], dilation=p["dilation"]))
    y_nan, _ = f(x_nan, w, b, s_nan)
    y_nan = np.asarray(y_nan)
    np.testing.assert_array_equal(bits(y_nan[~reads]), bits(np.asarray(y)[~reads]),
                                  err_msg="a NaN reached an output that does not read it")
    assert np.isnan(y_nan[reads]).all(), "an output that reads a NaN is not NaN"


def check_chunks(name, p, kind, pack, chunks):
    """The sequence in chunks, each from the previous one's final state, equals the full pass."""
    x, w, b, state = _inputs(p)
    pk = (lambda sl: {}) if kind == "none" else (lambda sl: {kind: pack[:, sl]})
    kw = dict(activation=p["activation"], dilation=p["dilation"], **_kw(name))
    full, full_final = mk.causal_conv1d(x, w, b, initial_state=state, return_final_state=True,
                                        **pk(slice(None)), **kw)
    ys, st_, start = [], state, 0
    for n in chunks:
        y, st_ = mk.causal_conv1d(x[:, start:start + n], w, b, initial_state=st_, return_final_state=True,
                                  **pk(slice(start, start + n)), **kw)
        ys.append(y)
        start += n
    total = start
    streamed = np.concatenate([np.asarray(y) for y in ys], axis=1)
    ref_ids, ref_state = _reference_args(kind, None if pack is None else pack[:, :total], state)
    ry = causal_conv1d_reference(x[:, :total], w, b, segment_ids=ref_ids, initial_state=ref_state,
                                 activation=p["activation"], dilation=p["dilation"])
    scale = magnitude(x, w) * p["width"] + (magnitude(b) if b is not None else 0.0) + 1.0
    assert_close(streamed, ry, x.dtype, p["width"], scale)
    assert_close(streamed, np.asarray(full)[:, :total], x.dtype, 2 * p["width"], 2 * scale)
    if total == p["length"] and p["width"] > 1:
        last = slice(total - chunks[-1], total)
        keep = np.ones(p["batch"], bool) if kind == "none" else (pack[:, last] >= 0).any(axis=1)
        # A row whose last chunk is all padding ends with zeros (its documented final state).
        np.testing.assert_array_equal(bits(np.asarray(st_)[keep]), bits(np.asarray(full_final)[keep]))


def _x_dtypes(name: str) -> list:
    """The activations' dtypes ``name`` takes: the TPU kernels refuse float16 (TPUs have none)."""
    return [F32, BF16] if "mosaic_tpu" in name else [F32, BF16, F16]


@st.composite
def update_problems(draw, name):
    x_dtype = draw(st.sampled_from(_x_dtypes(name)))
    width, dilation = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    window = (width - 1) * dilation
    circular = draw(st.booleans())
    state_len = window + draw(st.integers(0, 2)) + (1 if circular and window == 0 else 0)
    batch = draw(st.integers(1, 3))
    indexed = draw(st.booleans())
    slots = batch + (draw(st.integers(0, 2)) if indexed else 0)
    calls = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))  # tokens per call, 0: one token as (B, D)
    return dict(
        seed=draw(st.integers(0, 2**16)), x_dtype=str(x_dtype), width=width, dilation=dilation, state_len=state_len,
        circular=circular, batch=batch, slots=slots, indexed=indexed, dim=draw(st.integers(1, 8)),
        bias=draw(st.booleans()), activation=draw(st.sampled_from([None, "silu"])), calls=calls,
        fresh=draw(st.booleans()), pads=draw(st.booleans()) and indexed,
    )


def check_update(name, p):
    """Decode replay: every call against the update reference, the whole against the full pass."""
    x_dtype = np.dtype(p["x_dtype"])
    s, batch, dim, width = p["seed"], p["batch"], p["dim"], p["width"]
    rng = np.random.default_rng(s)
    w = random(s + 1, (width, dim), np.float32, scale=0.5).astype(x_dtype)
    b = random(s + 2, (dim,), x_dtype, scale=0.5) if p["bias"] else None
    pool = random(s + 3, (p["slots"], p["state_len"], dim), x_dtype)
    indices = None
    if p["indexed"]:
        indices = rng.permutation(p["slots"])[:batch].astype(np.int32)
        if p["pads"]:
            indices[rng.random(batch) < 0.4] = -1
    has_initial = (rng.random(batch) < 0.5) if p["fresh"] else None
    seqlens = rng.integers(0, 7, batch).astype(np.int32) if p["circular"] else None
    kw = dict(activation=p["activation"], dilation=p["dilation"], **_kw(name))
    ref_pool = np.asarray(pool, np.float64)
    window = (width - 1) * p["dilation"]
    before = np.asarray(pool, np.float64)[np.maximum(indices, 0) if indices is not None else np.arange(batch)]
    if p["circular"]:
        before = np.stack([before[r][[(seqlens[r] - window + j) % p["state_len"] for j in range(window)]]
                           for r in range(batch)]) if window else before[:, :0]
    else:
        before = before[:, p["state_len"] - window:]
    if has_initial is not None:
        before = np.where(has_initial[:, None, None], before, 0.0)
    ys, xs = [], []
    for i, tokens in enumerate(p["calls"]):
        x = random(s + 10 + i, (batch, dim) if tokens == 0 else (batch, tokens, dim), x_dtype)
        args = dict(state_indices=indices, cache_seqlens=seqlens, has_initial_state=has_initial if i == 0 else None)
        y, pool = mk.causal_conv1d_update(x, pool, w, b, **args, **kw)
        ry, ref_pool = causal_conv1d_update_reference(x, ref_pool, w, b, activation=p["activation"],
                                                      dilation=p["dilation"], **args)
        assert y.shape == x.shape and y.dtype == x_dtype and pool.dtype == x_dtype
        assert_close(y, ry, x_dtype, width, magnitude(x, w) * width + (magnitude(b) if b is not None else 0.0) + 1.0)
        np.testing.assert_array_equal(np.asarray(pool, np.float64), ref_pool)  # copies
        x3 = np.asarray(x)[:, None] if tokens == 0 else np.asarray(x)
        ys.append(np.asarray(y)[:, None] if tokens == 0 else np.asarray(y))
        xs.append(x3)
        if seqlens is not None:
            seqlens = seqlens + x3.shape[1]
    # The replay against one full pass of each row's sequence from its slot's window.
    x_all, y_all = np.concatenate(xs, axis=1), np.concatenate(ys, axis=1)
    live = np.ones(batch, bool) if indices is None else indices >= 0
    if live.any():
        full = causal_conv1d_reference(x_all[live], w, b, initial_state=before[live], activation=p["activation"],
                                       dilation=p["dilation"])
        assert_close(y_all[live], full, x_dtype, width, magnitude(x_all, w) * width + 1.0 + (magnitude(b) if b is not None else 0.0))
    assert (y_all[~live] == 0).all(), "a pad row's outputs are not zero"


CHECKS = {"full": check_full, "chunks": check_chunks, "update": check_update}


def _full(name, data):
    p = data.draw(problems(name))
    kind, pack = data.draw(packing(p["batch"], p["length"]))
    check_full(name, p, kind, pack)


def _chunks(name, data):
    p = data.draw(problems(name, max_length=16))
    kind, pack = data.draw(packing(p["batch"], p["length"], trailing_only=True))
    check_chunks(name, p, kind, pack, data.draw(chunk_schedule(p["length"])))


def _update(name, data):
    check_update(name, data.draw(update_problems(name)))


test_fuzz_causal_conv1d_matches_the_reference_and_keeps_the_contract, \
    test_fuzz_causal_conv1d_matches_the_reference_slow_tier, \
    test_fuzz_causal_conv1d_matches_the_reference_long_profile_xla = fuzz_tests(_full, PARAMS)
test_fuzz_causal_conv1d_chunks_with_state_equal_the_full_pass, \
    test_fuzz_causal_conv1d_chunks_slow_tier, \
    test_fuzz_causal_conv1d_chunks_long_profile_xla = fuzz_tests(_chunks, PARAMS)
test_fuzz_causal_conv1d_update_decode_replay, test_fuzz_causal_conv1d_update_slow_tier, \
    test_fuzz_causal_conv1d_update_long_profile_xla = fuzz_tests(_update, PARAMS)


@pytest.mark.parametrize("case", regressions.param_list(regressions.CAUSAL_CONV1D, IMPLS))
def test_fuzz_causal_conv1d_regressions(case):
    case.run(CHECKS)
