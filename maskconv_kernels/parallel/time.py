"""Context parallelism for video and audio: :func:`time_sharded_causal_conv` and
:func:`time_sharded_causal_conv_transpose`, ``causal_conv`` with its time axis split over devices.

Each device's chunk of frames is one chunk of a stream (:mod:`..ops.causal_conv.stream`):
its history is the last frames of the chunk before it in time, received by ``ppermute``
from whichever device holds that chunk (:func:`.halo.chunk_histories`), so every output
is computed whole, from the same frames and taps as in one call, and nothing reaches an
earlier frame from a later one. CogVideoX's ``ContextParallelCausalConv3d`` passes the
last ``k_T - 1`` frames forward in the same way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ..ops.causal_conv.checks import make_problem
from ..ops.causal_conv.stream import (
    CausalConvState, causal_conv_stream, causal_conv_transpose_stream, history_length,
)
from .halo import chunk_histories, chunks, shard_map, shards

__all__ = ["time_sharded_causal_conv", "time_sharded_causal_conv_transpose"]


def time_sharded_causal_conv(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    layout: str = "contiguous",
    batch_axis: str | tuple[str, ...] | None = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    **kwargs,
) -> jax.Array:
    """:func:`maskconv_kernels.causal_conv` with time split over ``axis_name``.

    Each device holds ``T / S`` frames (``S = mesh.shape[axis_name]``; zigzagged, chunks
    ``i`` and ``2S - 1 - i`` of ``2S``, as :func:`~.sequence.to_zigzag` lays them out) and
    receives the last ``(k_T - 1) * d_T`` input frames of the chunk before each of its
    chunks, with their segment ids: the frames its first outputs read, and nothing from
    later chunks. The first chunk's history is zeros, or with ``padding_mode="replicate"``
    copies of frame 0, as in one call. The outputs equal the single call's within
    rounding: XLA's convolutions and GEMMs choose their blocking from the shape, and XLA's
    CPU compiler may contract multiply-adds differently in the two programs.

    Args:
      x: as :func:`~maskconv_kernels.causal_conv` takes it (its ``dimension_numbers``);
        time split over ``axis_name``, the batch over ``batch_axis``.
      kernel, bias: the layer's; replicated.
      mesh: the device mesh. axis_name: the mesh axis that splits time.
      layout: ``"contiguous"`` or ``"zigzag"``.
      batch_axis: mesh axis (or axes) that also split the batch, or ``None``.
      segment_ids: ``(N, T, *spatial)`` integers or ``None``, split like ``x``: packed clips.
      **kwargs: the other keywords of :func:`~maskconv_kernels.causal_conv` (``strides``,
        ``dilation``, ``padding``, ``padding_mode``, ``spatial_padding_mode``, ``feature_group_count``,
        ``dimension_numbers``, ``precision``, ``implementation``, ``interpret``, ``config``).

    Returns:
      ``causal_conv``'s output, time split like ``x``'s.

    Raises:
      ValueError: ``T`` not a multiple of the chunks; a chunk shorter than the history the
        next one needs, or (strided) not a multiple of ``strides[0]`` frames;
        :func:`~maskconv_kernels.causal_conv`'s errors.
    """
    return _time_sharded("time_sharded_causal_conv", False, x, kernel, bias, mesh, axis_name, layout, batch_axis,
                         segment_ids, kwargs)


def time_sharded_causal_conv_transpose(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    layout: str = "contiguous",
    batch_axis: str | tuple[str, ...] | None = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    **kwargs,
) -> jax.Array:
    """:func:`maskconv_kernels.causal_conv_transpose` with time split over ``axis_name``: each chunk
    of ``T / S`` frames gives its ``T / S * strides[0]`` outputs from the last
    ``ceil(k_T / s_T) - 1`` frames before it. Arguments as :func:`time_sharded_causal_conv`'s."""
    return _time_sharded("time_sharded_causal_conv_transpose", True, x, kernel, bias, mesh, axis_name, layout,
                         batch_axis, segment_ids, kwargs)


_LAYER = ("strides", "dilation", "padding", "padding_mode", "spatial_padding_mode", "feature_group_count",
          "dimension_numbers", "precision", "implementation", "interpret", "config")


def _time_sharded(op, transposed, x, kernel, bias, mesh, axis_name, layout, batch_axis, segment_ids, kwargs):
    unknown = sorted(set(kwargs) - set(_LAYER))
    if unknown:
        raise TypeError(f"{op}: unexpected keyword arguments {unknown}; it takes causal_conv's: {list(_LAYER)}")
    checked = {k: v for k, v in kwargs.items() if k not in ("implementation", "interpret", "config")}
    problem, x, kernel, bias, ids = make_problem(op, x, kernel, bias, segment_ids, transposed=transposed, **checked)
    n = shards(mesh, axis_name)
    history = history_length(problem)
    count = chunks(problem.frames, n, layout, history, axis_name, what="the number of frames",
                   history_is=("ceil(k_T / s_T) - 1 = " if transposed else "(k_T - 1) * d_T = "))
    size = problem.frames // count
    if not transposed and size % problem.stride:
        raise ValueError(
            f"{op}: each chunk holds {size} frames, not a multiple of strides[0] = {problem.stride}: every chunk must "
            "give whole outputs (size / strides[0] of them); use fewer shards or pad time"
        )
    stream = causal_conv_transpose_stream if transposed else causal_conv_stream
    layer = {**kwargs, "dimension_numbers": None}  # x, kernel and ids are channels-last now

    def shard(x, kernel, bias=None, ids=None):
        index = lax.axis_index(axis_name)
        outputs = []
        for past, xc, ic, chunk in chunk_histories(layout, x, ids, None, history, axis_name, n):
            # Chunk 0 has no past: its history is the stream's own padding (zeros, or frame 0).
            state = CausalConvState(past.inputs, jnp.zeros((), jnp.int32), chunk(index) > 0, past.segment_ids)
            outputs.append(stream(xc, state, kernel, bias, segment_ids=ic, **layer)[0])
        return jnp.concatenate(outputs, axis=1)

    split = P(batch_axis, axis_name)
    given = {"x": (x, split), "kernel": (kernel, P()), "bias": (bias, P()), "ids": (ids, split)}
    given = {name: pair for name, pair in given.items() if pair[0] is not None}
    y = shard_map(lambda *args: shard(**dict(zip(given, args))), mesh, tuple(s for _, s in given.values()), split,
                  *(a for a, _ in given.values()))
    return problem.layout.output(y)
