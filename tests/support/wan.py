"""A faithful re-implementation of Wan's causal 3-D convolution, its frame cache and its resample
layers' time convolutions, channels-last.

Wan's VAE (diffusers' ``WanCausalConv3d`` and ``WanResample``; maxdiffusion's JAX port) makes a
``Conv3d`` causal by hand: it pads time by ``2 * p_T`` frames before and none after, the other
axes by ``p`` on both sides, and convolves with no padding of its own. Encoding and decoding
in chunks (the encoder's first chunk is one frame, then 4; the decoder's one latent frame at a
time), each layer keeps a ``feat_cache`` of the last ``CACHE_T = 2`` input frames; a chunk is
convolved after the cached frames, whose count is taken off the time padding::

    if cache_x is not None and padding_t > 0:
        x = cat([cache_x, x], time); padding_t -= cache_x.shape[time]
    x = pad(x, padding); return conv(x)

and the cache after a chunk is its last two frames (with one frame, the previous cache's
last frame first). :class:`WanCausalConv` is that, on an ``nnx.Conv`` with ``padding="VALID"``.

``WanResample``'s two 3-D modes add a time convolution with special cases of their own
(the per-frame ``Conv2d`` beside it is an ordinary convolution, left out here):

* ``"downsample3d"`` (:class:`WanTimeDownsample`): ``WanCausalConv3d(C, C, (3, 1, 1),
  stride=(2, 1, 1), padding=0)``. The first chunk is not convolved at all: it passes
  through and becomes the cache. Every later chunk is convolved after the cache's last
  frame, with no time padding::

      if feat_cache[idx] is None: feat_cache[idx] = x                 # passes unconvolved
      else: cache_x = x[-1:]; x = time_conv(cat([feat_cache[idx][-1:], x])); feat_cache[idx] = cache_x

* ``"upsample3d"`` (:class:`WanTimeUpsample`): ``WanCausalConv3d(C, 2 C, (3, 1, 1),
  padding=(1, 0, 0))`` whose two channel halves become two frames. The first chunk skips
  it (the cache is marked ``"Rep"``); the second is convolved from zeros (``time_conv(x)``,
  no cache: not the first chunk's frames), its cache led by zeros if it is one frame; later
  chunks after the cache::

      if feat_cache[idx] is None: feat_cache[idx] = "Rep"             # skips the time conv
      else:
          cache_x = x[-2:] (led by the old cache's last frame, or by zeros after "Rep", if short)
          x = time_conv(x) if feat_cache[idx] == "Rep" else time_conv(x, feat_cache[idx])
          feat_cache[idx] = cache_x
          x = x.reshape(b, 2, c, t, h, w); x = stack((x[:, 0], x[:, 1]), 3).reshape(b, c, 2 t, h, w)
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

__all__ = ["CACHE_T", "WanCausalConv", "WanTimeDownsample", "WanTimeUpsample", "run_chunks"]

CACHE_T = 2


def _triple(v) -> tuple[int, int, int]:
    return (v,) * 3 if isinstance(v, int) else tuple(v)


class WanCausalConv(nnx.Module):
    """``WanCausalConv3d``: ``x (N, T, H, W, C)`` -> ``(N, T', H', W', C_out)``.

    ``kernel_size``, ``padding`` and ``strides``: an int or ``(t, h, w)``; ``padding`` defaults
    to ``(k - 1) // 2`` per axis (a ``(k, k, k)`` layer's ``p``). Time is padded ``2 * p_T``
    before, the other axes ``p`` on both sides, and the ``nnx.Conv`` has ``padding="VALID"``.
    """

    def __init__(self, in_features: int, out_features: int, kernel_size=3, *, padding=None, strides=1,
                 rngs: nnx.Rngs):
        kernel_size = _triple(kernel_size)
        self.padding = tuple((k - 1) // 2 for k in kernel_size) if padding is None else _triple(padding)
        self.p = self.padding[1]  # the spatial pad (both spatial axes alike in Wan)
        self.conv = nnx.Conv(in_features, out_features, kernel_size, strides=_triple(strides), padding="VALID",
                             rngs=rngs)

    def __call__(self, x, cache_x=None):
        time = 2 * self.padding[0]
        if cache_x is not None and time > 0:
            x = jnp.concatenate([cache_x, x], axis=1)
            time -= cache_x.shape[1]
        p_h, p_w = self.padding[1:]
        pads = [(0, 0), (time, 0), (p_h, p_h), (p_w, p_w), (0, 0)]
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


class WanTimeDownsample(nnx.Module):
    """``WanResample("downsample3d")``'s time convolution and its cache: :meth:`step` takes one chunk."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.time_conv = WanCausalConv(dim, dim, (3, 1, 1), padding=0, strides=(2, 1, 1), rngs=rngs)

    def step(self, x, feat_cache):
        """``(y, feat_cache)`` for chunk ``x (N, L, H, W, C)``; ``feat_cache`` ``None`` before the first chunk."""
        if feat_cache is None:
            return x, x  # the first chunk passes through unconvolved, and is the cache
        cache_x = x[:, -1:]
        return self.time_conv(jnp.concatenate([feat_cache[:, -1:], x], axis=1)), cache_x


class WanTimeUpsample(nnx.Module):
    """``WanResample("upsample3d")``'s time convolution and its cache: :meth:`step` takes one chunk."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.dim = dim
        self.time_conv = WanCausalConv(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0), rngs=rngs)

    def step(self, x, feat_cache):
        """``(y, feat_cache)`` for chunk ``x (N, L, H, W, C)``: ``y`` is ``x`` for the first chunk
        (``feat_cache`` ``None``), else ``(N, 2 L, H, W, C)``."""
        if feat_cache is None:
            return x, "Rep"  # the first chunk skips the time convolution
        rep = isinstance(feat_cache, str)
        cache_x = x[:, -CACHE_T:]
        if cache_x.shape[1] < 2 and not rep:
            cache_x = jnp.concatenate([feat_cache[:, -1:], cache_x], axis=1)
        if cache_x.shape[1] < 2 and rep:
            cache_x = jnp.concatenate([jnp.zeros_like(cache_x), cache_x], axis=1)
        y = self.time_conv(x) if rep else self.time_conv(x, feat_cache)
        n, t, h, w, _ = y.shape
        # torch: (b, 2c, t) -> (b, 2, c, t) -> stack on a new axis after t: frame 2t + i is half i.
        y = y.reshape(n, t, h, w, 2, self.dim).transpose(0, 1, 4, 2, 3, 5).reshape(n, 2 * t, h, w, self.dim)
        return y, cache_x


def run_chunks(layer, chunks):
    """A resample layer's chunked pass (Wan's encode or decode loop): ``(outputs concatenated, last cache)``."""
    ys, cache = [], None
    for x in chunks:
        y, cache = layer.step(x, cache)
        ys.append(y)
    return jnp.concatenate(ys, axis=1), cache
