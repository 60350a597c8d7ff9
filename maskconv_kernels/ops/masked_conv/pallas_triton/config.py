"""The ``pallas_triton`` backend's config: tile sizes, frozen and validated, and their heuristic.

The three kernels are tiled GEMMs:

* forward: ``(pixels, C_in) x (C_in, C_out)`` per active tap, tiles of
  ``block_pixels x block_c_out``, reduction in steps of ``block_c_in``;
* input gradient: ``(pixels, C_out) x (C_out, C_in)`` per active tap, tiles of
  ``block_pixels x block_c_in``, reduction in steps of ``block_c_out``;
* weight gradient: ``(C_in, pixels) x (pixels, C_out)`` per active tap, tiles of
  ``block_c_in x block_c_out``, reduction over ``N * out_pixels`` in steps of
  ``block_pixels_reduce``, split into :func:`weight_grad_splits` independent ranges
  whose partial sums XLA adds in a fixed order (deterministic, no atomics).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ...._core.hardware import TL_DOT_MIN_BLOCK
from ...._core.tiling import next_pow2, reduction_splits
from ...._moved import renamed_attributes
from ..spec import ConvSpec

__all__ = ["Config", "KERNELS", "weight_grad_splits"]

_MIN_BLOCK = TL_DOT_MIN_BLOCK
_MAX_BLOCK = 512

@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes (powers of two, 16 to 512) and Triton launch parameters.

    Attributes:
      block_pixels: output pixels per tile (forward), input pixels per tile (input gradient).
      block_c_in: input channels per tile or reduction step.
      block_c_out: output channels per tile or reduction step.
      block_pixels_reduce: pixels per reduction step of the weight gradient.
      num_warps: warps per Triton program.
      num_stages: software-pipelining stages of the reduction loops.
    """

    block_pixels: int = 64
    block_c_in: int = 32
    block_c_out: int = 64
    block_pixels_reduce: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for field in ("block_pixels", "block_c_in", "block_c_out", "block_pixels_reduce"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"Config.{field} must be an int, got {value!r}")
            if value < _MIN_BLOCK or value > _MAX_BLOCK or value & (value - 1):
                raise ValueError(
                    f"Config.{field} must be a power of two from {_MIN_BLOCK} (the smallest tile Triton's "
                    f"dot accepts) to {_MAX_BLOCK}, got {value}"
                )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Config.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, (int, np.integer)) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"Config.num_stages must be an int from 1 to 8, got {self.num_stages!r}")

    @classmethod
    def get_default(cls, spec: ConvSpec, dtype, kernel: str = "forward") -> Config:
        """The heuristic: one GEMM tile per kernel and dtype, shrunk to the channel counts.

        Each kernel is a GEMM of ``m x n`` tiles reduced in steps of ``k`` (the module
        docstring says which dims): ``(128, 256, 64)``, 8 warps and 3 stages for 16-bit
        inputs, for every kernel; for float32, ``(128, 64, 32)`` with 4 warps and 3 stages
        (forward), ``(128, 128, 32)`` with 8 and 3 (input gradient), ``(128, 128, 16)``
        with 8 and 4 (weight gradient). These won a sweep of each kernel alone on an H200
        at the headline shapes (docs/performance.md). A channel dim's tile is the next
        power of two of its channel count when that is smaller, so that C=3 wastes a
        16-wide tile, not a 256-wide one; a tile that shrinks to fewer than 128x128
        elements gets 4 warps.

        Args:
          spec: the convolution.
          dtype: the inputs' dtype.
          kernel: ``"forward"``, ``"input_grad"`` or ``"weight_grad"``: the kernel the
            config is for (a config passed by the user applies to all three).
        """
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        m, n, k, warps, stages = _GEMM_TILES[np.dtype(dtype).itemsize >= 4][kernel]
        c_in, c_out = spec.c_in, spec.c_out
        if kernel == "forward":
            fields = dict(block_pixels=m, block_c_out=_fit(c_out, n), block_c_in=_fit(c_in, k))
            tile = m * fields["block_c_out"]
        elif kernel == "input_grad":
            fields = dict(block_pixels=m, block_c_in=_fit(c_in, n), block_c_out=_fit(c_out, k))
            tile = m * fields["block_c_in"]
        else:
            fields = dict(block_c_in=_fit(c_in, m), block_c_out=_fit(c_out, n), block_pixels_reduce=k)
            tile = fields["block_c_in"] * fields["block_c_out"]
        return cls(**fields, num_warps=warps if tile >= 128 * 128 else 4, num_stages=stages)


def _fit(channels: int, cap: int) -> int:
    """A channel dim's tile: the next power of two of the channel count, at most ``cap``."""
    return min(cap, next_pow2(max(channels, _MIN_BLOCK)))


# (m, n, k, num_warps, num_stages) per kernel, by whether the inputs are 32-bit.
_GEMM_TILES = {
    False: {"forward": (128, 256, 64, 8, 3), "input_grad": (128, 256, 64, 8, 3), "weight_grad": (128, 256, 64, 8, 3)},
    True: {"forward": (128, 64, 32, 4, 3), "input_grad": (128, 128, 32, 8, 3), "weight_grad": (128, 128, 16, 8, 4)},
}
KERNELS = tuple(_GEMM_TILES[True])


# Its name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"BlockSizes": "Config"})


def weight_grad_splits(programs: int, reduce_blocks: int) -> int:
    """How many ranges the weight gradient's pixel reduction is split into: enough programs
    to fill every SM four times, each range at least 8 pixel blocks (the shared heuristic)."""
    return reduction_splits(programs, reduce_blocks, waves=4, min_steps=8)
