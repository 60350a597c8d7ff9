"""Pallas GPU kernels (Triton lowering) that never read a masked tap.

* :mod:`.config`: :class:`BlockSizes`, the tile sizes and their heuristic;
* :mod:`.kernels`: the forward, input-gradient and weight-gradient kernels;
* :mod:`.conv`: :func:`unsupported`, :func:`masked_conv` and the custom VJP wiring.

Runs on NVIDIA GPUs, or anywhere with ``interpret=True``. Supports 1-D and 2-D
convolutions with any padding, strides, dilation, window or channel-partial masks and
float32 / bfloat16 / float16; 3-D and ``feature_group_count > 1`` are reported by
:func:`unsupported` (``implementation=None`` then uses ``"xla"``).

jax >= 0.11 deprecates the Pallas Triton backend; its warning is silenced at each
``pallas_call`` (see ``kernels._pallas_call``) until the official-Triton backend (issue 7).
"""
from .config import BlockSizes
from .conv import masked_conv, unsupported

__all__ = ["BlockSizes", "masked_conv", "unsupported"]
