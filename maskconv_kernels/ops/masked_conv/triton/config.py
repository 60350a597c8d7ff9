"""Block sizes for the Triton kernels: a frozen config, one heuristic, a small autotune list.

``heuristic`` picks a config from the problem's shape and dtype alone (what runs when
nothing may be timed, e.g. on CPU or with ``MASKCONV_TRITON_AUTOTUNE=0``).
``candidates`` is the list ``ops`` times on the GPU at the first launch of a problem
key; the winner is cached per process (``ops.tuned()`` shows it). :class:`Config`
(one :class:`Launch` per kernel) is the backend's config.
"""
from __future__ import annotations

import dataclasses
import os

from ...._core.hardware import TL_DOT_MIN_BLOCK, sm_count
from ...._core.tiling import cdiv, next_pow2, reduction_splits
from ...._moved import renamed_attributes

__all__ = ["Config", "Launch", "heuristic", "candidates", "autotune_enabled", "KINDS"]

KINDS = ("fwd", "dx", "dw")

_MIN_BLOCK = TL_DOT_MIN_BLOCK


@dataclasses.dataclass(frozen=True)
class Launch:
    """Launch parameters of one kernel.

    ``block_m x block_n`` is the output tile of a program and ``block_k`` the reduction
    step of one ``tl.dot``; what the three dims index depends on the kernel (see
    ``triton/kernels.py``). ``split`` (weight gradient only) divides
    the pixel reduction into that many deterministic partial sums.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < _MIN_BLOCK or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= {_MIN_BLOCK} (tl.dot's minimum), got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two up to 16, got {self.num_warps}")
        if self.num_stages < 1 or self.split < 1:
            raise ValueError(f"num_stages and split must be positive, got {self.num_stages} and {self.split}")


@dataclasses.dataclass(frozen=True)
class Config:
    """The ``triton`` backend's config: one :class:`Launch` per kernel, or ``None`` for the default.

    ``masked_conv(..., implementation="triton", config=Config(fwd=Launch(64, 128, 32)))``
    launches the forward with those tiles; a kernel left ``None`` is autotuned at its first
    launch on a GPU (the heuristic's pick elsewhere, or with ``MASKCONV_TRITON_AUTOTUNE=0``).
    """

    fwd: Launch | None = None
    dx: Launch | None = None
    dw: Launch | None = None

    def __post_init__(self):
        for kind in KINDS:
            value = getattr(self, kind)
            if value is not None and not isinstance(value, Launch):
                raise TypeError(f"Config.{kind} must be a Launch or None, got {type(value).__name__}")


# Its name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"Configs": "Config"})


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, next_pow2(n)))


def heuristic(kind: str, m: int, n: int, k: int, itemsize: int, taps: int = 1) -> Launch:
    """One config from shape and dtype.

    Args:
      kind: ``"fwd"`` (m: output pixels, n: C_out, k: C_in), ``"dx"`` (m: input pixels,
        n: C_in, k: C_out) or ``"dw"`` (m: C_in, n: C_out, k: output pixels).
      itemsize: bytes per input element (2 for bf16/f16, 4 for f32).
      taps: active taps; the weight gradient runs one program grid per tap, so it
        splits its pixel reduction only while taps * tiles leave SMs idle.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    wide = 64 if itemsize == 2 else 32  # the same bytes per k-step for both widths
    if kind == "dw":
        bm = _pow2_clamp(m, _MIN_BLOCK, 64)
        bn = _pow2_clamp(n, _MIN_BLOCK, 64)
        bk = 64 if itemsize == 2 else 32
        tiles = cdiv(m, bm) * cdiv(n, bn) * taps
        # Splits of the pixel reduction: two waves of programs, chunks of at least 8 dots.
        return Launch(bm, bn, bk, num_warps=4, num_stages=3, split=reduction_splits(tiles, cdiv(k, bk), waves=2))
    bn = _pow2_clamp(n, _MIN_BLOCK, 128)
    bk = _pow2_clamp(k, _MIN_BLOCK, wide)
    bm = 128 if m >= 128 * sm_count() else 64
    warps = 8 if bm * bn >= 128 * 128 else 4
    return Launch(bm, bn, bk, num_warps=warps, num_stages=3)


def candidates(kind: str, m: int, n: int, k: int, itemsize: int, taps: int = 1) -> list[Launch]:
    """The heuristic's pick first, then a few tiles around it (deduplicated)."""
    base = heuristic(kind, m, n, k, itemsize, taps)
    out = [base]
    if kind == "dw":
        variants = [
            dataclasses.replace(base, split=max(1, base.split // 2)),
            dataclasses.replace(base, split=min(64, base.split * 2)),
            dataclasses.replace(base, block_m=min(128, base.block_m * 2), num_warps=8),
            dataclasses.replace(base, block_k=min(128, base.block_k * 2)),
        ]
    else:
        variants = [
            dataclasses.replace(base, block_m=64 if base.block_m == 128 else 128),
            dataclasses.replace(base, num_stages=4),
            dataclasses.replace(base, block_k=max(_MIN_BLOCK, base.block_k // 2)),
            dataclasses.replace(base, block_n=max(_MIN_BLOCK, base.block_n // 2), num_warps=4),
        ]
    for c in variants:
        if c not in out:
            out.append(c)
    return out


def autotune_enabled() -> bool:
    """Timing configs at first launch is on unless ``MASKCONV_TRITON_AUTOTUNE=0``."""
    return os.environ.get("MASKCONV_TRITON_AUTOTUNE", "1") != "0"
