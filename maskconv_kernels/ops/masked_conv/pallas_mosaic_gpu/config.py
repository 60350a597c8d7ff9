"""The ``pallas_mosaic_gpu`` backend's config: tile sizes, frozen and validated, and their heuristic.

The kernels are implicit GEMMs over a padded pixel grid (:mod:`.grid`):

* forward and input gradient (:func:`.kernels.tap_gemm`): tiles of ``tile_pixels``
  output pixels (the wgmma M dimension) by ``tile_n`` output channels; the reduction runs
  over the active taps times ``block_k`` channels, one TMA box per step;
* weight gradient (:func:`.kernels.tap_weight_grad`): per active tap, tiles of 64 input
  channels by ``tile_n`` output channels, reduced over pixels one grid row chunk per
  step, split ``weight_grad_splits`` ways (partial sums added in a fixed order).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ...._core.hardware import SMEM_BYTES
from ...._moved import renamed_attributes
from ...._core.tiling import next_pow2, reduction_splits
from ..spec import ConvSpec

__all__ = ["Config", "stages", "weight_grad_splits"]

_PIXEL_TILES = (64, 128)  # wgmma's M is 64 per warpgroup instruction; 128 is two
_BLOCK_K = (16, 32, 64)  # 16-bit channels: 32, 64 or 128 bytes, one swizzle span
_TILE_N = (16, 32, 64, 128, 256)
_MAX_ACC = 128 * 128  # accumulator elements per warpgroup: 128 float32 registers per thread


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes and pipelining of the ``pallas_mosaic_gpu`` kernels.

    Attributes:
      tile_pixels: output pixels per forward / input-gradient tile: 64 or 128.
      tile_n: output channels per tile (input channels for the input gradient): 16 to 256,
        a power of two; the weight gradient's output-channel tile too.
      block_k: channels per reduction step (one TMA box of ``tile_pixels x block_k``): 16,
        32 or 64.
      max_concurrent_steps: TMA boxes in flight per program (pipeline stages), 1 to 8.
      weight_grad_splits: the most ranges the weight gradient's pixel reduction may be
        split into; ``None``: enough programs for every SM (:func:`weight_grad_splits`).
      weight_grad_c_in: input channels per weight-gradient tile (its wgmma M): 64 or 128.
      warp_specialized: forward and input gradient with a TMA producer warpgroup and two
        ``wgmma`` consumer warpgroups (tiles of ``2 * tile_pixels`` pixels), as jax's Hopper
        matmul; ``False``: one warpgroup issues both.
    """

    tile_pixels: int = 64
    tile_n: int = 64
    block_k: int = 64
    max_concurrent_steps: int = 3
    weight_grad_splits: int | None = None
    weight_grad_c_in: int = 64
    warp_specialized: bool = True

    def __post_init__(self):
        for field, allowed in (("tile_pixels", _PIXEL_TILES), ("tile_n", _TILE_N), ("block_k", _BLOCK_K)):
            value = getattr(self, field)
            if isinstance(value, bool) or value not in allowed:
                raise ValueError(f"Config.{field} must be one of {allowed}, got {value!r}")
        if isinstance(self.weight_grad_c_in, bool) or self.weight_grad_c_in not in _PIXEL_TILES:
            raise ValueError(f"Config.weight_grad_c_in must be one of {_PIXEL_TILES}, got {self.weight_grad_c_in!r}")
        if max(self.tile_pixels, self.weight_grad_c_in) * self.tile_n > _MAX_ACC:
            raise ValueError(
                f"Config.tile_pixels * tile_n and weight_grad_c_in * tile_n must be at most {_MAX_ACC}: the float32 "
                f"accumulator lives in one warpgroup's registers ({_MAX_ACC // 128} per thread), got "
                f"{self.tile_pixels}, {self.weight_grad_c_in} and {self.tile_n}"
            )
        steps = self.max_concurrent_steps
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= 8:
            raise ValueError(f"Config.max_concurrent_steps must be an int from 1 to 8, got {steps!r}")
        if not isinstance(self.warp_specialized, bool):
            raise ValueError(f"Config.warp_specialized must be a bool, got {self.warp_specialized!r}")
        splits = self.weight_grad_splits
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, (int, np.integer)) or splits < 1):
            raise ValueError(f"Config.weight_grad_splits must be None or a positive int, got {splits!r}")

    @classmethod
    def get_default(cls, spec: ConvSpec, dtype=None) -> Config:
        """Channel tiles that fit the channel counts (C=3 pads to 16, not 64); 128-pixel and
        128-channel tiles once channels are wide enough that 64 would reload the other
        operand too often."""
        del dtype  # 16-bit only: one heuristic
        c_max = max(spec.c_in, spec.c_out)
        return cls(
            tile_pixels=128 if c_max >= 128 else 64,
            tile_n=min(128, next_pow2(max(spec.c_out, 16))),
            block_k=min(64, next_pow2(max(spec.c_in, 16))),
            # A 128-channel tile reads each cotangent chunk half as often (L2 traffic).
            weight_grad_c_in=128 if spec.c_in >= 128 else 64,
        )


def stages(tiles: Config, step_bytes: int, fixed_bytes: int) -> int:
    """Pipeline stages: ``tiles.max_concurrent_steps``, fewer if shared memory cannot hold them (at least 2)."""
    fit = (SMEM_BYTES - fixed_bytes) // step_bytes
    if fit < 2:
        raise ValueError(
            f"Config {tiles} needs {fixed_bytes + 2 * step_bytes} bytes of shared memory for two pipeline stages, "
            f"more than the {SMEM_BYTES} an H100/H200 block has: use smaller tiles"
        )
    return max(2, min(tiles.max_concurrent_steps, fit))


def weight_grad_splits(tiles: Config, programs: int, chunks: int) -> int:
    """Splits of the weight gradient's reduction over ``chunks`` pixel chunks: a divisor of
    ``chunks`` (the kernel's chunks tile it exactly), at least 8 chunks each, filling every
    SM four times with the least waste in the last wave (the shared heuristic);
    ``tiles.weight_grad_splits`` caps them instead."""
    return reduction_splits(programs, chunks, waves=4, min_steps=8, most=tiles.weight_grad_splits, divisor=True)


# Its name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"Tiles": "Config"})
