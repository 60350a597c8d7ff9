"""``causal_conv1d``'s ``pallas_triton`` config: tiles, frozen and validated, and their heuristic."""
from __future__ import annotations

import dataclasses

from ...._core.args import is_int
from ...._core.tiling import next_pow2, reduction_splits
from ...._moved import renamed_attributes

__all__ = ["Config"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of the fused kernels: the forward's, and the backward's (the input, weight and
    bias gradients; the state's gradient too).

    Attributes:
      block_positions, backward_block_positions: positions per tile (a power of two, 16
        to 1024). Each tap reloads the tile shifted by up to ``(W-1) * dilation``
        positions; those reloads hit the cache, so HBM sees each element once plus the
        halo, ``(W-1) * dilation / block_positions`` of it.
      block_channels, backward_block_channels: channels per tile (a power of two, 16 to
        1024): contiguous, so each position's load is whole 16-byte vectors.
      num_warps, backward_num_warps: warps per program (1, 2, 4, 8 or 16).
      backward_splits: the most ranges the backward splits each channel block's position
        tiles into (each one program, its weight-gradient partial sum added in a fixed
        order afterwards); ``None``: enough programs to fill every SM four times.

    The defaults are the largest tiles that compile for sm_90a without register spills
    (the forward holds 32 values of a tile per thread; the backward keeps ``2W - 1``
    input tiles and ``W`` cotangent tiles live); the ptxas figures are in the design notes.
    """

    block_positions: int = 32
    block_channels: int = 128
    num_warps: int = 4
    backward_block_positions: int = 16
    backward_block_channels: int = 64
    backward_num_warps: int = 2
    backward_splits: int | None = None

    def __post_init__(self):
        for field in ("block_positions", "block_channels", "backward_block_positions", "backward_block_channels"):
            value = getattr(self, field)
            if not is_int(value) or not 16 <= value <= 1024 or value & (value - 1):
                raise ValueError(f"Config.{field} must be a power of two from 16 to 1024, got {value!r}")
        for field in ("num_warps", "backward_num_warps"):
            value = getattr(self, field)
            if not is_int(value) or value not in (1, 2, 4, 8, 16):
                raise ValueError(f"Config.{field} must be 1, 2, 4, 8 or 16, got {value!r}")
        splits = self.backward_splits
        if splits is not None and (not is_int(splits) or splits < 1):
            raise ValueError(f"Config.backward_splits must be None or a positive int, got {splits!r}")

    @classmethod
    def get_default(cls, length: int, dim: int) -> Config:
        """The defaults (see the class), smaller where the sequence or the channels are."""
        fit = lambda n, most: min(most, max(16, next_pow2(n)))  # noqa: E731
        return cls(
            block_positions=fit(length, 32), block_channels=fit(dim, 128),
            backward_block_positions=fit(length, 16), backward_block_channels=fit(dim, 64),
        )

    def tile(self, backward: bool) -> tuple[int, int, int]:
        """``(positions, channels, warps)`` of the forward's or the backward's tiles."""
        if backward:
            return self.backward_block_positions, self.backward_block_channels, self.backward_num_warps
        return self.block_positions, self.block_channels, self.num_warps

    def splits(self, channel_blocks: int, position_tiles: int) -> int:
        """Position ranges per channel block in the backward: ``channel_blocks * splits``
        programs fill every SM four times (or ``backward_splits`` caps them), none empty.

        Four: the backward holds 255 registers a thread, so four 2-warp programs fit an
        SM's 64K registers; each walks its tiles in order, and more of them keep more
        loads in flight. The partial sums, ``splits * (W + 1) * D`` float32, are small.
        """
        return reduction_splits(channel_blocks, position_tiles, waves=4, min_steps=1, most=self.backward_splits)


# Its name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"BlockSizes": "Config"})
