"""``causal_conv1d``'s shared suite: its implementations (:mod:`support.harness`), its
cases, a float64 oracle written from the formula, and the checks every implementation runs.

Each check takes the implementation as a function (its interpreter and tiles bound by the
caller) and the case's arrays, so that ``xla``, ``pallas_triton``,
``pallas_mosaic_gpu`` and ``pallas_mosaic_tpu`` hold to the same oracles, bounds and exactness checks:

* :func:`check_against_oracles`: the forward and final state against the float64
  reference, every gradient against jax's float64 autodiff of :func:`oracle` (the
  formula, no library code);
* :func:`check_nan_isolation`: NaN in other documents reaches none of one document's
  outputs, whose gradient is exactly 0.0 outside it;
* :func:`check_packed_equals_alone`: packed documents' outputs equal each alone, bit for bit;
* :func:`check_derivatives_of_every_order`: forward mode, reverse over reverse, a Hessian
  and a transposed JVP against the ``xla`` implementation's.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import harness
from support.harness import Op

from maskconv_kernels.ops.causal_conv1d import causal_conv1d, causal_conv1d_reference
from maskconv_kernels.ops.causal_conv1d.backends import REGISTRY
from maskconv_kernels.ops.causal_conv1d.checks import make_problem
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_gpu import Config as MosaicConfig
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import Config as TpuConfig
from maskconv_kernels.ops.causal_conv1d.pallas_triton import Config as TritonConfig

from .numerics import assert_close, random

__all__ = [
    "CAUSAL_CONV1D", "IMPLS", "MISSING", "implementation_params", "BF16", "F16", "F32", "GRID", "grid_id", "ids",
    "inputs", "oracle", "check_against_oracles", "check_nan_isolation", "check_packed_equals_alone",
    "check_derivatives_of_every_order",
]

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)


def _problem(x, weight, bias=None, **kw):
    kw = {k: v for k, v in kw.items() if k != "return_final_state"}
    return make_problem(x, weight, bias, **kw)[0]


CAUSAL_CONV1D = Op(causal_conv1d, REGISTRY, _problem,
                   lambda dtype: _problem(np.zeros((1, 4, 8), dtype), np.zeros((3, 8), dtype)))
# Several position tiles, channel blocks (and Triton's backward splits) at test sizes.
SMALL = {
    "pallas_triton": TritonConfig(block_positions=16, block_channels=16, backward_block_positions=16,
                                  backward_block_channels=16, backward_splits=3),
    "pallas_mosaic_gpu": MosaicConfig(block_channels=16, backward_block_channels=16),
    "pallas_mosaic_tpu": TpuConfig(block_positions=16, backward_block_positions=16),
}
IMPLS, MISSING = harness.implementations(CAUSAL_CONV1D, configs=SMALL)


def implementation_params() -> list:
    """``causal_conv1d``'s registry names as pytest params (for tests that call it by
    ``implementation=``, interpreted off a GPU), each that cannot run here skipped with
    the registry's own reason (``pallas_mosaic_gpu`` on jax < 0.11)."""
    return [pytest.param(name, id=name, marks=[pytest.mark.skip(reason=MISSING[name])] if name in MISSING else [])
            for name in REGISTRY.names]


# --------------------------------------------------------------------------- cases

GRID = [
    # width, dim, length, dilation, bias, activation, x dtype, weight dtype, segments, initial state
    *itertools.product((2, 3, 4), (5,), (1, 13), (1,), (True,), ("silu",), (F32,), (F32,), (False, True), (False, True)),
    # channels over a tile with a remainder, lengths of one and several position tiles
    *itertools.product((2, 8), (20,), (1, 37), (1,), (True,), ("silu",), (F32,), (F32,), (True,), (True,)),
    (4, 64, 129, 1, False, None, F32, F32, True, False),
    (4, 40, 151, 2, True, "silu", F32, F32, True, True),
    (8, 17, 50, 2, False, "silu", F32, F32, False, True),
    (8, 24, 67, 1, True, None, F32, F32, False, True),
    (4, 33, 16, 1, True, None, F32, F32, False, False),
    (4, 48, 33, 1, True, "silu", BF16, BF16, True, False),
    (4, 48, 33, 1, True, "silu", F16, F16, False, True),
    (2, 20, 29, 4, True, None, F16, F32, True, True),
    (4, 48, 33, 1, True, "silu", BF16, F32, True, True),  # Mamba's default: 16-bit activations, float32 weights
    (3, 16, 9, 3, False, "silu", F16, F32, True, False),
]


def grid_id(case) -> str:
    w, d, l, dil, bias, act, xd, wd, seg, st = case
    return (f"W{w}_D{d}_L{l}_d{dil}{'_bias' if bias else ''}{'_silu' if act else ''}_{xd}-{wd}"
            f"{'_seg' if seg else ''}{'_state' if st else ''}")


