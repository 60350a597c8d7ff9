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
from ..spec import ConvSpec

__all__ = ["Config", "BlockSizes", "weight_grad_splits"]

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
    def get_default(cls, spec: ConvSpec, dtype) -> Config:
        """The heuristic: channel tiles fit the channel counts, 16-bit inputs get larger tiles.

        Channel tiles are the next power of two of the channel count, capped at 64 (32 for
        the float32 reduction tile, whose operands take twice the shared memory), so that
        C=3 wastes a 16-wide tile, not a 64-wide one. Pixel tiles grow when the output
        has many pixels and few channels, so that a program still has work to amortise
        its index arithmetic over.
        """
        wide = np.dtype(dtype).itemsize >= 4
        c_in = min(next_pow2(max(spec.c_in, _MIN_BLOCK)), 32 if wide else 64)
        c_out = min(next_pow2(max(spec.c_out, _MIN_BLOCK)), 64 if wide else 128)
        pixels = 64 if max(spec.c_in, spec.c_out) >= 64 else 128
        return cls(
            block_pixels=pixels,
            block_c_in=c_in,
            block_c_out=c_out,
            block_pixels_reduce=64 if wide else 128,
            num_warps=4 if c_out * pixels <= 64 * 64 else 8,
            num_stages=2 if wide else 3,
        )


BlockSizes = Config  # its name before every backend's config was Config


def weight_grad_splits(programs: int, reduce_blocks: int) -> int:
    """How many ranges the weight gradient's pixel reduction is split into: enough programs
    to fill every SM four times, each range at least 8 pixel blocks (the shared heuristic)."""
    return reduction_splits(programs, reduce_blocks, waves=4, min_steps=8)
