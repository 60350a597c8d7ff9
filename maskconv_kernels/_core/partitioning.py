"""Kernel calls partitioned by XLA along the batch, like native ops.

``masked_conv`` under ``jax.jit`` with ``x`` sharded along its batch axis returns a
batch-sharded output, a batch-sharded input gradient and a kernel gradient summed across
devices, for every implementation; nothing to call:

* the ``xla`` implementations lower to ``lax`` ops, which XLA's partitioner sees through
  (the kernel gradient contracts over the batch, so it ends in one all-reduce);
* kernel implementations end in custom calls that XLA cannot partition; left alone, XLA
  would gather the whole batch onto every device. :mod:`.primitives` lowers each of their
  kernels through :func:`custom_partitioned` on several devices.

Spatial and sequence parallelism (a split height or sequence) are
:mod:`maskconv_kernels.parallel`.
"""
from __future__ import annotations

import itertools
import math

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["custom_partitioned"]


def custom_partitioned(fn, batched_in, batched_out, args, channels_in=None, channels_out=None):
    """``fn(*args)``, partitioned by XLA along the batch (and the channels) like a native op.

    ``fn(*arrays) -> tuple of arrays`` must be *per-example*: each argument is either
    batched (leading axis ``N``, example ``i`` only affects example ``i``) or replicated
    (the kernel), and each output is either batched or a sum over the examples (a kernel
    gradient). Then running ``fn`` on each device's slice of the batch and summing the
    non-batched outputs across devices (``psum``) gives ``fn``'s result; that is the
    partitioning rule given to XLA. With ``channels_in`` / ``channels_out`` (for each
    argument / output, the axis of its channels, or ``None``), ``fn`` is also
    *per-channel* (a depthwise op: channel ``c`` of every output reads channel ``c`` of
    the arguments only, and every output has channels), so each device may also run its
    slice of the channels: where XLA chose to split them (tensor parallelism), they stay
    split, and ``fn`` sees its local channel count.

    Why ``custom_partitioning`` and not ``shard_map``: a ``shard_map`` needs the mesh and the
    batch's mesh axes when the function is traced, and inside ``jax.jit`` with ``NamedSharding``
    inputs (no mesh in context, ``Auto`` axes) they are not known then; they are known
    only after XLA's sharding propagation. ``custom_partitioning`` is called back at that
    point with the shardings XLA chose, so ``masked_conv`` partitions like a convolution
    in any program, with no mesh argument and no change to the caller's code.

    It is called by :mod:`.primitives` when a primitive is *lowered* (below
    differentiation and batching, which the primitives' own rules handle), so
    ``custom_partitioning``'s lack of AD and batching rules does not matter.

    Args:
      fn: the per-example function.
      batched_in: for each argument, whether it has the batch as its leading axis.
      batched_out: for each output, whether it has the batch as its leading axis (else it
        is a sum over examples).
      args: the arrays.
      channels_in, channels_out: ``None`` (not per-channel), or for each argument / output
        the axis of its channels or ``None`` (it has none: segment ids).
    """
    out_shapes = jax.eval_shape(fn, *args)
    if any(a.ndim == 0 for a in args) or any(o.ndim == 0 for o in out_shapes):
        raise ValueError("batch_partitioned takes and returns arrays of rank >= 1")
    channels_in = [None] * len(args) if channels_in is None else [_axis(c, a.ndim) for c, a in zip(channels_in, args)]
    channels_out = [None] * len(out_shapes) if channels_out is None else [
        _axis(c, o.ndim) for c, o in zip(channels_out, out_shapes)]
    # Shardy's rule: one factor "n" for the batch and one "c" for the channels, each shared
    # by the arrays that have it; every other dimension is its own factor that must stay
    # replicated (a kernel backend reads whole sequences and images). A sharded height is
    # gathered here, not split: for that, see spatially_sharded_masked_conv.
    factors, names = [], (f"d{i}" for i in itertools.count())

    def dims(shape, batched, channel):
        out = []
        for axis in range(len(shape)):
            if batched and axis == 0:
                out.append("n")
            elif axis == channel:
                out.append("c")
            else:
                out.append(next(names))
                factors.append(out[-1])
        return " ".join(out)

    operands = ", ".join(dims(a.shape, b, c) for a, b, c in zip(args, batched_in, channels_in))
    results = ", ".join(dims(o.shape, b, c) for o, b, c in zip(out_shapes, batched_out, channels_out))

    def split_axes(mesh, arg_shapes, which):
        """The mesh axes that split the first argument with a batch (``which = None``) or with
        channels (else), or () where none does or they do not divide its size."""
        for shape, batched, channel in zip(arg_shapes, batched_in, channels_in):
            axis = (0 if batched else None) if which is None else channel
            if axis is None:
                continue
            sharding = shape.sharding
            if not isinstance(sharding, NamedSharding) or len(sharding.spec) <= axis:
                return ()
            entry = sharding.spec[axis]
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            # An uneven split would need padding through the kernel: replicate.
            if shape.shape[axis] % math.prod(mesh.shape[a] for a in axes):
                return ()
            return axes
        return ()

    def shardings(mesh, batch, channels, batched, channel_axes):
        specs = []
        for b, c in zip(batched, channel_axes):
            ndim = max(1 if b else 0, 0 if c is None else c + 1)
            spec = [None] * ndim
            if b and batch:
                spec[0] = batch
            if c is not None and channels:
                spec[c] = channels
            specs.append(NamedSharding(mesh, P(*spec)))
        return tuple(specs)

    def chosen(mesh, arg_shapes):
        batch = split_axes(mesh, arg_shapes, None)
        channels = split_axes(mesh, arg_shapes, "c")
        if set(batch) & set(channels):
            channels = ()
        return batch, channels

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, *chosen(mesh, arg_shapes), batched_out, channels_out)

    def partition(mesh, arg_shapes, result_shape):
        batch, channels = chosen(mesh, arg_shapes)

        def lower(*local_args):
            outs = fn(*local_args)
            if not batch:
                return tuple(outs)
            # Each device summed its own examples; the kernel gradient is the sum of those.
            return tuple(o if b else lax.psum(o, batch) for o, b in zip(outs, batched_out))

        return (mesh, lower, shardings(mesh, batch, channels, batched_out, channels_out),
                shardings(mesh, batch, channels, batched_in, channels_in))

    call = custom_partitioning(lambda *a: tuple(fn(*a)))
    call.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=f"{operands} -> {results}",
        need_replication_factors=tuple(factors),
    )
    return tuple(call(*args))


def _axis(axis, ndim: int):
    return None if axis is None else axis % ndim
