"""What the linen and nnx ``CausalConv`` modules share: the layer's fields as
:func:`~maskconv_kernels.causal_conv`'s arguments, batch dims, and the decode cache.

Both modules hold ``nn.Conv``'s parameters (``kernel (k_T, *k_spatial, C_in // groups,
C_out)``, ``bias (C_out,)``) and differ only in how they hold them and the cache; the
convolution, the stream and the cache's arrays are :class:`Layer`'s. The cache is a
:class:`~maskconv_kernels.ops.causal_conv.CausalConvState` taken apart into arrays
(:data:`CACHE_FIELDS`), one Flax variable each, because a Flax collection holds arrays,
not dataclasses: ``frames`` (the last ``(k_T - 1) * d_T`` input frames), ``offset``,
``started`` and, for a packed stream only, ``segment_ids``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
from flax.linen.linear import canonicalize_padding

from maskconv_kernels._core.args import as_segment_ids
from maskconv_kernels.flax._conv import kernel_size_tuple
from maskconv_kernels.ops.causal_conv import CausalConvState, causal_conv, causal_conv_stream, causal_conv_stream_init

__all__ = ["CACHE_FIELDS", "Layer", "state_arrays", "state_from", "refuse_full_pass_states"]

CACHE_FIELDS = ("frames", "offset", "started", "segment_ids")


def state_arrays(state: CausalConvState) -> dict[str, jax.Array]:
    """The state's arrays by field name, ``segment_ids`` left out for a stream without them."""
    return {name: getattr(state, name) for name in CACHE_FIELDS if getattr(state, name) is not None}


def state_from(arrays: Mapping[str, Any]) -> CausalConvState:
    """The state rebuilt from :func:`state_arrays`' mapping (Flax variables' values)."""
    return CausalConvState(**{name: arrays.get(name) for name in CACHE_FIELDS})


def refuse_full_pass_states(initial_state, return_final_state: bool, cache: str) -> None:
    """Raises ``ValueError`` for the full pass's state arguments when decoding, where ``cache`` holds the state."""
    if initial_state is not None or return_final_state:
        raise ValueError(
            f"initial_state and return_final_state are for the full pass (decode=False); a stream's state is {cache}: "
            "adopt an existing state there instead"
        )


