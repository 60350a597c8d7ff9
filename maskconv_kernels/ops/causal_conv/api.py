"""Causal convolutions over time, for video and audio tokenizers: :func:`causal_conv` and
:func:`causal_conv_transpose`.

Video VAEs and tokenizers (Wan, CogVideoX, Cosmos, MAGVIT-v2) and neural audio codecs
(EnCodec, SoundStream, DAC, Mimi) make a convolution causal along time by padding the
past and caching frames by hand. Here the padding is the convolution's own: output frame
``t`` reads input frames ``t * s_T - (k_T - 1) * d_T .. t * s_T`` and nothing later,
with the library's contract (no output depends on a later frame, bit for bit; NaN there
never reaches it; its gradient there is exactly 0.0). It is
:func:`~maskconv_kernels.masked_conv` with every tap active and time padded
``((k_T - 1) * d_T, 0)``: the past only, so no tap is masked and none is wasted.
Streaming is :mod:`.stream`'s.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ..masked_conv.api import run
from . import phases
from .backends import IMPLEMENTATIONS, PREFERENCE, REGISTRY
from .checks import Problem, make_problem

__all__ = ["causal_conv", "causal_conv_transpose", "IMPLEMENTATIONS", "PREFERENCE"]

# The name scope of every convolution these layers run (in HLO op names and jaxprs).
SCOPE = "causal_conv"


@dataclasses.dataclass(frozen=True)
class TimeConv:
    """One causal convolution along time as ``masked_conv`` runs it (channels-last).

    ``stride`` and ``dilation`` are time's (a transposed layer's phases: 1 and 1); the
    other axes are the problem's. ``backend``: the implementation's record, checked
    against the problem, or ``None`` (chosen per platform when lowered). Outputs are in
    the accumulation dtype (float32, or float64 for float64 inputs): bias and rounding
    are :func:`finish`'s, once.
    """

    problem: Problem
    stride: int
    dilation: int
    backend: object
    interpret: bool
    config: object

    def context(self, kernel) -> int:
        """``(k_T - 1) * d_T``: the frames before its own that an output reads."""
        return (kernel.shape[0] - 1) * self.dilation

    def __call__(self, x, kernel, time_pad: int, segment_ids=None):
        """``masked_conv``'s convolution of ``x (N, T, *spatial, C_in)`` with time padded ``(time_pad, 0)``.

        The problem was checked once, by the public call: this runs ``masked_conv``'s
        checked path (:func:`~..masked_conv.api.run`) on the problem's spec resized to
        ``x``'s frames, ``kernel``'s shape and ``time_pad``, without checking again. A
        ``spatial_padding_mode`` that copies pixels pads ``x``'s other axes here
        (:meth:`~.checks.Problem.pad_spatial`, each frame from its own pixels), so every
        caller (the full pass, the replicate head, a stream's history and chunk, a
        transposed layer's phases) pads the frames it convolves alike.

        Under the name scope :data:`SCOPE`: profiles and HLO show the layer by its op's
        name, and the causality audit tells it from a plain unmasked ``masked_conv`` (a
        causal layer reads its current frame; a shifted PixelCNN++-style convolution
        must not), :func:`maskconv_kernels.audit.order.learn_include_current`.
        """
        p = self.problem
        x = p.pad_spatial(x)
        spec = p.spec.resized(
            x.shape[1:-1], ((time_pad, 0), *p.conv_pads), kernel_shape=kernel.shape, segmented=segment_ids is not None
        )
        with jax.named_scope(SCOPE):
            return run(spec, x, kernel, backend=self.backend, interpret=self.interpret, config=self.config,
                       segment_ids=segment_ids)

    def causal(self, x, kernel, segment_ids=None):
        """The full causal pass: ``(N, floor((T - 1) / s) + 1, *out_spatial, C_out)``.

        ``"replicate"``: the outputs whose window reaches before frame 0 (the first
        ``ceil(context / s)``) are computed again from a copy of those few frames led by
        ``context`` copies of frame 0, and written over the zero-padded ones in place:
        no padded copy of ``x`` is made, and no output reads a padded zero.
        """
        context = self.context(kernel)
        y = self(x, kernel, context, segment_ids)
        head = min(-(-context // self.stride), y.shape[1])
        if self.problem.padding_mode != "replicate" or head == 0:
            return y
        frames = min((head - 1) * self.stride + 1, x.shape[1])
        first = jnp.broadcast_to(x[:, :1], (x.shape[0], context, *x.shape[2:]))
        y_head = self(jnp.concatenate([first, x[:, :frames]], axis=1), kernel, 0)
        return lax.dynamic_update_slice_in_dim(y, y_head, 0, axis=1)


def time_conv(op: str, problem: Problem, implementation, interpret, config, *, stride: int, dilation: int) -> TimeConv:
    """The problem's convolution with its implementation checked, the error in ``op``'s words."""
    backend, interpret = REGISTRY.resolve(problem.spec, implementation, interpret, config, op=op)
    return TimeConv(problem, stride, dilation, backend, interpret, config)


def finish(y, bias, segment_ids, problem: Problem):
    """The output in x's dtype: bias added in the accumulation dtype, padding frames (negative ids) zero, rounded once."""
    if bias is not None:
        y = y + bias.astype(y.dtype)
    if segment_ids is not None:
        y = jnp.where((segment_ids >= 0)[..., None], y, jnp.zeros((), y.dtype))
    return y.astype(problem.x_dtype)


def transposed_phases(p: Problem, kernel, causal):
    """The transposed layer from its phases (:mod:`.phases`): ``causal(group, kernel)`` runs
    each group's causal convolution; returns ``(N, T * s, *spatial, C_out)``, accumulation dtype."""
    groups = phases.plan(p.window[0], p.stride)
    parts = [causal(group, phases.group_kernel(kernel, group, p.stride, p.groups)) for group in groups]
    return phases.interleave(parts, groups, p.stride, p.groups, p.c_out)


def causal_conv(
    x: jax.typing.ArrayLike,
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
) -> jax.Array:
    """Causal convolution along time: output frame ``t`` reads input frames ``t * s_T - (k_T - 1) * d_T .. t * s_T``.

    Args:
      x: ``(N, T, *spatial, C_in)``, channels-last, with 0 to 2 spatial axes after time
        (audio ``(N, T, C)``, spectrograms ``(N, T, F, C)``, video ``(N, T, H, W, C)``);
        float32, bfloat16 or float16 (float64 with ``jax_enable_x64``, on ``"xla"``).
      kernel: ``(k_T, *k_spatial, C_in // feature_group_count, C_out)``; its dtype may
        differ from x's (``"xla"`` only, as ``masked_conv``'s: products in the wider
        dtype; a narrower kernel, float16 weights with float32 ``x``, is read exactly as
        ``kernel.astype(x.dtype)`` and only its gradient is rounded to float16).
      bias: ``(C_out,)`` or ``None``; added in float32.
      strides, dilation: an int (every axis) or one per spatial axis, time first.
      padding: the other axes' (not time's): ``"SAME"``, ``"VALID"`` or one ``(lo, hi)``
        pair per non-time spatial axis, as ``masked_conv`` applies them. ``"CAUSAL"``
        (``nn.Conv``'s word for what this op does along time) is taken by a 1-D layer,
        which has no other axis, and refused with other axes, whose padding it cannot say.
      padding_mode: the frames before frame 0: ``"zeros"``, or ``"replicate"`` (copies of
        frame 0, as Cosmos, CogVideoX and Wan's first chunk use).
      spatial_padding_mode: what ``padding`` adds on the other axes: ``"zeros"``, or
        copies of each frame's own pixels, ``"reflect"`` (mirrored without the edge, as
        LTX-2's decoder pads), ``"replicate"`` (the edge repeated) or ``"circular"``
        (wrapped): PyTorch's ``Conv3d(padding_mode=...)`` on the non-time axes, the name
        LTX-Video's ``CausalConv3d`` gives it. A separate keyword from ``padding_mode``
        because time can take neither a mirror nor a wrap (both read later frames). The
        copies are a ``jnp.pad`` of the frames (a padded copy of ``x``); the contract
        holds, since a copy is a pixel of the same frame. Not with ``segment_ids``.
      feature_group_count: as in ``lax.conv_general_dilated``.
      dimension_numbers: ``None`` (channels-last, as above) or lax's, e.g. ``("NCTHW",
        "OITHW", "NCTHW")`` (three strings, or a ``ConvDimensionNumbers``); time is the
        layout's first spatial axis.
      segment_ids: ``None``, or integers of x's shape without its channels: clips packed
        along time (or anywhere). No tap crosses a clip boundary, so a clip's first frames
        see zeros before it, as when it runs alone; negative ids mark padding (zero
        outputs, no gradient). Needs ``padding_mode="zeros"``, stride 1 and ``"SAME"``
        with zeros on the other axes, and ``implementation=None`` or ``"xla"``.
      precision: ``lax.Precision`` (or its name) for the products: ``"highest"`` gives
        IEEE float32 products on GPUs (no TF32) and TPUs (no bfloat16 passes). ``None``:
        what ``jax.default_matmul_precision`` sets, as for ``lax.conv``.
      implementation: ``None`` (per platform, when lowered, as ``masked_conv``'s) or one
        of :data:`IMPLEMENTATIONS`: ``"xla"`` (every problem, every platform) or a kernel
        backend that takes the problem (``"pallas_triton"``, ``"triton"``: 1-D and 2-D,
        ungrouped; ``"pallas_mosaic_gpu"``: 1-D and 2-D, stride 1, 16-bit).
      interpret: run a kernel implementation in its interpreter (any platform, slowly).
        With ``implementation="xla"`` there is no kernel to interpret: a ``UserWarning``
        says so and the call runs as with ``interpret=False``.
      config: the named implementation's ``Config`` (``masked_conv``'s), or ``None``.

    Returns:
      ``(N, floor((T - 1) / s_T) + 1, *out_spatial, C_out)`` in x's dtype (the layout of
      ``dimension_numbers``), accumulated in float32 and rounded once. No output depends
      on a later frame, bit for bit; NaN or inf in later frames never reaches it, and its
      gradient there is exactly 0.0.

    Raises:
      ValueError, TypeError: bad arguments (the message names the argument).
      NotImplementedError: the named implementation does not take this problem (3-D on
        a kernel backend, say), or cannot be lowered for the platform.
    """
    problem, x, kernel, bias, ids = make_problem(
        "causal_conv", x, kernel, bias, segment_ids, strides=strides, dilation=dilation, padding=padding,
        padding_mode=padding_mode, spatial_padding_mode=spatial_padding_mode, feature_group_count=feature_group_count,
        dimension_numbers=dimension_numbers, precision=precision,
    )
    conv = time_conv("causal_conv", problem, implementation, interpret, config,
                     stride=problem.stride, dilation=problem.dilation[0])
    y = conv.causal(x, kernel, ids)
    return problem.layout.output(finish(y, bias, ids, problem))


def causal_conv_transpose(
    x: jax.typing.ArrayLike,
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
) -> jax.Array:
    """Causal transposed convolution along time (upsampling by ``s_T = strides[0]``), for decoders.

    ``y[t * s_T + j] += x[t] * kernel[j]`` for every tap ``j`` (PyTorch's
    ``ConvTranspose1d`` along time, the causal decoders' trim: the first ``T * s_T``
    outputs, whose sums are complete), with a stride-1 convolution over the other axes.
    Output frame ``u`` reads input frames ``ceil((u - k_T + 1) / s_T) .. floor(u / s_T)``
    only. Computed as ``s_T`` stride-1 causal convolutions, one per output phase
    (:mod:`.phases`): no zero is inserted between frames, no tap multiplies one.

    Args:
      x: ``(N, T, *spatial, C_in)``, as :func:`causal_conv`'s.
      kernel: ``(k_T, *k_spatial, C_in // feature_group_count, C_out)``: tap ``j`` writes
        ``j`` frames after ``t * s_T`` (PyTorch's weight ``(C_in, C_out, k)`` is
        ``kernel[j, ci, co] = weight[ci, co, j]``).
      bias: ``(C_out,)`` or ``None``.
      strides: ``s_T`` (an int, or time's then 1 for every other axis).
      dilation: 1 along time; the other axes' may be larger.
      padding, padding_mode, spatial_padding_mode, feature_group_count, dimension_numbers,
        segment_ids (output frame ``u`` belongs to the clip of input frame ``u // s_T``), precision,
        implementation, interpret, config: as :func:`causal_conv`'s.

    Returns:
      ``(N, T * s_T, *out_spatial, C_out)`` in x's dtype (the layout of
      ``dimension_numbers``), with :func:`causal_conv`'s contract.
    """
    problem, x, kernel, bias, ids = make_problem(
        "causal_conv_transpose", x, kernel, bias, segment_ids, strides=strides, dilation=dilation, padding=padding,
        padding_mode=padding_mode, spatial_padding_mode=spatial_padding_mode, feature_group_count=feature_group_count,
        dimension_numbers=dimension_numbers, precision=precision, transposed=True,
    )
    conv = time_conv("causal_conv_transpose", problem, implementation, interpret, config, stride=1, dilation=1)
    y = transposed_phases(problem, kernel, lambda group, k: conv.causal(x, k, ids))
    if ids is not None:
        ids = jnp.repeat(ids, problem.stride, axis=1)
    return problem.layout.output(finish(y, bias, ids, problem))