def ids(seed, batch, length):
    """Documents of random lengths in each row, trailing padding in some, padding inside row 0."""
    rng = np.random.default_rng(seed)
    out = np.full((batch, length), -1, np.int32)
    for row in out:
        end = max(length - int(rng.integers(0, 4)), 0)
        cuts = np.sort(rng.choice(np.arange(1, max(end, 2)), min(2, max(end - 1, 0)), replace=False))
        row[:end] = 10 + np.searchsorted(cuts, np.arange(end), side="right")
    if length > 6:
        out[0, length // 2] = -1  # a padding position between two of a document's
    return out


def inputs(seed, batch, length, dim, width, x_dtype, w_dtype, dilation=1):
    """``(x, weight, bias, initial_state, dy)``: ``x``, the state and ``dy`` in ``x_dtype``, the rest in ``w_dtype``."""
    x = random(seed, (batch, length, dim), x_dtype)
    w = random(seed + 1, (width, dim), w_dtype, scale=0.5)
    b = random(seed + 2, (dim,), w_dtype, scale=0.5)
    state = random(seed + 3, (batch, (width - 1) * dilation, dim), x_dtype)
    dy = random(seed + 4, (batch, length, dim), x_dtype)
    return x, w, b, state, dy


def oracle(x, w, b, ids, state, activation, dilation):
    """float64 jnp: ``y[l] = act(b + sum_t w[t] * xe[l + S - (W-1-t) d])`` with document selects.

    ``ids`` every position's document (negative: padding), ``state`` the row's first
    document's past (zeros: none), ``b`` ``None`` for none."""
    batch, length, dim = x.shape
    width = w.shape[0]
    s = (width - 1) * dilation
    xe = jnp.concatenate([state, x], axis=1)
    ide = jnp.concatenate([jnp.broadcast_to(ids[:, :1], (batch, s)), ids], axis=1)
    y = jnp.zeros((batch, length, dim), x.dtype)
    for t in range(width):
        back = (width - 1 - t) * dilation
        same = ((ide[:, s - back : s - back + length] == ids) & (ids >= 0))[..., None]
        y = y + jnp.where(same, xe[:, s - back : s - back + length] * w[t], 0.0)
    if b is not None:
        y = y + b
    if activation:
        y = y * jax.nn.sigmoid(y)
    return jnp.where((ids >= 0)[..., None], y, 0.0)


# --------------------------------------------------------------------------- checks


def check_against_oracles(kernel, x, w, b, state, dy, ids, *, activation, dilation):
    """``kernel(x, w, b, initial_state=..., return_final_state=True, segment_ids=..., activation=...,
    dilation=...)``: forward, final state and every gradient against the oracles (``b``,
    ``state``, ``ids``: ``None`` where the case has none)."""
    batch, length = x.shape[:2]
    width = w.shape[0]
    kw = dict(segment_ids=ids, activation=activation, dilation=dilation)

    def run(x, w, b, state):
        return kernel(x, w, b, initial_state=state, return_final_state=True, **kw)

    (y, final), vjp = jax.vjp(run, x, w, b, state)
    ry, rfinal = causal_conv1d_reference(x, w, b, initial_state=state, return_final_state=True, **kw)
    assert y.dtype == x.dtype and final.dtype == x.dtype
    scale = float(np.abs(np.asarray(x, np.float64)).max() * np.abs(np.asarray(w, np.float64)).max()) + 1
    assert_close(y, ry, x.dtype, width, scale)
    np.testing.assert_array_equal(np.asarray(final, np.float64), rfinal)  # copies, not sums

    grads = vjp((dy, jnp.zeros_like(final)))
    with jax.enable_x64(True):
        as64 = lambda a: None if a is None else jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        doc = jnp.zeros((batch, length), jnp.int32) if ids is None else jnp.asarray(ids)
        past = jnp.zeros((batch, (width - 1) * dilation, x.shape[-1]), jnp.float64)
        expected = jax.vjp(lambda x, w, b, s: oracle(x, w, b, doc, past if s is None else s, activation, dilation),
                           as64(x), as64(w), as64(b), as64(state))[1](as64(dy))
    scale = float(np.abs(np.asarray(dy, np.float64)).max()) * max(1.0, float(np.abs(np.asarray(x, np.float64)).max()))
    scale *= max(1.0, float(np.abs(np.asarray(w, np.float64)).max())) * (width + 1)
    for name, got, want, reduction, like in zip(
        ("dx", "dweight", "dbias", "dinitial_state"), grads, expected, (width, batch * length, batch * length, width),
        (x, w, b, state),
    ):
        if like is None:
            assert got is None, name
            continue
        assert got.dtype == like.dtype, name
        assert_close(got, want, got.dtype, reduction, scale)


def check_nan_isolation(f, x, state, ids):
    """``f(x, state)``: the op with ``ids`` (two rows, no document shared between them) and
    a state. For each document, NaN in every other one (and the padding) leaves its
    outputs as they were; padding outputs are zero; the gradient of one document's
    outputs is exactly 0.0 outside it, and the state's is nonzero only in its row (the
    state belongs to each row's first document)."""
    f = jax.jit(f)
    clean = np.asarray(f(x, state))
    for doc in np.unique(ids[ids >= 0]):
        poisoned = jnp.where(jnp.asarray(ids != doc)[..., None], jnp.nan, x)  # every other document and the padding
        y = np.asarray(f(poisoned, state))
        np.testing.assert_array_equal(y[ids == doc], clean[ids == doc])
        assert (y[ids < 0] == 0).all()
    doc = int(ids[1, 0])
    gx, gs = jax.grad(lambda x, s: jnp.where(jnp.asarray(ids == doc)[..., None], f(x, s), 0).sum(), (0, 1))(x, state)
    gx, gs = np.asarray(gx), np.asarray(gs)
    assert (gx[ids != doc] == 0).all()
    assert (gs[0] == 0).all() and np.abs(gs[1]).sum() > 0
    assert np.abs(gx[ids == doc]).sum() > 0


def check_packed_equals_alone(f, dtype):
    """``f(x, w, b, ids)``: packed into one row, each document's outputs are its outputs alone,
    bit for bit: in its own row, right-padded (negative ids) to the packed length, as an
    unpacked batch is; and, from two tokens on, at its own length without ids. (A
    one-token document at its own length is a different program: jax 0.10's CPU
    compiler folds the taps that read only padding away and fuses the one product left
    with the bias add, one rounding fewer: the last bit can differ there.)"""
    lengths, dim, width = [13, 1, 2, 20], 24, 4
    docs = [random(20 + i, (n, dim), dtype) for i, n in enumerate(lengths)]
    w, b = random(1, (width, dim), np.float32, scale=0.5), random(2, (dim,), np.float32)
    total = sum(lengths)
    packed = jnp.concatenate(docs)[None]
    packed_ids = np.concatenate([np.full(n, 7 + i) for i, n in enumerate(lengths)])[None].astype(np.int32)
    alone = jnp.stack([jnp.zeros((total, dim), dtype).at[:n].set(d) for d, n in zip(docs, lengths)])
    alone_ids = np.stack([np.where(np.arange(total) < n, 3, -1) for n in lengths]).astype(np.int32)
    segmented, unsegmented = jax.jit(f), jax.jit(lambda x: f(x, w, b, None))
    y, y_alone = np.asarray(segmented(packed, w, b, packed_ids))[0], np.asarray(segmented(alone, w, b, alone_ids))
    starts = np.cumsum([0, *lengths])
    for i, (doc, n) in enumerate(zip(docs, lengths)):
        np.testing.assert_array_equal(y[starts[i]:starts[i] + n], y_alone[i, :n])
        if n > 1:
            np.testing.assert_array_equal(np.asarray(unsegmented(doc[None]))[0], y[starts[i]:starts[i] + n])


def check_derivatives_of_every_order(kernel, xla, x, w, b, state):
    """``kernel`` and ``xla``: ``f(x, w, b, state)`` in float32, with width 3 and length 11
    (the reduction lengths below). Forward mode, reverse over reverse, a Hessian and a
    transposed JVP through the kernels, against the xla implementation's (same math: the
    kernels run the first reverse derivative, the xla maps the ones above it)."""
    args = (x, w, b, state)
    loss = lambda f: lambda *a: jnp.sum(jnp.tanh(f(*a)) ** 2)  # noqa: E731
    scale = float(np.abs(x).max() * np.abs(w).max() * 3)

    def close(a, e, reduction):
        assert_close(a, e, F32, reduction, max(scale, float(np.abs(np.asarray(e)).max())))

    close(jax.jvp(kernel, args, args)[1], jax.jvp(xla, args, args)[1], 2 * 3 * 2)
    second = lambda f: jax.grad(lambda w: jnp.sum(jax.grad(loss(f), argnums=0)(x, w, b, state) ** 2))  # noqa: E731
    close(second(kernel)(w), second(xla)(w), 2 * 11 * 3 * 4)
    hessian = lambda f: jax.hessian(lambda b: loss(f)(x, w, b, state))(b)  # noqa: E731
    close(hessian(kernel), hessian(xla), 2 * 11 * 4)
    transposed = jax.linear_transpose(lambda t: jax.jvp(lambda x: kernel(x, w, b, state), (x,), (t,))[1], x)
    reverse = jax.vjp(lambda x: kernel(x, w, b, state), x)[1]
    ones = jnp.ones_like(x)
    close(transposed(ones)[0], reverse(ones)[0], 3 * 2)