@dataclasses.dataclass(frozen=True)
class Layer:
    """A ``CausalConv`` module's static fields (the linen and nnx modules' attributes of these names).

    ``padding`` is the non-time axes' (time is padded by the layer itself): ``"SAME"``,
    ``"VALID"``, an int, or one int or ``(lo, hi)`` pair per non-time axis, as flax
    canonicalises it, filled as ``spatial_padding_mode`` says. ``kernel_dilation`` is
    :func:`causal_conv`'s ``dilation``.
    """

    kernel_size: Any
    strides: Any
    padding: Any
    padding_mode: str
    spatial_padding_mode: str
    kernel_dilation: Any
    feature_group_count: int
    precision: Any
    implementation: str | None
    interpret: bool
    context_parallel: Any  # a parallel.ContextParallel or None

    @classmethod
    def of(cls, module) -> "Layer":
        return cls(**{f.name: getattr(module, f.name) for f in dataclasses.fields(cls)})

    @property
    def ndim(self) -> int:
        """Spatial axes, time included: the window's."""
        return len(kernel_size_tuple(self.kernel_size))

    def kernel_shape(self, in_features: int, features: int) -> tuple[int, ...]:
        """``(k_T, *k_spatial, C_in // feature_group_count, C_out)``: ``nn.Conv``'s kernel."""
        if in_features % self.feature_group_count:
            raise ValueError(
                f"feature_group_count={self.feature_group_count} must divide the input's {in_features} channels"
            )
        return (*kernel_size_tuple(self.kernel_size), in_features // self.feature_group_count, features)

    def kwargs(self) -> dict:
        """:func:`causal_conv`'s keyword arguments (``None`` strides and dilation are flax's 1)."""
        padding = self.padding
        if not isinstance(padding, str):
            padding = tuple(canonicalize_padding(padding, self.ndim - 1))
        return dict(
            strides=1 if self.strides is None else self.strides,
            dilation=1 if self.kernel_dilation is None else self.kernel_dilation,
            padding=padding, padding_mode=self.padding_mode, spatial_padding_mode=self.spatial_padding_mode,
            feature_group_count=self.feature_group_count,
            precision=self.precision, implementation=self.implementation, interpret=self.interpret,
        )

    def _batch_shape(self, shape) -> tuple[int, ...]:
        """The batch dims of an input ``(*batch_dims, T, *spatial, C_in)``: none, one or several, as ``nn.Conv``."""
        n = len(shape) - self.ndim - 1
        if n < 0:
            raise ValueError(
                f"inputs must be (*batch_dims, T, *spatial, C_in) with {self.ndim} axes for the window "
                f"{kernel_size_tuple(self.kernel_size)} (time first), got shape {tuple(shape)}"
            )
        return tuple(shape[:n])

    def _flat(self, inputs, segment_ids):
        """``inputs`` as ``(N, T, *spatial, C_in)`` (batch dims flattened into ``N``), ids likewise."""
        batch = self._batch_shape(inputs.shape)
        x = inputs.reshape(-1, *inputs.shape[len(batch):])
        if segment_ids is not None:
            what = "the inputs' shape without their channels, (*batch_dims, T, *spatial)"
            segment_ids = as_segment_ids(segment_ids, tuple(inputs.shape[:-1]), what)
            segment_ids = segment_ids.reshape(-1, *segment_ids.shape[len(batch):])
        return batch, x, segment_ids

    def __call__(self, inputs, kernel, bias, segment_ids=None) -> jax.Array:
        """The full pass: ``(*batch_dims, floor((T - 1) / s_T) + 1, *out_spatial, C_out)`` in inputs' dtype,
        time split over ``context_parallel`` where the layer has one."""
        batch, x, ids = self._flat(inputs, segment_ids)
        conv = causal_conv if self.context_parallel is None else self.context_parallel.causal_conv
        y = conv(x, kernel, bias, segment_ids=ids, **self.kwargs())
        return y.reshape(*batch, *y.shape[1:])

    def stream(self, inputs, state: CausalConvState, kernel, bias, segment_ids=None):
        """One chunk ``(*batch_dims, L, *spatial, C_in)`` of a stream: ``(y_chunk, new_state)``.

        :func:`causal_conv_stream`'s rules: the first chunk any length, then multiples of
        ``s_T`` (a ``ValueError`` otherwise where ``state.started`` is concrete, a
        ``checkify`` error under ``jax.experimental.checkify.checkify`` where it is traced).
        """
        batch, x, ids = self._flat(inputs, segment_ids)
        y, state = causal_conv_stream(x, state, kernel, bias, segment_ids=ids, **self.kwargs())
        return y.reshape(*batch, *y.shape[1:]), state

    def from_state(self, inputs, state: CausalConvState | None, kernel, bias, segment_ids, return_final_state: bool):
        """The full pass given a state (``initial_state``) or asked for one (``return_final_state``):
        :meth:`stream` on the whole input, ``y`` or ``(y, final_state)``.

        A state is what a stream carries, so the pass is :func:`causal_conv_stream`'s: from
        ``None`` its outputs are the full pass's (bit for bit where ``docs/causal_conv.md``
        says the stream is), from a started state the input must be a multiple of ``s_T``
        frames. The state's batch is the flattened batch dims.
        """
        if self.context_parallel is not None:
            raise ValueError(
                "initial_state and return_final_state run the layer as a stream on one device, and context_parallel "
                "splits the full pass only: call the module without context_parallel for a pass with states"
            )
        y, state = self.stream(inputs, state, kernel, bias, segment_ids)
        return (y, state) if return_final_state else y

    def initial_state(self, input_shape, dtype, kernel_shape, kernel_dtype, segmented: bool) -> CausalConvState:
        """The cache before a stream of inputs shaped ``input_shape`` (any length ``T``) in ``dtype``.

        From :func:`causal_conv_stream_init`: shapes and dtypes only, nothing computed.
        ``segmented``: every chunk will come with ``segment_ids``.
        """
        batch = self._batch_shape(tuple(input_shape))
        frame = (math.prod(batch), *tuple(input_shape)[len(batch):])
        kw = {k: v for k, v in self.kwargs().items() if k not in ("precision", "implementation", "interpret")}
        return causal_conv_stream_init(
            jax.ShapeDtypeStruct(frame, dtype), jax.ShapeDtypeStruct(tuple(kernel_shape), kernel_dtype),
            segment_ids=jax.ShapeDtypeStruct(frame[:-1], "int32") if segmented else None, **kw,
        )
