"""Float64 NumPy oracles of :func:`~maskconv_kernels.causal_conv1d` and
:func:`~maskconv_kernels.causal_conv1d_update`, written from causal-conv1d's own references
(``causal_conv1d_ref``, ``causal_conv1d_update_ref``) with segments and states added.
"""
from __future__ import annotations

import numpy as np

from .checks import check_activation
from .update import PAD_SLOT_ID

__all__ = ["causal_conv1d_reference", "causal_conv1d_update_reference"]


def causal_conv1d_reference(
    x, weight, bias=None, *, segment_ids=None, initial_state=None, return_final_state=False, activation=None,
    dilation=1,
):
    """Float64 NumPy oracle of :func:`causal_conv1d` (same arguments; outputs in float64).

    A loop over taps on padded arrays: tap ``t`` of position ``l`` reads position
    ``l - (W - 1 - t) * dilation`` where that is in the same document (the state counts
    as the first document's), else nothing.
    """
    check_activation(activation)
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


def causal_conv1d_update_reference(
    x, conv_state, weight, bias=None, *, activation=None, dilation=1, state_indices=None, cache_seqlens=None,
    has_initial_state=None,
):
    """Float64 NumPy oracle of :func:`causal_conv1d_update` (same arguments): ``(y, new_conv_state)`` in float64.

    Written from causal-conv1d's ``causal_conv1d_update_ref``, one row at a time: the
    row's window of inputs before ``x`` (the slot's last ``(W - 1) * dilation``, or in
    circular mode those at ``(cache_seqlens - k) % state_len``), the convolution over
    window and tokens, then the tokens written back. Padding rows give zeros and write
    nothing. Indices are assumed valid.
    """
    check_activation(activation)
    x = np.asarray(x, np.float64)
    one_token = x.ndim == 2
    x = x[:, None] if one_token else x
    weight = np.asarray(weight, np.float64)
    pool = np.array(conv_state, np.float64)
    batch, tokens, d = x.shape
    width = weight.shape[0]
    window, state_len = (width - 1) * dilation, pool.shape[1]
    slots = np.arange(batch) if state_indices is None else np.asarray(state_indices)
    y = np.zeros_like(x)
    for b, slot in enumerate(slots):
        if slot == PAD_SLOT_ID:
            continue
        row = pool[slot].copy()
        if has_initial_state is not None and not has_initial_state[b]:
            row[:] = 0.0
        if cache_seqlens is None:
            before = row[state_len - window :]
            row = np.concatenate([row, x[b]])[tokens:]
        else:
            n = int(cache_seqlens[b])
            before = row[[(n - window + j) % state_len for j in range(window)]]
            for t in range(tokens):
                row[(n + t) % state_len] = x[b, t]
        xe = np.concatenate([before, x[b]])
        for t in range(tokens):
            y[b, t] = sum(weight[k] * xe[t + k * dilation] for k in range(width))
        if bias is not None:
            y[b] += np.asarray(bias, np.float64)
        if activation is not None:
            y[b] = y[b] / (1 + np.exp(-y[b]))
        pool[slot] = row
    return (y[:, 0] if one_token else y), pool
