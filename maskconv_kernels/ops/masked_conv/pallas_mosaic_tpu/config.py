"""The ``pallas_mosaic_tpu`` backend's config: block sizes, frozen and validated, their heuristic and VMEM budget.

The three kernels are sums of shifted GEMMs (:mod:`.geometry`):

* forward and input gradient: a grid step computes ``block_pixels`` result pixels
  (about: whole rows, or whole sublane tiles of a single row) by ``block_channels``
  result channels, summing every active tap's ``(pixels, C_read) x (C_read, channels)``
  product in float32;
* weight gradient: a grid step adds ``block_taps`` active taps' ``(C_in, pixels) x
  (pixels, channels)`` products, over ``block_pixels`` output pixels, into a float32
  ``(block_taps, C_in, block_channels)`` accumulator that lives across the batch and
  pixel steps.

VMEM: TPU v5e has 128 MiB per core, v7x 64 MiB, and Mosaic's scoped default is 16 or
32 MiB. The kernels ask for :data:`VMEM_LIMIT_BYTES` (48 MiB) and the heuristic keeps
the buffers it counts (:meth:`.geometry.Geometry.vmem_bytes`) within
:data:`VMEM_BUDGET_BYTES` (32 MiB), the rest left to Mosaic's own temporaries. The
defaults are the best of a sweep on a TPU v5e (``benchmarks/masked_conv_tpu_blocks.py``;
its figures in docs/performance.md): 256 result channels (two lane tiles) and up to 2,048
pixels a step (a whole 32 x 32 image), in each of the three kernels.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..kernel_problem import KernelProblem, kernel_problem
from ..spec import ConvSpec
from .geometry import LANES, Geometry, forward_taps, input_grad_taps, make_geometry

__all__ = ["Config", "KERNELS", "VMEM_LIMIT_BYTES", "VMEM_BUDGET_BYTES", "geometry", "vmem_bytes"]

MiB = 1 << 20
VMEM_LIMIT_BYTES = 48 * MiB  # what the kernels ask Mosaic for: below v7x's 64 MiB per core
VMEM_BUDGET_BYTES = 32 * MiB  # what the counted buffers may take; the rest is Mosaic's
KERNELS = ("forward", "input_grad", "weight_grad")

_MIN_PIXELS, _MAX_PIXELS = 8, 8192
_MAX_CHANNELS = 2048


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Config:
    """Block sizes of the ``pallas_mosaic_tpu`` kernels (one config applies to all three).

    Attributes:
      block_pixels: result pixels per grid step, about (the GEMMs' M): rounded to whole
        result rows, or for single-row problems to whole sublane tiles and halos; a power
        of two from 8 to 8192.
      block_channels: result channels per grid step (output channels for the forward and
        the weight gradient, input channels for the input gradient): a multiple of 128 (a
        whole number of lane tiles) up to 2048; fewer channels than this are one block.
      block_taps: active taps per weight-gradient grid step (its accumulator holds
        ``block_taps x C_in x block_channels`` float32 values); at least 1.
      pad_in_kernel: the kernels pad their image operand in VMEM instead of reading a
        padded copy that XLA makes in HBM first, where a grid step holds a whole image
        and the operand's width is whole sublane tiles (:func:`.geometry.make_geometry`);
        elsewhere it changes nothing. Results are the same bit for bit. On by default:
        the copy is one image's read and write per kernel, which each kernel timed alone
        on a TPU v5e paid for (docs/design/tpu.md).
    """

    block_pixels: int = 2048
    block_channels: int = 256
    block_taps: int = 64
    pad_in_kernel: bool = True

    def __post_init__(self):
        for field in ("block_pixels", "block_channels", "block_taps"):
            if not _is_int(getattr(self, field)):
                raise TypeError(f"Config.{field} must be an int, got {getattr(self, field)!r}")
        if not isinstance(self.pad_in_kernel, bool):
            raise TypeError(f"Config.pad_in_kernel must be a bool, got {self.pad_in_kernel!r}")
        p = self.block_pixels
        if not _MIN_PIXELS <= p <= _MAX_PIXELS or p & (p - 1):
            raise ValueError(f"Config.block_pixels must be a power of two from {_MIN_PIXELS} to {_MAX_PIXELS}, got {p}")
        c = self.block_channels
        if c % LANES or not LANES <= c <= _MAX_CHANNELS:
            raise ValueError(
                f"Config.block_channels must be a multiple of {LANES} (whole lane tiles: a block's last dimension is "
                f"a multiple of 128 or the whole dimension) from {LANES} to {_MAX_CHANNELS}, got {c}"
            )
        if self.block_taps < 1:
            raise ValueError(f"Config.block_taps must be at least 1, got {self.block_taps}")

    @classmethod
    def get_default(cls, spec: ConvSpec, dtype, kernel: str = "forward") -> Config:
        """The heuristic: the largest blocks of ``(2048 pixels, 256 channels, every tap)`` that fit the VMEM budget.

        Shrinks, in this order, until :func:`vmem_bytes` is within :data:`VMEM_BUDGET_BYTES`:
        the weight gradient's taps per step (halved), the result channels (to 128), the
        pixels (halved, to 8). A problem that fits none is returned at the smallest
        blocks; :func:`~.conv.unsupported` refuses it.

        Args:
          spec: the convolution.
          dtype: the operands' dtype.
          kernel: ``"forward"``, ``"input_grad"`` or ``"weight_grad"``.
        """
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        problem = kernel_problem(spec)
        itemsize = np.dtype(dtype).itemsize
        config = cls(block_taps=max(1, len(problem.taps)))
        while vmem_bytes(problem, kernel, itemsize, config) > VMEM_BUDGET_BYTES:
            smaller = _smaller(config, kernel)
            if smaller is None:
                break
            config = smaller
        return config


def _smaller(config: Config, kernel: str) -> Config | None:
    """The next config the heuristic tries, or ``None`` at the smallest blocks."""
    if kernel == "weight_grad" and config.block_taps > 1:
        return dataclasses.replace(config, block_taps=config.block_taps // 2)
    if config.block_channels > LANES:
        return dataclasses.replace(config, block_channels=LANES)
    if config.block_pixels > _MIN_PIXELS:
        return dataclasses.replace(config, block_pixels=config.block_pixels // 2)
    return None


def geometry(problem: KernelProblem, kernel: str, itemsize: int, config: Config) -> Geometry:
    """The blocks of ``kernel`` on ``problem`` under ``config``.

    The forward reads ``x`` (``C_in``) into ``C_out`` results, the input gradient ``dy``
    (``C_out``) into ``C_in``; the weight gradient slides the forward's windows over ``x``
    and blocks ``dy``'s ``C_out`` channels.
    """
    if kernel == "input_grad":
        taps, c_read, c_result = input_grad_taps(problem), problem.c_out, problem.c_in
    else:
        taps, c_read, c_result = forward_taps(problem), problem.c_in, problem.c_out
    return make_geometry(taps, c_read, c_result, itemsize, config.block_pixels, config.block_channels,
                         pad_inside=config.pad_in_kernel)


def vmem_bytes(problem: KernelProblem, kernel: str, itemsize: int, config: Config) -> int:
    """The VMEM ``kernel``'s counted buffers take on ``problem`` (results counted as float32)."""
    g = geometry(problem, kernel, itemsize, config)
    per_step = min(config.block_taps, len(problem.taps)) if kernel == "weight_grad" else len(problem.pieces)
    return g.vmem_bytes(kernel, per_step)
