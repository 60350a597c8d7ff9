"""Running masked convolutions on a device mesh with JAX's own SPMD.

Two kinds of parallelism:

* **Data parallel** (batch split across devices): nothing to call. ``masked_conv`` under
  ``jax.jit`` with ``x`` sharded along its batch axis returns a batch-sharded output, a
  batch-sharded input gradient and a kernel gradient summed across devices, for every
  backend:

  - ``"xla"`` is made of ``lax.conv_general_dilated`` / ``dot_general`` / slices under a
    ``jax.custom_vjp``, which XLA's partitioner sees through: it partitions them like any
    convolution (the kernel gradient contracts over the batch, so it ends in one
    all-reduce). Nothing is wrapped.
  - Kernel backends (Pallas, Triton) end in custom calls that XLA cannot partition; left
    alone, XLA would gather the whole batch onto every device. :func:`batch_partitioned`
    wraps them in ``custom_partitioning`` (see there for why not ``shard_map``).

* **Spatial** (height split across devices, for images or sequences too large for one
  device): :func:`spatially_sharded_masked_conv`, a ``shard_map`` that exchanges only the
  halo rows the mask's active taps read, with ``ppermute``.
"""
from __future__ import annotations

import itertools
import math

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["NATIVE_SPMD", "HOST_INTERPRETED", "partitioned_masked_conv", "batch_partitioned", "spatially_sharded_masked_conv", "halo_rows"]

# Backends built from XLA ops only: XLA partitions them itself (and across any axis, not
# only the batch), so wrapping them would only take options away from the partitioner.
NATIVE_SPMD = frozenset({"xla"})
# Backends whose interpret mode is a host callback (jax.pure_callback): the Triton
# interpreter. Host code gains nothing from partitioning, and a pure_callback inside
# custom_partitioning segfaults on several CPU devices (jax 0.10.2 and 0.12.0), so those
# calls are left to XLA unpartitioned.
HOST_INTERPRETED = frozenset({"triton"})


def partitioned_masked_conv(implementation: str, module, x, kernel, spec, *, interpret: bool):
    """``module.masked_conv(x, kernel, spec)``, made batch-partitionable when it is a kernel backend.

    The hook :func:`maskconv_kernels.masked_conv` calls for every backend.
    """
    if implementation in NATIVE_SPMD or (interpret and implementation in HOST_INTERPRETED):
        return module.masked_conv(x, kernel, spec, interpret=interpret)

    def conv(x, kernel):
        return (module.masked_conv(x, kernel, spec, interpret=interpret),)

    (out,) = batch_partitioned(conv, batched_in=(True, False), batched_out=(True,))(x, kernel)
    return out


# --------------------------------------------------------------------------- data parallel


def batch_partitioned(fn, batched_in: tuple[bool, ...], batched_out: tuple[bool, ...]):
    """Makes ``fn`` partition along the batch like a native XLA op, differentiably.

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

    ``custom_partitioning`` has no differentiation or batching rule of its own, so:

    * the gradient is a ``custom_vjp`` whose backward is ``batch_partitioned`` again, of
      ``fn``'s VJP (``jax.vjp`` of the backend, so the backend's own backward kernels run;
      the forward that ``jax.vjp`` traces is unused there and XLA removes it).
      The VJP of a per-example function is per-example (batched cotangents and inputs ->
      batched gradients; replicated inputs -> summed gradients), so this recursion also
      gives second derivatives;
    * ``vmap`` folds the mapped axis into the batch when only batched arguments are mapped
      (one partitioned call), and otherwise maps ``fn`` itself (correct, not partitioned).

    Args:
      fn: the per-example function.
      batched_in: for each argument, whether it has the batch as its leading axis.
      batched_out: for each output, whether it has the batch as its leading axis (else it
        is a sum over examples).

    Returns:
      A function with ``fn``'s signature.
    """
    batched_in, batched_out = tuple(batched_in), tuple(batched_out)
    n_in = len(batched_in)

    @jax.custom_vjp
    def call(*args):
        return _partitioned_call(fn, batched_in, batched_out, args)

    def fwd(*args):
        return call(*args), args

    def bwd(args, cts):
        def vjp_fn(*primals_and_cts):
            primals, cts_ = primals_and_cts[:n_in], primals_and_cts[n_in:]
            _, pullback = jax.vjp(fn, *primals)
            return tuple(pullback(tuple(cts_)))

        return batch_partitioned(vjp_fn, batched_in + batched_out, batched_in)(*args, *cts)

    call.defvjp(fwd, bwd)
    return call


