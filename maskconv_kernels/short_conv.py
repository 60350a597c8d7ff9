"""Short causal convolutions of sequence models, in the field's terms: :func:`causal_conv1d`.

Mamba / Mamba-2, gated DeltaNet, Hyena, LFM2 and RWKV-style token shifts run a
depthwise causal 1-D convolution of width 2 to 4 over ``(B, L, D)`` activations, trained
on packed documents (``segment_ids``) and served from a state of the last inputs. This
is Dao-AILab's ``causal_conv1d_fn`` (``seq_idx``, ``initial_states``,
``return_final_states``, bias and SiLU) channels-last in JAX, built on
:func:`maskconv_kernels.masked_conv` (``feature_group_count=D``, ``padding="CAUSAL"``),
so it inherits its contract: a position never reads a later one, nor (with
``segment_ids``) one of another document: selected, never multiplied, so the gradient
across documents is exactly 0.0 and a NaN in one document changes no other's output.
Its derivatives, of every order, are those of ``masked_conv``'s three maps.

:func:`causal_conv1d_reference` is the float64 NumPy oracle, written from
causal-conv1d's math (its ``causal_conv1d_ref``) with segments and states added.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .api import masked_conv
from .spec import as_operand, as_segment_ids

__all__ = ["causal_conv1d", "causal_conv1d_reference", "ACTIVATIONS"]

# causal-conv1d's names: "swish" is SiLU's other name.
ACTIVATIONS = (None, "silu", "swish")


def _check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish' (the same), got {activation!r}")


def _check_operands(x, weight, bias, dilation):
    """The shapes shared by the full convolution and the decode step; returns ``(W, D, state length)``."""
    if x.ndim != 3:
        raise ValueError(f"x must be (B, L, D), got shape {tuple(x.shape)}")
    d = x.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != d:
        raise ValueError(
            f"weight must be (W, D) = (width, {d}) to match x of shape {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError(f"weight needs a width of at least 1, got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (d,):
        raise ValueError(f"bias must be (D,) = ({d},), got {tuple(bias.shape)}")
    if isinstance(dilation, bool) or not isinstance(dilation, (int, np.integer)) or dilation < 1:
        raise ValueError(f"dilation must be a positive int, got {dilation!r}")
    width = int(weight.shape[0])
    return width, d, (width - 1) * int(dilation)


def _check_state(name: str, state, batch: int, state_len: int, d: int, dtype) -> None:
    expected = (batch, state_len, d)
    if tuple(state.shape) != expected:
        raise ValueError(
            f"{name} must be (B, (W - 1) * dilation, D) = {expected}, got {tuple(state.shape)}"
        )
    if np.dtype(state.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have x's dtype {np.dtype(dtype)}, got {np.dtype(state.dtype)}")


def causal_conv1d(
    x: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    segment_ids: jax.typing.ArrayLike | None = None,
    initial_state: jax.typing.ArrayLike | None = None,
    return_final_state: bool = False,
    activation: str | None = None,
    dilation: int = 1,
    implementation: str | None = None,
    interpret: bool = False,
    config=None,
):
    """Depthwise causal 1-D convolution: ``y[b, l, d] = act(bias[d] + sum_t weight[t, d] * x[b, l - (W-1-t) * dilation, d])``.

    Args:
      x: ``(B, L, D)``, float32, bfloat16 or float16.
      weight: ``(W, D)``; its dtype may be wider than x's (Mamba keeps float32 weights
        for bfloat16 activations).
      bias: ``(D,)`` or ``None``.
      segment_ids: ``(B, L)`` integers or ``None``: packed documents. No tap crosses a
        document boundary; negative ids mark padding, whose outputs are zero and which
        receives no gradient.
      initial_state: ``(B, (W - 1) * dilation, D)`` in x's dtype, the inputs before
        ``x[:, 0]`` (zeros when ``None``); differentiable. With ``segment_ids`` it belongs
        to each row's first document.
      return_final_state: also return the state after ``x``: its last ``(W - 1) *
        dilation`` inputs (the initial state's too, if ``x`` is shorter), in x's dtype;
        with ``segment_ids``, those of each row's last document (zeros before its start
        and in an all-padding row).
      activation: ``None`` or ``"silu"`` (``"swish"``).
      dilation: the taps' spacing.
      implementation: as in :func:`masked_conv` (``None``: chosen per platform), except
        ``"pallas_triton"``: the fused kernels of :mod:`maskconv_kernels.short_conv_kernels`
        (bias, SiLU and selects in the convolution's one pass; NVIDIA GPUs, or any platform
        with ``interpret=True``). Differentiable once, in reverse mode (a
        ``jax.custom_vjp``): ``jax.jvp`` and second derivatives raise there.
      interpret: run a kernel implementation in its interpreter (any platform, slowly).
      config: the implementation's config (``short_conv_kernels.BlockSizes`` for
        ``"pallas_triton"``), or ``None`` for its default.

    Returns:
      ``y``: ``(B, L, D)`` in x's dtype, accumulated in float32 (bias and activation
      applied in float32, rounded once), or ``(y, final_state)``.
    """
    _check_activation(activation)
    x, weight = as_operand("x", x), as_operand("weight", weight)
    bias = None if bias is None else as_operand("bias", bias)
    width, d, state_len = _check_operands(x, weight, bias, dilation)
    batch, length = x.shape[:2]
    ids = None if segment_ids is None else as_segment_ids(segment_ids, x.shape)
    xe, ide = x, ids
    if initial_state is not None:
        initial_state = as_operand("initial_state", initial_state)
        _check_state("initial_state", initial_state, batch, state_len, d, x.dtype)
    if implementation == "pallas_triton":
        return _fused(x, weight, bias, ids, initial_state, return_final_state, activation, dilation, config, interpret)
    if initial_state is not None:
        # The state is the input before position 0, of the row's first document; the
        # outputs at the state's own positions are dropped.
        xe = jnp.concatenate([initial_state, x], axis=1)
        if ids is not None:
            ide = jnp.concatenate([jnp.broadcast_to(ids[:, :1], (batch, state_len)), ids], axis=1)
    acc = jnp.promote_types(jnp.float32, jnp.promote_types(x.dtype, weight.dtype))
    y = masked_conv(
        xe, weight[:, None, :], np.ones(width, bool), padding="CAUSAL", dilation=dilation, feature_group_count=d,
        preferred_element_type=acc, implementation=implementation, segment_ids=ide, interpret=interpret,
        config=config,
    )[:, xe.shape[1] - length :]
    if bias is not None:
        y = y + bias.astype(acc)
    if activation is not None:
        y = jax.nn.silu(y)
    if ids is not None:
        y = jnp.where((ids >= 0)[..., None], y, jnp.zeros((), y.dtype))  # bias and activation included
    y = y.astype(x.dtype)
    if not return_final_state:
        return y
    return y, _final_state(xe, ide, state_len)


def _fused(x, weight, bias, ids, initial_state, return_final_state, activation, dilation, config, interpret):
    """The ``"pallas_triton"`` path: the fused kernels, and the final state by gathers."""
    from . import short_conv_kernels  # Pallas: imported when this path runs

    y = short_conv_kernels.causal_conv1d_fused(
        x, weight, bias, ids, initial_state, activation=activation, dilation=dilation, config=config,
        interpret=interpret,
    )
    if not return_final_state:
        return y
    return y, short_conv_kernels.final_state(x, initial_state, ids, (weight.shape[0] - 1) * dilation)


def _final_state(xe, ids, state_len: int):
    """The last ``state_len`` inputs of ``xe`` ``(B, T, D)``; with ``ids``, of each row's last document."""
    batch, total, d = xe.shape
    if state_len == 0:
        return jnp.zeros((batch, 0, d), xe.dtype)
    if ids is None:
        tail = xe[:, max(total - state_len, 0) :]
        return jnp.pad(tail, ((0, 0), (state_len - tail.shape[1], 0), (0, 0)))
    positions = jnp.arange(total)
    end = jnp.max(jnp.where(ids >= 0, positions, -1), axis=1)  # last non-padding position, -1 if none
    last_id = jnp.take_along_axis(ids, jnp.maximum(end, 0)[:, None], axis=1)
    index = end[:, None] - state_len + 1 + jnp.arange(state_len)  # (B, state_len)
    safe = jnp.clip(index, 0, total - 1)
    keep = (index >= 0) & (end[:, None] >= 0) & (jnp.take_along_axis(ids, safe, axis=1) == last_id)
    values = jnp.take_along_axis(xe, safe[..., None], axis=1)
    return jnp.where(keep[..., None], values, jnp.zeros((), xe.dtype))


