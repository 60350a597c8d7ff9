"""Context parallelism: :func:`sequence_sharded_causal_conv1d`, a short causal convolution with its
sequence split across devices, exchanging a ``(W - 1) * dilation`` halo from the previous
shard only, with initial and final states.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..ops.causal_conv1d import causal_conv1d
from ..ops.causal_conv1d.checks import make_problem
from .halo import LAYOUTS
from .halo import chunk_histories as _chunk_histories
from .halo import chunks as _chunks
from .halo import shard_map as _shard_map
from .halo import shards as _shards

__all__ = ["sequence_sharded_causal_conv1d", "to_zigzag", "from_zigzag", "LAYOUTS"]



def _zigzag_order(shards: int) -> np.ndarray:
    """The chunks in layout order: ``0, 2S-1, 1, 2S-2, ...``."""
    return np.stack([np.arange(shards), 2 * shards - 1 - np.arange(shards)], axis=1).reshape(-1)


def _permute_chunks(x, shards: int, axis: int, order: np.ndarray):
    x = jnp.asarray(x)
    axis = axis % x.ndim
    n = 2 * shards
    if x.shape[axis] % n:
        raise ValueError(f"axis {axis} of length {x.shape[axis]} must be a multiple of 2 * shards = {n}")
    chunked = x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1:])
    sharding = jax.typeof(chunked).sharding
    if not any(name is not None for name in getattr(sharding, "spec", ())):
        return jnp.take(chunked, order, axis=axis).reshape(x.shape)
    # Split by an Explicit mesh: the gather must be told its output's sharding (the input's).
    index = (slice(None),) * axis + (jnp.asarray(order),)
    return chunked.at[index].get(out_sharding=sharding).reshape(x.shape)


def to_zigzag(x: jax.typing.ArrayLike, shards: int, axis: int = 1) -> jax.Array:
    """A global sequence in the zigzag (load-balanced) layout of causal context parallelism.

    The sequence axis is cut into ``2 * shards`` chunks, put in the order ``0, 2S-1, 1,
    2S-2, ..., S-1, S``, so that an even split over ``S`` devices gives device ``i`` chunks
    ``i`` and ``2S-1-i``: the convention of Megatron's context parallelism, ring-attention
    implementations and MaxText's ``context_parallel_load_balance``, under which each
    device holds an equal share of a causal attention's work. Its inverse is
    :func:`from_zigzag`. ``x``'s length along ``axis`` must be a multiple of ``2 * shards``.
    It permutes a whole array (on the host or one device, as a data loader lays out a
    batch); an array split by an Explicit mesh keeps its sharding (the chunks move
    between devices).
    """
    return _permute_chunks(x, shards, axis, _zigzag_order(shards))


def from_zigzag(x: jax.typing.ArrayLike, shards: int, axis: int = 1) -> jax.Array:
    """The sequence order of an array in :func:`to_zigzag`'s layout."""
    return _permute_chunks(x, shards, axis, np.argsort(_zigzag_order(shards)))


