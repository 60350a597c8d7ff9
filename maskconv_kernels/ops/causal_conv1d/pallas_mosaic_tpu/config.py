"""``causal_conv1d``'s ``pallas_mosaic_tpu`` config: blocks, frozen and validated, their heuristic and VMEM budget.

Imports no Pallas module: choosing a backend costs nothing where the kernels do not run.
"""
from __future__ import annotations

import dataclasses

from ...._core.args import is_int
from ...._core.tiling import round_up

__all__ = ["Config", "KERNELS", "DECODE_KERNEL", "MIXED_KERNEL", "ZEROS", "NAN", "PAD", "LANES", "VMEM_LIMIT_BYTES",
           "COMPARE_PAIRS", "halo_rows"]

# The kernels' names (in a lowered module, in profiles).
KERNELS = ("causal_conv1d_tpu_fwd", "causal_conv1d_tpu_bwd")
DECODE_KERNEL = "causal_conv1d_tpu_update"  # causal_conv1d_update's decode step (.decode)
MIXED_KERNEL = "causal_conv1d_tpu_step"  # causal_conv1d_step's mixed step (.mixed)
# The decode kernel's codes for a row's slot read (``reads``): a slot number, or one of these.
ZEROS, NAN, PAD = -1, -2, -3  # not read (zeros); an index outside the pool (NaN); a pad row
LANES = 128  # a vreg's lanes: a block's channels are a multiple of this, or all of them
SUBLANES = 16  # a bfloat16 vreg's rows (float32: 8): halos and position blocks are multiples
MiB = 1 << 20
VMEM_LIMIT_BYTES = 48 * MiB  # what the kernels ask Mosaic for: below v7x's 64 MiB per core
# The serving steps' index bookkeeping in XLA (each token's request, the tiles that store
# state rows, the race check) compares every pair of indices, one fused compare and
# reduction, up to this many pairs, and scatters beyond (docs/design/tpu.md, The race check).
COMPARE_PAIRS = 1 << 22
_MAX_POSITIONS = 8192
_MAX_CHANNELS = 4096


def halo_rows(state_len: int) -> int:
    """``H``: the rows a block reads before (and the backward after) its own, ``S = (W-1) *
    dilation`` rounded up to whole 16-row tiles (16 at least: one bfloat16 vreg)."""
    return max(SUBLANES, round_up(state_len, SUBLANES))


