"""masked_conv composes with jit, vmap, grad/vjp and checkpoint."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_close, assert_second_order_close, random, second_order

import maskconv_kernels as mk
from maskconv_kernels.reference import masked_conv_reference, masked_conv_reference_vjp

# Every result is compared with the float64 reference under the suite's float32 bound
# (conftest.TOLERANCE): two float32 programs (eager and jitted, batched and not) may
# round differently, by an amount that depends on the CPU's vector width.
M = mk.pixelcnn_mask((3, 3), "B")
TAPS = int(M.sum())


def _xk():
    return random(0, (2, 6, 7, 3)), random(1, (3, 3, 3, 4))


def _scale(a):
    return float(np.abs(a).max())


def test_vmap_over_an_extra_batch_axis(conv):
    x, k = _xk()
    xs = jnp.stack([x, 2 * x, -x])
    batched = jax.vmap(lambda x: conv(x, k, M))(xs)
    for i in range(3):
        assert_close(batched[i], masked_conv_reference(xs[i], k, M), np.float32, TAPS * 3, _scale(xs[i]) * _scale(k))


def test_vmap_over_kernels_and_its_gradient(conv):
    x, k = _xk()
    ks = jnp.stack([k, 0.5 * k])
    f = lambda k: (conv(x, k, M) ** 2).sum()
    g = jax.vmap(jax.grad(f))(ks)
    for i in range(2):
        # d/dk sum(y^2) = 2 * dk(x, y): y's own rounding (over taps x C_in) and the
        # reduction over pixels, relative to |x| * |y|.
        y = masked_conv_reference(x, ks[i], M)
        _, expected = masked_conv_reference_vjp(x, ks[i], M, 2 * y)
        reduction = TAPS * 3 + int(np.prod(y.shape[:-1]))
        assert_close(g[i], expected, np.float32, reduction, 2 * _scale(x) * _scale(y))


def test_checkpoint_gives_the_same_gradients(conv):
    x, k = _xk()
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
            assert_close(g, e, np.float32, reduction, scale * max(1.0, _scale(x) * _scale(k)))


def test_grad_of_grad_matches_the_leaky_baseline(conv):
    # Reverse over reverse: the backward is itself differentiable (a custom VJP has no
    # forward mode, so jvp/jacfwd are not supported).
    x, k = _xk()
    assert_second_order_close(second_order(conv, x, k, M), x, k, M)


def test_jit_cache_one_trace_per_mask():
    x, k = _xk()
    traces = []

    @jax.jit
    def f(x, k):
        traces.append(1)
        return mk.masked_conv(x, k, M)

    f(x, k)
    f(x + 1, k)
    assert len(traces) == 1
