"""``causal_conv1d``'s ``pallas_mosaic_gpu`` config: tiles, frozen and validated, and their heuristic.

Imports no Mosaic GPU module (jax 0.10's needs absl-py): choosing a backend costs nothing.
"""
from __future__ import annotations

import dataclasses

from ...._core.args import is_int
from ...._core.tiling import next_pow2

__all__ = ["Config", "KERNELS"]

# The kernels' names (in a lowered module, in ptxas' logs): here, so that naming them
# imports no Mosaic GPU.
KERNELS = ("causal_conv1d_mgpu_fwd", "causal_conv1d_mgpu_bwd_pre", "causal_conv1d_mgpu_bwd")

# A tile is one warpgroup's WGMMA register layout: rows in 64s, columns in 8s.
_POSITIONS = (64, 128)
_CHANNELS = (8, 16, 32, 64, 128)
# float32 values of one tile per thread (128 threads): the backward keeps a few tiles
# live (its input gradient, the inputs, a cotangent); 32 each compiles without spills.
_MAX_TILE = 64 * 64


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of the Mosaic GPU kernels: the forward's, and the backward's (the cotangent of
    the pre-activation, then the input, weight and bias gradients).

    Attributes:
      block_positions, backward_block_positions: positions per tile, 64 or 128 (the rows
        of the WGMMA register layout one warpgroup holds). The state, ``(W-1) * dilation``
        positions, is rounded up to whole tiles in front of the sequence.
      block_channels, backward_block_channels: channels per tile, a power of two from 8 to
        128 (contiguous: each thread loads pairs of neighbouring channels).

    ``positions * channels`` is at most 4096: 32 float32 registers a thread per tile, so the
    backward's live tiles compile for sm_90a without spills.
    """

    block_positions: int = 64
    block_channels: int = 64
    backward_block_positions: int = 64
    backward_block_channels: int = 64

    def __post_init__(self):
        for field, allowed in (
            ("block_positions", _POSITIONS), ("backward_block_positions", _POSITIONS),
            ("block_channels", _CHANNELS), ("backward_block_channels", _CHANNELS),
        ):
            value = getattr(self, field)
            if not is_int(value) or value not in allowed:
                raise ValueError(f"Config.{field} must be one of {allowed}, got {value!r}")
        for positions, channels in (("block_positions", "block_channels"),
                                    ("backward_block_positions", "backward_block_channels")):
            if getattr(self, positions) * getattr(self, channels) > _MAX_TILE:
                raise ValueError(
                    f"Config.{positions} * {channels} must be at most {_MAX_TILE} (32 float32 registers a thread "
                    f"per tile), got {getattr(self, positions)} * {getattr(self, channels)}"
                )

    @classmethod
    def get_default(cls, length: int, dim: int) -> Config:
        """64 positions by 64 channels, fewer channels where ``dim`` is smaller (8 at least)."""
        del length  # a tile of 64 positions is the layout's least
        channels = min(64, max(8, next_pow2(dim)))
        return cls(block_channels=channels, backward_block_channels=channels)

    def tile(self, backward: bool) -> tuple[int, int]:
        """``(positions, channels)`` of the forward's or the backward's tiles."""
        if backward:
            return self.backward_block_positions, self.backward_block_channels
        return self.block_positions, self.block_channels
