"""``Conv`` (also ``MaskedConv``): ``flax.nnx.Conv(mask=...)`` with the mask made exact.

The same constructor and the same state as ``flax.nnx.Conv`` (``kernel``, ``bias``, and
the ``mask`` array as it was given), so ``nnx.state`` of one, or a checkpoint of it,
loads into the other; the convolution is :func:`maskconv_kernels.masked_conv`, which
never reads a masked tap. ``MaskedConv`` is the same class.

``ShortConv``: the short causal convolution of Mamba / gated DeltaNet layers, and
``CausalConv``: ``nnx.Conv``'s parameters as a causal convolution over time, each as the
linen module of the same name.
"""
from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from flax.typing import Dtype, Initializer, PaddingLike, PrecisionLike

from maskconv_kernels.flax import _causal_conv, _conv, _decode, _short_conv
from maskconv_kernels.masks import as_mask
from maskconv_kernels.ops.causal_conv import CausalConvState
from maskconv_kernels.parallel.context import ContextParallel

__all__ = ["Conv", "MaskedConv", "ShortConv", "CausalConv"]


def _conv_params(rngs, kernel_shape, use_bias, kernel_init, bias_init, param_dtype, kernel_metadata, bias_metadata):
    """``(kernel, bias)`` as ``nnx.Conv`` draws them (kernel first, then bias), so the same
    Rngs give the same parameters; ``bias`` is ``nnx.data(None)`` without one."""
    kernel = nnx.Param(kernel_init(rngs.params(), kernel_shape, param_dtype), **kernel_metadata)
    if not use_bias:
        return kernel, nnx.data(None)
    return kernel, nnx.Param(bias_init(rngs.params(), (kernel_shape[-1],), param_dtype), **bias_metadata)


