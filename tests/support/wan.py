"""A faithful re-implementation of Wan's causal 3-D convolution and its frame cache, channels-last.

Wan's VAE (diffusers' ``WanCausalConv3d``; maxdiffusion's JAX port) makes a ``Conv3d``
causal by hand: it pads time by ``2 * p_T`` frames before and none after, the other axes
by ``p`` on both sides, and convolves with no padding of its own. Decoding in chunks, each
layer keeps a ``feat_cache`` of the last ``CACHE_T = 2`` input frames; a chunk is
convolved after the cached frames, whose count is taken off the time padding::

    if cache_x is not None and padding_t > 0:
        x = cat([cache_x, x], time); padding_t -= cache_x.shape[time]
    x = pad(x, padding); return conv(x)

and the cache after a chunk is its last two frames (with one frame, the previous cache's
last frame first). :class:`WanCausalConv` is that, on an ``nnx.Conv`` with ``padding="VALID"``.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

__all__ = ["CACHE_T", "WanCausalConv"]

CACHE_T = 2


class WanCausalConv(nnx.Module):
    """``x (N, T, H, W, C)`` -> ``(N, T, H, W, C_out)`` with a ``(k, k, k)`` kernel, padding ``p = (k - 1) // 2``."""

    def __init__(self, in_features: int, out_features: int, kernel_size: int = 3, *, rngs: nnx.Rngs):
        self.p = (kernel_size - 1) // 2
        self.conv = nnx.Conv(in_features, out_features, (kernel_size,) * 3, padding="VALID", rngs=rngs)

    def __call__(self, x, cache_x=None):
        time = 2 * self.p
        if cache_x is not None and time > 0:
            x = jnp.concatenate([cache_x, x], axis=1)
            time -= cache_x.shape[1]
        pads = [(0, 0), (time, 0), (self.p, self.p), (self.p, self.p), (0, 0)]
        return self.conv(jnp.pad(x, pads))

    @staticmethod
    def next_cache(x, feat_cache=None):
        """The ``feat_cache`` after chunk ``x``: its last ``CACHE_T`` frames, led by the old cache's last one if short."""
        cache_x = x[:, -CACHE_T:]
        if cache_x.shape[1] < CACHE_T and feat_cache is not None:
            cache_x = jnp.concatenate([feat_cache[:, -1:], cache_x], axis=1)
        return cache_x

    def decode(self, chunks):
        """Wan's chunked decode: each chunk after the cache of the previous; the outputs concatenated."""
        ys, cache = [], None
        for x in chunks:
            ys.append(self(x, cache))
            cache = self.next_cache(x, cache)
        return jnp.concatenate(ys, axis=1), cache
