"""What every split of a spatial or sequence axis shares: the mesh axis, the halo, the ``shard_map``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

__all__ = ["shards", "halo", "shard_map"]


def shards(mesh: jax.sharding.Mesh, axis_name: str) -> int:
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    return mesh.shape[axis_name]


def halo(a: jax.Array, rows: int, axis_name: str, shards: int, *, before: bool, border=None) -> jax.Array:
    """The ``rows`` positions (axis 1) that a shard needs from its neighbour, by ``lax.ppermute``.

    ``before``: the previous shard's last rows (shard 0 has none); else the next shard's
    first rows (the last shard has none). The shard without that neighbour gets zeros, or
    ``border`` (broadcast to the halo's shape) where given: padding ids, an initial state.
    Called inside a ``shard_map`` over ``axis_name``.
    """
    if before:
        piece, pairs, edge = a[:, a.shape[1] - rows :], [(i, i + 1) for i in range(shards - 1)], 0
    else:
        piece, pairs, edge = a[:, :rows], [(i + 1, i) for i in range(shards - 1)], shards - 1
    received = lax.ppermute(piece, axis_name, pairs)
    if border is None:
        return received
    return jnp.where(lax.axis_index(axis_name) == edge, jnp.asarray(border, a.dtype), received)


def shard_map(fn, mesh, in_specs, out_specs, *args):
    """``jax.shard_map(fn, ...)(*args)``, on a mesh with Auto or Explicit axes."""
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # Explicit axes type arrays by their sharding, and shard_map takes them as typed:
        # move them to the split it needs (with Auto axes, shard_map inserts this itself).
        args = [jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
