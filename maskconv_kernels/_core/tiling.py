"""Tile arithmetic shared by every kernel backend: powers of two, ceiling divisions, and one
heuristic for splitting a long reduction (a weight gradient's sum over pixels) into
independent ranges whose partial sums are added afterwards in a fixed order.
"""
from __future__ import annotations

from .hardware import sm_count

__all__ = ["next_pow2", "cdiv", "round_up", "reduction_splits", "sum_in_order"]


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(n: int, m: int) -> int:
    """``ceil(n / m)`` for positive ``m``."""
    return -(-n // m)


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return cdiv(n, m) * m


def reduction_splits(
    programs: int, steps: int, *, waves: int = 4, min_steps: int = 8, most: int | None = None,
    divisor: bool = False,
) -> int:
    """Into how many ranges a reduction of ``steps`` steps is split, each one program.

    A weight gradient has few output tiles (``programs``: taps x channel tiles, often a
    few dozen) and a long reduction over every pixel of the batch; splitting it gives the
    GPU enough programs. Each split then writes a float32 partial sum, added in a fixed
    order (the same bits run to run, no atomics).

    Args:
      programs: the programs without splitting.
      steps: the reduction's steps (pixel blocks, tiles, chunks).
      waves: how many times the splits should fill every SM (``sm_count()``).
      min_steps: the fewest steps a split keeps, so partial sums stay small beside the work.
      most: the most splits allowed (a config's cap), instead of what ``waves`` asks for.
      divisor: splits must divide ``steps`` (the Mosaic GPU kernels' chunks tile it
        exactly); of those allowed, the one that wastes least of the last wave of programs,
        ties to fewer splits. Otherwise the steps are shared evenly and no split is empty.

    Returns:
      At least 1, at most ``max(1, steps // min_steps)``.
    """
    sms = sm_count()
    wanted = most or cdiv(waves * sms, max(programs, 1))
    upper = max(1, min(wanted, steps // min_steps))
    if divisor:
        allowed = [s for s in range(1, upper + 1) if steps % s == 0]
        return min(allowed, key=lambda s: (cdiv(programs * s, sms) / s, s))
    return cdiv(steps, cdiv(steps, upper))  # the same steps per split; none empty


def sum_in_order(parts):
    """``parts.sum(0)`` as elementwise adds in a fixed order: the same bits run to run (no atomics)."""
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total
