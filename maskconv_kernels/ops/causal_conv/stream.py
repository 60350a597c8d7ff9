"""Streaming causal convolutions: :func:`causal_conv_stream` and :func:`causal_conv_transpose_stream`.

A stream feeds a layer chunks of frames and gets, for each, the outputs those frames
complete; the outputs of all chunks, concatenated, are those of one call on all the
frames (:func:`~.api.causal_conv`). The state between chunks is what the next outputs
read from the past: the last ``(k_T - 1) * d_T`` input frames (frames before the stream
are zeros, or copies of its frame 0), never partial sums, so every output is computed
whole, from the same frames and taps as in the full pass.

With a time stride ``s``, output ``t`` reads up to frame ``t * s``: a first chunk of
``L`` frames gives ``ceil(L / s)`` outputs and leaves the next output ``offset = ceil(L
/ s) * s - L`` frames into the next chunk; every later chunk is a multiple of ``s``
frames and gives ``length / s`` outputs, the offset unchanged. The offset is data (an
int32 scalar), so a stream of equal chunks has one state type: ``jit`` compiles one
program per chunk shape, ``lax.scan`` carries it, and its buffers can be donated.

The transposed convolution (upsampling, :func:`~.api.causal_conv_transpose`) streams
its phases' stride-1 convolutions (:mod:`.phases`) on one history of input frames: any
chunk length, ``s`` outputs per frame. This is overlap-add carried as inputs rather
than as the overlapping partial sums: a partial sum would fix, at each chunk boundary,
where an output's reduction is split, which the full pass does not split.

Whether the concatenated outputs are the full pass's bit for bit depends on the
implementation's reduction order: the kernel backends' is fixed by channel tiles, the
same for every frame and every length (bit for bit); XLA's convolution and GEMM
libraries choose their blocking from the problem's shape, so ``"xla"`` agrees within a
rounding bound (``docs/causal_conv.md`` says where, and why).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._core.args import as_operand, as_segment_ids, is_int
from ..._core.errors import OpError
from ..._core.history import History, check_history
from . import phases
from .api import finish, time_conv, transposed_phases
from .checks import Problem, make_problem

__all__ = [
    "CausalConvState", "causal_conv_stream", "causal_conv_transpose_stream", "causal_conv_stream_init", "history_length",
]


@dataclasses.dataclass(frozen=True)
class CausalConvState:
    """What a stream carries between chunks: a pytree of arrays (``jit``, ``scan`` and donation take it).

    Attributes:
      frames: ``(N, F, *spatial, C_in)`` in x's dtype, channels-last whatever the
        layer's ``dimension_numbers``: the last ``F`` input frames (``F = (k_T - 1) * d_T``;
        for a transposed layer ``ceil(k_T / s_T) - 1``), with zeros or copies of frame 0
        before the stream's start.
      offset: int32 ``()``: how many frames into the next chunk the next output's newest
        frame lies (0 without a time stride).
      started: bool ``()``: whether a chunk went through; before it, ``"replicate"``
        takes the frames before the start from the first chunk.
      segment_ids: ``(N, F, *spatial)`` int32, the clips of ``frames`` (-1 before the
        start), or ``None`` for a stream without ``segment_ids``.

    A Flax module holds each array as a variable of its ``"cache"`` collection (and
    rebuilds the state from them on each call); an Equinox module holds the state itself
    in an ``eqx.nn.State``. :func:`causal_conv_stream_init` gives the state before a
    first chunk, for a cache that must exist before the stream starts, and (``frames=``)
    the state holding a cache of past frames that a port already keeps: build it there,
    not from these fields, whose ``offset`` and ``started`` are the stream's bookkeeping.
    """

    frames: jax.Array
    offset: jax.Array
    started: jax.Array
    segment_ids: jax.Array | None = None


jax.tree_util.register_dataclass(
    CausalConvState, data_fields=["frames", "offset", "started", "segment_ids"], meta_fields=[]
)


def history_length(problem: Problem) -> int:
    """How many input frames a stream carries: ``(k_T - 1) * d_T``, transposed ``ceil(k_T / s_T) - 1``."""
    if problem.transposed:
        return phases.plan(problem.window[0], problem.stride)[0].context
    return problem.context


def _fresh(problem: Problem) -> CausalConvState:
    """The state before the first chunk."""
    n, f = problem.batch, history_length(problem)
    past = History.of_no_document(jnp.zeros((n, f, *problem.frame_shape()), problem.x_dtype), problem.segmented)
    return CausalConvState(past.inputs, jnp.zeros((), jnp.int32), jnp.zeros((), bool), past.segment_ids)


def _check_state(err: OpError, state, problem: Problem) -> None:
    if not isinstance(state, CausalConvState):
        raise err.type(
            f"state must be None (a new stream) or the CausalConvState the previous chunk returned, got "
            f"{type(state).__name__}"
        )
    f = history_length(problem)
    expected = (problem.batch, f, *problem.frame_shape())
    what = "ceil(k_T / s_T) - 1" if problem.transposed else "(k_T - 1) * d_T"
    check_history(err, "state.frames", state.frames, expected, f"(N, {what}, *spatial, C_in)", problem.x_dtype,
                  inputs="the chunk's", hint=": a state belongs to one layer (its kernel, stride and dilation) and one "
                  "batch of streams")
    if tuple(state.offset.shape) != () or tuple(state.started.shape) != ():
        raise err.value(
            f"state.offset and state.started must be scalars, got shapes {tuple(state.offset.shape)} and "
            f"{tuple(state.started.shape)}"
        )
    if (state.segment_ids is not None) != problem.segmented:
        raise err.value(
            "segment_ids must be given with every chunk of a stream or with none: the state was made "
            + ("with" if state.segment_ids is not None else "without") + " them, this chunk "
            + ("has them" if problem.segmented else "has none")
        )
    if problem.segmented and tuple(state.segment_ids.shape) != (problem.batch, f, *problem.spatial):
        raise err.value(
            f"state.segment_ids must be {(problem.batch, f, *problem.spatial)}, got {tuple(state.segment_ids.shape)}"
        )


def _started(state: CausalConvState):
    """``state.started`` as a Python bool where it is known (not traced), else ``None``."""
    try:
        return bool(np.asarray(state.started))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
        return None


def _history(state: CausalConvState | None, chunk, problem: Problem) -> History:
    """The frames before the chunk: the state's, or before the start the stream's own padding."""
    f = history_length(problem)
    before = jnp.broadcast_to(chunk[:, :1], (chunk.shape[0], f, *chunk.shape[2:]))
    if state is None:
        fresh = _fresh(problem)
        frames = before if problem.padding_mode == "replicate" else fresh.frames
        return History(frames, fresh.segment_ids)
    frames = state.frames
    if problem.padding_mode == "replicate":
        frames = jnp.where(state.started, frames, before)
    return History(frames, state.segment_ids)


def _setup(op: str, x_chunk, state, kernel, bias, segment_ids, layer: dict, transposed: bool):
    """The chunk's problem and convolution, with ``state`` checked against them."""
    implementation, interpret, config = (layer.pop(k) for k in ("implementation", "interpret", "config"))
    problem, x, kernel, bias, ids = make_problem(op, x_chunk, kernel, bias, segment_ids, transposed=transposed, **layer)
    stride, dilation = (1, 1) if transposed else (problem.stride, problem.dilation[0])
    conv = time_conv(op, problem, implementation, interpret, config, stride=stride, dilation=dilation)
    if state is not None:
        _check_state(OpError(op), state, problem)
    return problem, conv, x, kernel, bias, ids


