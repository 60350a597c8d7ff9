"""Sampling the gated PixelCNN of ``model.py`` pixel by pixel: naive, and with decode caches.

Both draw pixel ``p`` (raster order) as ``jax.random.categorical(sub, logits_p)`` with
``key, sub = jax.random.split(key)`` per pixel, so from the same key they give the same
samples whenever their logits agree (exactly, in practice: both sum over active taps only).

* :func:`sample_naive`: one full forward pass of the network per pixel, ``H * W`` passes
  over the whole image, as everyone samples a PixelCNN (a jitted ``lax.fori_loop``).
* :func:`sample_cached`: the same network with ``decode=True`` (Ramachandran et al.
  2017): the vertical stack once per row, the horizontal stack once per pixel, each layer
  reading its recent inputs from a cache. One ``lax.scan`` over rows, one over pixels.
* :func:`resample_from_logits`: what naive sampling would have drawn, from one full
  forward pass over finished samples. Exactness makes this cheap check equivalent to
  naive sampling: the logits at ``p`` read only pixels before ``p``, so changing the
  later ones (zeros during naive sampling, samples here) leaves them bit-identical.

Needs flax and this package only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from model import GatedPixelCNN, to_input


@functools.partial(jax.jit, static_argnames=("model", "n", "shape", "steps"))
def sample_naive(model: GatedPixelCNN, variables, key, n: int, shape: tuple[int, int], steps: int | None = None):
    """``(n, H, W)`` int32 levels; one full forward pass per pixel.

    ``steps`` (default ``H * W``) stops early: the first ``steps`` pixels are drawn (for
    timing the per-pixel cost on large images), the rest stay 0.
    """
    h, w = shape

    def body(p, carry):
        key, img = carry
        logits = model.apply(variables, to_input(img, model.levels))
        key, sub = jax.random.split(key)
        i, j = p // w, p % w
        return key, img.at[:, i, j].set(jax.random.categorical(sub, logits[:, i, j]))

    return jax.lax.fori_loop(0, h * w if steps is None else steps, body, (key, jnp.zeros((n, h, w), jnp.int32)))[1]


@functools.partial(jax.jit, static_argnames=("model", "n", "shape"))
def sample_cached(model: GatedPixelCNN, variables, key, n: int, shape: tuple[int, int]):
    """``(n, H, W)`` int32 levels; each layer computes each position once, from its cache."""
    h, w = shape
    dec = model.clone(decode=True)
    # Only the cache is kept: XLA drops the rest of this init (a full pass, fresh params).
    cache = dec.init(jax.random.key(0), jnp.zeros((n, h, w, 1)))["cache"]
    params = variables["params"]

    def row(carry, i):
        cache, key, img = carry
        previous_row = to_input(img[:, jnp.maximum(i - 1, 0)][:, None], model.levels)  # ignored at i = 0
        v_pre, mutated = dec.apply({"params": params, "cache": cache}, previous_row, part="rows", mutable=["cache"])

        def pixel(carry, j):
            cache, key, img = carry
            q = jnp.maximum(i * w + j - 1, 0)  # the previous pixel in raster order (ignored at 0)
            previous = to_input(img[:, q // w, q % w][:, None, None], model.levels)
            v_at = tuple(jax.lax.dynamic_slice_in_dim(v, j, 1, axis=2) for v in v_pre)
            logits, mutated = dec.apply(
                {"params": params, "cache": cache}, previous, part="pixel", v_pre=v_at, mutable=["cache"]
            )
            key, sub = jax.random.split(key)
            img = img.at[:, i, j].set(jax.random.categorical(sub, logits[:, 0, 0]))
            return (mutated["cache"], key, img), None

        return jax.lax.scan(pixel, (mutated["cache"], key, img), jnp.arange(w))[0], None

    start = (cache, key, jnp.zeros((n, h, w), jnp.int32))
    return jax.lax.scan(row, start, jnp.arange(h))[0][2]


@functools.partial(jax.jit, static_argnames=("model",))
def resample_from_logits(model: GatedPixelCNN, variables, key, samples):
    """What :func:`sample_naive` draws from ``key``, given its result ``samples`` ``(n, H, W)``."""
    n, h, w = samples.shape
    logits = model.apply(variables, to_input(samples, model.levels)).reshape(n, h * w, -1)

    def draw(key, p):
        key, sub = jax.random.split(key)
        return key, jax.random.categorical(sub, logits[:, p])

    return jnp.moveaxis(jax.lax.scan(draw, key, jnp.arange(h * w))[1], 0, 1).reshape(n, h, w)
