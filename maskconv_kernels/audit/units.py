"""The audit's view of a model: ``x`` and ``y`` as units (positions, or sub-pixels), and batching.

A unit is one position of the grid (or one of ``sub_pixels`` channel groups of it,
ordered after the pixel): the audit asks which input units each output unit may see.
:class:`Layout` moves ``x`` (or ``y``) to ``(U, elements per unit)`` and back, and
:func:`unit_function` wraps ``f`` in that view. Chunking keeps every batched call at one
shape, so each check compiles once.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Layout", "unit_index", "unit_indices", "unit_function", "chunk_length", "padded", "single_leaf",
           "CHUNK_BYTES"]

# Budget for one chunk's largest batched tensor (cotangents, gradients, outputs): small
# enough that a chunk's activations stay in cache, large enough to amortise each call
# (docs/audit.md, Cost, measures it).
CHUNK_BYTES = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class Layout:
    """How ``x`` and ``y`` map to ``(U, K)`` and ``(U, F)``: U = positions * groups units.

    ``to_units`` moves the position axes first, splits the channel axis (last) into
    ``groups`` and moves the group next to the position, then flattens the rest.
    """

    x_shape: tuple[int, ...]
    position_axes: tuple[int, ...]
    groups: int

    @staticmethod
    def make(x: jax.Array, position_axes, groups: int) -> "Layout":
        if position_axes is None:
            position_axes = tuple(range(1, x.ndim - 1)) if x.ndim >= 3 else ((1,) if x.ndim == 2 else (0,))
        axes = tuple(sorted(a % x.ndim for a in position_axes)) if x.ndim else ()
        if not axes or len(set(axes)) != len(axes):
            raise ValueError(f"position_axes={position_axes} must name distinct axes of x, which has shape {x.shape}")
        if groups < 1:
            raise ValueError(f"sub_pixels must be a positive int, got {groups}")
        if groups > 1:
            if x.ndim - 1 in axes:
                raise ValueError("sub_pixels > 1 splits x's last axis (channels), so it cannot be a position axis; "
                                 "pass position_axes without it")
            if x.shape[-1] % groups:
                raise ValueError(f"sub_pixels={groups} must divide x's channels, {x.shape[-1]}")
        return Layout(tuple(x.shape), axes, groups)

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(self.x_shape[a] for a in self.position_axes)

    @property
    def n_units(self) -> int:
        return int(np.prod(self.positions)) * self.groups

    def check_output(self, y) -> None:
        if y.ndim <= max(self.position_axes) or any(y.shape[a] != self.x_shape[a] for a in self.position_axes):
            raise ValueError(
                f"f(x) has shape {y.shape}, not aligned to x's positions: its axes {self.position_axes} must have "
                f"sizes {self.positions} (x has shape {self.x_shape}); pass position_axes if the positions are "
                "elsewhere")
        if self.groups > 1 and y.shape[-1] % self.groups:
            raise ValueError(f"sub_pixels={self.groups} must divide f(x)'s last axis, {y.shape[-1]}")

    def to_units(self, a: jax.Array) -> jax.Array:
        """``a`` (x- or y-shaped) -> ``(U, elements per unit)``."""
        rest = [i for i in range(a.ndim) if i not in self.position_axes]
        a = jnp.transpose(a, (*self.position_axes, *rest))
        p, r = int(np.prod(self.positions)), a.shape[len(self.position_axes):]
        if self.groups == 1:
            return a.reshape(p, -1)
        a = a.reshape(p, int(np.prod(r[:-1], dtype=int)), self.groups, r[-1] // self.groups)
        return jnp.transpose(a, (0, 2, 1, 3)).reshape(p * self.groups, -1)

    def from_units(self, u: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """Inverse of :meth:`to_units` for an array of ``shape``."""
        rest = [i for i in range(len(shape)) if i not in self.position_axes]
        moved = (*self.positions, *(shape[i] for i in rest))
        p = int(np.prod(self.positions))
        if self.groups > 1:
            u = u.reshape(p, self.groups, int(np.prod(moved[len(self.positions):-1], dtype=int)), -1)
            u = jnp.transpose(u, (0, 2, 1, 3))
        a = u.reshape(moved)
        return jnp.transpose(a, np.argsort((*self.position_axes, *rest)))


def unit_index(unit: int, positions: tuple[int, ...], groups: int) -> tuple[int, ...]:
    pos, g = divmod(unit, groups)
    idx = tuple(int(i) for i in np.unravel_index(pos, positions))
    return idx + ((g,) if groups > 1 else ())


def unit_indices(layout: Layout) -> np.ndarray:
    """int ``(U, d)``: every unit's index (position coordinates, then the sub-pixel if any)."""
    pos = np.stack(np.unravel_index(np.arange(int(np.prod(layout.positions))), layout.positions), -1)
    if layout.groups == 1:
        return pos
    pos = np.repeat(pos, layout.groups, axis=0)
    return np.concatenate([pos, np.tile(np.arange(layout.groups), len(pos) // layout.groups)[:, None]], -1)


def unit_function(f, x: jax.Array, layout: Layout, cast: bool):
    """``xu (U, K) float32 -> yu (U, F)``: f seen unit by unit, float32 at both ends if ``cast``."""

    def g(xu):
        a = layout.from_units(xu, x.shape)
        y = single_leaf(f(a.astype(x.dtype) if cast else a))
        return layout.to_units(y.astype(jnp.float32) if cast else y)

    return g


def chunk_length(chunk_size, per_item_elements: int, basis: int) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return int(chunk_size)
    items = CHUNK_BYTES // max(1, 4 * per_item_elements * basis)
    return int(max(1, min(256, 2 ** int(math.log2(max(1, items))))))


def padded(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` repeated at its last entry up to length ``n``: every chunk has one shape, so one compilation."""
    return np.concatenate([a, np.repeat(a[-1:], n - len(a))]) if len(a) < n else a


def single_leaf(y):
    leaves = jax.tree_util.tree_leaves(y)
    if len(leaves) != 1:
        raise ValueError(f"f(x) must return one array (or a pytree with one leaf), got {len(leaves)} leaves; "
                         "audit a function that selects the output aligned to x")
    return leaves[0]
