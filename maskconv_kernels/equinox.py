"""Equinox modules: ``equinox.nn.Conv`` with an exact mask.

``Conv`` (also ``MaskedConv``) and ``Conv1d``, ``Conv2d``, ``Conv3d`` subclass
``equinox.nn.Conv``, so code that looks modules up by type still finds them. They have
its fields, plus two static ones, ``mask`` and ``implementation``; the same parameters
from the same key (Equinox's own initialisation runs); and the same leaves (``weight``,
``bias``), so ``eqx.tree_serialise_leaves`` of one loads into the other. Channels-first
and unbatched, as Equinox's: ``x: (C_in, *spatial)``, ``weight: (C_out, C_in // groups,
*kernel_size)`` (``jax.vmap`` over a batch folds into the convolution's batch).

Equinox has no masked convolution; the usual one is ``eqx.nn.Conv`` with ``weight *
mask``, which reads every tap, so ``0 * NaN`` under a masked tap reaches the output.
These call :func:`maskconv_kernels.masked_conv` with ``dimension_numbers`` for
Equinox's layout: masked taps are never read.

``CausalConv``: :func:`maskconv_kernels.causal_conv` with ``eqx.nn.Conv``'s parameters,
in the same layout, streamed through an ``eqx.nn.State``. Needs the ``equinox`` extra;
the core package does not import equinox.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maskconv_kernels._core.args import as_segment_ids, is_int
from maskconv_kernels._extras import require
from maskconv_kernels._modules import concrete_mask, pad_with_copies, refuse_segment_ids_with_copies
from maskconv_kernels.masks import Mask, as_mask
from maskconv_kernels.ops.causal_conv import CausalConvState, causal_conv, causal_conv_stream, causal_conv_stream_init
from maskconv_kernels.ops.masked_conv import masked_conv
from maskconv_kernels.ops.masked_conv.layout import Layout
from maskconv_kernels.parallel.context import ContextParallel

eqx = require("equinox", "equinox", "maskconv_kernels.equinox")

__all__ = ["Conv", "MaskedConv", "Conv1d", "Conv2d", "Conv3d", "CausalConv"]

def _dimension_numbers(ndim: int) -> tuple[str, str, str]:
    """Equinox's layout, lax's default: ``("NCHW", "OIHW", "NCHW")`` in 2-D."""
    spatial = "DHW"[-ndim:]
    return ("NC" + spatial, "OI" + spatial, "NC" + spatial)


def _check_rank(x, num_spatial_dims: int, name: str) -> None:
    if x.ndim != num_spatial_dims + 1:
        raise ValueError(
            f"Input to {name} needs to have rank {num_spatial_dims + 1} ((in_channels, *spatial), unbatched, "
            f"as equinox.nn.Conv), but input has shape {x.shape}: vmap over a batch"
        )


def _example_segment_ids(segment_ids, x_shape) -> jax.Array:
    """``(*spatial)`` ids for ``x (in_channels, *spatial)``, with the batch axis of one example."""
    what = "x's spatial shape (x is (in_channels, *spatial), unbatched)"
    return as_segment_ids(segment_ids, tuple(x_shape[1:]), what)[None]


def _static_mask(mask, kernel_size: tuple[int, ...], weight_shape: tuple[int, ...]) -> Mask | None:
    """``mask`` (shape ``kernel_size``, or ``weight_shape``: Equinox's ``(O, I, *kernel_size)``) as a hashable Mask."""
    if mask is None or isinstance(mask, Mask):
        return None if mask is None else as_mask(mask, (*kernel_size, *weight_shape[1::-1]))
    concrete_mask(mask, "equinox.nn.Conv with weight * mask")
    shape = tuple(np.shape(mask))
    if shape not in (kernel_size, weight_shape):
        raise ValueError(
            f"mask has shape {shape} but kernel_size is {kernel_size}: pass a mask of shape {kernel_size} (one bit "
            f"per tap) or of the weight's shape {weight_shape} (out_channels, in_channels // groups, *kernel_size)"
        )
    layout = Layout.channels_first(len(kernel_size))
    return as_mask(layout.mask(mask), layout.kernel_shape(weight_shape))


class Conv(eqx.nn.Conv):
    """Exact masked convolution, a drop-in replacement for ``equinox.nn.Conv``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import maskconv_kernels as mk
        >>> from maskconv_kernels import equinox as mk_eqx
        >>> conv = mk_eqx.Conv2d(1, 4, 3, padding=1, mask=mk.pixelcnn_mask((3, 3), "A"), key=jax.random.key(0))
        >>> conv.weight.shape
        (4, 1, 3, 3)
        >>> x = jnp.ones((1, 8, 8)).at[:, 4, 4].set(jnp.nan)   # (C_in, H, W)
        >>> bool(jnp.isnan(conv(x)[:, 4, 4]).any())
        False

    Args:
      num_spatial_dims, in_channels, out_channels, kernel_size, stride, padding,
      dilation, groups, use_bias, padding_mode, dtype, key: as in ``equinox.nn.Conv``
        (padding ``"SAME"``, ``"SAME_LOWER"``, ``"VALID"``, ints or ``(lo, hi)`` pairs;
        ``padding_mode`` ``"ZEROS"``, ``"REFLECT"``, ``"REPLICATE"`` or ``"CIRCULAR"``).
        ``dtype``: float32, bfloat16, float16 (float64 with ``jax_enable_x64``); complex
        is not supported.
      mask: static 0/1 or bools of shape ``kernel_size`` (one bit per tap) or of the
        weight's shape ``(out_channels, in_channels // groups, *kernel_size)``
        (channel-partial taps); stored as a hashable :class:`maskconv_kernels.Mask`.
        ``None`` makes every tap active.
      implementation: ``None`` (best backend for the platform) or one of
        :data:`maskconv_kernels.IMPLEMENTATIONS`.
    """

    mask: Mask | None = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)

    def __init__(
        self,
        num_spatial_dims: int,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: str | int | Sequence[int] | Sequence[tuple[int, int]] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        use_bias: bool = True,
        padding_mode: str = "ZEROS",
        dtype=None,
        *,
        mask=None,
        implementation: str | None = None,
        key: jax.Array,
    ):
        super().__init__(
            num_spatial_dims, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, use_bias,
            padding_mode, dtype, key=key,
        )
        self.mask = _static_mask(mask, self.kernel_size, self.weight.shape)
        self.implementation = implementation

    def __call__(
        self, x: jax.Array, *, segment_ids: jax.Array | None = None, key: jax.Array | None = None
    ) -> jax.Array:
        """``x: (in_channels, *spatial)`` -> ``(out_channels, *out_spatial)``; ``key`` is ignored, as in Equinox.

        ``segment_ids``: ``None``, or integers ``(*spatial)``: packed documents, as
        :func:`maskconv_kernels.masked_conv` takes them (``jax.vmap`` both over a batch).
        No tap crosses a document boundary; negative ids are padding, where the
        convolution is zero (the output is the bias). Needs an output on the input's grid
        (stride 1 and a size-keeping padding: ``"SAME"``, or ``(k - 1) // 2`` and ``k // 2``
        per side) and ``padding_mode="ZEROS"``: the other modes copy values across the
        border (wrapped, mirrored or repeated), positions that no document owns.
        """
        del key
        _check_rank(x, self.num_spatial_dims, "Conv")
        if segment_ids is not None:
            segment_ids = self._segment_ids(segment_ids, x.shape)
        padding = self.padding
        if self.padding_mode != "ZEROS":
            x, padding = self._pad(x), "VALID"
        mask = self.mask if self.mask is not None else np.ones(self.kernel_size, bool)
        y = masked_conv(
            x[None], self.weight, mask, strides=self.stride, padding=padding, dilation=self.dilation,
            feature_group_count=self.groups, dimension_numbers=_dimension_numbers(self.num_spatial_dims),
            implementation=self.implementation, segment_ids=segment_ids,
        )[0]
        return y + self.bias if self.use_bias else y

    def _segment_ids(self, segment_ids, x_shape) -> jax.Array:
        """``(*spatial)`` ids for ``x (in_channels, *spatial)``, batched as ``masked_conv`` takes them."""
        if self.padding_mode != "ZEROS":
            refuse_segment_ids_with_copies("padding_mode", self.padding_mode, "padding_mode='ZEROS'")
        return _example_segment_ids(segment_ids, x_shape)

    def _pad(self, x: jax.Array) -> jax.Array:
        """Equinox's non-zero padding modes: copies of real values, so no masked tap is read after it."""
        if isinstance(self.padding, str):
            window = tuple(d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation))
            pads = lax.padtype_to_pads(x.shape[1:], window, self.stride, self.padding)
        else:
            pads = list(self.padding)
        return pad_with_copies(x, pads, self.padding_mode, 1)