@dataclasses.dataclass(frozen=True)
class Config:
    """Blocks of the two kernels: the forward's and the backward's.

    Attributes:
      block_positions, backward_block_positions: positions per grid step (a multiple of
        16 from 16 to 8192; rounded up to whole halos, ``H`` rows). A step also reads
        the ``H`` positions before its block (the backward: and the ``H`` after), so HBM
        sees each element ``1 + H / positions`` times (``2H`` in the backward).
      block_channels, backward_block_channels: channels per grid step (a multiple of 128
        up to 4096); ``D`` no larger than this is one block of all its channels.
      decode_rows, decode_channels: the decode kernel's (``causal_conv1d_update``) rows of
        the batch and channels per grid step: rows from 1 to 256 (a batch no larger is
        one block; rows are a leading dimension of its blocks), channels a multiple of
        128 up to 8192 (the largest that divides ``D``; ``D`` itself where none does).
        A step moves one DMA per row each way, so the fewer channel blocks the better
        (docs/performance.md, TPU v5e: the decode kernel's sweep).
      step_tokens, step_channels: the mixed step's kernel (``causal_conv1d_step``) tokens
        and channels per grid step: tokens a multiple of 16 from 16 to 256 (a step no longer
        is one block), channels a multiple of 128 up to 8192 (the largest that divides
        ``D``; ``D`` itself where none does). Its slot buffers hold 8 float32 rows a token
        (and ``S`` in the pool's dtype for a 16-bit pool), so their VMEM grows as tokens x
        channels: the tokens are halved until they fit (``MixedStatic.fitted``). A step
        moves one DMA per request each way and channel block, so wider blocks make fewer;
        of four tiles timed on a TPU v5e, few tokens over all the channels was the fastest
        at every serving shape (docs/performance.md).
      step_states_from_frame: the mixed step's kernel stores every token's would-be state
        (``S`` strided stores a token) only in tiles where a request shorter than ``S``
        tokens ends (a decode token's state mixes its slot and its token); elsewhere each
        ending request's state is its last ``S`` inputs, copied from the frame by one
        aligned load and a sublane roll a request. States are the same bits either way.
        On by default: the stores it skips were the step's largest vector cost on a TPU
        v5e, and without them the serving shapes' mixed steps ran 7-17% faster
        (docs/performance.md).

    The defaults fill a grid step with about a MiB of input (Pallas double-buffers each
    block: the step's DMA overlaps the previous step's arithmetic) and keep the
    backward's float32 frames (``2H + positions`` rows of inputs and of the
    pre-activation's cotangent) within a few MiB of VMEM.
    """

    block_positions: int = 1024
    block_channels: int = 512
    backward_block_positions: int = 512
    backward_block_channels: int = 512
    decode_rows: int = 8
    decode_channels: int = 8192
    step_tokens: int = 32
    step_channels: int = 8192
    step_states_from_frame: bool = True

    def __post_init__(self):
        for field in ("block_positions", "backward_block_positions"):
            value = getattr(self, field)
            if not is_int(value) or value % SUBLANES or not SUBLANES <= value <= _MAX_POSITIONS:
                raise ValueError(f"Config.{field} must be a multiple of {SUBLANES} from {SUBLANES} to "
                                 f"{_MAX_POSITIONS}, got {value!r}")
        if not is_int(self.decode_rows) or not 1 <= self.decode_rows <= 256:
            raise ValueError(f"Config.decode_rows must be an int from 1 to 256, got {self.decode_rows!r}")
        if not is_int(self.step_tokens) or self.step_tokens % SUBLANES or not SUBLANES <= self.step_tokens <= 256:
            raise ValueError(f"Config.step_tokens must be a multiple of {SUBLANES} from {SUBLANES} to 256, got "
                             f"{self.step_tokens!r}")
        if not isinstance(self.step_states_from_frame, bool):
            raise TypeError(f"Config.step_states_from_frame must be a bool, got {self.step_states_from_frame!r}")
        step = self.step_channels
        if not is_int(step) or step % LANES or not LANES <= step <= 8192:
            raise ValueError(f"Config.step_channels must be a multiple of {LANES} from {LANES} to 8192, got {step!r}")
        channels = self.decode_channels
        if not is_int(channels) or channels % LANES or not LANES <= channels <= 8192:
            raise ValueError(f"Config.decode_channels must be a multiple of {LANES} from {LANES} to 8192, got "
                             f"{self.decode_channels!r}")
        for field in ("block_channels", "backward_block_channels"):
            value = getattr(self, field)
            if not is_int(value) or value % LANES or not LANES <= value <= _MAX_CHANNELS:
                raise ValueError(f"Config.{field} must be a multiple of {LANES} (whole lane tiles) from {LANES} "
                                 f"to {_MAX_CHANNELS}, got {value!r}")

    @classmethod
    def get_default(cls, length: int, dim: int) -> Config:
        """The defaults (see the class); they apply to every problem (a short sequence is
        one block)."""
        del length, dim
        return cls()

    def blocks(self, backward: bool, length: int, dim: int, state_len: int) -> tuple[int, int]:
        """``(positions, channels)`` of a grid step: positions a multiple of ``H`` (and no
        more than the sequence needs), channels all of ``dim`` where it fits one block."""
        halo = halo_rows(state_len)
        positions = self.backward_block_positions if backward else self.block_positions
        positions = min(round_up(positions, halo), round_up(max(length, 1), halo))
        channels = self.backward_block_channels if backward else self.block_channels
        return positions, (dim if dim <= channels else channels)

    def decode_blocks(self, batch: int, dim: int) -> tuple[int, int]:
        """``(rows, channels)`` of a decode grid step: all rows of a batch no larger than
        ``decode_rows``; the largest multiple of 128 up to ``decode_channels`` that divides
        ``dim`` (its DMAs take whole blocks), or all of ``dim``."""
        rows = batch if batch <= self.decode_rows else self.decode_rows
        return rows, _dividing_channels(dim, self.decode_channels)

    def step_blocks(self, tokens: int, dim: int) -> tuple[int, int]:
        """``(tokens, channels)`` of a mixed step's grid step: all of a step no longer than
        ``step_tokens``; channels as :meth:`decode_blocks` chooses them, up to ``step_channels``."""
        return min(tokens, self.step_tokens), _dividing_channels(dim, self.step_channels)


def _dividing_channels(dim: int, most: int) -> int:
    """All of ``dim`` up to ``most``; else the largest multiple of 128 up to ``most`` that
    divides it (DMAs take whole blocks), or all of ``dim`` where none does."""
    if dim <= most:
        return dim
    fits = [c for c in range(LANES, most + 1, LANES) if dim % c == 0]
    return fits[-1] if fits else dim
