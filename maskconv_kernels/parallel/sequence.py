"""Context parallelism: :func:`sequence_sharded_causal_conv1d`, a short causal convolution with its
sequence split across devices, exchanging a ``(W - 1) * dilation`` halo from the previous
shard only, with initial and final states.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .._core.history import History
from ..ops.causal_conv1d import causal_conv1d
from ..ops.causal_conv1d.checks import make_problem
from .halo import halo as _halo
from .halo import shard_map as _shard_map
from .halo import shards as _shards

__all__ = ["sequence_sharded_causal_conv1d"]


def sequence_sharded_causal_conv1d(
    x: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | tuple[str, ...] | None = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    initial_state: jax.typing.ArrayLike | None = None,
    return_final_state: bool = False,
    activation: str | None = None,
    dilation: int = 1,
    implementation: str | None = "xla",
    interpret: bool = False,
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

    Args:
      x: ``(B, L, D)``; ``L`` split over ``axis_name``, ``B`` over ``batch_axis``.
      weight, bias, activation, dilation: as in ``causal_conv1d``; replicated.
      mesh: the device mesh.
      axis_name: the mesh axis that splits ``L``.
      batch_axis: mesh axis (or axes) that also split ``B``, or ``None``.
      segment_ids: ``None`` or integers ``(B, L)``, split like ``x``: packed documents,
        negative ids padding, as in ``causal_conv1d``.
      initial_state: ``(B, (W - 1) * dilation, D)`` in x's dtype, or ``None``; split like
        ``B``. The inputs before position 0 (of each row's first document).
      return_final_state: also return the state after ``x``, ``(B, (W - 1) * dilation, D)``
        split like ``B``, as ``causal_conv1d`` defines it. It is the last inputs of the
        shard holding each row's last non-padding position, with its halo (a document
        shorter than the state may begin on the shard before); that shard is found by a
        ``pmax`` of shard indices, and its state copied to all, bit for bit
        (:func:`_copy_from_one_shard`).
      implementation, interpret: as in ``causal_conv1d``, run on each shard (``"xla"`` by default).

    Returns:
      ``y``: ``(B, L, D)`` in x's dtype, split like ``x``, or ``(y, final_state)``.

    Raises:
      ValueError: ``axis_name`` is not an axis of ``mesh``; ``L`` is not a multiple of
        ``S``; or a shard holds fewer than ``(W - 1) * dilation`` positions (the halo must
        come from the immediate neighbour); the bad arguments ``causal_conv1d`` rejects.
      TypeError: as in ``causal_conv1d``.
    """
    problem, x, weight, bias, segment_ids, initial_state = make_problem(
        x, weight, bias, segment_ids, initial_state, activation=activation, dilation=dilation,
    )
    length, state_len = problem.length, problem.state_len
    shards = _shards(mesh, axis_name)
    if length % shards:
        raise ValueError(
            f"sequence length {length} must be a multiple of the {shards} shards along {axis_name!r}: "
            f"pad x (with negative segment ids) or use fewer shards"
        )
    local = length // shards
    if local < state_len:
        fits = max(s for s in range(1, length // state_len + 1) if length % s == 0)
        raise ValueError(
            f"each shard holds {local} positions but needs a halo of (W - 1) * dilation = {state_len} inputs from "
            f"the previous shard alone: use at most {fits} shards along {axis_name!r} for length {length}, or a "
            f"longer sequence"
        )

    def shard(x, weight, bias=None, ids=None, state=None):
        index = lax.axis_index(axis_name)
        past = History(x[:, :0], None if ids is None else ids[:, :0])
        if state_len:
            # As on one device: shard 0's halo is the initial state, of the row's first
            # document, or zeros of no document.
            first = -1 if state is None else History.of_first_document(state, ids).segment_ids
            past = History(
                _halo(x, state_len, axis_name, shards, before=True, border=state),
                None if ids is None else _halo(ids, state_len, axis_name, shards, before=True, border=first),
            )
        xe, ide = past.extend(x, ids)
        # The halo's own outputs (on zeros of no document) are dropped.
        out = causal_conv1d(
            xe, weight, bias, segment_ids=ide, return_final_state=return_final_state, activation=activation,
            dilation=dilation, implementation=implementation, interpret=interpret,
        )
        if not return_final_state:
            return past.outputs(out)
        y, candidate = out
        # The state is the shard's with the row's last non-padding position (the last
        # shard where there is none: its state is then zeros, as on one device).
        if ids is None:
            mine = jnp.full(x.shape[:1], index == shards - 1)
        else:
            last = lax.pmax(jnp.where(jnp.any(ids >= 0, axis=1), index, -1), axis_name)
            mine = index == jnp.where(last >= 0, last, shards - 1)
        return past.outputs(y), _copy_from_one_shard(candidate, mine, axis_name)

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