class Conv(nnx.Module):
    """Exact masked convolution, a drop-in replacement for ``flax.nnx.Conv(mask=...)``.

    ``MaskedConv`` is this class. Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> import maskconv_kernels as mk
        >>> from maskconv_kernels.flax import nnx as mk_nnx
        >>> layer = mk_nnx.MaskedConv(1, 4, (3, 3), mask=mk.pixelcnn_mask((3, 3), "A"), rngs=nnx.Rngs(0))
        >>> layer.kernel.shape
        (3, 3, 1, 4)
        >>> x = jnp.ones((2, 8, 8, 1)).at[:, 4, 4].set(jnp.nan)
        >>> bool(jnp.isnan(layer(x)[:, 4, 4]).any())
        False

    Args:
      in_features: ``C_in``.
      out_features: ``C_out``.
      kernel_size: the window, an int (1-D) or one int per spatial dim.
      strides, padding, input_dilation, kernel_dilation, feature_group_count, use_bias,
      dtype, param_dtype, precision, kernel_init, bias_init, promote_dtype,
      preferred_element_type, rngs, kernel_metadata, bias_metadata: as in
        ``flax.nnx.Conv``.
      mask: static 0/1 or bools, of shape ``kernel_size`` (one bit per tap) or the full
        kernel shape ``(*kernel_size, in_features // feature_group_count, out_features)``;
        ``None`` makes every tap active. Which taps are read is fixed here: the convolution
        reads ``static_mask``, a hashable :class:`maskconv_kernels.Mask`. The ``mask``
        attribute keeps the argument as ``nnx.Conv`` keeps it (an array there is state), so
        the two modules' states, and checkpoints, have the same tree.
      implementation: ``None`` (best backend for the platform) or one of
        :data:`maskconv_kernels.IMPLEMENTATIONS`.
      decode: autoregressive decoding, as ``nnx.MultiHeadAttention(decode=True)``:
        :meth:`init_cache` with a full-size input shape allocates ``nnx.Cache`` state (sized
        from the mask's active taps; see :mod:`maskconv_kernels.ops.masked_conv.decode`), then each call
        consumes one position in raster order: ``(N, 1, 1, in_features)`` (one pixel;
        ``(N, 1, in_features)`` in 1-D) or ``(N, 1, W, in_features)`` (one row). Stride 1.
      decode_shift: in decode mode, the input given at position ``p`` is the one at
        ``p - decode_shift`` (``1`` for a model's first, type "A", layer).

    ``nnx.Conv``'s ``conv_general_dilated`` argument is absent: the convolution is what
    this module replaces.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | tp.Sequence[int],
        strides: None | int | tp.Sequence[int] = 1,
        *,
        padding: PaddingLike = "SAME",
        input_dilation: None | int | tp.Sequence[int] = 1,
        kernel_dilation: None | int | tp.Sequence[int] = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        mask: tp.Any = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        promote_dtype: tp.Callable = dtypes.promote_dtype,
        preferred_element_type: Dtype | None = None,
        implementation: str | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        decode: bool = False,
        decode_shift: int = 0,
    ):
        kernel_size = _conv.kernel_size_tuple(kernel_size)
        if in_features % feature_group_count:
            raise ValueError(f"feature_group_count={feature_group_count} must divide in_features={in_features}")
        kernel_shape = (*kernel_size, in_features // feature_group_count, out_features)
        self.kernel_shape = kernel_shape
        self.kernel, self.bias = _conv_params(
            rngs, kernel_shape, use_bias, kernel_init, bias_init, param_dtype, kernel_metadata, bias_metadata,
        )
        self.in_features = in_features
        self.out_features = out_features
        self.kernel_size = kernel_size
        self.strides = strides
        self.padding = padding
        self.input_dilation = input_dilation
        self.kernel_dilation = kernel_dilation
        self.feature_group_count = feature_group_count
        self.use_bias = use_bias
        # Static (not state), hashable, and checked against the kernel now: in_features is known.
        static = _conv.static_mask(mask, kernel_size, out_features)
        self.static_mask = None if static is None else as_mask(static, kernel_shape)
        self.mask = mask  # as nnx.Conv keeps it: its state holds a mask array, so ours does too
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type
        self.implementation = implementation
        # Autoregressive decoding (maskconv_kernels/flax/_decode.py); init_cache allocates.
        self.decode = decode
        self.decode_shift = decode_shift
        self.cached_input: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def init_cache(self, input_shape: tp.Sequence[int], dtype=jnp.float32) -> None:
        """Allocates the decode cache for full-size inputs of ``input_shape`` ``(N, *spatial, in_features)``.

        Call it before decoding, as ``nnx.MultiHeadAttention.init_cache``; calling it again
        starts a new sequence.
        """
        for name, value in self._layer().new_cache(input_shape, self.kernel_shape, dtype).items():
            setattr(self, name, nnx.Cache(value))

    def _layer(self) -> _conv.Layer:
        return _conv.Layer.of(self, mask=self.static_mask)

    def __call__(
        self, inputs: jax.Array, segment_ids: jax.Array | None = None, *, out_sharding=None,
        decode: bool | None = None,
    ) -> jax.Array:
        """Applies the masked convolution.

        Args:
          inputs: ``(*batch_dims, *spatial, in_features)``; several batch dims are
            flattened and restored, none is allowed (single example), as in ``nnx.Conv``.
          segment_ids: ``None``, or integers ``(*batch_dims, *spatial)``: packed documents,
            as in the linen :meth:`maskconv_kernels.flax.linen.Conv.__call__`; not when
            decoding.
          out_sharding: only ``None``; explicit output sharding is not supported yet.
            Keyword-only here (``nnx.Conv`` takes it second): the second place is
            ``segment_ids``, as in the linen module.
          decode: overrides the module's ``decode`` for this call.

        Returns:
          ``(*batch_dims, *out_spatial, out_features)``.
        """
        if isinstance(segment_ids, (jax.sharding.Sharding, jax.sharding.PartitionSpec)):
            raise TypeError(
                "the second argument of this Conv is segment_ids, got a sharding: pass out_sharding= by keyword "
                "(nnx.Conv takes it second)"
            )
        if out_sharding is not None:
            raise NotImplementedError(
                "out_sharding is not supported by maskconv_kernels.flax.nnx.Conv yet: call it without out_sharding and "
                "constrain the result with jax.sharding.reshard"
            )
        if jnp.shape(inputs)[-1] != self.in_features:
            raise ValueError(
                f"inputs have {jnp.shape(inputs)[-1]} channels (shape {jnp.shape(inputs)}) but this Conv was "
                f"built with in_features={self.in_features}: the last dim of inputs must be in_features"
            )
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        if not (self.decode if decode is None else decode):
            return self._layer()(inputs, kernel, bias, segment_ids)
        if self.cached_input is None or self.cache_index is None:
            raise ValueError("decode cache not initialized: call init_cache(input_shape) first")
        cache = {name: getattr(self, name) for name in _decode.CACHE_FIELDS}
        y, values = self._layer().decode_step(inputs, kernel, bias, segment_ids, {n: v[...] for n, v in cache.items()})
        for name, value in values.items():
            cache[name][...] = value
        return y


# The same class, as in maskconv_kernels.flax.linen.
MaskedConv = Conv


class ShortConv(nnx.Module):
    """The short causal convolution of Mamba / Mamba-2 / gated DeltaNet layers, as a module.

    :func:`maskconv_kernels.causal_conv1d` with its parameters.

    ``nnx.Param`` state ``weight`` ``(kernel_size, features)`` and ``bias``
    ``(features,)``, initialised as PyTorch's ``Conv1d(features, features, kernel_size,
    groups=features)`` (``uniform(±1/sqrt(kernel_size))`` for both; a PyTorch weight
    ``(D, 1, W)`` loads as ``w[:, 0, :].T``)::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from maskconv_kernels.flax import nnx as mk_nnx
        >>> layer = mk_nnx.ShortConv(8, 4, activation="silu", rngs=nnx.Rngs(0))
        >>> layer.weight.shape, layer(jnp.ones((2, 16, 8))).shape
        ((4, 8), (2, 16, 8))

    Args:
      features: the channels ``D``.
      kernel_size: the width ``W``.
      dilation, use_bias, activation, dtype, param_dtype, weight_init, bias_init,
        implementation, padding, padding_id, arithmetic: as in the linen
        :class:`maskconv_kernels.flax.ShortConv`.
      rngs: draws ``weight``, then ``bias``.
      decode: Flax's decode convention (as ``MaskedConv(decode=True)``): :meth:`init_cache`
        allocates ``conv_state`` (an ``nnx.Cache``), or adopts a state the model already
        holds, then each call consumes one or several tokens ``(N, T, features)`` through
        :func:`maskconv_kernels.causal_conv1d_update`.
      context_parallel: ``None``, or the :class:`~maskconv_kernels.parallel.ContextParallel`
        split of the sequence, as the linen module's.
    """

    def __init__(
        self,
        features: int,
        kernel_size: int,
        *,
        dilation: int = 1,
        use_bias: bool = True,
        activation: str | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        weight_init: Initializer = _short_conv.weight_init,
        bias_init: Initializer | None = None,
        implementation: str | None = None,
        rngs: nnx.Rngs,
        decode: bool = False,
        context_parallel: ContextParallel | None = None,
        padding: PaddingLike = "CAUSAL",
        padding_id: int | None = None,
        arithmetic: str = "wide",
    ):
        _short_conv.check_padding(padding, kernel_size, dilation)
        _short_conv.check_arithmetic(arithmetic)
        self.weight = nnx.Param(weight_init(rngs.params(), (kernel_size, features), param_dtype))
        self.bias: nnx.Param | None
        if use_bias:
            init = _short_conv.bias_init_for(kernel_size, bias_init)
            self.bias = nnx.Param(init(rngs.params(), (features,), param_dtype))
        else:
            self.bias = nnx.data(None)
        self.features = features
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.use_bias = use_bias
        self.activation = activation
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.implementation = implementation
        self.decode = decode
        self.context_parallel = context_parallel
        self.padding = padding
        self.padding_id = padding_id
        self.arithmetic = arithmetic
        self.conv_state: nnx.Cache | None = nnx.data(None)

    @classmethod
    def from_conv(
        cls, conv: nnx.Module, *, activation: str | None = None, implementation: str | None = None,
        decode: bool = False, padding_id: int | None = None, context_parallel: ContextParallel | None = None,
    ) -> "ShortConv":
        """The ``ShortConv`` with a depthwise causal 1-D convolution's parameters, computing what it computes, bit for bit.

        ``conv``: ``nnx.Conv(D, D, W, feature_group_count=D, padding="CAUSAL")`` (or
        padding ``((W - 1) * kernel_dilation, 0)``; MaxText's gated DeltaNet conv), stride
        1, no mask, no input dilation; or this library's 1-D
        :class:`~maskconv_kernels.flax.nnx.CausalConv` ``(D, D, W, feature_group_count=D)``
        with ``padding_mode="zeros"``. Its ``kernel (W, 1, D)`` becomes ``weight (W, D)``
        (:func:`~maskconv_kernels.flax.from_conv_params`); its bias, kernel dilation,
        ``dtype``, ``param_dtype`` and arithmetic are kept: an ``nnx.Conv(dtype=bfloat16,
        param_dtype=float32)`` rounds its weight to bfloat16 before it convolves, and so
        does the ``ShortConv`` (``arithmetic="nn_conv"``; ``"promote"`` from a
        ``CausalConv``). ``activation``, ``implementation``, ``decode``, ``padding_id``,
        ``context_parallel``: the new module's.
        """
        fields = _short_conv.conv_fields(conv, causal_conv=isinstance(conv, CausalConv))
        kernel = conv.kernel[...]
        params = _short_conv.from_conv_params(
            {"kernel": kernel, **({"bias": conv.bias[...]} if conv.bias is not None else {})}
        )
        width = fields.pop("kernel_size")
        module = cls(
            kernel.shape[-1], width, **fields, activation=activation, implementation=implementation,
            rngs=nnx.Rngs(0), decode=decode, padding_id=padding_id, context_parallel=context_parallel,
        )
        module.weight[...] = params["weight"]
        if conv.bias is not None:
            module.bias[...] = params["bias"]
        return module

    def init_cache(self, input_shape: tp.Sequence[int] | None = None, dtype: Dtype | None = None, *,
                   state: jax.typing.ArrayLike | None = None) -> None:
        """Allocates ``conv_state``, zeros ``(N, (kernel_size - 1) * dilation, features)``, for inputs ``(N, L, D)``;
        or adopts ``state``.

        ``dtype``: the decoded inputs' (default the module's ``dtype``, else float32).
        ``state``: instead of zeros, a state the model already holds, the last ``(kernel_size
        - 1) * dilation`` inputs of each row, oldest first (MaxText's ``(B, K - 1, D)`` conv
        state; a full pass's ``return_final_state``): ``input_shape`` and ``dtype`` are then
        its own. Call it before decoding, as ``nnx.MultiHeadAttention.init_cache``; calling
        it again starts new sequences.
        """
        if state is not None:
            state = jnp.asarray(state)
            window = (self.kernel_size - 1) * self.dilation
            if input_shape is not None or dtype is not None or tuple(state.shape[1:]) != (window, self.features) \
                    or state.ndim != 3:
                raise ValueError(
                    f"init_cache(state=...) adopts a state (N, (kernel_size - 1) * dilation, features) = (N, {window}, "
                    f"{self.features}) with its own shape and dtype (no input_shape or dtype), got shape "
                    f"{tuple(state.shape)}" + (" and input_shape or dtype" if input_shape is not None or dtype is not None
                                               else "")
                )
            self.conv_state = nnx.Cache(state)
            return
        if input_shape is None:
            raise ValueError("init_cache needs input_shape, the full-size input's (N, L, features), or state=")
        shape = _short_conv.state_shape(tuple(input_shape), self.kernel_size, self.dilation, self.features)
        if dtype is None:
            dtype = jnp.float32 if self.dtype is None else self.dtype
        self.conv_state = nnx.Cache(jnp.zeros(shape, dtype))

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None = None, *, decode: bool | None = None,
        state_indices=None, has_initial_state=None, positions: jax.Array | None = None,
        initial_state: jax.Array | None = None, return_final_state: bool = False,
    ):
        """The convolution, or (decoding) the next tokens.

        Args:
          x: ``(N, L, features)``; when decoding, ``(N, T, features)`` (or ``(B, T,
            features)`` with ``state_indices``).
          segment_ids: ``(N, L)`` packed documents (negative, or ``padding_id``: padding),
            as in :func:`causal_conv1d`; not when decoding.
          decode: overrides the module's ``decode`` for this call.
          state_indices, has_initial_state: decoding only, as in :func:`~maskconv_kernels.causal_conv1d_update`.
          positions: ``(N, L)`` (decoding: ``(N, T)``) each token's position in its
            document, as in the linen module: packing by positions, also when decoding.
          initial_state, return_final_state: the full pass's state, as in the linen module
            (:func:`causal_conv1d`'s): then ``(y, final_state)``.
        """
        if jnp.shape(x)[-1] != self.features:
            raise ValueError(
                f"x has {jnp.shape(x)[-1]} channels (shape {jnp.shape(x)}) but this ShortConv was built with "
                f"features={self.features}: the last dim of x must be features"
            )
        weight = self.weight[...]
        bias = self.bias[...] if self.bias is not None else None
        if not (self.decode if decode is None else decode):
            _short_conv.refuse_state_arguments(state_indices, has_initial_state, "init_cache")
            return _short_conv.full_pass(self, x, weight, bias, segment_ids, positions, initial_state=initial_state,
                                         return_final_state=return_final_state)
        _short_conv.refuse_full_pass_states(initial_state, return_final_state, "conv_state (init_cache)")
        if self.conv_state is None:
            raise ValueError("decode state not initialized: call init_cache(input_shape) first")
        y, self.conv_state[...] = _short_conv.decode_step(
            self, x, self.conv_state[...], weight, bias, segment_ids, positions, state_indices=state_indices,
            has_initial_state=has_initial_state,
        )
        return y


class CausalConv(nnx.Module):
    """A causal convolution over time with ``nnx.Conv``'s parameters: :func:`maskconv_kernels.causal_conv`.

    The linen :class:`maskconv_kernels.flax.linen.CausalConv` as an nnx module:
    ``nnx.Param`` state ``kernel (k_T, *k_spatial, in_features // feature_group_count,
    out_features)`` and ``bias (out_features,)``, drawn as ``nnx.Conv`` draws them (the
    same ``Rngs`` give the same values), so ``nnx.state`` of an ``nnx.Conv`` of the same
    kernel size, or its checkpoint, loads unchanged::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from maskconv_kernels.flax import nnx as mk_nnx
        >>> layer = mk_nnx.CausalConv(4, 8, (3, 3, 3), rngs=nnx.Rngs(0))
        >>> layer.kernel.shape, layer(jnp.ones((1, 9, 16, 16, 4))).shape
        ((3, 3, 3, 4, 8), (1, 9, 16, 16, 8))

    Args:
      in_features: ``C_in``.
      out_features: ``C_out``.
      kernel_size: the window ``(k_T, *k_spatial)``, time first (an int: a 1-D layer).
      strides, padding, padding_mode, spatial_padding_mode, kernel_dilation,
      feature_group_count, use_bias, dtype, param_dtype, precision, kernel_init,
      bias_init, implementation, interpret: as the linen module's attributes
        (``padding`` and ``spatial_padding_mode`` are the non-time axes').
      rngs: draws ``kernel``, then ``bias``.
      kernel_metadata, bias_metadata: as in ``nnx.Conv``.
      decode: stream chunks, as ``nnx.MultiHeadAttention(decode=True)``:
        :meth:`init_cache` allocates ``nnx.Cache`` state (``frames``, ``offset``,
        ``started``, ``segment_ids``: the fields of
        :class:`~maskconv_kernels.ops.causal_conv.CausalConvState`), or adopts a state the
        model already has, then each call takes the next chunk ``(*batch_dims, L,
        *spatial, in_features)`` and returns its outputs (the first chunk any length,
        later ones multiples of ``s_T``).
      context_parallel: ``None``, or the :class:`~maskconv_kernels.parallel.ContextParallel`
        split of time, as the linen module's.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | tp.Sequence[int],
        strides: None | int | tp.Sequence[int] = 1,
        *,
        padding: PaddingLike = "SAME",
        padding_mode: str = "zeros",
        spatial_padding_mode: str = "zeros",
        kernel_dilation: None | int | tp.Sequence[int] = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        implementation: str | None = None,
        interpret: bool = False,
        rngs: nnx.Rngs,
        kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        decode: bool = False,
        context_parallel: ContextParallel | None = None,
    ):
        self.kernel_size = _conv.kernel_size_tuple(kernel_size)
        self.strides = strides
        self.padding = padding
        self.padding_mode = padding_mode
        self.spatial_padding_mode = spatial_padding_mode
        self.kernel_dilation = kernel_dilation
        self.feature_group_count = feature_group_count
        self.precision = precision
        self.implementation = implementation
        self.interpret = interpret
        self.context_parallel = context_parallel
        self.kernel_shape = _causal_conv.Layer.of(self).kernel_shape(in_features, out_features)
        self.kernel, self.bias = _conv_params(
            rngs, self.kernel_shape, use_bias, kernel_init, bias_init, param_dtype, kernel_metadata, bias_metadata,
        )
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.decode = decode
        self.frames: nnx.Cache | None = nnx.data(None)
        self.offset: nnx.Cache | None = nnx.data(None)
        self.started: nnx.Cache | None = nnx.data(None)
        self.segment_ids: nnx.Cache | None = nnx.data(None)

    def init_cache(self, input_shape: tp.Sequence[int] | None = None, dtype: Dtype | None = None, *,
                   segmented: bool = False, state: CausalConvState | None = None) -> None:
        """Allocates the stream's state for chunks shaped ``input_shape`` ``(*batch_dims, L, *spatial, in_features)``,
        or adopts ``state``.

        ``L`` does not matter. ``dtype``: the chunks' after promotion (default the
        module's ``dtype``, else ``param_dtype``: what promotion gives for inputs no
        wider). ``segmented``: every chunk will come with ``segment_ids``. ``state``:
        instead, a :class:`~maskconv_kernels.ops.causal_conv.CausalConvState` the model
        already has (:func:`~maskconv_kernels.ops.causal_conv.causal_conv_stream_init`
        with ``frames=``, a cache of past frames such as Wan's ``feat_cache``; or a full
        pass's ``return_final_state``), taken alone. Calling it again starts a new stream.
        """
        if state is not None:
            if input_shape is not None or dtype is not None or segmented:
                raise ValueError("init_cache(state=...) adopts the state as it is: pass state alone (its frames say the "
                                 "shape and dtype, its segment_ids whether it is packed)")
            if not isinstance(state, CausalConvState):
                raise TypeError(f"state must be a CausalConvState (causal_conv_stream_init(..., frames=...) makes one "
                                f"from a cache of frames), got {type(state).__name__}")
        elif input_shape is None:
            raise ValueError("init_cache needs input_shape, the chunks' (*batch_dims, L, *spatial, in_features), or "
                             "state=")
        else:
            if dtype is None:
                dtype = self.param_dtype if self.dtype is None else self.dtype
            state = _causal_conv.Layer.of(self).initial_state(
                input_shape, dtype, self.kernel_shape, self.param_dtype, segmented)
        arrays = _causal_conv.state_arrays(state)
        for name in _causal_conv.CACHE_FIELDS:  # segment_ids too: None unless segmented
            setattr(self, name, nnx.Cache(arrays[name]) if name in arrays else nnx.data(None))

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None = None, *, decode: bool | None = None,
        initial_state: CausalConvState | None = None, return_final_state: bool = False,
    ):
        """The causal convolution of ``x``, or (decoding) of the stream's next chunk.

        Args:
          x: ``(*batch_dims, T, *spatial, in_features)``, as the linen module's ``inputs``.
          segment_ids: ``None`` or ``(*batch_dims, T, *spatial)`` integers, as the linen
            module's (when decoding: with every chunk of a stream whose cache was
            allocated with ``segmented=True``).
          decode: overrides the module's ``decode`` for this call.
          initial_state, return_final_state: the full pass's state, as the linen module's.

        Returns:
          ``(*batch_dims, floor((T - 1) / s_T) + 1, *out_spatial, out_features)``
          (decoding: the chunk's outputs) in the computation dtype; with
          ``return_final_state``, ``(y, final_state)``.
        """
        if jnp.shape(x)[-1] != self.in_features:
            raise ValueError(
                f"x has {jnp.shape(x)[-1]} channels (shape {jnp.shape(x)}) but this CausalConv was built with "
                f"in_features={self.in_features}: the last dim of x must be in_features"
            )
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=self.dtype)
        layer = _causal_conv.Layer.of(self)
        if not (self.decode if decode is None else decode):
            if initial_state is not None or return_final_state:
                return layer.from_state(x, initial_state, kernel, bias, segment_ids, return_final_state)
            return layer(x, kernel, bias, segment_ids)
        _causal_conv.refuse_full_pass_states(initial_state, return_final_state, "the module's cache (init_cache)")
        if self.frames is None:
            raise ValueError("decode cache not initialized: call init_cache(input_shape) first")
        cache = {name: getattr(self, name) for name in _causal_conv.CACHE_FIELDS if getattr(self, name) is not None}
        y, state = layer.stream(x, _causal_conv.state_from({n: v[...] for n, v in cache.items()}), kernel, bias,
                                segment_ids)
        for name, value in _causal_conv.state_arrays(state).items():
            cache[name][...] = value
        return y
