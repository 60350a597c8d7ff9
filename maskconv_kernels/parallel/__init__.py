"""Parallelism over a split spatial or sequence axis (data parallelism needs nothing: kernel
calls are batch-partitioned by XLA, :mod:`maskconv_kernels._core.partitioning`).

* :mod:`.spatial`: :func:`spatially_sharded_masked_conv`, the height split, halos by ``ppermute``;
* :mod:`.sequence`: :func:`sequence_sharded_causal_conv1d`, context parallelism;
* :mod:`.halo`: what both share.
"""
from .sequence import sequence_sharded_causal_conv1d
from .spatial import halo_rows, spatially_sharded_masked_conv

__all__ = ["spatially_sharded_masked_conv", "sequence_sharded_causal_conv1d", "halo_rows"]
