"""The ``xla`` backend: exact masked convolutions in pure JAX, on every platform.

* :mod:`.conv`: :class:`Config` (a strategy per linear map), :func:`unsupported` and the
  three maps as :mod:`..maps` calls them;
* :mod:`.blocks`: the blocked strategies, ``"gemm"`` and ``"conv_blocks"``;
* :mod:`.depthwise`: depthwise problems as shifted products, and the segment selects.
"""
from ...._moved import renamed_attributes
from .conv import (
    DIRECT_CONVOLUTION, MAPS, STRATEGIES, Config, cpu_strategy, forward, input_grad, unsupported, weight_grad,
)

__all__ = [
    "Config", "STRATEGIES", "MAPS", "DIRECT_CONVOLUTION", "cpu_strategy", "unsupported", "forward", "input_grad",
    "weight_grad",
]

# The config's name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"XlaConfig": "Config"})
