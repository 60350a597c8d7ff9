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


def custom_partitioned(fn, batched_in, batched_out, args):
    """``fn(*args)``, partitioned by XLA along the batch like a native op.

    ``fn(*arrays) -> tuple of arrays`` must be *per-example*: each argument is either
    batched (leading axis ``N``, example ``i`` only affects example ``i``) or replicated
    (the kernel), and each output is either batched or a sum over the examples (a kernel
    gradient). Then running ``fn`` on each device's slice of the batch and summing the
    non-batched outputs across devices (``psum``) gives ``fn``'s result; that is the
    partitioning rule given to XLA.

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
    """
    out_shapes = jax.eval_shape(fn, *args)
    if any(a.ndim == 0 for a in args) or any(o.ndim == 0 for o in out_shapes):
        raise ValueError("batch_partitioned takes and returns arrays of rank >= 1")
    # Shardy's rule: one factor "n" for the batch, shared by the batched arrays; every
    # other dimension is its own factor that must stay replicated (a kernel backend reads
    # whole images and whole kernels). A sharded height is gathered here, not split: for
    # that, see spatially_sharded_masked_conv.
    factors, names = [], (f"d{i}" for i in itertools.count())

    def dims(shape, batched):
        own = [next(names) for _ in (shape[1:] if batched else shape)]
        factors.extend(own)
        return " ".join((["n"] if batched else []) + own)

    operands = ", ".join(dims(a.shape, b) for a, b in zip(args, batched_in))
    results = ", ".join(dims(o.shape, b) for o, b in zip(out_shapes, batched_out))

    def axes_of(mesh, arg_shapes):
        """The mesh axes that shard the batch of the first batched argument (or ())."""
        for shape, batched in zip(arg_shapes, batched_in):
            if not batched:
                continue
            sharding = shape.sharding
            if not isinstance(sharding, NamedSharding) or not sharding.spec:
                return ()
            first = sharding.spec[0]
            axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
            # An uneven split would need padding examples through the kernel: replicate.
            if shape.shape[0] % math.prod(mesh.shape[a] for a in axes):
                return ()
            return axes
        return ()

    def shardings(mesh, axes, flags):
        batch = P(axes if axes else None)
        return tuple(NamedSharding(mesh, batch if b else P()) for b in flags)

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, axes_of(mesh, arg_shapes), batched_out)

    def partition(mesh, arg_shapes, result_shape):
        axes = axes_of(mesh, arg_shapes)

        def lower(*local_args):
            outs = fn(*local_args)
            if not axes:
                return tuple(outs)
            # Each device summed its own examples; the kernel gradient is the sum of those.
            return tuple(o if b else lax.psum(o, axes) for o, b in zip(outs, batched_out))

        return mesh, lower, shardings(mesh, axes, batched_out), shardings(mesh, axes, batched_in)

    call = custom_partitioning(lambda *a: tuple(fn(*a)))
    call.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=f"{operands} -> {results}",
        need_replication_factors=tuple(factors),
    )
    return tuple(call(*args))
