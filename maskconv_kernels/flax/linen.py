"""``Conv`` (also ``MaskedConv``): ``flax.linen.Conv(mask=...)`` with the mask made exact.

Same fields, same parameters (``kernel`` of shape ``(*kernel_size, C_in // groups,
features)`` and ``bias`` of shape ``(features,)``, same initialisers), and the same class
name: in a compact parent, linen names a submodule after its class (``Conv_0``,
``Conv_1``, ...), so a model whose ``nn.Conv`` is swapped for this one keeps its variable
paths, and its checkpoints load unchanged. ``MaskedConv`` is the same class under a name
that says what it is. The difference: ``nn.Conv`` computes ``conv(x, kernel * mask)``,
which reads every tap and multiplies the masked ones by zero, so a NaN or Inf under a
masked tap reaches the output (``0 * NaN = NaN``), and on GPUs a Winograd or FFT
convolution mixes neighbouring windows. This module calls
:func:`maskconv_kernels.masked_conv`, which never reads a masked tap.

``ShortConv``: the short causal convolution of Mamba / gated DeltaNet layers
(:func:`maskconv_kernels.causal_conv1d`), with ``decode=True`` for serving.

``CausalConv``: ``nn.Conv``'s parameters as a causal convolution over time
(:func:`maskconv_kernels.causal_conv`) for video and audio tokenizers, with
``decode=True`` streaming chunks of frames.
"""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from flax.linen.linear import PaddingLike, default_kernel_init
from flax.typing import Dtype, Initializer, PrecisionLike

from maskconv_kernels.flax import _causal_conv, _conv, _decode, _short_conv
from maskconv_kernels.flax._short_conv import from_conv_params
from maskconv_kernels.ops.causal_conv import CausalConvState
from maskconv_kernels.parallel.context import ContextParallel

__all__ = ["Conv", "MaskedConv", "ShortConv", "CausalConv", "from_conv_params"]


