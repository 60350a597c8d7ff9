"""What every split of a spatial or sequence axis shares: the mesh axis, the halo, the ``shard_map``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

from .._core.history import History

__all__ = ["LAYOUTS", "shards", "chunks", "halo", "chunk_histories", "shard_map"]

# How a sequence lies over the shards: in order, or zigzagged (sequence.to_zigzag).
LAYOUTS = ("contiguous", "zigzag")


def shards(mesh: jax.sharding.Mesh, axis_name: str) -> int:
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    return mesh.shape[axis_name]


def chunks(length: int, shards: int, layout: str, history: int, axis_name: str, *, what: str = "sequence length",
           history_is: str = "") -> int:
    """How many chunks ``layout`` cuts ``length`` positions into (``shards``, or twice that zigzagged),
    checked: an even split, and each chunk at least the ``history`` the next one needs from it
    (``history_is`` spells it in the message: ``"(W - 1) * dilation = "``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    per = 2 if layout == "zigzag" else 1  # chunks a shard holds
    count = shards * per
    if length % count:
        raise ValueError(
            f"{what} {length} must be a multiple of the {shards} shards along {axis_name!r}"
            + (f" times 2 (the zigzag layout's {count} chunks)" if per == 2 else "")
            + ": pad x (with negative segment ids) or use fewer shards"
        )
    size = length // count
    if size < history:
        options = [n for n in range(1, length // (per * history) + 1) if length % (per * n) == 0]
        fewer = f"use at most {max(options)} shards along {axis_name!r} for length {length}, or " if options else "use "
        raise ValueError(
            f"each chunk holds {size} positions but needs a halo of {history_is}{history} inputs from the chunk before it alone "
            f"({layout} layout): {fewer}a longer sequence"
        )
    return count


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


def chunk_histories(layout: str, x, ids, state, state_len: int, axis_name: str, shards: int):
    """A shard's chunks along axis 1: ``(history, inputs, segment ids, chunk index of the shard index)`` each.

    Contiguous: one chunk, whose history is the previous shard's last ``state_len`` inputs.
    Zigzag: shard ``i`` holds chunks ``i`` and ``2S - 1 - i``; chunk ``i``'s history is the
    tail of chunk ``i - 1`` (shard ``i - 1``'s first chunk), chunk ``2S - 1 - i``'s the tail
    of chunk ``2S - 2 - i`` (shard ``i + 1``'s second chunk; on the last shard, its own
    first chunk, chunk ``S - 1``). Chunk 0's history is ``state``, of the row's first
    document, or zeros of no document, as on one device. Called inside a ``shard_map``.
    """
    if layout == "zigzag":
        half = x.shape[1] // 2
        split = lambda a: (None, None) if a is None else (a[:, :half], a[:, half:])  # noqa: E731
        (xa, xb), (ia, ib) = split(x), split(ids)
    else:
        xa, ia = x, ids
    empty = History(x[:, :0], None if ids is None else ids[:, :0])
    first = -1 if state is None else History.of_first_document(state, ids).segment_ids
    ahead = empty if not state_len else History(
        halo(xa, state_len, axis_name, shards, before=True, border=state),
        None if ids is None else halo(ia, state_len, axis_name, shards, before=True, border=first),
    )
    pieces = [(ahead, xa, ia, lambda index: index)]
    if layout == "zigzag":
        behind = empty if not state_len else History(
            _tail_of_next(xb, xa, state_len, axis_name, shards),
            None if ids is None else _tail_of_next(ib, ia, state_len, axis_name, shards),
        )
        pieces.append((behind, xb, ib, lambda index: 2 * shards - 1 - index))
    return pieces


def _tail_of_next(second, first, rows: int, axis_name: str, shards: int):
    """The last ``rows`` positions of the next shard's ``second`` chunk; the last shard's own ``first``'s."""
    received = lax.ppermute(second[:, second.shape[1] - rows:], axis_name, [(i + 1, i) for i in range(shards - 1)])
    own = first[:, first.shape[1] - rows:]
    return jnp.where(lax.axis_index(axis_name) == shards - 1, own, received)


def shard_map(fn, mesh, in_specs, out_specs, *args):
    """``jax.shard_map(fn, ...)(*args)``, on a mesh with Auto or Explicit axes."""
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # Explicit axes type arrays by their sharding, and shard_map takes them as typed:
        # move them to the split it needs (with Auto axes, shard_map inserts this itself).
        args = [jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