def _partitioned_call(fn, batched_in, batched_out, args):
    @jax.custom_batching.custom_vmap
    def mapped(*args):
        return _custom_partitioned(fn, batched_in, batched_out, args)

    @mapped.def_vmap
    def rule(axis_size, in_batched, *args):
        mapped_args = [b for b, m in zip(batched_in, in_batched) if m]
        if all(batched_in[i] or not in_batched[i] for i in range(len(args))) and all(batched_out) and mapped_args:
            # vmap over examples of examples: one call on (axis_size * N, ...).
            folded = []
            for a, b, m in zip(args, batched_in, in_batched):
                if b:
                    a = a if m else jax.numpy.broadcast_to(a, (axis_size, *a.shape))
                    a = a.reshape(axis_size * a.shape[1], *a.shape[2:])
                folded.append(a)
            outs = _partitioned_call(fn, batched_in, batched_out, tuple(folded))
            outs = tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs)
            return outs, (True,) * len(outs)
        outs = jax.vmap(fn, in_axes=tuple(0 if m else None for m in in_batched))(*args)
        return tuple(outs), (True,) * len(outs)

    explicit = _explicit_mesh(args)
    if explicit is None:
        return mapped(*args)
    # Explicit mesh axes type every traced value by its sharding, and kernel code (Pallas
    # refs in particular) does not take sharded types. Inside auto_axes the types are
    # plain again and custom_partitioning decides the split, as with Auto axes.
    mesh = explicit
    first = next(a for a, b in zip(args, batched_in) if b)
    spec = jax.typeof(first).sharding.spec
    batch = P(spec[0] if len(spec) else None)
    out_sharding = tuple(NamedSharding(mesh, batch if b else P()) for b in batched_out)
    return jax.sharding.auto_axes(lambda *a: mapped(*a), out_sharding=out_sharding)(*args)


def _explicit_mesh(args):
    """The abstract mesh of the arguments' types when it has Explicit axes, else None."""
    for a in args:
        mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def _custom_partitioned(fn, batched_in, batched_out, args):
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


# --------------------------------------------------------------------------- spatial


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

    Returns:
      ``(N, H_out, *rest_out, C_out)``, split the same way as ``x``.

    Raises:
      ValueError: the split does not fit (the message says which limit): ``H`` must be a
        multiple of ``D * strides[0]``; the output height must be ``H / strides[0]``
        (``"SAME"`` padding, or explicit pads that keep it; not ``"VALID"`` in ``H``); and
        each shard must hold at least as many rows as the halo it sends.
    """
    from .api import masked_conv
    from .spec import make_spec

    spec = make_spec(
        x, kernel, mask, strides=strides, padding=padding, dilation=dilation,
        feature_group_count=feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type,
    )
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    shards = mesh.shape[axis_name]
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
    forward = [(i, i + 1) for i in range(shards - 1)]
    backward = [(i + 1, i) for i in range(shards - 1)]

    def shard(x, kernel):
        parts = []
        if above:
            # Shard i gets the last rows of shard i - 1; shard 0 gets zeros (its padding).
            parts.append(lax.ppermute(x[:, local - above :], axis_name, forward))
        parts.append(x)
        if below:
            parts.append(lax.ppermute(x[:, :below], axis_name, backward))
        xh = jax.numpy.concatenate(parts, axis=1) if len(parts) > 1 else x
        if crop:
            xh = xh[:, : xh.shape[1] - crop]
        return masked_conv(
            xh, kernel, spec.mask, strides=spec.strides, padding=local_pads, dilation=spec.dilation,
            feature_group_count=spec.groups, precision=spec.precision,
            preferred_element_type=preferred_element_type, implementation=implementation, interpret=interpret,
        )

    x_spec = P(batch_axis, axis_name)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # Explicit axes type arrays by their sharding, and shard_map takes them as typed:
        # move them to the split it needs (with Auto axes, shard_map inserts this itself).
        x = jax.sharding.reshard(x, NamedSharding(mesh, x_spec))
        kernel = jax.sharding.reshard(kernel, NamedSharding(mesh, P()))
    return jax.shard_map(shard, mesh=mesh, in_specs=(x_spec, P()), out_specs=x_spec)(x, kernel)
