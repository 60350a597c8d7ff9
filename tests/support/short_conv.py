"""The checks every kernel implementation of ``causal_conv1d`` runs, written once.

Each takes the implementation as a function (its interpreter and tiles bound by the
caller) and the case's arrays, drawn by the calling module, so that ``pallas_triton`` and
``pallas_mosaic_gpu`` hold to the same oracles, bounds and exactness checks:

* :func:`check_against_oracles`: the forward and final state against the float64
  reference, every gradient against the ``xla`` implementation differentiated in float64;
* :func:`check_nan_isolation`: NaN in other documents reaches none of one document's
  outputs, whose gradient is exactly 0.0 outside it;
* :func:`check_packed_equals_alone`: packed documents' outputs equal each alone, bit for bit;
* :func:`check_derivatives_of_every_order`: forward mode, reverse over reverse, a Hessian
  and a transposed JVP against the ``xla`` implementation's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskconv_kernels.ops.causal_conv1d import causal_conv1d, causal_conv1d_reference
from maskconv_kernels.ops.causal_conv1d.backends import REGISTRY
from maskconv_kernels.ops.causal_conv1d.checks import make_problem

from .numerics import assert_close, random

__all__ = ["implementation_params", "check_against_oracles", "check_nan_isolation", "check_packed_equals_alone",
           "check_derivatives_of_every_order"]

F32 = np.dtype(np.float32)


def implementation_params() -> list:
    """``causal_conv1d``'s implementations as pytest params, each skipped with the registry's
    own reason where it cannot run here interpreted (``pallas_mosaic_gpu`` on jax < 0.11)."""
    problem = make_problem(np.zeros((1, 4, 8), np.float32), np.zeros((3, 8), np.float32))[0]
    params = []
    for name in REGISTRY.names:
        why = REGISTRY.get(name).unsupported(problem, None, True)
        marks = [pytest.mark.skip(reason=str(why))] if why is not None else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


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
        xla = lambda x, w, b, s: causal_conv1d(x, w, b, initial_state=s, implementation="xla", **kw)  # noqa: E731
        _, vjp64 = jax.vjp(xla, as64(x), as64(w), as64(b), as64(state))
        expected = vjp64(as64(dy))
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
    a state. NaN in every document but one (and the padding) leaves that document's outputs
    as they were; padding outputs are zero; the gradient of its outputs is exactly 0.0
    outside it, and the state's is nonzero only in its row (the state belongs to each
    row's first document)."""
    f = jax.jit(f)
    clean = np.asarray(f(x, state))
    doc = int(ids[1, 0])
    poisoned = jnp.where(jnp.asarray(ids != doc)[..., None], jnp.nan, x)  # every other document and the padding
    y = np.asarray(f(poisoned, state))
    np.testing.assert_array_equal(y[ids == doc], clean[ids == doc])
    assert (y[ids < 0] == 0).all()
    gx, gs = jax.grad(lambda x, s: jnp.where(jnp.asarray(ids == doc)[..., None], f(x, s), 0).sum(), (0, 1))(x, state)
    gx, gs = np.asarray(gx), np.asarray(gs)
    assert (gx[ids != doc] == 0).all()
    assert (gs[0] == 0).all() and np.abs(gs[1]).sum() > 0
    assert np.abs(gx[ids == doc]).sum() > 0


def check_packed_equals_alone(f, dtype):
    """``f(x, w, b, ids)``: packed into one row, each document's outputs are its outputs alone
    (in its own row, right-padded to the packed length), bit for bit."""
    lengths, dim, width = [13, 1, 20], 24, 4
    docs = [random(20 + i, (n, dim), dtype) for i, n in enumerate(lengths)]
    w, b = random(1, (width, dim), np.float32, scale=0.5), random(2, (dim,), np.float32)
    total = sum(lengths)
    packed = jnp.concatenate(docs)[None]
    packed_ids = np.concatenate([np.full(n, 7 + i) for i, n in enumerate(lengths)])[None].astype(np.int32)
    alone = jnp.stack([jnp.zeros((total, dim), dtype).at[:n].set(d) for d, n in zip(docs, lengths)])
    alone_ids = np.stack([np.where(np.arange(total) < n, 3, -1) for n in lengths]).astype(np.int32)
    f = jax.jit(f)
    y, y_alone = np.asarray(f(packed, w, b, packed_ids))[0], np.asarray(f(alone, w, b, alone_ids))
    starts = np.cumsum([0, *lengths])
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(y[starts[i]:starts[i] + n], y_alone[i, :n])


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
