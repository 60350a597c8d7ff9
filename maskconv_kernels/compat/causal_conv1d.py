"""Dao-AILab's ``causal_conv1d`` package in JAX: its names, its layouts, its return conventions.

Code that calls causal-conv1d ports by its import line::

    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update                    # PyTorch
    from maskconv_kernels.compat.causal_conv1d import causal_conv1d_fn, causal_conv1d_update  # JAX

and by taking the state the update returns, since a JAX array cannot be written in
place: ``out, conv_state = causal_conv1d_update(x, conv_state, weight, ...)``.

Layouts are causal-conv1d's, channels-first: ``x (batch, dim, seqlen)``, ``weight (dim,
width)``, states ``(batch, dim, width - 1)``, the pool ``(slots, dim, state_len)``. Each
call transposes into :func:`maskconv_kernels.causal_conv1d`'s channels-last problem and
back; the update transposes the rows' slots only, never the whole pool. The semantics are
causal-conv1d's (its ``causal_conv1d_ref``, ``causal_conv1d_update_ref`` and kernels):
a negative ``seq_idx`` is padding, whose outputs are zeros; a row whose
``conv_state_indices`` is -1 gets zeros and touches no slot; ``cache_seqlens`` makes each
slot a circular buffer. The library's contract holds through them: no output reads a
later position or (with ``seq_idx``) another document, selected rather than multiplied,
so a NaN in one document reaches no other and the gradient across documents is 0.0.

Where this differs from causal-conv1d, on purpose:

* :func:`causal_conv1d_update` returns ``(out, new_conv_state)``: ``conv_state`` is not
  written in place (under ``jax.jit(..., donate_argnums=1)`` XLA reuses its buffer).
* ``final_states_out`` cannot be written either: it is checked (its shape and dtype, and
  that ``return_final_states`` is set) and the states are returned in its place, as
  causal-conv1d returns ``(out, final_states_out)``.
* ``seq_idx`` with ``initial_states`` or ``return_final_states``, which causal-conv1d
  refuses, has :func:`maskconv_kernels.causal_conv1d`'s meaning: the initial state
  belongs to each row's first document, the final state is that of its last.
* Any width, any ``dim`` and any integer dtype for ``seq_idx``, ``cache_seqlens`` and
  ``conv_state_indices`` (causal-conv1d's kernels take widths 2 to 4 and int32).
* Derivatives are JAX's, of every order with ``implementation="xla"``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .._core.args import as_operand, as_segment_ids
from .._core.errors import OpError
from .._core.history import check_dtype, check_history
from ..ops.causal_conv1d import api as _api
from ..ops.causal_conv1d import update as _update

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]


def causal_conv1d_fn(
    x: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    seq_idx: jax.typing.ArrayLike | None = None,
    initial_states: jax.typing.ArrayLike | None = None,
    return_final_states: bool = False,
    final_states_out: jax.typing.ArrayLike | None = None,
    activation: str | None = None,
    *,
    implementation: str | None = None,
    interpret: bool = False,
):
    """causal-conv1d's ``causal_conv1d_fn``: ``out[b, d, l] = act(bias[d] + sum_w weight[d, w] * x[b, d, l - (width - 1) + w])``.

    Args:
      x: ``(batch, dim, seqlen)``; float32, bfloat16 or float16.
      weight: ``(dim, width)``; may be wider than x (float32 weights, bfloat16 x):
        products in the wider dtype, accumulated in float32.
      bias: ``(dim,)`` or ``None``.
      seq_idx: ``(batch, seqlen)`` integers or ``None``: packed documents. A tap reads
        position ``q`` for output ``l`` only where ``seq_idx[q] == seq_idx[l]``; negative
        ids are padding, whose outputs are zeros.
      initial_states: ``(batch, dim, width - 1)`` in x's dtype: the inputs before
        ``x[..., 0]`` (zeros when ``None``).
      return_final_states: also return the last ``width - 1`` inputs of
        ``initial_states ++ x`` (zeros before the first if ``seqlen`` is shorter),
        ``(batch, dim, width - 1)`` in x's dtype.
      final_states_out: ``None``, or an array of that shape and dtype, with
        ``return_final_states=True``: where causal-conv1d writes the states. JAX arrays
        are immutable, so it is checked and left as it is; the states are returned.
      activation: ``None``, ``"silu"`` or ``"swish"`` (the same).
      implementation, interpret: as in :func:`maskconv_kernels.causal_conv1d`.

    Returns:
      ``out (batch, dim, seqlen)`` in x's dtype, or ``(out, final_states)``.
    """
    x, weight = as_operand("x", x), as_operand("weight", weight)
    if x.ndim != 3:
        raise ValueError(
            f"causal_conv1d_fn: x must be (batch, dim, seqlen), channels-first as causal-conv1d takes it, got "
            f"shape {tuple(x.shape)}" + (": x needs a batch axis, x[None] gives one" if x.ndim == 2 else "")
        )
    batch, dim, seqlen = (int(n) for n in x.shape)
    width = _check_weight("causal_conv1d_fn", weight, x.shape)
    if seq_idx is not None:
        seq_idx = as_segment_ids(seq_idx, (batch, seqlen), "(batch, seqlen), x's shape without dim", "seq_idx")
    states = (batch, dim, width - 1)
    if initial_states is not None:
        initial_states = _check_states("causal_conv1d_fn", "initial_states", initial_states, states, x.dtype)
    if final_states_out is not None:
        if not return_final_states:
            raise ValueError(
                "causal_conv1d_fn: final_states_out is where the final states go with return_final_states=True "
                "(causal-conv1d ignores it otherwise): pass return_final_states=True, or drop final_states_out"
            )
        _check_states("causal_conv1d_fn", "final_states_out", final_states_out, states, x.dtype)
    result = _api.causal_conv1d(
        _swap(x), weight.T, bias, segment_ids=seq_idx,
        initial_state=None if initial_states is None else _swap(initial_states),
        return_final_state=bool(return_final_states), activation=activation,
        implementation=implementation, interpret=interpret,
    )
    if not return_final_states:
        return _swap(result)
    out, final_states = result
    return _swap(out), _swap(final_states)


def causal_conv1d_update(
    x: jax.typing.ArrayLike,
    conv_state: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    activation: str | None = None,
    cache_seqlens: jax.typing.ArrayLike | None = None,
    conv_state_indices: jax.typing.ArrayLike | None = None,
    *,
    implementation: str | None = None,
    interpret: bool = False,
):
    """causal-conv1d's ``causal_conv1d_update``, returning the new state: ``(out, new_conv_state)``.

    Row ``b`` continues the sequence its slot of ``conv_state`` holds: its outputs are
    those :func:`causal_conv1d_fn` gives for ``x[b]`` after the slot's last ``width - 1``
    inputs, and the slot then holds the last ``state_len`` inputs.

    Args:
      x: ``(batch, dim)`` (one token) or ``(batch, dim, seqlen)``; float32, bfloat16 or float16.
      conv_state: ``(slots, dim, state_len)`` in x's dtype, ``state_len >= width - 1``;
        ``slots == batch`` without ``conv_state_indices``. Linear (``cache_seqlens=None``):
        a slot holds its sequence's last ``state_len`` inputs, oldest first.
      weight, bias, activation: as in :func:`causal_conv1d_fn`.
      cache_seqlens: ``(batch,)`` non-negative integers or ``None``: the slots are circular
        buffers; row ``b`` had ``cache_seqlens[b]`` inputs before ``x``, its window is read
        at ``(cache_seqlens - (width - 1) ... cache_seqlens - 1) % state_len`` and its tokens
        are written from ``cache_seqlens % state_len`` on. The caller advances it.
      conv_state_indices: ``(batch,)`` signed integers or ``None``: row ``b``'s slot
        (continuous batching); -1 marks a row without a request, whose outputs are zeros
        and which reads and writes no slot. Concrete indices are checked; traced ones as
        in :func:`maskconv_kernels.causal_conv1d_update`.
      implementation, interpret: as in :func:`maskconv_kernels.causal_conv1d`.

    Returns:
      ``out`` shaped like ``x`` in x's dtype, and the new pool, shaped like ``conv_state``.
    """
    x, weight = as_operand("x", x), as_operand("weight", weight)
    conv_state = as_operand("conv_state", conv_state)
    if x.ndim not in (2, 3):
        raise ValueError(
            "causal_conv1d_update: x must be (batch, dim) for one token or (batch, dim, seqlen), channels-first as "
            f"causal-conv1d takes it, got shape {tuple(x.shape)}"
        )
    one_token = x.ndim == 2
    xt = x[..., None] if one_token else x
    batch, dim = (int(n) for n in xt.shape[:2])
    width = _check_weight("causal_conv1d_update", weight, xt.shape)
    shape = tuple(conv_state.shape)
    if len(shape) != 3 or shape[1] != dim or shape[2] < width - 1:
        raise ValueError(
            f"causal_conv1d_update: conv_state must be (slots, dim, state_len) with dim = {dim} and state_len >= "
            f"width - 1 = {width - 1}, got {shape}"
        )
    if conv_state_indices is None and shape[0] != batch:
        raise ValueError(
            f"causal_conv1d_update: conv_state has {shape[0]} slots but x has {batch} rows: without "
            "conv_state_indices row b uses slot b; pass conv_state_indices (batch,) to choose each row's slot"
        )
    check_dtype(OpError("causal_conv1d_update"), "conv_state", conv_state, x.dtype)
    indices = None
    rows = conv_state
    if conv_state_indices is not None:
        indices = _update.check_state_indices(conv_state_indices, batch, shape[0], name="conv_state_indices")
        rows = _update.read_slots(conv_state, indices)
    out, new_rows = _update.causal_conv1d_update(
        _swap(xt), _swap(rows), weight.T, bias, activation=activation, cache_seqlens=cache_seqlens,
        implementation=implementation, interpret=interpret,
    )
    out, new_rows = _swap(out), _swap(new_rows)
    if indices is None:
        new_state = new_rows
    else:
        out = _update.zero_padding_rows(out, indices)
        new_state = _update.write_slots(conv_state, indices, new_rows)
    return (out[..., 0] if one_token else out), new_state


def _swap(a: jax.Array) -> jax.Array:
    """``(batch, dim, length)`` <-> ``(batch, length, dim)``: causal-conv1d's layout <-> this library's."""
    return jnp.swapaxes(a, 1, 2)


def _check_weight(fn: str, weight, x_shape) -> int:
    """``weight (dim, width)`` for ``x (batch, dim, seqlen)``; returns ``width``."""
    dim = int(x_shape[1])
    if weight.ndim == 2 and weight.shape[0] == dim and weight.shape[1] >= 1:
        return int(weight.shape[1])
    hint = ""
    if weight.ndim == 2 and weight.shape[1] == dim:
        hint = " (maskconv_kernels.causal_conv1d's (width, dim) weight: pass weight.T)"
    elif weight.ndim == 2 and len(x_shape) == 3 and weight.shape[0] == x_shape[2]:
        hint = (
            " (x looks channels-last, (batch, seqlen, dim): causal-conv1d's x is (batch, dim, seqlen); transpose "
            "it, or call maskconv_kernels.causal_conv1d, which takes channels-last x)"
        )
    raise ValueError(
        f"{fn}: weight must be (dim, width) = ({dim}, width >= 1) to match x of shape {tuple(x_shape)} read as "
        f"(batch, dim, seqlen), got {tuple(weight.shape)}{hint}"
    )


def _check_states(fn: str, name: str, states, expected: tuple[int, ...], dtype) -> jax.Array:
    """A ``(batch, dim, width - 1)`` state in x's dtype."""
    states = as_operand(name, states)
    check_history(OpError(fn), name, states, expected, "(batch, dim, width - 1)", dtype)
    return states