def causal_conv1d_reference(
    x, weight, bias=None, *, segment_ids=None, initial_state=None, return_final_state=False, activation=None,
    dilation=1,
):
    """Float64 NumPy oracle of :func:`causal_conv1d` (same arguments; outputs in float64).

    A loop over taps on padded arrays: tap ``t`` of position ``l`` reads position
    ``l - (W - 1 - t) * dilation`` where that is in the same document (the state counts
    as the first document's), else nothing.
    """
    _check_activation(activation)
    x = np.asarray(x, np.float64)
    weight = np.asarray(weight, np.float64)
    batch, length, d = x.shape
    width = weight.shape[0]
    state_len = (width - 1) * dilation
    state = np.zeros((batch, state_len, d)) if initial_state is None else np.asarray(initial_state, np.float64)
    xe = np.concatenate([state, x], axis=1)
    ids = np.zeros((batch, length), np.int64) if segment_ids is None else np.asarray(segment_ids, np.int64)
    # Zeros before the state belong to no document; the state to the first position's.
    ide = np.concatenate([np.broadcast_to(ids[:, :1], (batch, state_len)), ids], axis=1)
    if initial_state is None:
        ide[:, :state_len] = np.iinfo(np.int64).min
    y = np.zeros((batch, length, d))
    for t in range(width):
        back = (width - 1 - t) * dilation
        source = slice(state_len - back, state_len - back + length)
        same = (ide[:, source] == ids) & (ids >= 0)
        y += np.where(same[..., None], xe[:, source] * weight[t], 0.0)
    if bias is not None:
        y += np.asarray(bias, np.float64)
    if activation is not None:
        y = y / (1 + np.exp(-y))
    y = np.where((ids >= 0)[..., None], y, 0.0)
    if not return_final_state:
        return y
    if segment_ids is None:
        return y, xe[:, xe.shape[1] - state_len :]
    final = np.zeros((batch, state_len, d))
    for b in range(batch):
        kept = np.flatnonzero(ide[b] >= 0)
        if kept.size:
            end = kept[-1]
            for j in range(state_len):
                q = end - state_len + 1 + j
                if q >= 0 and ide[b, q] == ide[b, end]:
                    final[b, j] = xe[b, q]
    return y, final