def sequence_sharded_causal_conv1d(
    x: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | tuple[str, ...] | None = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    padding_id: int | None = None,
    initial_state: jax.typing.ArrayLike | None = None,
    return_final_state: bool = False,
    activation: str | None = None,
    dilation: int = 1,
    implementation: str | None = "xla",
    interpret: bool = False,
    layout: str = "contiguous",
):
    """:func:`maskconv_kernels.causal_conv1d` with the sequence split over ``axis_name``: context parallelism.

    Each device holds ``L / S`` positions (``S = mesh.shape[axis_name]``) and computes
    their outputs. It receives, by one ``lax.ppermute``, the last ``(W - 1) * dilation``
    inputs of the previous shard (and their segment ids), as many as its first output
    reaches back; nothing comes from later shards, so no value ever flows from a later
    position to an earlier one. Shard 0's halo is ``initial_state`` (zeros without
    one). A document that straddles a border is continued exactly: the halo's ids are
    the previous shard's. Each output is computed as ``causal_conv1d`` computes it on one
    device, so the result is the same, bit for bit. Differentiable in ``x``, ``weight``,
    ``bias`` and ``initial_state``, in forward and reverse mode; the ``weight`` and
    ``bias`` gradients are summed over the mesh. The gradients equal one device's within
    rounding, not bit for bit: a halo position's input gradient adds two shards' sums, and
    the weight gradient is a ``psum`` of per-shard sums.

    ``layout="zigzag"``: ``x`` (and the ids, and ``y``) lie in :func:`to_zigzag`'s
    load-balanced layout, as causal attention under context parallelism wants them:
    device ``i`` holds chunks ``i`` and ``2S - 1 - i`` of ``2S``. Each chunk receives the
    last ``(W - 1) * dilation`` inputs of the chunk before it in sequence order, from
    whichever device holds it (two ``ppermute`` s: chunk ``i``'s from device ``i - 1``,
    chunk ``2S - 1 - i``'s from device ``i + 1``; the last device's second chunk follows
    its own first), and nothing from later chunks. ``initial_state`` feeds chunk 0; the
    final state comes from chunk ``2S - 1`` (with segment ids, the chunk holding each
    row's last non-padding position). The two chunks run as one call, stacked along the
    batch.

    Args:
      x: ``(B, L, D)``; ``L`` split over ``axis_name``, ``B`` over ``batch_axis``.
      weight, bias, activation, dilation: as in ``causal_conv1d``; replicated.
      mesh: the device mesh.
      axis_name: the mesh axis that splits ``L``.
      batch_axis: mesh axis (or axes) that also split ``B``, or ``None``.
      segment_ids: ``None`` or integers ``(B, L)``, split like ``x``: packed documents,
        negative ids padding, as in ``causal_conv1d``.
      padding_id: ``None`` or the segment id that also marks padding (MaxText's ``0``),
        as in ``causal_conv1d``.
      initial_state: ``(B, (W - 1) * dilation, D)`` in x's dtype, or ``None``; split like
        ``B``. The inputs before position 0 (of each row's first document).
      return_final_state: also return the state after ``x``, ``(B, (W - 1) * dilation, D)``
        split like ``B``, as ``causal_conv1d`` defines it. It is the last inputs of the
        shard holding each row's last non-padding position, with its halo (a document
        shorter than the state may begin on the shard before); that shard is found by a
        ``pmax`` of shard indices, and its state copied to all, bit for bit
        (:func:`_copy_from_one_shard`).
      implementation, interpret: as in ``causal_conv1d``, run on each shard (``"xla"`` by default).
      layout: ``"contiguous"`` (device ``i`` holds positions ``[i L / S, (i + 1) L / S)``)
        or ``"zigzag"`` (above).

    Returns:
      ``y``: ``(B, L, D)`` in x's dtype, split like ``x``, or ``(y, final_state)``.

    Raises:
      ValueError: ``axis_name`` is not an axis of ``mesh``; an unknown ``layout``; ``L`` is
        not a multiple of ``S`` (``2S`` zigzagged); or a chunk holds fewer than ``(W - 1) *
        dilation`` positions (the halo must come from the chunk before alone); the bad
        arguments ``causal_conv1d`` rejects.
      TypeError: as in ``causal_conv1d``.
    """
    problem, x, weight, bias, segment_ids, initial_state = make_problem(
        x, weight, bias, segment_ids, initial_state, activation=activation, dilation=dilation, padding_id=padding_id,
    )
    length, state_len = problem.length, problem.state_len
    shards = _shards(mesh, axis_name)
    chunks = _chunks(length, shards, layout, state_len, axis_name, history_is="(W - 1) * dilation = ")

    def shard(x, weight, bias=None, ids=None, state=None):
        index = lax.axis_index(axis_name)
        pieces = _chunk_histories(layout, x, ids, state, state_len, axis_name, shards)
        # Each chunk after its history, the chunks stacked along the batch: one call.
        extended = [past.extend(xc, ic) for past, xc, ic, _ in pieces]
        xe = jnp.concatenate([e[0] for e in extended], axis=0)
        ide = None if ids is None else jnp.concatenate([e[1] for e in extended], axis=0)
        out = causal_conv1d(
            xe, weight, bias, segment_ids=ide, return_final_state=return_final_state, activation=activation,
            dilation=dilation, implementation=implementation, interpret=interpret,
        )
        y, candidates = out if return_final_state else (out, None)
        rows = x.shape[0]
        # The history's own outputs (on zeros of no document) are dropped.
        y = jnp.concatenate([past.outputs(y[k * rows:(k + 1) * rows]) for k, (past, *_) in enumerate(pieces)], axis=1)
        if not return_final_state:
            return y
        # The state is the chunk's with the row's last non-padding position (the last
        # chunk where there is none: its state is then zeros, as on one device).
        order = [chunk(index) for *_, chunk in pieces]
        if ids is None:
            target = chunks - 1
        else:
            held = [jnp.where(jnp.any(ic >= 0, axis=1), k, -1) for (_, _, ic, _), k in zip(pieces, order)]
            last = lax.pmax(functools.reduce(jnp.maximum, held), axis_name)
            target = jnp.where(last >= 0, last, chunks - 1)
        mine = [jnp.broadcast_to(k == target, (rows,)) for k in order]
        value = candidates[:rows]
        for k in range(1, len(pieces)):
            value = jnp.where(_rows(mine[k], value), candidates[k * rows:(k + 1) * rows], value)
        return y, _copy_from_one_shard(value, functools.reduce(jnp.logical_or, mine), axis_name)

    x_spec, row_spec = P(batch_axis, axis_name), P(batch_axis)
    operands = {"x": (x, x_spec), "weight": (weight, P())}
    for name, value, spec in (("bias", bias, P()), ("ids", segment_ids, x_spec), ("state", initial_state, row_spec)):
        if value is not None:
            operands[name] = (value, spec)
    names = list(operands)
    out_specs = (x_spec, row_spec) if return_final_state else x_spec
    return _shard_map(
        lambda *args: shard(**dict(zip(names, args))), mesh,
        tuple(s for _, s in operands.values()), out_specs, *(a for a, _ in operands.values()),
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _copy_from_one_shard(value: jax.Array, mine: jax.Array, axis_name: str) -> jax.Array:
    """Row ``b`` of ``value`` ``(B, ...)`` from the one shard where ``mine[b]``, on every shard, bit for bit.

    A ``psum`` of the values' bits, as unsigned integers, to which every other shard adds
    zeros: integer sums are exact, where XLA's CPU all-reduce of floats returns ``0.0``
    for a ``-0.0`` (even when every other term is ``-0.0``). Its derivative is the float ``psum`` of the
    selected tangents, which is linear, so reverse mode transposes it.
    """
    unsigned = jnp.dtype(f"uint{8 * value.dtype.itemsize}")
    bits = jnp.where(_rows(mine, value), lax.bitcast_convert_type(value, unsigned), jnp.zeros((), unsigned))
    return lax.bitcast_convert_type(lax.psum(bits, axis_name), value.dtype)


@_copy_from_one_shard.defjvp
def _copy_from_one_shard_jvp(axis_name, primals, tangents):
    value, mine = primals
    tangent = jnp.where(_rows(mine, value), tangents[0], jnp.zeros((), tangents[0].dtype))
    return _copy_from_one_shard(value, mine, axis_name), lax.psum(tangent, axis_name)


def _rows(mine: jax.Array, like: jax.Array) -> jax.Array:
    return mine.reshape(mine.shape + (1,) * (like.ndim - mine.ndim))
