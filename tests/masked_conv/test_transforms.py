"""masked_conv composes with jit, vmap, grad/vjp, checkpoint and forward mode, on every backend.

Forward-mode transforms (``jvp``, ``jacfwd``, ``hessian``, ``linearize`` and
``linear_transpose``) are compared with the same transforms of the leaky
``lax.conv_general_dilated(x, kernel * mask)`` on tiny shapes, cheap enough for the
interpreters.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close, assert_second_order_close, random, second_order

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference, masked_conv_reference_vjp

# Every result is compared with the float64 reference under the suite's bound for the
# backend's dtype (conftest.TOLERANCE, conv.dtype): two float32 programs (eager and jitted, batched and not) may
# round differently, by an amount that depends on the CPU's vector width.
M = mk.pixelcnn_mask((3, 3), "B")
TAPS = int(M.sum())


def _xk(dtype):
    return random(0, (2, 6, 7, 3), dtype), random(1, (3, 3, 3, 4), dtype)


def _scale(a):
    return float(np.abs(a).max())


def test_vmap_over_an_extra_batch_axis(conv):
    x, k = _xk(conv.dtype)
    xs = jnp.stack([x, 2 * x, -x])
    batched = jax.vmap(lambda x: conv(x, k, M))(xs)
    for i in range(3):
        assert_close(batched[i], masked_conv_reference(xs[i], k, M), conv.dtype, TAPS * 3, _scale(xs[i]) * _scale(k))


def test_vmap_over_kernels_and_its_gradient(conv):
    x, k = _xk(conv.dtype)
    ks = jnp.stack([k, 0.5 * k])
    f = lambda k: (conv(x, k, M) ** 2).sum()
    g = jax.vmap(jax.grad(f))(ks)
    for i in range(2):
        # d/dk sum(y^2) = 2 * dk(x, y): y's own rounding (over taps x C_in) and the
        # reduction over pixels, relative to |x| * |y|.
        y = masked_conv_reference(x, ks[i], M)
        _, expected = masked_conv_reference_vjp(x, ks[i], M, 2 * y)
        reduction = TAPS * 3 + int(np.prod(y.shape[:-1]))
        assert_close(g[i], expected, conv.dtype, reduction, 2 * _scale(x) * _scale(y))


def test_checkpoint_gives_the_same_gradients(conv):
    x, k = _xk(conv.dtype)
    f = lambda x, k: jnp.sin(conv(x, k, M)).sum()
    eager = jax.grad(f, (0, 1))(x, k)
    rematerialised = jax.jit(jax.grad(jax.checkpoint(f), (0, 1)))(x, k)
    y = masked_conv_reference(x, k, M)
    expected = masked_conv_reference_vjp(x, k, M, np.cos(y))
    # cos(y) carries y's rounding (|cos'| <= 1) and its own few ulps.
    dx_bound = (TAPS * 3 + TAPS * 4, _scale(k))
    dk_bound = (TAPS * 3 + int(np.prod(y.shape[:-1])), _scale(x))
    for got in (eager, rematerialised):
        for g, e, (reduction, scale) in zip(got, expected, (dx_bound, dk_bound)):
            assert_close(g, e, conv.dtype, reduction, scale * max(1.0, _scale(x) * _scale(k)))


def test_grad_of_grad_matches_the_leaky_baseline(conv):
    # Reverse over reverse: the gradient maps are themselves differentiable.
    x, k = _xk(conv.dtype)
    assert_second_order_close(second_order(conv, x, k, M), x, k, M, conv.dtype)


def test_jit_cache_one_trace_per_mask():
    x, k = _xk(np.float32)
    traces = []

    @jax.jit
    def f(x, k):
        traces.append(1)
        return mk.masked_conv(x, k, M)

    f(x, k)
    f(x + 1, k)
    assert len(traces) == 1


# --------------------------------------------------------------------------- forward mode

TINY_X, TINY_K = (1, 4, 5, 2), (3, 3, 2, 3)


def _tiny(dtype):
    return random(5, TINY_X, dtype), random(6, TINY_K, dtype, scale=0.5)


def _leaky(x, k, mask=M):
    """The same transforms of lax.conv_general_dilated(x, kernel * mask), at IEEE precision."""
    return mk.leaky_masked_conv(x, k, mask, precision="highest")


def _float64(fn, *args):
    """``fn(*args)`` with every array argument in float64: the reference of a transform."""
    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in args]
        return jax.tree.map(np.asarray, fn(*args))


# Like the rest of the suite, the float32 results below are compared with the same
# transform of the leaky baseline in float64 (not with its float32 run), under the
# float32 bound of conftest.TOLERANCE: sqrt(reduction) x the largest sum of |terms|,
# which is the same linear map applied to |x|, |k| and |tangent|.
C_IN, C_OUT = TINY_K[-2], TINY_K[-1]
PIXELS = int(np.prod(TINY_X[:-1]))


def test_jvp_matches_the_leaky_baseline(conv):
    x, k = _tiny(conv.dtype)
    tx, tk = random(7, TINY_X, conv.dtype), random(8, TINY_K, conv.dtype)
    y, ty = jax.jvp(lambda x, k: jnp.sin(conv(x, k, M)), (x, k), (tx, tk))
    y_ref, ty_ref = _float64(lambda *a: jax.jvp(lambda x, k: jnp.sin(_leaky(x, k)), a[:2], a[2:]), x, k, tx, tk)
    primal = _float64(_leaky, jnp.abs(x), jnp.abs(k)).max()
    tangent = _float64(lambda *a: _leaky(a[0], a[3]) + _leaky(a[2], a[1]), *map(jnp.abs, (x, k, tx, tk))).max()
    assert_close(y, y_ref, conv.dtype, TAPS * C_IN, primal)
    # cos(y) carries y's rounding (|cos'| <= 1) into the tangent.
    assert_close(ty, ty_ref, conv.dtype, 2 * TAPS * C_IN, tangent * max(1.0, primal))


def test_jacfwd_and_jacrev_match_the_leaky_baseline(conv):
    # Each Jacobian entry is one kernel or input value (one tap joins an input and an output pixel).
    x, k = _tiny(conv.dtype)
    f = lambda x, k: conv(x, k, M)
    expected = _float64(jax.jacfwd(_leaky, (0, 1)), x, k)
    for jac in (jax.jacfwd, jax.jacrev):
        for got, ref, scale in zip(jax.jit(jac(f, (0, 1)))(x, k), expected, (_scale(k), _scale(x))):
            assert_close(got, ref, conv.dtype, 1, scale)


@pytest.mark.slow  # forward over reverse; the fast tier has jacfwd, jacrev and grad of grad
def test_hessian_matches_the_leaky_baseline(conv):
    x, k = _tiny(conv.dtype)
    loss = lambda f: (lambda x, k: jnp.sum(jnp.tanh(f(x, k, M)) ** 2))
    expected = _float64(jax.hessian(loss(_leaky), 1), x, k)
    # H = J^T diag(g''(y)) J with g = tanh^2, |g''| <= 2: the sum of |terms| is at most the
    # Hessian of sum(conv(|x|, k)^2), 2 J^T J on |x|; y's own rounding reaches g'' too.
    magnitude = _float64(jax.hessian(lambda x, k: jnp.sum(_leaky(x, k) ** 2), 1), jnp.abs(x), k).max()
    got = jax.jit(jax.hessian(loss(conv), 1))(x, k)
    assert_close(got, expected, conv.dtype, TAPS * C_IN + PIXELS, magnitude * max(1.0, 2 * _scale(x) * _scale(k)))


def test_linearize_and_its_transpose_match_the_leaky_baseline(conv):
    x, k = _tiny(conv.dtype)
    tx, tk = random(7, TINY_X, conv.dtype), random(8, TINY_K, conv.dtype)
    y, f_lin = jax.linearize(lambda x, k: conv(x, k, M), x, k)
    y_ref, ty_ref = _float64(lambda *a: jax.jvp(_leaky, a[:2], a[2:]), x, k, tx, tk)
    assert_close(y, y_ref, conv.dtype, TAPS * C_IN, _scale(x) * _scale(k))
    tangent = _scale(tx) * _scale(k) + _scale(x) * _scale(tk)
    assert_close(f_lin(tx, tk), ty_ref, conv.dtype, 2 * TAPS * C_IN, tangent)
    dy = random(9, y.shape, conv.dtype)
    dx, dk = jax.linear_transpose(f_lin, x, k)(dy)
    rdx, rdk = masked_conv_reference_vjp(x, k, M, dy)
    assert_close(dx, rdx, conv.dtype, TAPS * C_OUT, _scale(dy) * _scale(k))
    assert_close(dk, rdk, conv.dtype, PIXELS, _scale(dy) * _scale(x))


def test_forward_mode_keeps_the_exactness_contract(conv):
    """NaN tangents of inputs reachable only through masked taps change no output tangent.

    The type-B 3x3 mask masks the row below the centre, so output rows 0-2 reach input
    rows 3-4 only through masked taps; masked kernel entries are never read at all.
    """
    x, k = _tiny(conv.dtype)
    f = lambda x, k: conv(x, k, M)
    tx, tk = random(7, TINY_X, conv.dtype), random(8, TINY_K, conv.dtype)
    _, clean = jax.jvp(f, (x, k), (tx, tk))
    poisoned_tx = tx.at[:, 3:].set(jnp.nan)
    poisoned_tk = jnp.where(M[..., None, None] > 0, tk, jnp.nan)
    _, out = jax.jvp(f, (x, k), (poisoned_tx, poisoned_tk))
    np.testing.assert_array_equal(np.asarray(out[:, :3]), np.asarray(clean[:, :3]))
    _, out = jax.jvp(f, (x, k), (tx, poisoned_tk))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


def test_vmap_of_jvp_over_kernels(conv):
    x, k = _tiny(conv.dtype)
    ks = jnp.stack([k, -0.5 * k])
    tks = jnp.stack([k, k])
    f = lambda k, tk: jax.jvp(lambda k: conv(x, k, M), (k,), (tk,))[1]
    got = jax.vmap(f)(ks, tks)
    for i in range(2):  # the tangent is conv(x, tk): linear in tk
        assert_close(got[i], masked_conv_reference(x, tks[i], M), conv.dtype, TAPS * C_IN, _scale(x) * _scale(tks[i]))
