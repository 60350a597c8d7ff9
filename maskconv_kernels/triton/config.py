"""Block sizes for the Triton kernels: a frozen config, one heuristic, a small autotune list.

``heuristic`` picks a config from the problem's shape and dtype alone (what runs when
nothing may be timed, e.g. on CPU or with ``MASKCONV_TRITON_AUTOTUNE=0``).
``candidates`` is the list ``ops`` times on the GPU at the first launch of a problem
key; the winner is cached per process (``ops.tuned()`` shows it). :class:`Configs`
(one ``Config`` per kernel) is the backend's public config.
"""
from __future__ import annotations

import dataclasses
import os

from ..hardware import SM_COUNT, TL_DOT_MIN_BLOCK

__all__ = ["Config", "Configs", "heuristic", "candidates", "autotune_enabled", "KINDS"]

KINDS = ("fwd", "dx", "dw")

_MIN_BLOCK = TL_DOT_MIN_BLOCK


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters of one kernel.

    ``block_m x block_n`` is the output tile of a program and ``block_k`` the reduction
    step of one ``tl.dot``; what the three dims index depends on the kernel (see
    :mod:`maskconv_kernels.triton.kernels`). ``split`` (weight gradient only) divides
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
class Configs:
    """The ``triton`` backend's config: one :class:`Config` per kernel, or ``None`` for the default.

    ``masked_conv(..., implementation="triton", config=Configs(fwd=Config(64, 128, 32)))``
    launches the forward with those tiles; a kernel left ``None`` is autotuned at its first
    launch on a GPU (the heuristic's pick elsewhere, or with ``MASKCONV_TRITON_AUTOTUNE=0``).
    """

    fwd: Config | None = None
    dx: Config | None = None
    dw: Config | None = None

    def __post_init__(self):
        for kind in KINDS:
            value = getattr(self, kind)
            if value is not None and not isinstance(value, Config):
                raise TypeError(f"Configs.{kind} must be a Config or None, got {type(value).__name__}")


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    p = 1 << max(int(n) - 1, 0).bit_length()
    return max(lo, min(hi, p))


# Aim for about two waves of programs on an H100/H200 before splitting a reduction.
_TARGET_PROGRAMS = 2 * SM_COUNT


def _split(tiles: int, pixels: int, block_k: int) -> int:
    """Splits of the weight gradient's pixel reduction: enough programs, chunks >= 8 dots."""
    split = 1
    while tiles * split * 2 <= _TARGET_PROGRAMS and pixels // (split * 2) >= 8 * block_k and split < 64:
        split *= 2
    return split


def heuristic(kind: str, m: int, n: int, k: int, itemsize: int, taps: int = 1) -> Config:
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
        tiles = -(-m // bm) * -(-n // bn) * taps
        return Config(bm, bn, bk, num_warps=4, num_stages=3, split=_split(tiles, k, bk))
    bn = _pow2_clamp(n, _MIN_BLOCK, 128)
    bk = _pow2_clamp(k, _MIN_BLOCK, wide)
    bm = 128 if m >= 128 * SM_COUNT else 64
    warps = 8 if bm * bn >= 128 * 128 else 4
    return Config(bm, bn, bk, num_warps=warps, num_stages=3)


def candidates(kind: str, m: int, n: int, k: int, itemsize: int, taps: int = 1) -> list[Config]:
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
