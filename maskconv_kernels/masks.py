"""Static convolution masks: one normalised type, and builders for the usual models.

A mask is either *window-shaped* (``window``, one bit per tap) or *full*
(``(*window, C_in // groups, C_out)``, one bit per kernel entry, for channel-partial
taps such as the original PixelCNN's R/G/B ordering). Every backend takes the same
normalised :class:`Mask` and reads only what it says is active; none re-derives it.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Sequence

import numpy as np

__all__ = [
    "Mask",
    "Box",
    "Term",
    "as_mask",
    "pixelcnn_mask",
    "causal_mask",
    "vertical_stack_mask",
    "horizontal_stack_mask",
    "channel_grouped_mask",
]


@dataclasses.dataclass(frozen=True)
class Box:
    """A dense, fully active sub-window: taps ``start[d] <= k[d] < start[d] + size[d]``."""

    start: tuple[int, ...]
    size: tuple[int, ...]

    def taps(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(s, s + n) for s, n in zip(self.start, self.size))))


@dataclasses.dataclass(frozen=True)
class Term:
    """One exact piece of a masked convolution.

    ``out[..., out_channels] += conv(x[..., in_channels], kernel[box, in_channels, out_channels])``
    where every kernel entry the term reads is active. ``None`` channels mean all of them.
    Channel indices are within a feature group.
    """

    box: Box
    in_channels: tuple[int, ...] | None
    out_channels: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True, eq=False)
class Mask:
    """A normalised, hashable, static mask.

    Attributes:
      window: the kernel window, e.g. ``(7, 7)``.
      bits: bool array of shape ``window`` or ``(*window, C_in // groups, C_out)``.
    """

    window: tuple[int, ...]
    bits: np.ndarray

    def __post_init__(self):
        self.bits.setflags(write=False)

    # Hash and compare by content so that jit caches one trace per distinct mask.
    @functools.cached_property
    def _key(self):
        return (self.bits.shape, self.bits.tobytes())

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, Mask) and self._key == other._key

    def __repr__(self):
        kind = "full" if self.is_full else "window"
        return f"Mask({kind}, shape={self.bits.shape}, active_taps={len(self.active_taps)}/{self.num_taps})"

    @property
    def is_full(self) -> bool:
        return self.bits.ndim > len(self.window)

    @property
    def num_taps(self) -> int:
        return int(np.prod(self.window))

    @functools.cached_property
    def tap_bits(self) -> np.ndarray:
        """Bool array of shape ``window``: a tap is active if any of its entries is."""
        if not self.is_full:
            return self.bits
        return self.bits.any(axis=(-2, -1))

    @functools.cached_property
    def active_taps(self) -> tuple[tuple[int, ...], ...]:
        """Active taps in raster order."""
        return tuple(tuple(int(i) for i in t) for t in np.argwhere(self.tap_bits))

    @functools.cached_property
    def partial_taps(self) -> tuple[tuple[int, ...], ...]:
        """Taps that are active for some, but not all, (in, out) channel pairs."""
        if not self.is_full:
            return ()
        return tuple(t for t in self.active_taps if not self.bits[t].all())

    @functools.cached_property
    def raster_run(self) -> int | None:
        """The first active tap's flat (raster) index when the active taps are one raster run, else None.

        PixelCNN, causal and stack masks are runs: a kernel names the ``t``-th active tap
        by a division of ``t + run`` instead of a chain of selects.
        """
        return raster_run(int(np.ravel_multi_index(t, self.window)) for t in self.active_taps)

    def active_entries(self, c_in: int, c_out: int) -> int:
        """Number of active (tap, c_in, c_out) products, the FLOP count's unit."""
        if self.is_full:
            return int(self.bits.sum())
        return len(self.active_taps) * c_in * c_out

    def dense(self, c_in: int, c_out: int) -> np.ndarray:
        """The mask broadcast to the full kernel shape ``(*window, c_in, c_out)``."""
        if self.is_full:
            return self.bits
        return np.broadcast_to(self.bits[..., None, None], (*self.window, c_in, c_out))

    @functools.cached_property
    def terms(self) -> tuple[Term, ...]:
        """The mask as a sum of dense pieces that read active entries only.

        Window masks give one term per box. Full masks group output channels by the
        input channels each tap gives them, so channel-partial taps cost what they use.
        """
        if not self.is_full:
            return tuple(Term(b, None, None) for b in _boxes(self.tap_bits))
        c_in, c_out = self.bits.shape[-2:]
        # (tap, active input channels) -> output channels with exactly that pattern.
        groups: dict[tuple[int, ...], dict[tuple, list[int]]] = {}
        for tap in self.active_taps:
            by_inputs: dict[tuple[int, ...], list[int]] = {}
            for co in range(c_out):
                ci = tuple(int(i) for i in np.flatnonzero(self.bits[tap][:, co]))
                if ci:
                    by_inputs.setdefault(ci, []).append(co)
            for ci, cos in by_inputs.items():
                groups.setdefault(tap, {})[(ci, tuple(cos))] = cos
        # Taps that share (input set, output set) form one tap set, split into boxes.
        by_channels: dict[tuple, np.ndarray] = {}
        for tap, pieces in groups.items():
            for key in pieces:
                by_channels.setdefault(key, np.zeros(self.window, bool))[tap] = True
        terms = []
        for (ci, co), taps in by_channels.items():
            ci_all = ci if len(ci) < c_in else None
            co_all = co if len(co) < c_out else None
            terms.extend(Term(b, ci_all, co_all) for b in _boxes(taps))
        return tuple(terms)


def _boxes(taps: np.ndarray) -> list[Box]:
    """Greedy cover of the active taps by disjoint boxes, in raster order.

    From the first uncovered tap, grow along the last axis, then along each earlier
    axis while the whole slab stays active and uncovered. For PixelCNN masks this gives
    the optimal cover: a 7x7 type-A mask is a 3x7 box plus a 1x3 box.
    """
    left = np.array(taps, bool)
    boxes = []
    while left.any():
        start = tuple(int(i) for i in np.argwhere(left)[0])
        size = [1] * left.ndim
        for axis in reversed(range(left.ndim)):
            while True:
                stop = start[axis] + size[axis]
                if stop >= left.shape[axis]:
                    break
                slab = tuple(
                    slice(stop, stop + 1) if a == axis else slice(s, s + n)
                    for a, (s, n) in enumerate(zip(start, size))
                )
                if not left[slab].all():
                    break
                size[axis] += 1
        box = Box(start, tuple(size))
        left[tuple(slice(s, s + n) for s, n in zip(box.start, box.size))] = False
        boxes.append(box)
    return boxes


def raster_run(flat_taps) -> int | None:
    """The first of sorted flat tap indices when they are consecutive (one raster run), else None."""
    flat = list(flat_taps)
    if not flat or flat != list(range(flat[0], flat[0] + len(flat))):
        return None
    return flat[0]


def as_mask(mask, kernel_shape: Sequence[int]) -> Mask:
    """Normalises ``mask`` against ``kernel_shape = (*window, C_in // groups, C_out)``.

    Raises:
      TypeError: the mask is traced (not static) or not array-like.
      ValueError: the mask's shape or values do not fit.
    """
    if isinstance(mask, Mask):
        bits = mask.bits
    else:
        bits = _static_bits(mask)
    window = tuple(int(k) for k in kernel_shape[:-2])
    kernel_shape = tuple(int(k) for k in kernel_shape)
    if bits.shape[: len(window)] == window and len(bits.shape) == len(kernel_shape) and bits.shape != kernel_shape:
        raise ValueError(
            f"mask has the full kernel shape's rank but shape {bits.shape}, and the kernel is {kernel_shape}: a "
            f"full mask needs C_in // feature_group_count = {kernel_shape[-2]} and C_out = {kernel_shape[-1]} "
            f"channel dims (or pass a window-shaped mask of shape {window})"
        )
    if bits.shape not in (window, kernel_shape):
        raise ValueError(
            f"mask has shape {bits.shape} but the kernel window is {window}: pass a mask of shape "
            f"{window} (one bit per tap) or {tuple(kernel_shape)} (the full kernel shape)"
        )
    return Mask(window, np.array(bits, bool))


def _static_bits(mask) -> np.ndarray:
    import jax

    if mask is None:
        raise TypeError(
            "mask must be array-like of 0/1 or bools (shape window or the full kernel shape), got None: "
            "for a convolution with every tap active pass np.ones(window, bool)"
        )
    if isinstance(mask, jax.core.Tracer):
        raise TypeError(
            "mask must be static (a numpy array, nested lists or a concrete jax array), not a traced "
            f"value ({type(mask).__name__}): which taps a kernel reads is decided when it is traced "
            "and compiled, so a mask cannot depend on traced values. Close over the mask instead of "
            "passing it as an argument of a jitted function."
        )
    try:
        arr = np.asarray(mask)
    except Exception as e:  # e.g. a deleted buffer, or an object that is not array-like
        raise TypeError(f"mask must be array-like of 0/1 or bools, got {type(mask).__name__}") from e
    if arr.dtype == bool:
        return arr
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"mask must hold bools or 0/1 numbers, got dtype {arr.dtype}")
    bad = ~np.isin(arr, (0, 1))
    if bad.any():
        raise ValueError(
            f"mask must hold only 0 and 1 (or bools), got {arr[bad].flat[0]!r} at index "
            f"{tuple(int(i) for i in np.argwhere(bad)[0])}: masks select taps, they do not scale them"
        )
    return arr.astype(bool)


