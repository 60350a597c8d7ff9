"""Spatial parallelism: a masked convolution with its height split across devices.

For images or sequences too large for one device: :func:`spatially_sharded_masked_conv`
is a ``shard_map`` that exchanges only the halo rows the mask's active taps read, with
``ppermute``, and calls :func:`maskconv_kernels.masked_conv` on each shard. It sits above
the API (it imports it; nothing below imports it).
"""
from __future__ import annotations

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from .api import masked_conv
from .spec import make_spec

__all__ = ["spatially_sharded_masked_conv", "halo_rows"]


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
