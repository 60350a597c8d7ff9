"""The transposed (upsampling) causal convolution as stride-1 causal convolutions, one per phase.

A transposed convolution along time with upsampling factor ``s`` and ``k`` taps writes
input frame ``t`` through tap ``j`` to output frame ``t * s + j`` (PyTorch's
``ConvTranspose1d``; a causal decoder keeps the first ``T * s`` outputs, whose sums are
complete). Output frame ``u = t' * s + i`` (phase ``i``) is therefore

    ``y[t' * s + i] = sum_m x[t' - m] @ K[i + m * s]``,  ``m = 0 .. ceil((k - i) / s) - 1``,

a stride-1 causal convolution of ``x`` with the phase's taps ``K[i::s]`` (newest last).
Computed this way no zero is inserted between input frames and no tap multiplies one, the
output at ``u`` reads inputs ``t <= u / s`` only, and a stream carries input frames, as a
forward causal convolution does. Phases with the same number of taps (at most two counts:
``ceil(k / s)`` for ``i < k - (ceil(k / s) - 1) * s``, one fewer for the rest) run as one
convolution whose output channels hold them side by side; phases without taps (``k < s``)
are zeros.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

__all__ = ["Group", "plan", "group_kernel", "interleave"]


@dataclasses.dataclass(frozen=True)
class Group:
    """Phases with the same number of taps, convolved together."""

    phases: tuple[int, ...]
    taps: int

    @property
    def context(self) -> int:
        return self.taps - 1


@functools.lru_cache(maxsize=None)
def plan(window: int, factor: int) -> tuple[Group, ...]:
    """The groups of phases ``0 .. factor - 1`` with taps, fullest first (phases without taps are left out)."""
    most = -(-window // factor)
    full = window - (most - 1) * factor  # phases 0 .. full - 1 have `most` taps
    groups = [Group(tuple(range(min(full, factor))), most)]
    if full < factor and most > 1:
        groups.append(Group(tuple(range(full, factor)), most - 1))
    return tuple(groups)


def group_kernel(kernel: jax.Array, group: Group, factor: int, feature_groups: int) -> jax.Array:
    """``(taps, *k_spatial, C_in // G, G * P * (C_out // G))``: the group's phase kernels side by side.

    Phase ``i``'s causal kernel is ``K[i + (taps - 1 - j) * s]`` at tap ``j`` (its newest
    tap last). Its output channels go next to the other phases' within each feature
    group, so feature group ``g`` of the stacked convolution reads the input channels
    it reads in the layer.
    """
    phases = [jnp.flip(kernel[i::factor][: group.taps], axis=0) for i in group.phases]
    stacked = jnp.stack(phases, axis=-2)  # (taps, *k_sp, C_in/G, P, C_out)
    *lead, cig, p, c_out = stacked.shape
    stacked = stacked.reshape(*lead, cig, p, feature_groups, c_out // feature_groups)
    stacked = jnp.swapaxes(stacked, -3, -2)  # (..., G, P, C_out/G)
    return stacked.reshape(*lead, cig, feature_groups * p * (c_out // feature_groups))


def interleave(parts, groups, factor: int, feature_groups: int, c_out: int) -> jax.Array:
    """``(N, T * s, *spatial, C_out)`` from each group's ``(N, T, *spatial, G * P * C_out / G)``.

    Frame ``t * s + i`` is phase ``i``'s frame ``t``; phases without taps are zeros. The
    groups hold consecutive phases in order (:func:`plan`), so the phases are joined
    along a new axis after time, which a reshape then folds into it (without feature
    groups or spatial axes, a reshape alone).
    """
    n, frames, *spatial, _ = parts[0].shape
    ndim = len(spatial)
    moved = []
    for y, group in zip(parts, groups):
        y = y.reshape(n, frames, *spatial, feature_groups, len(group.phases), c_out // feature_groups)
        y = jnp.moveaxis(y, 3 + ndim, 2)  # (N, T, P, *spatial, G, C_out / G)
        moved.append(y.reshape(n, frames, len(group.phases), *spatial, c_out))
    missing = factor - sum(len(g.phases) for g in groups)
    if missing:
        moved.append(jnp.zeros((n, frames, missing, *spatial, c_out), parts[0].dtype))
    y = moved[0] if len(moved) == 1 else jnp.concatenate(moved, axis=2)
    return y.reshape(n, frames * factor, *spatial, c_out)
