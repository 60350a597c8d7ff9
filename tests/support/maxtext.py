"""Faithful re-implementations of MaxText's short convolutions, the layers the porting tests port.

MaxText's Qwen3-Next gated DeltaNet (``src/MaxText/layers/qwen3.py``,
``Qwen3NextGatedDeltaNet``) convolves its ``q, k, v`` projections with::

    self.conv1d = nnx.Conv(conv_dim, conv_dim, kernel_size=(K,), feature_group_count=conv_dim,
                           padding="CAUSAL", use_bias=False, dtype=cfg.dtype, rngs=rngs)
    qkv_conv = jax.nn.silu(self.conv1d(qkv).astype(jnp.float32)).astype(cfg.dtype)

(``param_dtype`` left at float32, so a bfloat16 ``cfg.dtype`` rounds the float32 kernel to
bfloat16 before it convolves), and its serving path keeps a ``(B, K - 1, D)`` conv state, the
last ``K - 1`` inputs of each row, from which a decode step convolves the state followed by
the new tokens. Packed rows carry ``decoder_segment_ids`` with documents ``1, 2, ...`` and
padding ``0``, which this convolution ignores.

:class:`MaxTextShortConv` is that: the same ``nnx.Conv``, the same float32 SiLU, the same
state (read naively from the row's last ``K - 1`` positions, as MaxText reads it; the tests
take it from unpadded rows, where it is right).

MaxText's Engram layer (``src/MaxText/layers/engram.py``, ``ShortConv``) normalises each of its
``G`` groups with an ``nnx.RMSNorm``, concatenates them and convolves with a depthwise,
dilated ``CAUSAL`` conv (``dilation = max_ngram_size``), float32 throughout::

    self.conv = nnx.Conv(G * C, G * C, kernel_size=(K,), feature_group_count=G * C,
                         kernel_dilation=(dilation,), padding="CAUSAL", use_bias=False, rngs=rngs)
    y = self.act_fn(self.conv(jnp.concatenate([norm_i(x[:, :, i]) for i ...], -1)))  # SiLU

:class:`MaxTextEngramConv` is that, ``x (B, L, G, C)`` -> ``(B, L, G, C)``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["MaxTextShortConv", "MaxTextEngramConv", "maxtext_segment_ids"]


class MaxTextShortConv(nnx.Module):
    """MaxText's gated DeltaNet short convolution and its conv state, ``x (B, L, D)`` -> ``(B, L, D)`` in ``dtype``."""

    def __init__(self, dim: int, kernel_size: int, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):
        self.kernel_size = kernel_size
        self.dtype = dtype
        self.conv1d = nnx.Conv(dim, dim, kernel_size=(kernel_size,), feature_group_count=dim, padding="CAUSAL",
                               use_bias=False, dtype=dtype, rngs=rngs)

    def _silu(self, y):
        return jax.nn.silu(y.astype(jnp.float32)).astype(self.dtype)

    def __call__(self, qkv):
        """The training / prefill pass."""
        return self._silu(self.conv1d(qkv))

    def prefill(self, qkv):
        """``(outputs, conv_state)``: the state is the last ``K - 1`` inputs, in ``dtype``."""
        return self(qkv), qkv[:, qkv.shape[1] - (self.kernel_size - 1):].astype(self.dtype)

    def decode(self, tokens, conv_state):
        """``T`` new tokens after ``conv_state``: ``(outputs (B, T, D), new conv_state)``."""
        window = jnp.concatenate([conv_state, tokens.astype(self.dtype)], axis=1)
        y = self._silu(self.conv1d(window))[:, conv_state.shape[1]:]
        return y, window[:, window.shape[1] - (self.kernel_size - 1):]


class MaxTextEngramConv(nnx.Module):
    """MaxText Engram's ``ShortConv``: group-wise RMS norms, a depthwise dilated causal conv, SiLU."""

    def __init__(self, hidden_size: int, kernel_size: int = 4, dilation: int = 3, hc_mult: int = 4, *,
                 rngs: nnx.Rngs):
        channels = hidden_size * hc_mult
        self.conv = nnx.Conv(channels, channels, kernel_size=(kernel_size,), feature_group_count=channels,
                             kernel_dilation=(dilation,), padding="CAUSAL", use_bias=False, rngs=rngs)
        self.norms = nnx.List([nnx.RMSNorm(num_features=hidden_size, rngs=rngs) for _ in range(hc_mult)])

    def normed(self, x):
        """``(B, L, G * C)``: each group normalised, concatenated (what the conv reads)."""
        return jnp.concatenate([self.norms[i](x[:, :, i, :]) for i in range(x.shape[2])], axis=-1)

    def __call__(self, x):
        b, length, g, c = x.shape
        return jax.nn.silu(self.conv(self.normed(x))).reshape(b, length, g, c)


def maxtext_segment_ids(lengths, total: int):
    """``decoder_segment_ids`` of one packed row: documents of ``lengths`` numbered from 1, then ``0`` up to ``total``."""
    ids = [k + 1 for k, n in enumerate(lengths) for _ in range(n)]
    return jnp.asarray(ids + [0] * (total - len(ids)), jnp.int32)
