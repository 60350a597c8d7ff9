"""Parallelism over a split spatial or sequence axis (data parallelism needs nothing: kernel
calls are batch-partitioned by XLA, :mod:`maskconv_kernels._core.partitioning`).

* :mod:`.spatial`: :func:`spatially_sharded_masked_conv`, the height split, halos by ``ppermute``;
* :mod:`.sequence`: :func:`sequence_sharded_causal_conv1d`, context parallelism (contiguous or
  zigzag: :func:`to_zigzag`, :func:`from_zigzag`);
* :mod:`.time`: :func:`time_sharded_causal_conv`, :func:`time_sharded_causal_conv_transpose`, video and
  audio convolutions with time split (contiguous or zigzag);
* :mod:`.context`: :class:`ContextParallel`, a split as the modules' ``context_parallel`` attribute;
* :mod:`.halo`: what both share.
"""
from .context import ContextParallel
from .sequence import from_zigzag, sequence_sharded_causal_conv1d, to_zigzag
from .spatial import halo_rows, spatially_sharded_masked_conv
from .time import time_sharded_causal_conv, time_sharded_causal_conv_transpose

__all__ = [
    "spatially_sharded_masked_conv", "sequence_sharded_causal_conv1d", "time_sharded_causal_conv",
    "time_sharded_causal_conv_transpose", "to_zigzag", "from_zigzag", "halo_rows", "ContextParallel",
]
