"""The cells every benchmark table writes the same way: times, sizes, and exactness.

One place, so that a millisecond, a MiB, a leak and a NaN-isolation read alike in the
grid, the sequence and causal_conv modes, the roofline and the tuner.
"""
from __future__ import annotations

__all__ = ["ms", "mib", "leak_cell", "nan_cell"]


def ms(seconds: float | None) -> str:
    """Milliseconds to 3 significant digits; ``—`` for no time."""
    return "—" if seconds is None else f"{1e3 * seconds:.3g}"


def mib(size: int | None, digits: str = ".1f") -> str:
    """Bytes in MiB (``digits``: the format, ``.1f`` or ``.3g``); ``—`` where the platform reports none."""
    return "—" if size is None else format(size / 2**20, digits)


def leak_cell(row: dict) -> str:
    """The largest leaked gradient: ``0``, or the value in bold; ``—`` where not measured."""
    if "leak_max_abs" not in row:
        return "—"
    v = row["leak_max_abs"]
    return "0" if v == 0.0 else f"**{v:.1e}**"


def nan_cell(row: dict) -> str:
    """``yes`` where no clean output changed, else how many did; ``—`` where not measured."""
    if "nan_isolated" not in row:
        return "—"
    return "yes" if row["nan_isolated"] else f"**no** ({row['nan_changed']} changed)"