MaskedConv = Conv


def _fixed_rank(ndim: int) -> type[Conv]:
    """``Conv`` with ``num_spatial_dims=ndim``, as ``equinox.nn.Conv{ndim}d``."""

    class ConvNd(Conv):
        def __init__(
            self,
            in_channels: int,
            out_channels: int,
            kernel_size: int | Sequence[int],
            stride: int | Sequence[int] = 1,
            padding: str | int | Sequence[int] | Sequence[tuple[int, int]] = 0,
            dilation: int | Sequence[int] = 1,
            groups: int = 1,
            use_bias: bool = True,
            padding_mode: str = "ZEROS",
            dtype=None,
            *,
            mask=None,
            implementation: str | None = None,
            key: jax.Array,
        ):
            super().__init__(
                ndim, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, use_bias,
                padding_mode, dtype, mask=mask, implementation=implementation, key=key,
            )

    ConvNd.__name__ = ConvNd.__qualname__ = f"Conv{ndim}d"
    ConvNd.__doc__ = f"As :class:`Conv` with ``num_spatial_dims={ndim}``: the drop-in for ``equinox.nn.Conv{ndim}d``."
    return ConvNd


Conv1d, Conv2d, Conv3d = (_fixed_rank(n) for n in (1, 2, 3))


class CausalConv(eqx.nn.StatefulLayer):
    """A causal convolution over time with ``eqx.nn.Conv``'s parameters: :func:`maskconv_kernels.causal_conv`.

    Channels-first and unbatched, as Equinox's: ``x (in_channels, T, *spatial)``, time
    the first spatial axis. Output frame ``t`` reads input frames ``t * s_T - (k_T - 1) *
    d_T .. t * s_T`` and nothing later (before frame 0: zeros, or copies of frame 0 with
    ``padding_mode="replicate"``). The leaves are ``eqx.nn.Conv``'s, ``weight (out_channels,
    in_channels // groups, k_T, *k_spatial)`` and ``bias (out_channels, 1, ..., 1)``, drawn
    by Equinox's own initialisation from the same key, so an ``eqx.nn.Conv`` of the same
    kernel size that was made causal by padding its input by hand loads unchanged.

    Streaming threads an ``eqx.nn.State``, as ``eqx.nn.BatchNorm`` does: built with
    ``stream=True`` through ``eqx.nn.make_with_state``, the layer holds the
    :class:`~maskconv_kernels.ops.causal_conv.CausalConvState` before a stream (from
    :func:`maskconv_kernels.ops.causal_conv.causal_conv_stream_init`) in an
    ``eqx.nn.StateIndex``, and ``y, state = layer(x_chunk, state)`` takes the next chunk
    (:func:`maskconv_kernels.causal_conv_stream`: the first any length, later ones
    multiples of ``s_T``); ``layer(x)`` without a state is the full pass. The state is one
    example's (``jax.vmap`` both the chunks and the state over a batch)::

        >>> import equinox as eqx, jax, jax.numpy as jnp
        >>> from maskconv_kernels import equinox as mk_eqx
        >>> layer, state = eqx.nn.make_with_state(mk_eqx.CausalConv)(
        ...     1, 4, 8, 3, stride=2, stream=True, key=jax.random.key(0))   # audio: k 3, stride 2
        >>> x = jnp.ones((4, 9))                                             # (C_in, T)
        >>> y0, state = layer(x[:, :1], state)
        >>> y1, state = layer(x[:, 1:], state)
        >>> jnp.concatenate([y0, y1], axis=1).shape, layer(x).shape
        ((8, 5), (8, 5))

    Args:
      num_spatial_dims, in_channels, out_channels, kernel_size, stride, dilation, groups,
      use_bias, dtype, key: as in ``equinox.nn.Conv``, time the first spatial axis.
      padding: the non-time axes' only: ``"SAME"`` (the default, not Equinox's ``0``:
        a video layer keeps its frame size), ``"VALID"``, an int, or one int or
        ``(lo, hi)`` pair per non-time axis. Time's is the layer's own,
        ``((k_T - 1) * d_T, 0)`` (``"CAUSAL"``, Flax's word for it, is taken by a 1-D
        layer, which has no other axis).
      padding_mode: the frames before frame 0: ``"zeros"`` or ``"replicate"`` (Equinox's
        ``"ZEROS"`` and ``"REPLICATE"`` spell the same).
      spatial_padding_mode: what ``padding`` adds on the other axes: ``"zeros"``, or
        copies of each frame's own pixels, ``"reflect"``, ``"replicate"`` or
        ``"circular"`` (any case, as Equinox spells them), as
        :func:`maskconv_kernels.causal_conv` takes it. ``eqx.nn.Conv``'s one
        ``padding_mode`` covers every axis; here time's and the others' are two, since
        time can be neither mirrored nor wrapped.
      stream: hold a stream's state (an ``eqx.nn.StateIndex``), so that the layer takes
        ``(x_chunk, state)``; then ``spatial_shape`` is the chunks' non-time spatial
        sizes (``(H, W)`` for video, ``(F,)`` for a spectrogram, ``()`` for audio) and
        their dtype the weight's.
      segmented: the stream's chunks all come with ``segment_ids``.
      implementation: ``None`` (per platform) or one of
        :data:`maskconv_kernels.ops.causal_conv.IMPLEMENTATIONS`.
      interpret: run a kernel implementation in its interpreter.
      context_parallel: ``None``, or the :class:`~maskconv_kernels.parallel.ContextParallel`
        split of time: the full pass (``x`` sharded along ``T`` in its layout; under
        ``jax.vmap``, which cannot split the batch, so ``batch_axis`` must be ``None``) runs
        :func:`~maskconv_kernels.parallel.time_sharded_causal_conv`; streams are not split.
    """

    weight: jax.Array
    bias: jax.Array | None
    state_index: eqx.nn.StateIndex | None
    num_spatial_dims: int = eqx.field(static=True)
    in_channels: int = eqx.field(static=True)
    out_channels: int = eqx.field(static=True)
    kernel_size: tuple[int, ...] = eqx.field(static=True)
    stride: tuple[int, ...] = eqx.field(static=True)
    padding: str | tuple[tuple[int, int], ...] = eqx.field(static=True)
    dilation: tuple[int, ...] = eqx.field(static=True)
    groups: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    padding_mode: str = eqx.field(static=True)
    spatial_padding_mode: str = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)
    interpret: bool = eqx.field(static=True)
    context_parallel: ContextParallel | None = eqx.field(static=True)

    def __init__(
        self,
        num_spatial_dims: int,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: str | int | Sequence[int] | Sequence[tuple[int, int]] = "SAME",
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        use_bias: bool = True,
        padding_mode: str = "zeros",
        dtype=None,
        *,
        spatial_padding_mode: str = "zeros",
        stream: bool = False,
        spatial_shape: Sequence[int] = (),
        segmented: bool = False,
        implementation: str | None = None,
        interpret: bool = False,
        context_parallel: ContextParallel | None = None,
        key: jax.Array,
    ):
        spatial_shape = tuple(spatial_shape)
        if stream and len(spatial_shape) != num_spatial_dims - 1:
            raise ValueError(
                f"stream=True needs spatial_shape, the chunks' {num_spatial_dims - 1} non-time spatial sizes "
                f"(x_chunk is (in_channels, L, *spatial_shape)), got {spatial_shape!r}"
            )
        # Equinox's own constructor: its checks, its normalised tuples, its parameters from the key.
        conv = eqx.nn.Conv(num_spatial_dims, in_channels, out_channels, kernel_size, stride, 0, dilation, groups,
                           use_bias, dtype=dtype, key=key)
        self.weight, self.bias = conv.weight, conv.bias
        self.num_spatial_dims, self.in_channels, self.out_channels = num_spatial_dims, in_channels, out_channels
        self.kernel_size, self.stride, self.dilation = conv.kernel_size, conv.stride, conv.dilation
        self.groups, self.use_bias = groups, use_bias
        self.padding = _non_time_padding(padding, num_spatial_dims - 1)
        self.padding_mode = padding_mode.lower() if isinstance(padding_mode, str) else padding_mode
        self.spatial_padding_mode = (spatial_padding_mode.lower() if isinstance(spatial_padding_mode, str)
                                     else spatial_padding_mode)
        self.implementation, self.interpret = implementation, interpret
        if context_parallel is not None and context_parallel.batch_axis is not None:
            raise ValueError(
                "CausalConv (Equinox) takes one example (jax.vmap over a batch), so its context_parallel cannot split "
                f"the batch: batch_axis must be None, got {context_parallel.batch_axis!r}"
            )
        self.context_parallel = context_parallel
        self.state_index = None
        if stream:
            chunk = (1, in_channels, 1, *spatial_shape)
            kw = {k: v for k, v in self._kwargs().items() if k not in ("implementation", "interpret")}
            self.state_index = eqx.nn.StateIndex(causal_conv_stream_init(
                jax.ShapeDtypeStruct(chunk, self.weight.dtype), self.weight,
                segment_ids=jax.ShapeDtypeStruct((1, 1, *spatial_shape), jnp.int32) if segmented else None, **kw,
            ))

    def is_stateful(self) -> bool:
        """Whether ``eqx.nn.Sequential`` threads a state through it: built with ``stream=True``."""
        return self.state_index is not None

    def _kwargs(self) -> dict:
        return dict(
            strides=self.stride, dilation=self.dilation, padding=self.padding, padding_mode=self.padding_mode,
            spatial_padding_mode=self.spatial_padding_mode, feature_group_count=self.groups,
            dimension_numbers=_dimension_numbers(self.num_spatial_dims), implementation=self.implementation,
            interpret=self.interpret,
        )

    def __call__(self, x: jax.Array, state=None, *, segment_ids: jax.Array | None = None,
                 key: jax.Array | None = None, initial_state: CausalConvState | None = None,
                 return_final_state: bool = False):
        """The full pass, ``layer(x) -> y``, or the stream's next chunk, ``layer(x_chunk, state) -> (y, state)``.

        Args:
          x: ``(in_channels, T, *spatial)``, unbatched (``jax.vmap`` over a batch).
          state: ``None``, or the ``eqx.nn.State`` holding this layer's stream (its
            initial one from ``eqx.nn.make_with_state``, then each call's; a state the
            model already has is adopted with ``state.set(layer.state_index, s)``, ``s``
            from :func:`~maskconv_kernels.ops.causal_conv.causal_conv_stream_init` with
            ``frames=``).
          segment_ids: ``None`` or integers ``(T, *spatial)``: clips packed along time, no
            tap crossing a clip (negative ids: padding, zero outputs). Needs
            ``padding_mode="zeros"``, stride 1 and ``"SAME"``; in a stream, with every
            chunk of a layer built with ``segmented=True``.
          key: ignored, as in Equinox.
          initial_state: the full pass from a state, without an ``eqx.nn.State``: ``None`` or
            the example's :class:`~maskconv_kernels.ops.causal_conv.CausalConvState` (a batch
            of one, channels-last frames ``(1, F, *spatial, in_channels)``), as
            :func:`~maskconv_kernels.causal_conv_stream` takes it: the pass is then that
            stream's chunk (after a started state, a multiple of ``s_T`` frames).
          return_final_state: also return the state after ``x`` (without an ``eqx.nn.State``).

        Returns:
          ``(out_channels, floor((T - 1) / s_T) + 1, *out_spatial)`` in x's dtype
          (accumulated in float32, bias included, rounded once); with a state, the chunk's
          outputs and the new state; with ``return_final_state``, ``(y, final_state)``.
        """
        del key
        _check_rank(x, self.num_spatial_dims, "CausalConv")
        ids = None if segment_ids is None else _example_segment_ids(segment_ids, x.shape)
        bias = None if self.bias is None else self.bias.reshape(-1)
        if initial_state is not None or return_final_state:
            return self._from_state(x, state, ids, bias, initial_state, return_final_state)
        if state is None:
            conv = causal_conv if self.context_parallel is None else self.context_parallel.causal_conv
            return conv(x[None], self.weight, bias, segment_ids=ids, **self._kwargs())[0]
        if self.state_index is None:
            raise ValueError(
                "this CausalConv holds no stream state: build it with stream=True (and spatial_shape) through "
                "eqx.nn.make_with_state to call it with one, or call layer(x) for the full pass"
            )
        y, new = causal_conv_stream(x[None], state.get(self.state_index), self.weight, bias, segment_ids=ids,
                                    **self._kwargs())
        return y[0], state.set(self.state_index, new)


    def _from_state(self, x, state, ids, bias, initial_state, return_final_state):
        """The full pass as a stream's chunk from ``initial_state`` (or ``None``): ``y`` or ``(y, final_state)``."""
        if state is not None:
            raise ValueError(
                "pass an eqx.nn.State (the layer's stream) or initial_state / return_final_state (a pass with explicit "
                "states), not both: adopt a state into the eqx.nn.State with state.set(layer.state_index, s)"
            )
        if self.context_parallel is not None:
            raise ValueError(
                "initial_state and return_final_state run the layer as a stream on one device, and context_parallel "
                "splits the full pass only: call a layer without context_parallel for a pass with states"
            )
        y, new = causal_conv_stream(x[None], initial_state, self.weight, bias, segment_ids=ids, **self._kwargs())
        return (y[0], new) if return_final_state else y[0]


def _non_time_padding(padding, n: int):
    """``padding`` of the non-time axes as :func:`causal_conv` takes it: a string, or ``n`` ``(lo, hi)`` pairs."""
    if isinstance(padding, str):
        return padding
    if is_int(padding):
        return ((int(padding), int(padding)),) * n
    return tuple((int(p), int(p)) if is_int(p) else tuple(p) for p in padding)
