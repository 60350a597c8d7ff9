"""``causal_conv``: causal convolutions over time for video and audio tokenizers, streamed exactly.

* :mod:`.api`: :func:`causal_conv` and :func:`causal_conv_transpose` (upsampling);
* :mod:`.stream`: :func:`causal_conv_stream`, :func:`causal_conv_transpose_stream`, their
  :class:`CausalConvState` and :func:`causal_conv_stream_init`;
* :mod:`.checks`: the arguments, checked into a :class:`~.checks.Problem`;
* :mod:`.phases`: the transposed convolution as one stride-1 convolution per phase;
* :mod:`.reference`: the float64 NumPy oracles;
* :mod:`.backends`: the implementations table, ``masked_conv``'s records.
"""
from .api import IMPLEMENTATIONS, PREFERENCE, causal_conv, causal_conv_transpose
from .checks import PADDING_MODES, SPATIAL_PADDING_MODES
from .reference import causal_conv_reference, causal_conv_transpose_reference
from .stream import CausalConvState, causal_conv_stream, causal_conv_stream_init, causal_conv_transpose_stream

__all__ = [
    "causal_conv", "causal_conv_transpose", "causal_conv_stream", "causal_conv_transpose_stream",
    "causal_conv_stream_init", "CausalConvState", "causal_conv_reference", "causal_conv_transpose_reference",
    "PADDING_MODES", "SPATIAL_PADDING_MODES", "IMPLEMENTATIONS", "PREFERENCE",
]
