""":class:`ContextParallel`: a module's sequence or time axis split over a mesh axis, as configuration.

The ``ShortConv`` and ``CausalConv`` modules (linen, nnx, Equinox) take one as their
``context_parallel`` attribute; their full pass then runs
:func:`~.sequence.sequence_sharded_causal_conv1d` or :func:`~.time.time_sharded_causal_conv`
instead of the one-device op, so that a model runs under context parallelism by
configuration, its parameters unchanged. Decode steps and streams are not split (one
token or one chunk at a time).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .._core.args import segment_ids_of_positions
from .halo import LAYOUTS
from .sequence import from_zigzag, sequence_sharded_causal_conv1d, to_zigzag
from .time import time_sharded_causal_conv

__all__ = ["ContextParallel"]


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Where the sequence (time) axis of a module's input lies: split over ``mesh.shape[axis_name]`` devices.

    Args:
      mesh: the device mesh.
      axis_name: the mesh axis that splits the sequence (time).
      layout: ``"contiguous"`` (device ``i`` holds the ``i``-th ``1/S`` of the sequence)
        or ``"zigzag"`` (chunks ``i`` and ``2S - 1 - i`` of ``2S``: :func:`~.sequence.to_zigzag`'s
        layout, the one causal attention balances its work with). The module's input,
        segment ids, positions and output all lie in it.
      batch_axis: mesh axis (or axes) that also split the batch, or ``None``.

    Raises:
      ValueError: ``axis_name`` or a ``batch_axis`` is not an axis of ``mesh``; an unknown ``layout``.

    Example (a Flax model on 8 devices, the sequence split 4 ways, the batch 2)::

        mesh = jax.make_mesh((4, 2), ("seq", "data"))
        layer = ShortConv(kernel_size=4, context_parallel=ContextParallel(mesh, "seq", batch_axis="data"))
    """

    mesh: jax.sharding.Mesh
    axis_name: str
    layout: str = "contiguous"
    batch_axis: str | tuple[str, ...] | None = None

    def __post_init__(self):
        names = tuple(self.mesh.axis_names)
        batch = () if self.batch_axis is None else (
            (self.batch_axis,) if isinstance(self.batch_axis, str) else tuple(self.batch_axis))
        for what, name in [("axis_name", self.axis_name)] + [("batch_axis", b) for b in batch]:
            if name not in names:
                raise ValueError(f"ContextParallel: {what}={name!r} is not an axis of the mesh, whose axes are {names}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"ContextParallel: layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def shards(self) -> int:
        """``S``: the devices along ``axis_name``."""
        return self.mesh.shape[self.axis_name]

    def _where(self) -> dict:
        return dict(mesh=self.mesh, axis_name=self.axis_name, layout=self.layout, batch_axis=self.batch_axis)

    def segment_ids_of_positions(self, positions) -> jax.Array:
        """Positions ``(B, L)`` in this layout as segment ids in it (documents counted in sequence order).

        A document's id counts the starts before it along the whole sequence, so a
        zigzagged array is put in sequence order for the count and back (integers only:
        the activations never move).
        """
        positions = jnp.asarray(positions)
        if self.layout == "zigzag":
            ids = segment_ids_of_positions(from_zigzag(positions, self.shards), positions.shape, "positions")
            return to_zigzag(ids, self.shards)
        return segment_ids_of_positions(positions, positions.shape, "positions")

    def causal_conv1d(self, x, weight, bias=None, *, segment_ids=None, positions=None, **kwargs) -> jax.Array:
        """:func:`~maskconv_kernels.causal_conv1d` over this split: :func:`~.sequence.sequence_sharded_causal_conv1d`.

        ``positions`` (RecurrentGemma's ``segment_pos``) become segment ids first
        (:meth:`segment_ids_of_positions`); ``kwargs``: ``sequence_sharded_causal_conv1d``'s
        other keywords.
        """
        if positions is not None:
            if segment_ids is not None:
                raise ValueError("causal_conv1d: pass segment_ids or positions, not both")
            segment_ids = self.segment_ids_of_positions(positions)
        return sequence_sharded_causal_conv1d(x, weight, bias, segment_ids=segment_ids, **self._where(), **kwargs)

    def causal_conv(self, x, kernel, bias=None, **kwargs) -> jax.Array:
        """:func:`~maskconv_kernels.causal_conv` over this split: :func:`~.time.time_sharded_causal_conv`."""
        return time_sharded_causal_conv(x, kernel, bias, **self._where(), **kwargs)
