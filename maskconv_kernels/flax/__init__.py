"""Flax modules: exact drop-in replacements for ``Conv(mask=...)``.

* :class:`maskconv_kernels.flax.linen.Conv` replaces ``flax.linen.Conv``;
* :class:`maskconv_kernels.flax.nnx.Conv` replaces ``flax.nnx.Conv``;
* :class:`ShortConv` and :class:`maskconv_kernels.flax.nnx.ShortConv`: the short causal
  convolution of Mamba / gated DeltaNet layers (``weight``, ``bias``, ``activation``),
  with ``decode=True`` for serving; :func:`from_conv_params` loads a depthwise
  ``nn.Conv``'s parameters into it (``nnx.ShortConv.from_conv`` an ``nnx.Conv``);
* :class:`CausalConv` and :class:`maskconv_kernels.flax.nnx.CausalConv`: a causal
  convolution over time (:func:`maskconv_kernels.causal_conv`) with ``nn.Conv``'s
  parameters, for video and audio tokenizers, with ``decode=True`` streaming chunks.

Each ``Conv`` is also importable as ``MaskedConv`` (the same class; ``maskconv_kernels.flax.MaskedConv``
is the linen one). Both keep the class name, parameter names, shapes and initialisers of
the flax module, so a checkpoint of one loads into the other. Needs the ``flax`` extra
(``pip install "maskconv-kernels[flax]"``); the core package does not import flax.
"""
# Absolute imports throughout: inside this package, the name ``flax`` must stay the
# flax library, not ``maskconv_kernels.flax``.
from maskconv_kernels._extras import require

require("flax", "flax", "maskconv_kernels.flax")

from maskconv_kernels.flax import linen, nnx  # noqa: E402
from maskconv_kernels.flax.linen import CausalConv, Conv, MaskedConv, ShortConv, from_conv_params  # noqa: E402

__all__ = ["Conv", "MaskedConv", "ShortConv", "CausalConv", "from_conv_params", "linen", "nnx"]
