"""The ``xla`` backend: exact masked convolutions in pure JAX, on every platform.

* :mod:`.conv`: :class:`Config` (a strategy per linear map), :func:`unsupported` and the
  three maps as :mod:`..maps` calls them;
* :mod:`.blocks`: the blocked strategies, ``"gemm"`` and ``"conv_blocks"``;
* :mod:`.depthwise`: depthwise problems as shifted products, and the segment selects.
"""
from .conv import MAPS, STRATEGIES, Config, XlaConfig, cpu_strategy, forward, input_grad, unsupported, weight_grad

__all__ = ["Config", "XlaConfig", "STRATEGIES", "MAPS", "cpu_strategy", "unsupported", "forward", "input_grad", "weight_grad"]
