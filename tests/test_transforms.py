"""masked_conv composes with jit, vmap, grad/vjp and checkpoint."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import random

import maskconv_kernels as mk

M = mk.pixelcnn_mask((3, 3), "B")


def _xk():
    return random(0, (2, 6, 7, 3)), random(1, (3, 3, 3, 4))


def test_vmap_over_an_extra_batch_axis(conv):
    x, k = _xk()
    xs = jnp.stack([x, 2 * x, -x])
    batched = jax.vmap(lambda x: conv(x, k, M))(xs)
    for i in range(3):
        np.testing.assert_allclose(batched[i], conv(xs[i], k, M), rtol=1e-6, atol=1e-6)


def test_vmap_over_kernels_and_its_gradient(conv):
    x, k = _xk()
    ks = jnp.stack([k, 0.5 * k])
    f = lambda k: (conv(x, k, M) ** 2).sum()
    g = jax.vmap(jax.grad(f))(ks)
    for i in range(2):
        np.testing.assert_allclose(g[i], jax.grad(f)(ks[i]), rtol=1e-5, atol=1e-5)


def test_checkpoint_gives_the_same_gradients(conv):
    x, k = _xk()
    f = lambda x, k: jnp.sin(conv(x, k, M)).sum()
    g1 = jax.grad(f, (0, 1))(x, k)
    g2 = jax.jit(jax.grad(jax.checkpoint(f), (0, 1)))(x, k)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_grad_of_grad_matches_the_leaky_baseline(conv):
    # Reverse over reverse: the backward is itself differentiable (a custom VJP has no
    # forward mode, so jvp/jacfwd are not supported).
    x, k = _xk()

    def outer(f):
        gx = lambda k: jax.grad(lambda x: (f(x, k, M) ** 2).sum())(x)
        return jax.grad(lambda k: jnp.tanh(gx(k)).sum())(k)

    expected = outer(lambda x, k, m: mk.leaky_masked_conv(x, k, m, precision="highest"))
    np.testing.assert_allclose(outer(conv), expected, rtol=1e-4, atol=1e-4)


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