def causal_conv_stream(
    x_chunk: jax.typing.ArrayLike,
    state: CausalConvState | None,
    kernel: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    strides=1,
    dilation=1,
    padding="SAME",
    padding_mode: str = "zeros",
    spatial_padding_mode: str = "zeros",
    feature_group_count: int = 1,
    dimension_numbers=None,
    segment_ids: jax.typing.ArrayLike | None = None,
    precision=None,
    implementation: str | None = None,
    interpret: bool = False,
    config=None,
) -> tuple[jax.Array, CausalConvState]:
    """One chunk of a stream through :func:`~.api.causal_conv`: ``(y_chunk, new_state)``.

    Args:
      x_chunk: ``(N, L, *spatial, C_in)`` (the layout of ``dimension_numbers``): the
        next ``L`` frames. The first chunk may have any length ``L >= 1`` (Wan's 1 + 4k
        frames included); with a time stride ``s_T``, every later chunk a multiple of
        ``s_T``.
      state: ``None`` to start a stream, else the :class:`CausalConvState` the previous
        chunk returned (or :func:`causal_conv_stream_init`'s).
      kernel, bias: the layer's, as :func:`~.api.causal_conv` takes them.
      strides, dilation, padding, padding_mode, spatial_padding_mode, feature_group_count,
        dimension_numbers, precision, implementation, interpret, config: the layer's, as
        :func:`~.api.causal_conv` takes them; the same for every chunk. The state holds
        the frames unpadded: a ``spatial_padding_mode`` pads each convolved frame as the
        full pass does.
      segment_ids: the chunk's, ``(N, L, *spatial)``, if the layer packs clips (then
        with every chunk).

    Returns:
      ``y_chunk``: ``(N, ceil(L / s_T), *out_spatial, C_out)`` for a first chunk,
      ``(N, L / s_T, ...)`` after it; concatenated along time, the chunks' outputs are
      :func:`~.api.causal_conv`'s on the concatenated frames (bit for bit where the
      implementation's reduction order allows: ``docs/causal_conv.md``). ``new_state``:
      the state after the chunk.

    Raises:
      ValueError: a later chunk whose length is not a multiple of ``s_T``, or a state
        of another layer; :func:`~.api.causal_conv`'s errors otherwise. A state passed
        to a jitted function is traced, so whether it has started is checked only under
        ``jax.experimental.checkify.checkify`` (the same message); unchecked, a chunk
        whose length is not a multiple of ``s_T`` is computed as a first chunk, and its
        outputs are NaN if the state had started (the bug shows, as a traced index
        outside a decode pool reads NaN).
    """
    op = "causal_conv_stream"
    problem, conv, x, kernel, bias, ids = _setup(op, x_chunk, state, kernel, bias, segment_ids, dict(
        strides=strides, dilation=dilation, padding=padding, padding_mode=padding_mode,
        spatial_padding_mode=spatial_padding_mode, feature_group_count=feature_group_count,
        dimension_numbers=dimension_numbers, precision=precision, implementation=implementation, interpret=interpret,
        config=config,
    ), False)
    length, stride, f = problem.frames, problem.stride, problem.context
    first, unchecked = state is None, False
    if length % stride:
        started = None if state is None else _started(state)
        if started is not False and state is not None:  # raises now, or leaves a checkify check if traced
            OpError(op).check(
                ~state.started,
                f"after the first chunk every chunk needs a multiple of strides[0] = {stride} frames (each gives "
                f"length / {stride} outputs), got {length} frames; the first chunk may have any length >= 1",
            )
        first, unchecked = True, state is not None and started is None
    past = _history(state, x, problem)
    xe, ide = past.extend(x, ids)  # frames P - F .. P + L - 1
    if ide is not None:
        # Segment ids need an output per input frame (stride 1): the history's outputs are dropped.
        y = past.outputs(conv(xe, kernel, f, ide))
    elif first or stride == 1:
        y = conv(xe, kernel, 0)  # the next output is the chunk's first frame
    else:
        # The next output's newest frame is `offset` frames into the chunk: its window
        # starts at xe[offset]; a fixed length keeps the shape static.
        y = conv(lax.dynamic_slice_in_dim(xe, state.offset, f + length - stride + 1, axis=1), kernel, 0)
    if first:
        offset = jnp.asarray(-(-length // stride) * stride - length, jnp.int32)
    else:
        offset = state.offset
    after = past.after(xe, ide)
    new_state = CausalConvState(after.inputs, offset, jnp.ones((), bool), after.segment_ids)
    y = finish(y, bias, ids, problem)
    if unchecked:  # a traced state: a started stream given an off-stride chunk gives NaN, never wrong numbers
        y = jnp.where(state.started, jnp.asarray(jnp.nan, y.dtype), y)
    return problem.layout.output(y), new_state


def causal_conv_transpose_stream(
    x_chunk: jax.typing.ArrayLike,
    state: CausalConvState | None,
    kernel: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    strides=1,
    dilation=1,
    padding="SAME",
    padding_mode: str = "zeros",
    spatial_padding_mode: str = "zeros",
    feature_group_count: int = 1,
    dimension_numbers=None,
    segment_ids: jax.typing.ArrayLike | None = None,
    precision=None,
    implementation: str | None = None,
    interpret: bool = False,
    config=None,
) -> tuple[jax.Array, CausalConvState]:
    """One chunk of a stream through :func:`~.api.causal_conv_transpose`: ``(y_chunk, new_state)``.

    Any chunk length ``L >= 1``; ``y_chunk`` is ``(N, L * s_T, *out_spatial, C_out)``,
    the outputs whose sums the chunk completes. Arguments and guarantee as
    :func:`causal_conv_stream`'s.
    """
    op = "causal_conv_transpose_stream"
    problem, conv, x, kernel, bias, ids = _setup(op, x_chunk, state, kernel, bias, segment_ids, dict(
        strides=strides, dilation=dilation, padding=padding, padding_mode=padding_mode,
        spatial_padding_mode=spatial_padding_mode, feature_group_count=feature_group_count,
        dimension_numbers=dimension_numbers, precision=precision, implementation=implementation, interpret=interpret,
        config=config,
    ), True)
    past = _history(state, x, problem)
    xe, ide = past.extend(x, ids)
    f = past.length

    def group_conv(group: phases.Group, k):
        c = group.context
        window = xe[:, f - c:]
        if ide is None:
            return conv(window, k, 0)
        return conv(window, k, c, ide[:, f - c:])[:, c:]

    y = transposed_phases(problem, kernel, group_conv)
    after = past.after(xe, ide)
    new_state = CausalConvState(after.inputs, jnp.zeros((), jnp.int32), jnp.ones((), bool), after.segment_ids)
    out_ids = None if ids is None else jnp.repeat(ids, problem.stride, axis=1)
    return problem.layout.output(finish(y, bias, out_ids, problem)), new_state


def causal_conv_stream_init(
    x_chunk, kernel, *, transpose: bool = False, strides=1, dilation=1, padding="SAME", padding_mode: str = "zeros",
    spatial_padding_mode: str = "zeros", feature_group_count: int = 1, dimension_numbers=None, segment_ids=None,
    frames=None, frames_segment_ids=None, offset: int = 0,
) -> CausalConvState:
    """The state before a stream's next chunk: a new stream's (Flax's ``init``), or one adopted from a cache of frames.

    ``x_chunk`` and ``kernel`` may be arrays or ``jax.ShapeDtypeStruct`` s (only their
    shapes and dtypes are read); ``x_chunk`` is a chunk as the layer takes it, its other
    axes unpadded whatever ``spatial_padding_mode`` (the state holds input frames, which
    each chunk's convolution pads); ``segment_ids`` (their shape alone) if the stream packs
    clips; ``transpose=True`` for :func:`causal_conv_transpose_stream`; the other
    keyword arguments the layer's. Without ``frames``, passing it is passing ``state=None``.

    ``frames``: a cache of the input frames before the next chunk that a port already
    holds (Wan's ``feat_cache`` of the last frames), ``(N, F', *spatial, C_in)`` in the
    layout of ``dimension_numbers`` (time where the chunk has it) and x's dtype, oldest
    first. The state holds the last ``F = (k_T - 1) * d_T`` of them (``ceil(k_T / s_T) - 1``
    for a transposed layer); with fewer, the frames before them are what the layer reads
    before a stream's start: zeros, or with ``"replicate"`` copies of the oldest frame
    given (the stream's frame 0). The stream has then started: the next chunk is a later
    one (a multiple of ``s_T`` frames). ``frames_segment_ids``: their clips, ``(N, F',
    *spatial)``, for a stream with ``segment_ids``. ``offset``: how many frames into the
    next chunk the next output's newest frame lies, in ``[0, s_T)`` (0: the chunk's first
    frame; after a stream of ``T`` frames, ``ceil(T / s_T) * s_T - T``).

    Raises:
      ValueError, TypeError: the layer's arguments, as :func:`causal_conv_stream`'s; frames
        of another layer (batch, spatial shape, channels, dtype); ``frames`` of a packed
        stream without ``frames_segment_ids``; an ``offset`` outside ``[0, s_T)``.
    """
    op = "causal_conv_stream_init"
    kwargs = dict(strides=strides, dilation=dilation, padding=padding, padding_mode=padding_mode,
                  spatial_padding_mode=spatial_padding_mode, feature_group_count=feature_group_count,
                  dimension_numbers=dimension_numbers)
    struct = lambda a, dtype=None: jax.ShapeDtypeStruct(tuple(a.shape), dtype or a.dtype)  # noqa: E731
    found = {}

    def check(x, k, ids):  # traced abstractly: nothing is allocated but the state
        found["problem"] = make_problem(op, x, k, None, ids, transposed=transpose, **kwargs)[0]
        return ()

    ids = None if segment_ids is None else struct(segment_ids, jnp.int32)
    jax.eval_shape(check, struct(x_chunk), struct(kernel), ids)
    problem = found["problem"]
    if frames is None:
        if frames_segment_ids is not None or offset != 0:
            raise OpError(op).value("frames_segment_ids and offset describe adopted frames: pass frames with them")
        return _fresh(problem)
    return _adopted(OpError(op), problem, frames, frames_segment_ids, offset)


def _adopted(err: OpError, problem: Problem, frames, frame_ids, offset) -> CausalConvState:
    """The started state holding ``frames`` (the caller's layout), the last ``F`` of them, older ones padded."""
    with err.words():
        frames = as_operand("frames", frames)
    shape, layout = tuple(frames.shape), problem.layout
    if len(shape) != problem.ndim + 2:
        raise err.value(f"frames must be (N, F', *spatial, C_in) in the chunk's layout, {problem.ndim + 2} axes, "
                        f"got shape {shape}")
    frames = layout.x(frames)  # channels-last, time axis 1
    f, given = history_length(problem), frames.shape[1]
    expected = (problem.batch, given, *problem.frame_shape())
    check_history(err, "frames", frames, expected, "(N, F', *spatial, C_in) channels-last", problem.x_dtype,
                  inputs="the chunk's", hint=": a cache of the frames before the chunk, of this layer's batch, "
                  "spatial shape and channels")
    if not is_int(offset) or not 0 <= offset < problem.stride:
        raise err.value(f"offset must be an int in [0, strides[0]) = [0, {problem.stride}), got {offset!r}")
    if problem.segmented != (frame_ids is not None):
        raise err.value(
            "a packed stream (segment_ids) needs frames_segment_ids, the clips of the adopted frames (N, F', *spatial)"
            if problem.segmented else "frames_segment_ids are for a packed stream: pass segment_ids with them")
    kept = frames[:, max(given - f, 0):]
    missing = f - kept.shape[1]
    if missing > 0:  # what the layer reads before a stream's start
        first = kept[:, :1] if given else jnp.zeros((problem.batch, 1, *problem.frame_shape()), problem.x_dtype)
        pad = first if problem.padding_mode == "replicate" else jnp.zeros_like(first)
        kept = jnp.concatenate([jnp.broadcast_to(pad, (pad.shape[0], missing, *pad.shape[2:])), kept], axis=1)
    ids = None
    if frame_ids is not None:
        with err.words():
            frame_ids = layout.segment_ids(as_segment_ids(frame_ids, layout.segment_ids_shape(shape),
                                                          "frames' shape without its channels",
                                                          name="frames_segment_ids"))
        ids = frame_ids[:, max(given - f, 0):].astype(jnp.int32)
        if missing > 0:
            ids = jnp.concatenate([jnp.full((ids.shape[0], missing, *ids.shape[2:]), -1, jnp.int32), ids], axis=1)
    return CausalConvState(kept, jnp.asarray(offset, jnp.int32), jnp.ones((), bool), ids)
