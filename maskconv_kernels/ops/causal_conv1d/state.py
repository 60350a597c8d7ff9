"""The state a causal convolution leaves after a sequence: its last ``(W - 1) * dilation`` inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["final_state"]


def final_state(x: jax.Array, initial_state: jax.Array | None, segment_ids: jax.Array | None, state_len: int):
    """The last ``state_len`` inputs of the sequence ``initial_state ++ x`` (zeros for a missing state).

    With ``segment_ids``, those of each row's last document: zeros before its start, and in
    an all-padding row (the state belongs to the row's first document). Gathers of
    ``state_len`` positions a row: ``x`` is not copied.

    Shapes: ``x (B, L, D)``, ``initial_state (B, state_len, D)`` or ``None``,
    ``segment_ids (B, L)`` or ``None``; returns ``(B, state_len, D)`` in x's dtype.
    """
    batch, length, d = x.shape
    if state_len == 0:
        return jnp.zeros((batch, 0, d), x.dtype)
    state = jnp.zeros((batch, state_len, d), x.dtype) if initial_state is None else initial_state
    # Positions of the extended sequence: e in [0, state_len) is the state, e - state_len of x after.
    if segment_ids is None:
        end = jnp.full((batch,), state_len + length - 1)
        keep_doc = lambda index: jnp.ones(index.shape, bool)  # noqa: E731
    else:
        ids = segment_ids
        last = jnp.max(jnp.where(ids >= 0, jnp.arange(length), -1), axis=1)  # -1: an all-padding row
        end = jnp.where(last >= 0, last + state_len, -1)
        last_id = jnp.take_along_axis(ids, jnp.maximum(last, 0)[:, None], axis=1)

        def keep_doc(index):
            doc = jnp.take_along_axis(ids, jnp.clip(index - state_len, 0, length - 1), axis=1)
            return (doc == last_id) & (end[:, None] >= 0)

    index = end[:, None] - state_len + 1 + jnp.arange(state_len)  # (B, state_len)
    from_state = jnp.take_along_axis(state, jnp.clip(index, 0, state_len - 1)[..., None], axis=1)
    if length:
        from_x = jnp.take_along_axis(x, jnp.clip(index - state_len, 0, length - 1)[..., None], axis=1)
        values = jnp.where((index >= state_len)[..., None], from_x, from_state)
    else:
        values = from_state
    keep = (index >= 0) & keep_doc(index)
    return jnp.where(keep[..., None], values, jnp.zeros((), x.dtype))
