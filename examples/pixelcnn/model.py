"""A gated PixelCNN (van den Oord et al., 2016, "Conditional Image Generation with
PixelCNN Decoders") built from :class:`maskconv_kernels.flax.MaskedConv`.

Two stacks remove the blind spot of the original PixelCNN:

* the vertical stack sees whole rows above the pixel. Its first layer uses
  :func:`maskconv_kernels.vertical_stack_mask` type "A" (rows strictly above the
  centre); later layers type "B" also keep the centre row, which is safe because their
  input already depends on rows strictly above only. That is the paper's "shift down
  by one row", done by the mask;
* the horizontal stack sees the pixels left of it in its row
  (:func:`maskconv_kernels.horizontal_stack_mask`, type "A" first, then "B") plus the
  vertical stack at the same position, through a 1x1 convolution.

Each layer is gated, ``tanh(a) * sigmoid(b)``, with a residual connection on the
horizontal stack. ``leaky=True`` builds the same network, with the same parameter
tree, from ``flax.linen.Conv(mask=...)``: the baseline of the receptive-field picture.

``decode=True`` builds it from ``MaskedConv(decode=True)`` layers for fast sampling
(``sampling.py``): the vertical stack is computed one row at a time (``part="rows"``,
once per row: its type "B" layers read the current row on both sides), the horizontal
stack one pixel at a time (``part="pixel"``); the first layers are fed the previous row
and the previous pixel (``decode_shift=1``).

Needs flax and this package only (the tests import it).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import maskconv_kernels as mk
from maskconv_kernels.flax import MaskedConv


def vertical_mask(k: int, first: bool) -> np.ndarray:
    """``(k, k)``: rows strictly above the centre (first layer), or up to and including it."""
    return mk.vertical_stack_mask((k, k), "A" if first else "B")


def horizontal_mask(k: int, first: bool) -> np.ndarray:
    """``(1, k)``: left of the centre (first layer, type "A"), or up to and including it ("B")."""
    return mk.horizontal_stack_mask((1, k), "A" if first else "B")


def gate(a: jax.Array) -> jax.Array:
    value, gate_ = jnp.split(a, 2, axis=-1)
    return jnp.tanh(value) * nn.sigmoid(gate_)


class GatedPixelCNN(nn.Module):
    """``(N, H, W, 1)`` inputs in ``[-1, 1]`` -> ``(N, H, W, levels)`` logits of each pixel's level.

    The logits at pixel ``p`` depend on inputs strictly before ``p`` in raster order only.
    """

    levels: int = 4
    features: int = 32
    layers: int = 5
    first_window: int = 5
    window: int = 3
    leaky: bool = False
    decode: bool = False

    def masked(self, features: int, mask: np.ndarray, c_in: int, name: str, first: bool = False):
        if self.leaky:
            # What flax users write today: the kernel-shaped mask multiplies the kernel.
            full = np.broadcast_to(mask[..., None, None], (*mask.shape, c_in, features))
            return nn.Conv(features, mask.shape, mask=full, name=name)
        return MaskedConv(features, mask.shape, mask=mask, name=name, decode=self.decode, decode_shift=int(first))

    @nn.compact
    def __call__(self, x: jax.Array, part: str = "all", v_pre: tuple | None = None):
        """The logits, or (``decode=True``) one row or one pixel of the network.

        Args:
          x: ``part="all"``: the image ``(N, H, W, 1)``; ``"rows"``: the previous row
            ``(N, 1, W, 1)``; ``"pixel"``: the previous pixel ``(N, 1, 1, 1)``.
          part: ``"all"``, ``"rows"`` (the vertical stack for the current row) or
            ``"pixel"`` (the horizontal stack and head at the current pixel).
          v_pre: ``part="pixel"`` only: the vertical stack's pre-activations at the
            current pixel, one ``(N, 1, 1, 2 * features)`` per layer.

        Returns:
          ``"all"``: ``(N, H, W, levels)`` logits; ``"rows"``: the vertical stack's
          pre-activations, one ``(N, 1, W, 2 * features)`` per layer; ``"pixel"``:
          ``(N, 1, 1, levels)`` logits.
        """
        if part == "rows":
            return self.vertical(x)
        if part == "pixel":
            return self.horizontal(x, v_pre)
        return self.horizontal(x, self.vertical(x))

    def window_of(self, i: int) -> int:
        return self.first_window if i == 0 else self.window

    def vertical(self, v: jax.Array) -> tuple:
        """The vertical stack's pre-activations, one per layer."""
        pres = []
        for i in range(self.layers):
            mask = vertical_mask(self.window_of(i), i == 0)
            v_pre = self.masked(2 * self.features, mask, v.shape[-1], f"v{i}", first=i == 0)(v)
            pres.append(v_pre)
            v = gate(v_pre)
        return tuple(pres)

    def horizontal(self, h: jax.Array, v_pre: tuple) -> jax.Array:
        """The horizontal stack, fed the vertical stack at the same position, then the head."""
        f = self.features
        for i in range(self.layers):
            first = i == 0
            mask = horizontal_mask(self.window_of(i), first)
            h_pre = self.masked(2 * f, mask, h.shape[-1], f"h{i}", first=first)(h)
            h_pre = h_pre + nn.Conv(2 * f, (1, 1), name=f"v_to_h{i}")(v_pre[i])
            h_out = nn.Conv(f, (1, 1), name=f"h_out{i}")(gate(h_pre))
            h = h_out if first else h + h_out
        y = nn.Conv(4 * f, (1, 1), name="head0")(nn.relu(h))
        return nn.Conv(self.levels, (1, 1), name="head1")(nn.relu(y))


def to_input(levels_img: jax.Array, levels: int) -> jax.Array:
    """Integer levels ``(N, H, W)`` -> the model's float input ``(N, H, W, 1)`` in ``[-1, 1]``."""
    return (levels_img[..., None].astype(jnp.float32) / (levels - 1)) * 2.0 - 1.0


def nll_nats(params, model: GatedPixelCNN, levels_img: jax.Array) -> jax.Array:
    """Mean negative log-likelihood per pixel, in nats."""
    logits = model.apply(params, to_input(levels_img, model.levels))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, levels_img[..., None].astype(jnp.int32), axis=-1).mean()
