"""Spatial parallelism: a masked convolution with its height split across devices.

For images or sequences too large for one device: :func:`spatially_sharded_masked_conv`
is a ``shard_map`` that exchanges only the halo rows the mask's active taps read, with
``ppermute``, and calls :func:`maskconv_kernels.masked_conv` on each shard. Segment ids
travel with their inputs' halo, so packed documents that straddle a shard border are
continued exactly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._core.args import as_segment_ids
from ..ops.masked_conv import masked_conv
from ..ops.masked_conv.spec import make_spec
from .halo import halo as _halo
from .halo import shard_map as _shard_map
from .halo import shards as _shards

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
