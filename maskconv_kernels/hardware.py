"""Hardware constants the kernel heuristics and ahead-of-time lowering share (one place).

The kernels are tuned for NVIDIA Hopper (H100 / H200): the tile heuristics size their
grids against its SM count, and lowering for ``cuda`` on a machine without a GPU
targets its compute capability.
"""
from __future__ import annotations

__all__ = ["SM_COUNT", "COMPUTE_CAPABILITY", "DEVICE_KIND", "TL_DOT_MIN_BLOCK"]

# Streaming multiprocessors of an H100 SXM / H200.
SM_COUNT = 132
# sm_90: what a cuda lowering targets when no GPU is attached to ask.
COMPUTE_CAPABILITY = 90
# The device an abstract mesh names for a cuda lowering on a host without a GPU (jax >= 0.12).
DEVICE_KIND = "NVIDIA H200"
# Triton's tl.dot needs every dimension of a tile to be at least 16.
TL_DOT_MIN_BLOCK = 16
