"""Spatial parallelism: a masked convolution with its height split across devices.

For images or sequences too large for one device: :func:`spatially_sharded_masked_conv`
is a ``shard_map`` that exchanges only the halo rows the mask's active taps read, with
``ppermute``, and calls :func:`maskconv_kernels.masked_conv` on each shard. Segment ids
travel with their inputs' halo, so packed documents that straddle a shard border are
continued exactly. :func:`sequence_sharded_causal_conv1d` is the same for the short
convolutions of sequence models (context parallelism): a ``(W - 1) * dilation`` halo from
the previous shard only, with initial and final states. It sits above the API (it
imports it; nothing below imports it).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from .api import masked_conv
from .short_conv import _check_activation, _check_operands, _check_state, causal_conv1d
from .spec import as_operand, as_segment_ids, make_spec

__all__ = ["spatially_sharded_masked_conv", "sequence_sharded_causal_conv1d", "halo_rows"]


def halo_rows(spec, local_rows: int) -> tuple[int, int]:
    """``(above, below)``: the input rows a height shard needs from its neighbours.

    Output row ``o`` reads input row ``o * s - lo + t * d`` for the row offsets ``t`` of the
    *active* taps only, so a causal mask (no active tap below the centre) needs nothing
    from below, and its outputs never depend on the shards after them.
    """
    rows = sorted({tap[0] for tap in spec.mask.active_taps})
    (lo, _), s, d = spec.padding[0], spec.strides[0], spec.dilation[0]
    above = max(0, lo - rows[0] * d)
    # Last output row of a shard is (local_rows // s - 1) in shard coordinates; it reads
    # up to local_rows - s - lo + t_max * d, i.e. this many rows past the shard's end.
    below = max(0, rows[-1] * d - lo - s + 1)
    return above, below


def spatially_sharded_masked_conv(
    x: jax.Array,
    kernel: jax.Array,
    mask,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | tuple[str, ...] | None = None,
    strides=1,
    padding="SAME",
    dilation=1,
    feature_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
    implementation: str | None = "xla",
    interpret: bool = False,
    segment_ids: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """:func:`maskconv_kernels.masked_conv` with the first spatial dim split over ``axis_name``.

    Each device holds ``H / D`` rows of ``x`` (``D = mesh.shape[axis_name]``) and computes
    the same share of the output rows. Before its convolution it receives, by
    ``lax.ppermute``, the last rows of the shard above and the first rows of the shard
    below, as many as the mask's active taps reach (:func:`halo_rows`): a causal mask
    exchanges only the halo from above, and no value ever flows from a later shard. The
    image borders get the zero padding ``masked_conv`` would use. Differentiable; the
    kernel gradient is summed over the mesh.

    Args:
      x: ``(N, H, *rest, C_in)``, 1-3 spatial dims; ``H`` is split.
      kernel, mask, strides, padding, dilation, feature_group_count, precision,
      preferred_element_type, implementation, interpret: as in ``masked_conv``.
      mesh: the device mesh.
      axis_name: the mesh axis that splits ``H``.
      batch_axis: mesh axis (or axes) that also split the batch, or ``None``.
      segment_ids: ``None`` or integers ``(N, H, *rest)``, split like ``x``: packed
        documents, as in ``masked_conv`` (stride 1, a size-preserving padding). The halo
        carries the neighbours' ids with their inputs, so a document that straddles a
        border is continued exactly; beyond the image borders the ids are padding.

    Returns:
      ``(N, H_out, *rest_out, C_out)``, split the same way as ``x``.

    Raises:
      ValueError: the split does not fit (the message says which limit): ``H`` must be a
        multiple of ``D * strides[0]``; the output height must be ``H / strides[0]``
        (``"SAME"`` padding, or explicit pads that keep it; not ``"VALID"`` in ``H``); and
        each shard must hold at least as many rows as the halo it sends.
    """
    spec = make_spec(
        x, kernel, mask, strides=strides, padding=padding, dilation=dilation,
        feature_group_count=feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type, segmented=segment_ids is not None,
    )
    if segment_ids is not None:
        segment_ids = as_segment_ids(segment_ids, x.shape[:-1])
    shards = _shards(mesh, axis_name)
    height, s, (lo, hi) = spec.in_spatial[0], spec.strides[0], spec.padding[0]
    if height % (shards * s):
        raise ValueError(
            f"height {height} must be a multiple of {shards} shards x stride {s} = {shards * s} "
            f"for spatial sharding over {axis_name!r}: pad the input or use fewer shards"
        )
    if spec.out_spatial[0] * s != height:
        raise ValueError(
            f"spatial sharding needs output height == input height / stride ({height} / {s} = {height // s}), "
            f"got {spec.out_spatial[0]} with height padding {(lo, hi)}: use padding='SAME' (or explicit pads "
            f"that keep the height), and crop the output afterwards"
        )
    local = height // shards
    above, below = halo_rows(spec, local)
    if above > local or below > local:
        raise ValueError(
            f"each shard holds {local} rows but the mask's active taps need a halo of {above} rows above and "
            f"{below} below, which must come from the immediate neighbours: use at most "
            f"{height // max(above, below)} shards along {axis_name!r}"
        )
    # In shard coordinates (halo rows prepended), output row o reads o * s - lo + t * d + above.
    local_lo = lo - above
    local_hi = (local // s - 1) * s + spec.dilation[0] * (spec.window[0] - 1) + 1 - (local + above + below) - local_lo
    # Negative high padding (strided, no halo below): drop rows no output reads.
    crop = max(0, -local_hi)
    local_pads = ((local_lo, max(0, local_hi)), *spec.padding[1:])

    def shard(x, kernel, ids=None):
        # Shard i gets the last rows of shard i - 1 and the first of shard i + 1; the shards
        # at the image borders get zeros (masked_conv's padding) and padding ids.
        xs, id_parts = [x], [ids]
        if above:
            xs.insert(0, _halo(x, above, axis_name, shards, before=True))
            if ids is not None:
                id_parts.insert(0, _halo(ids, above, axis_name, shards, before=True, border=-1))
        if below:
            xs.append(_halo(x, below, axis_name, shards, before=False))
            if ids is not None:
                id_parts.append(_halo(ids, below, axis_name, shards, before=False, border=-1))
        xh = jnp.concatenate(xs, axis=1) if len(xs) > 1 else x

        def conv(xh, pads, **kw):
            return masked_conv(
                xh, kernel, spec.mask, strides=spec.strides, padding=pads, dilation=spec.dilation,
                feature_group_count=spec.groups, precision=spec.precision,
                preferred_element_type=preferred_element_type, implementation=implementation, interpret=interpret, **kw
            )

        if ids is not None:
            # Segment ids need an output on the input's grid (stride 1): the halo rows' own
            # outputs are computed with the global padding too, and dropped.
            idh = jnp.concatenate(id_parts, axis=1) if len(id_parts) > 1 else ids
            return conv(xh, spec.padding, segment_ids=idh)[:, above : above + local]
        if crop:
            xh = xh[:, : xh.shape[1] - crop]
        return conv(xh, local_pads)

    x_spec = P(batch_axis, axis_name)
    if segment_ids is None:
        return _shard_map(shard, mesh, (x_spec, P()), x_spec, x, kernel)
    return _shard_map(shard, mesh, (x_spec, P(), x_spec), x_spec, x, kernel, segment_ids)


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
):
    """:func:`maskconv_kernels.short_conv.causal_conv1d` with the sequence split over ``axis_name``: context parallelism.

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
      implementation: as in ``causal_conv1d``, run on each shard (``"xla"`` by default).

    Returns:
      ``y``: ``(B, L, D)`` in x's dtype, split like ``x``, or ``(y, final_state)``.

    Raises:
      ValueError: ``axis_name`` is not an axis of ``mesh``; ``L`` is not a multiple of
        ``S``; or a shard holds fewer than ``(W - 1) * dilation`` positions (the halo must
        come from the immediate neighbour); the bad arguments ``causal_conv1d`` rejects.
      TypeError: as in ``causal_conv1d``.
    """
    _check_activation(activation)
    x, weight = as_operand("x", x), as_operand("weight", weight)
    bias = None if bias is None else as_operand("bias", bias)
    _, d, state_len = _check_operands(x, weight, bias, dilation)
    batch, length = x.shape[:2]
    if segment_ids is not None:
        segment_ids = as_segment_ids(segment_ids, x.shape[:-1])
    if initial_state is not None:
        initial_state = as_operand("initial_state", initial_state)
        _check_state("initial_state", initial_state, batch, state_len, d, x.dtype)
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
        xe, ide = x, ids
        if state_len:
            # As on one device: shard 0's halo is the initial state, of the row's first
            # document, or zeros of no document.
            xe = jnp.concatenate([_halo(x, state_len, axis_name, shards, before=True, border=state), x], axis=1)
            if ids is not None:
                first = -1 if state is None else jnp.broadcast_to(ids[:, :1], (ids.shape[0], state_len))
                ide = jnp.concatenate([_halo(ids, state_len, axis_name, shards, before=True, border=first), ids], axis=1)
        # The halo's own outputs (on zeros of no document) are dropped.
        out = causal_conv1d(
            xe, weight, bias, segment_ids=ide, return_final_state=return_final_state, activation=activation,
            dilation=dilation, implementation=implementation,
        )
        if not return_final_state:
            return out[:, state_len:]
        y, candidate = out
        # The state is the shard's with the row's last non-padding position (the last
        # shard where there is none: its state is then zeros, as on one device).
        if ids is None:
            mine = jnp.full(x.shape[:1], index == shards - 1)
        else:
            last = lax.pmax(jnp.where(jnp.any(ids >= 0, axis=1), index, -1), axis_name)
            mine = index == jnp.where(last >= 0, last, shards - 1)
        return y[:, state_len:], _copy_from_one_shard(candidate, mine, axis_name)

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


def _shards(mesh: jax.sharding.Mesh, axis_name: str) -> int:
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    return mesh.shape[axis_name]


def _halo(a: jax.Array, rows: int, axis_name: str, shards: int, *, before: bool, border=None) -> jax.Array:
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


def _shard_map(fn, mesh, in_specs, out_specs, *args):
    """``jax.shard_map(fn, ...)(*args)``, on a mesh with Auto or Explicit axes."""
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # Explicit axes type arrays by their sharding, and shard_map takes them as typed:
        # move them to the split it needs (with Auto axes, shard_map inserts this itself).
        args = [jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