class Conv(nn.Module):
    """Exact masked convolution, a drop-in replacement for ``flax.linen.Conv(mask=...)``.

    ``MaskedConv`` is this class. Swap one line and keep the checkpoint::

        >>> import flax.linen as nn
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> import maskconv_kernels as mk
        >>> from maskconv_kernels.flax import MaskedConv
        >>> mask = mk.pixelcnn_mask((3, 3), "A")            # window-shaped: one bit per tap
        >>> layer = MaskedConv(features=4, kernel_size=(3, 3), mask=mask)
        >>> x = jnp.ones((2, 8, 8, 1))
        >>> variables = layer.init(jax.random.key(0), x)
        >>> jax.tree_util.tree_map(jnp.shape, variables)
        {'params': {'bias': (4,), 'kernel': (3, 3, 1, 4)}}
        >>> full = np.broadcast_to(mask[..., None, None], (3, 3, 1, 4))  # nn.Conv takes this shape
        >>> leaky = nn.Conv(features=4, kernel_size=(3, 3), mask=full)
        >>> bool(jnp.allclose(layer.apply(variables, x), leaky.apply(variables, x)))
        True
        >>> x = x.at[:, 4, 4].set(jnp.nan)                # the pixel each centre must not see
        >>> bool(jnp.isnan(layer.apply(variables, x)[0, 4, 4]).any())
        False

    Attributes:
      features: number of output channels, ``C_out``.
      kernel_size: the window, an int (1-D) or one int per spatial dim.
      strides: int or one int per spatial dim.
      padding: ``"SAME"``, ``"VALID"``, ``"CIRCULAR"``, ``"REFLECT"``, ``"CAUSAL"`` (1-D
        only), an int, or one int or ``(lo, hi)`` pair per spatial dim; as in ``nn.Conv``.
      input_dilation: int or one int per spatial dim; needs explicit (non-string) padding,
        as in ``nn.Conv``.
      kernel_dilation: int or one int per spatial dim.
      feature_group_count: ``C_in`` and ``features`` are split into this many groups.
      use_bias: add a ``(features,)`` bias.
      mask: static 0/1 or bools, of shape ``kernel_size`` (one bit per tap, e.g. from
        :func:`maskconv_kernels.pixelcnn_mask`) or the full kernel shape ``(*kernel_size,
        C_in // feature_group_count, features)`` (what ``nn.Conv`` takes). A numpy or
        concrete jax array, never a traced one; stored as a hashable
        :class:`maskconv_kernels.Mask`. ``None`` makes every tap active.
      dtype: the computation dtype (default: promoted from input and params).
      param_dtype: the dtype of ``kernel`` and ``bias``.
      precision: ``lax.Precision`` of the products (``"highest"``: no TF32 on GPUs).
      kernel_init, bias_init: initialisers, the same defaults as ``nn.Conv``.
      promote_dtype: ``(inputs, kernel, bias, dtype=...) -> (inputs, kernel, bias)``.
      implementation: ``None`` (best backend for the platform) or one of
        :data:`maskconv_kernels.IMPLEMENTATIONS`.
      decode: autoregressive decoding, as ``nn.MultiHeadDotProductAttention(decode=True)``:
        ``init`` with a full-size input allocates a ``"cache"`` collection (sized from the
        mask's active taps; see :mod:`maskconv_kernels.ops.masked_conv.decode`), then each
        ``apply(..., mutable=["cache"])`` consumes one position in raster order: an input
        ``(N, 1, 1, C_in)`` (one pixel; ``(N, 1, C_in)`` in 1-D) or ``(N, 1, W, C_in)`` (one
        row) gives the output there. Stride 1 only.
      decode_shift: in decode mode, the input given at position ``p`` is the one at
        ``p - decode_shift`` (``1`` for a model's first, type "A", layer: it is fed the
        previous sample).

    ``nn.Conv``'s deprecated ``conv_general_dilated`` and ``conv_general_dilated_cls``
    fields are absent: the convolution is what this module replaces.
    """

    features: int
    kernel_size: int | Sequence[int]
    strides: None | int | Sequence[int] = 1
    padding: PaddingLike = "SAME"
    input_dilation: None | int | Sequence[int] = 1
    kernel_dilation: None | int | Sequence[int] = 1
    feature_group_count: int = 1
    use_bias: bool = True
    mask: Any = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = nn.initializers.zeros_init()
    promote_dtype: Any = promote_dtype
    implementation: str | None = None
    # Autoregressive decoding (maskconv_kernels/flax/_decode.py).
    decode: bool = False
    decode_shift: int = 0

    def __post_init__(self):
        # A linen module is a dataclass hashed and compared by its fields (clone, nn.jit,
        # lifted transforms), so the mask is stored as a content-hashed Mask, not an array.
        object.__setattr__(self, "mask", _conv.static_mask(self.mask, self.kernel_size, self.features))
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """Applies the masked convolution.

        Args:
          inputs: ``(*batch_dims, *spatial, C_in)``, channels-last; several batch dims are
            flattened and restored, none is allowed (single example), as in ``nn.Conv``.
          segment_ids: ``None``, or integers ``(*batch_dims, *spatial)``: packed documents,
            as :func:`maskconv_kernels.masked_conv` takes them: no tap crosses a document
            boundary. Negative ids are padding, where the convolution is zero (the output
            is the bias) and which receives no gradient. Needs an output on the input's
            grid (stride 1; ``"SAME"``, ``"CAUSAL"`` or size-keeping pairs) and zero
            padding (not ``"CIRCULAR"`` or ``"REFLECT"``, which copy values across a row's
            border); not when decoding.

        Returns:
          ``(*batch_dims, *out_spatial, features)`` in the promoted dtype.
        """
        kernel_size = _conv.kernel_size_tuple(self.kernel_size)
        in_features = jnp.shape(inputs)[-1]
        if in_features % self.feature_group_count:
            raise ValueError(
                f"feature_group_count={self.feature_group_count} must divide the input's {in_features} channels"
            )
        kernel_shape = (*kernel_size, in_features // self.feature_group_count, self.features)
        kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        layer = _conv.Layer.of(self, preferred_element_type=None)
        if self.decode and self.has_variable("cache", "cached_input"):
            cache = {name: self.variable("cache", name) for name in _decode.CACHE_FIELDS}
            y, values = layer.decode_step(inputs, kernel, bias, segment_ids, {n: v.value for n, v in cache.items()})
            for name, value in values.items():
                cache[name].value = value
            return y
        if self.decode:
            # At init: the "cache" collection for this full-size (N, *spatial, C_in) input.
            for name, value in layer.new_cache(inputs.shape, kernel.shape, inputs.dtype).items():
                self.variable("cache", name, lambda value=value: value)
        return layer(inputs, kernel, bias, segment_ids)


# The same class: linen names auto-named submodules after the class (Conv_0), as nn.Conv's.
MaskedConv = Conv


class ShortConv(nn.Module):
    """The short causal convolution of Mamba / Mamba-2 / gated DeltaNet layers, as a module.

    :func:`maskconv_kernels.causal_conv1d` with its parameters.

    Parameters as those layers hold them: ``weight`` ``(kernel_size, D)`` and ``bias``
    ``(D,)``, initialised as PyTorch's ``Conv1d(D, D, kernel_size, groups=D)``
    (``uniform(±1/sqrt(kernel_size))`` for both; a PyTorch weight ``(D, 1, W)`` loads as
    ``w[:, 0, :].T``, the parameters of a depthwise ``nn.Conv`` (``kernel (W, 1, D)``)
    through :func:`from_conv_params`); ``D`` is the input's last dim::

        >>> import jax, jax.numpy as jnp
        >>> from maskconv_kernels.flax import ShortConv
        >>> layer = ShortConv(kernel_size=4, activation="silu")
        >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 16, 8)))
        >>> jax.tree_util.tree_map(jnp.shape, variables)
        {'params': {'bias': (8,), 'weight': (4, 8)}}

    Attributes:
      kernel_size: the width ``W``.
      dilation: the taps' spacing.
      use_bias: add a ``(D,)`` bias (Mamba: yes; gated DeltaNet: no).
      activation: ``None`` or ``"silu"`` (``"swish"``), applied in float32 after the bias.
      dtype: the dtype of the outputs and of the decode state (the input is cast to it);
        ``None`` keeps the input's (with ``arithmetic="wide"``; otherwise the promoted one
        of the input and parameters, as Flax's).
      param_dtype: the dtype of ``weight`` and ``bias``.
      weight_init: initialiser of ``weight`` (default PyTorch's, as above).
      bias_init: initialiser of ``bias``; ``None`` is PyTorch's ``uniform(±1/sqrt(kernel_size))``.
      implementation: as in :func:`maskconv_kernels.masked_conv`.
      decode: Flax's decode convention (as ``MaskedConv(decode=True)``): ``init`` with a
        full-size input ``(N, L, D)`` allocates the ``"cache"`` collection's ``conv_state``
        (``(N, (kernel_size - 1) * dilation, D)``, zeros), then each ``apply(...,
        mutable=["cache"])`` consumes one or several tokens ``(N, T, D)`` (or, with
        ``state_indices``, ``(B, T, D)`` for ``B`` of the ``N`` slots) and returns their
        outputs, through :func:`maskconv_kernels.causal_conv1d_update`. A state the model
        already holds (MaxText's ``(B, K - 1, D)`` conv state) is the collection itself:
        ``{"params": ..., "cache": {"conv_state": state}}``.
      context_parallel: ``None``, or the :class:`~maskconv_kernels.parallel.ContextParallel`
        split of the sequence: the full pass takes ``x`` (and ``segment_ids``,
        ``positions``) sharded along ``L`` in its layout and runs
        :func:`~maskconv_kernels.parallel.sequence_sharded_causal_conv1d` (bit for bit
        the one-device outputs); decode steps are not split.
      padding: ``"CAUSAL"`` (the default) or ``((kernel_size - 1) * dilation, 0)``: what a
        Flax conv's causal padding says, kept so that a port keeps its arguments; any
        other padding raises (a ``ShortConv`` never reads a later position).
      padding_id: ``None``, or the segment id that marks padding besides the negative ones
        (MaxText's ``0``), as :func:`maskconv_kernels.causal_conv1d` takes it: its
        positions have zero outputs, no gradient, and the final state comes from each
        row's last other token.
      arithmetic: how the weight and bias meet the input: ``"wide"`` (the default: they
        stay in ``param_dtype``, products in the wider dtype, float32 accumulation, bias and
        activation in float32, one rounding; Mamba's float32 weights with bfloat16
        activations), ``"promote"`` (input, weight and bias cast to one computation dtype
        first, as Flax's ``promote_dtype``, then as ``"wide"``: the library's
        ``CausalConv``) or ``"nn_conv"`` (``nn.Conv(dtype=...)`` then the activation: the
        promoted convolution rounded, the bias added in the computation dtype, the
        activation in float32 on that, rounded). :meth:`from_conv` picks the converted
        layer's.
    """

    kernel_size: int
    dilation: int = 1
    use_bias: bool = True
    activation: str | None = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    weight_init: Initializer = _short_conv.weight_init
    bias_init: Initializer | None = None
    implementation: str | None = None
    decode: bool = False
    context_parallel: ContextParallel | None = None
    padding: PaddingLike = "CAUSAL"
    padding_id: int | None = None
    arithmetic: str = "wide"

    def __post_init__(self):
        _short_conv.check_padding(self.padding, self.kernel_size, self.dilation)
        _short_conv.check_arithmetic(self.arithmetic)
        super().__post_init__()

    @classmethod
    def from_conv(
        cls, conv: nn.Module, *, activation: str | None = None, implementation: str | None = None,
        decode: bool = False, padding_id: int | None = None, **fields,
    ) -> "ShortConv":
        """The ``ShortConv`` that computes what a depthwise causal 1-D convolution computes, bit for bit.

        ``conv``: ``nn.Conv(D, (W,), feature_group_count=D, padding="CAUSAL")`` (or padding
        ``((W - 1) * kernel_dilation, 0)``), stride 1, no mask, no input dilation; or this
        library's 1-D ``CausalConv`` with ``padding_mode="zeros"``. Its kernel dilation,
        bias, ``dtype`` and ``param_dtype`` are kept, and its arithmetic (``"nn_conv"`` for
        a Flax conv, which rounds its float32 weight to a bfloat16 ``dtype`` before it
        convolves; ``"promote"`` for a ``CausalConv``). Its parameters convert with
        :func:`~maskconv_kernels.flax.from_conv_params`. ``activation``, ``implementation``,
        ``decode``, ``padding_id`` and ``fields`` (``name=``, ``context_parallel=``): the
        new module's::

            >>> import flax.linen as nn, jax, jax.numpy as jnp
            >>> from maskconv_kernels.flax import ShortConv, from_conv_params
            >>> conv = nn.Conv(8, (4,), feature_group_count=8, padding="CAUSAL", use_bias=False,
            ...                dtype=jnp.bfloat16)              # MaxText's gated DeltaNet conv
            >>> x = jax.random.normal(jax.random.key(0), (2, 16, 8))
            >>> conv_variables = conv.init(jax.random.key(1), x)
            >>> short = ShortConv.from_conv(conv)
            >>> y = short.apply(from_conv_params(conv_variables), x)
            >>> y.dtype, bool((y == conv.apply(conv_variables, x)).all())
            (dtype(bfloat16), True)
        """
        causal = isinstance(conv, CausalConv)
        return cls(**_short_conv.conv_fields(conv, causal_conv=causal), activation=activation,
                   implementation=implementation, decode=decode, padding_id=padding_id, **fields)

    @nn.compact
    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None = None, *, state_indices=None, has_initial_state=None,
        positions: jax.Array | None = None, initial_state: jax.Array | None = None, return_final_state: bool = False,
    ):
        """The convolution, or (decoding) the next tokens.

        Args:
          x: ``(N, L, D)``; when decoding, ``(N, T, D)`` (or ``(B, T, D)`` with ``state_indices``).
          segment_ids: ``(N, L)`` packed documents (negative, or ``padding_id``: padding), as in
            :func:`causal_conv1d`; not when decoding.
          state_indices, has_initial_state: decoding only, as in :func:`~maskconv_kernels.causal_conv1d_update`:
            each row's slot of the state (``-1``: a row without a request), and where a
            row starts a new sequence.
          positions: ``(N, L)`` (decoding: ``(N, T)``) each token's position in its
            document, RecurrentGemma's ``segment_pos``: packing by positions instead of
            ``segment_ids`` (a 0 starts a document, negative is padding), also when
            decoding, where a document may start inside the chunk.
          initial_state: full pass only: ``(N, (kernel_size - 1) * dilation, D)`` in the
            computation dtype, the inputs before ``x[:, 0]`` (a state the model keeps in its
            own cache, MaxText's conv state), as :func:`causal_conv1d` takes it.
          return_final_state: full pass only: also return the state after ``x`` (each
            row's last inputs; with packing, of its last document up to its last real
            token), as :func:`causal_conv1d` returns it.

        Returns:
          ``(N, L, D)`` (decoding: shaped like ``x``) in ``dtype``, else x's dtype (the
          promoted one for ``arithmetic`` other than ``"wide"``); with
          ``return_final_state``, ``(y, final_state)``.
        """
        d = jnp.shape(x)[-1]
        weight = self.param("weight", self.weight_init, (self.kernel_size, d), self.param_dtype)
        bias = None
        if self.use_bias:
            bias_init = _short_conv.bias_init_for(self.kernel_size, self.bias_init)
            bias = self.param("bias", bias_init, (d,), self.param_dtype)
        if self.decode:
            _short_conv.refuse_full_pass_states(initial_state, return_final_state, 'the "cache" collection\'s conv_state')
        if self.decode and self.has_variable("cache", "conv_state"):
            state = self.variable("cache", "conv_state")
            y, state.value = _short_conv.decode_step(
                self, x, state.value, weight, bias, segment_ids, positions, state_indices=state_indices,
                has_initial_state=has_initial_state,
            )
            return y
        _short_conv.refuse_state_arguments(state_indices, has_initial_state, "init allocated the cache")
        if self.decode:
            x_dtype = _short_conv.operands(self, x, weight, bias)[0].dtype
            shape = _short_conv.state_shape(jnp.shape(x), self.kernel_size, self.dilation, d)
            self.variable("cache", "conv_state", jnp.zeros, shape, x_dtype)
        return _short_conv.full_pass(self, x, weight, bias, segment_ids, positions, initial_state=initial_state,
                                     return_final_state=return_final_state)