# --------------------------------------------------------------------------- builders


def _check_window(window, ndim=None) -> tuple[int, ...]:
    window = (window,) if isinstance(window, int) else tuple(int(k) for k in window)
    if ndim is not None and len(window) != ndim:
        raise ValueError(f"window must have {ndim} dims, got {window}")
    if any(k < 1 for k in window):
        raise ValueError(f"window sizes must be positive, got {window}")
    return window


def _check_type(mask_type: str) -> str:
    if mask_type not in ("A", "B"):
        raise ValueError(f"mask_type must be 'A' (centre excluded) or 'B' (centre included), got {mask_type!r}")
    return mask_type


def pixelcnn_mask(window, mask_type: str = "B") -> np.ndarray:
    """Raster-order causal mask (van den Oord et al., 2016), for any odd window and rank.

    Taps strictly before the centre in raster order are active; type "B" also keeps
    the centre, type "A" (the first layer) excludes it.

    Returns: bool array of shape ``window``.
    """
    window = _check_window(window)
    if any(k % 2 == 0 for k in window):
        raise ValueError(f"pixelcnn_mask needs an odd window so that it has a centre, got {window}")
    _check_type(mask_type)
    flat_centre = int(np.ravel_multi_index(tuple(k // 2 for k in window), window))
    order = np.arange(int(np.prod(window))).reshape(window)
    return order < flat_centre + (mask_type == "B")


def causal_mask(kernel_size: int, include_current: bool = True) -> np.ndarray:
    """1-D causal mask: with ``padding="SAME"``, output t sees inputs up to t (or t-1).

    With ``padding="CAUSAL"`` every tap is already causal, so a mask is not needed there.

    Returns: bool array of shape ``(kernel_size,)``.
    """
    (k,) = _check_window(kernel_size, 1)
    centre = k // 2
    return np.arange(k) < centre + int(include_current)


def vertical_stack_mask(window, mask_type: str = "A") -> np.ndarray:
    """Gated PixelCNN vertical stack (van den Oord et al., 2016): whole rows above the pixel.

    Type "A" (the first layer) keeps the rows strictly above the centre. Type "B" (later
    layers) also keeps the centre row: their input already depends on rows strictly above
    only, so this is the paper's shift down by one row, done by the mask.

    Returns: bool array of shape ``window`` (2-D, odd height).
    """
    kh, kw = _check_window(window, 2)
    if kh % 2 == 0:
        raise ValueError(f"vertical_stack_mask needs an odd height, got {window}")
    _check_type(mask_type)
    m = np.zeros((kh, kw), bool)
    m[: kh // 2 + (mask_type == "B")] = True
    return m


def horizontal_stack_mask(window, mask_type: str = "B") -> np.ndarray:
    """Gated PixelCNN horizontal stack: the centre row, left of the centre (and it, type "B").

    Returns: bool array of shape ``window`` (2-D, odd width).
    """
    kh, kw = _check_window(window, 2)
    if kw % 2 == 0 or kh % 2 == 0:
        raise ValueError(f"horizontal_stack_mask needs an odd window, got {window}")
    _check_type(mask_type)
    m = np.zeros((kh, kw), bool)
    m[kh // 2, : kw // 2 + (mask_type == "B")] = True
    return m


def channel_grouped_mask(window, c_in: int, c_out: int, mask_type: str = "B", groups: int = 3) -> np.ndarray:
    """PixelCNN mask with channel ordering (R, then G, then B), full kernel shape.

    Channels are split into ``groups`` contiguous groups. Taps before the centre are
    fully active; at the centre, output group j sees input groups i < j (type "A") or
    i <= j (type "B").

    Returns: bool array of shape ``(*window, c_in, c_out)``.
    """
    window = _check_window(window)
    _check_type(mask_type)
    if c_in % groups or c_out % groups:
        raise ValueError(f"c_in={c_in} and c_out={c_out} must both be divisible by groups={groups}")
    m = np.broadcast_to(pixelcnn_mask(window, "A")[..., None, None], (*window, c_in, c_out)).copy()
    gi = np.arange(c_in) // (c_in // groups)
    go = np.arange(c_out) // (c_out // groups)
    allowed = gi[:, None] < go[None, :] if mask_type == "A" else gi[:, None] <= go[None, :]
    m[tuple(k // 2 for k in window)] = allowed
    return m
