"""A faithful re-implementation of LTX-2's causal 3-D convolution, channels-last.

maxdiffusion's ``LTX2VideoCausalConv3d`` (the JAX port of diffusers' layer of the same name)
pads by hand and convolves with an ``nnx.Conv(padding="VALID")``::

    if causal:   # frame 0 repeated k_T - 1 times before it
        x = concatenate([repeat(x[:, :1], k_T - 1, axis=1), x], axis=1)
    else:        # frame 0 and the last frame, (k_T - 1) // 2 each side
        ...
    x = jnp.pad(x, ((0, 0), (0, 0), (k_H // 2,) * 2, (k_W // 2,) * 2, (0, 0)), mode=mode)
    return self.conv(x)

with ``mode`` its ``spatial_padding_mode`` (``"zeros"`` read as ``"constant"``,
``"replicate"`` as ``"edge"``, ``"reflect"`` as it is). ``LTX2VideoAutoencoderKL`` defaults to
``decoder_causal=True`` and ``decoder_spatial_padding_mode="reflect"``: every convolution of its
decoder repeats frame 0 along time and reflects the spatial axes. The kernel is drawn by
``xavier_uniform``, the bias by ``nnx.Conv``'s default (zeros).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

__all__ = ["LTX2CausalConv"]

_MODES = {"zeros": "constant", "replicate": "edge"}


class LTX2CausalConv(nnx.Module):
    """``LTX2VideoCausalConv3d``: ``x (N, T, H, W, C)`` -> ``(N, T', H', W', C_out)``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size=3, stride=1, groups: int = 1,
                 spatial_padding_mode: str = "zeros", *, rngs: nnx.Rngs):
        self.kernel_size = (kernel_size,) * 3 if isinstance(kernel_size, int) else tuple(kernel_size)
        self.spatial_padding_mode = spatial_padding_mode
        self.conv = nnx.Conv(in_channels, out_channels, self.kernel_size,
                             strides=(stride,) * 3 if isinstance(stride, int) else tuple(stride),
                             feature_group_count=groups, padding="VALID",
                             kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)

    def __call__(self, x, causal: bool = True):
        k_t, k_h, k_w = self.kernel_size
        if causal:
            if k_t > 1:
                x = jnp.concatenate([jnp.repeat(x[:, :1], k_t - 1, axis=1), x], axis=1)
        elif (k_t - 1) // 2 > 0:
            side = (k_t - 1) // 2
            x = jnp.concatenate([jnp.repeat(x[:, :1], side, axis=1), x, jnp.repeat(x[:, -1:], side, axis=1)], axis=1)
        if k_h // 2 > 0 or k_w // 2 > 0:
            pads = ((0, 0), (0, 0), (k_h // 2,) * 2, (k_w // 2,) * 2, (0, 0))
            x = jnp.pad(x, pads, mode=_MODES.get(self.spatial_padding_mode, self.spatial_padding_mode))
        return self.conv(x)