class CausalConv(nn.Module):
    """A causal convolution over time with ``nn.Conv``'s parameters: :func:`maskconv_kernels.causal_conv`.

    Output frame ``t`` reads input frames ``t * s_T - (k_T - 1) * d_T .. t * s_T`` and
    nothing later; before frame 0 the input is zeros or copies of frame 0
    (``padding_mode``). The parameters are ``nn.Conv``'s of the same kernel size, names,
    shapes and initialisers (``kernel (k_T, *k_spatial, C_in // feature_group_count,
    features)``, ``bias (features,)``), so an ``nn.Conv`` that was made causal by padding
    its input by hand loads unchanged: the same ``init`` key gives the same values, and
    its variables give what it gave on the padded input. (Linen names an unnamed
    submodule after its class, ``CausalConv_0``: a model swapping it in for ``Conv_0``
    passes ``name="Conv_0"`` to keep the checkpoint's paths.)::

        >>> import jax, jax.numpy as jnp
        >>> from maskconv_kernels.flax import CausalConv
        >>> layer = CausalConv(features=8, kernel_size=(3, 3, 3), strides=(2, 1, 1), padding_mode="replicate")
        >>> x = jnp.ones((1, 9, 16, 16, 4))                       # (N, T, H, W, C): Wan's 1 + 4 + 4 frames
        >>> variables = layer.init(jax.random.key(0), x)
        >>> jax.tree_util.tree_map(jnp.shape, variables)
        {'params': {'bias': (8,), 'kernel': (3, 3, 3, 4, 8)}}
        >>> layer.apply(variables, x).shape                         # floor((9 - 1) / 2) + 1 frames
        (1, 5, 16, 16, 8)

    Attributes:
      features: ``C_out``.
      kernel_size: the window ``(k_T, *k_spatial)``, time first (an int: a 1-D, audio, layer).
      strides: an int (every axis) or one per axis, time first; ``None`` is 1.
      padding: the non-time axes' only: ``"SAME"``, ``"VALID"``, an int, or one int or
        ``(lo, hi)`` pair per non-time axis. Time's is the layer's own,
        ``((k_T - 1) * d_T, 0)``; so ``"CAUSAL"`` (``nn.Conv``'s word for it) is taken by a
        1-D layer, and refused, naming these, by one with other axes.
      padding_mode: the frames before frame 0: ``"zeros"`` or ``"replicate"`` (copies of
        frame 0, as Cosmos, CogVideoX and Wan).
      spatial_padding_mode: what ``padding`` adds on the other axes: ``"zeros"``, or
        copies of each frame's own pixels, ``"reflect"`` (mirrored, as LTX-2's decoder
        pads), ``"replicate"`` (the edge repeated) or ``"circular"`` (wrapped), as
        :func:`maskconv_kernels.causal_conv` takes it (its own keyword: time can be
        neither mirrored nor wrapped). The cache holds the frames unpadded. Not with
        ``segment_ids``.
      kernel_dilation: an int or one per axis, time first; ``None`` is 1.
      feature_group_count: ``C_in`` and ``features`` split into this many groups.
      use_bias: add a ``(features,)`` bias (in float32, before the one rounding).
      dtype: the computation dtype (default: promoted from the inputs and parameters, as
        ``nn.Conv``); the output and the cache's frames have it. Accumulation is float32.
      param_dtype: the dtype of ``kernel`` and ``bias``.
      precision: ``lax.Precision`` of the products (``"highest"``: no TF32 on GPUs).
      kernel_init, bias_init: ``nn.Conv``'s defaults.
      implementation: ``None`` (per platform) or one of
        :data:`maskconv_kernels.ops.causal_conv.IMPLEMENTATIONS`.
      interpret: run a kernel implementation in its interpreter.
      decode: stream chunks of frames, in Flax's decode convention: ``init`` allocates the
        ``"cache"`` collection (``frames``, ``offset``, ``started``, and ``segment_ids``
        if ``init`` was given them: the fields of
        :class:`~maskconv_kernels.ops.causal_conv.CausalConvState`, shaped from the
        ``init`` input's batch, spatial and channel sizes; its length does not matter),
        then each ``apply(..., mutable=["cache"])`` takes the next chunk ``(*batch_dims,
        L, *spatial, C_in)`` and returns its outputs (:func:`maskconv_kernels.causal_conv_stream`:
        the first chunk any length ``L``, later ones multiples of ``s_T``). Concatenated
        along time they are the full pass's (bit for bit where
        ``docs/causal_conv.md`` says so). Fixed-length chunks compile once under ``jit``.
        A state the model already has (a cache of past frames through
        :func:`~maskconv_kernels.ops.causal_conv.causal_conv_stream_init`'s ``frames=``) is
        adopted as the collection :meth:`cache_from_state` gives.
      context_parallel: ``None``, or the :class:`~maskconv_kernels.parallel.ContextParallel`
        split of time: the full pass takes ``inputs`` (and ``segment_ids``) sharded along
        ``T`` in its layout (the batch dims flattened into one, split over its ``batch_axis``) and runs
        :func:`~maskconv_kernels.parallel.time_sharded_causal_conv`; streams are not split.
    """

    features: int
    kernel_size: int | Sequence[int]
    strides: None | int | Sequence[int] = 1
    padding: PaddingLike = "SAME"
    padding_mode: str = "zeros"
    kernel_dilation: None | int | Sequence[int] = 1
    feature_group_count: int = 1
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = nn.initializers.zeros_init()
    implementation: str | None = None
    interpret: bool = False
    decode: bool = False
    context_parallel: ContextParallel | None = None
    # Last, so that the positional order of the fields before it stays as it was.
    spatial_padding_mode: str = "zeros"

    @staticmethod
    def cache_from_state(state: CausalConvState) -> dict[str, jax.Array]:
        """The ``"cache"`` collection holding ``state``, to decode from a state the model already has.

        ``state``: a :class:`~maskconv_kernels.ops.causal_conv.CausalConvState`, from
        :func:`~maskconv_kernels.ops.causal_conv.causal_conv_stream_init` with ``frames=``
        (a cache of past frames, Wan's ``feat_cache``) or a full pass's
        ``return_final_state``. ``apply({**variables, "cache": CausalConv.cache_from_state(state)},
        chunk, mutable=["cache"])`` continues it.
        """
        return _causal_conv.state_arrays(state)

    @nn.compact
    def __call__(
        self, inputs: jax.Array, segment_ids: jax.Array | None = None, *, initial_state: CausalConvState | None = None,
        return_final_state: bool = False,
    ):
        """The causal convolution of ``inputs``, or (decoding) of the stream's next chunk.

        Args:
          inputs: ``(*batch_dims, T, *spatial, C_in)``, channels-last, time first; batch
            dims as ``nn.Conv`` takes them (none, one or several).
          segment_ids: ``None``, or integers ``(*batch_dims, T, *spatial)``: clips packed
            along time, no tap crossing a clip (negative ids: padding, zero outputs).
            Needs ``padding_mode="zeros"``, stride 1 and ``"SAME"``. When decoding, with
            every chunk of a stream whose ``init`` had them.
          initial_state: full pass only: ``None`` or the
            :class:`~maskconv_kernels.ops.causal_conv.CausalConvState` of the frames before
            ``inputs`` (its batch the flattened batch dims), as
            :func:`~maskconv_kernels.causal_conv_stream` takes it; the pass is then that
            stream's chunk (after a started state, a multiple of ``s_T`` frames).
          return_final_state: full pass only: also return the state after ``inputs``.

        Returns:
          ``(*batch_dims, floor((T - 1) / s_T) + 1, *out_spatial, features)`` (decoding:
          the chunk's ``ceil(L / s_T)`` or ``L / s_T`` frames) in the computation dtype;
          with ``return_final_state``, ``(y, final_state)``.
        """
        layer = _causal_conv.Layer.of(self)
        shape = layer.kernel_shape(jnp.shape(inputs)[-1], self.features)
        kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if self.decode:
            _causal_conv.refuse_full_pass_states(initial_state, return_final_state,
                                                 'the "cache" collection (CausalConv.cache_from_state)')
        if self.decode and self.has_variable("cache", "frames"):
            cache = {name: self.variable("cache", name) for name in _causal_conv.CACHE_FIELDS
                     if self.has_variable("cache", name)}
            state = _causal_conv.state_from({name: v.value for name, v in cache.items()})
            y, state = layer.stream(inputs, state, kernel, bias, segment_ids)
            for name, value in _causal_conv.state_arrays(state).items():
                cache[name].value = value
            return y
        if self.decode:
            state = layer.initial_state(inputs.shape, inputs.dtype, shape, kernel.dtype, segment_ids is not None)
            for name, value in _causal_conv.state_arrays(state).items():
                self.variable("cache", name, lambda value=value: value)
        if initial_state is not None or return_final_state:
            return layer.from_state(inputs, initial_state, kernel, bias, segment_ids, return_final_state)
        return layer(inputs, kernel, bias, segment_ids)
