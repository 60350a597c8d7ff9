"""What a causal op reads before a chunk of a sequence: its last inputs, with their segment ids.

A causal convolution's output at ``p`` reads inputs back to ``p - F`` (``F = (W - 1) *
dilation``). Every way this library splits a sequence runs on the same idea: put the
``F`` inputs before the chunk (a state, a decode slot, a neighbour shard's halo, a
stream's last frames) in front of it, run the op on the whole, drop the outputs at the
history's own positions, and keep the last ``F`` inputs as the next chunk's history.
:class:`History` is that idea, written once for ``causal_conv1d`` (its initial state),
its decode step, ``causal_conv_stream`` and context parallelism; :class:`Ring` is the
circular slot of a decode cache, where input ``p`` lives at ``p % size``.

Layouts: the sequence axis is axis 1, the batch axis 0: inputs ``(B, F, ...)``, segment
ids ``(B, F, ...)`` without the channels.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .errors import OpError

__all__ = ["History", "Ring", "check_history", "check_dtype"]


@dataclasses.dataclass(frozen=True)
class History:
    """The inputs before a chunk, oldest first, and their segment ids (a pytree).

    Attributes:
      inputs: ``(B, F, ...)``.
      segment_ids: ``(B, F, ...)`` integers, or ``None`` for an op without segment ids.
        ``-1`` marks positions of no document (before a stream's start).
    """

    inputs: jax.Array
    segment_ids: jax.Array | None = None

    @property
    def length(self) -> int:
        return self.inputs.shape[1]

    @classmethod
    def of_first_document(cls, inputs: jax.Array, segment_ids: jax.Array | None) -> "History":
        """A state that belongs to each row's first document: its ids are ``segment_ids[:, :1]``'s."""
        if segment_ids is None:
            return cls(inputs)
        shape = (segment_ids.shape[0], inputs.shape[1], *segment_ids.shape[2:])
        return cls(inputs, jnp.broadcast_to(segment_ids[:, :1], shape))

    @classmethod
    def of_no_document(cls, inputs: jax.Array, segmented: bool) -> "History":
        """Inputs of no document (zeros before a start): ids ``-1`` where the op has ids."""
        if not segmented:
            return cls(inputs)
        return cls(inputs, jnp.full(inputs.shape[:-1], -1, jnp.int32))

    def extend(self, x: jax.Array, segment_ids: jax.Array | None = None):
        """``(inputs, segment_ids)`` of the history followed by the chunk ``x`` (and its ids)."""
        xe = jnp.concatenate([self.inputs, x], axis=1)
        if self.segment_ids is None:
            return xe, None
        return xe, jnp.concatenate([self.segment_ids.astype(segment_ids.dtype), segment_ids], axis=1)

    def outputs(self, y: jax.Array) -> jax.Array:
        """The outputs of the chunk: ``y`` of the extended sequence without the history's positions."""
        return y[:, self.length:]

    def after(self, extended: jax.Array, extended_ids: jax.Array | None = None) -> "History":
        """The next chunk's history: the last ``F`` positions of the extended sequence."""
        start = extended.shape[1] - self.length
        return History(extended[:, start:], None if extended_ids is None else extended_ids[:, start:])


@dataclasses.dataclass(frozen=True)
class Ring:
    """A circular slot of ``size`` positions along axis 1: input ``p`` lives at ``p % size``."""

    size: int

    def index(self, q: jax.Array) -> jax.Array:
        """The slot of position ``q >= 0`` (C's remainder: cheaper in a loop than Python's floor)."""
        return lax.rem(q, jnp.asarray(self.size, q.dtype))

    def positions(self, start: jax.Array, count: int, first: int = 0) -> jax.Array:
        """``(B, count)`` slots of positions ``start + first ... start + first + count - 1`` (``start``: ``(B,)``)."""
        return (start.astype(jnp.int32)[:, None] + jnp.arange(first, first + count)) % self.size

    def read(self, rows: jax.Array, end: jax.Array, count: int) -> jax.Array:
        """``(B, count, ...)``: the ``count`` inputs before position ``end`` of each row, oldest first."""
        return jnp.take_along_axis(rows, _trailing(self.positions(end, count, -count), rows), axis=1)

    def write(self, rows: jax.Array, start: jax.Array, x: jax.Array) -> jax.Array:
        """``rows`` with ``x (B, T, ...)`` written at positions ``start ...``; only the last ``size``
        tokens of a longer ``x`` (it overwrites its own first ones)."""
        tokens = x.shape[1]
        kept = min(tokens, self.size)
        at = self.positions(start, kept, tokens - kept)
        return jax.vmap(lambda row, at, values: row.at[at].set(values))(rows, at, x[:, tokens - kept:])


def _trailing(index: jax.Array, like: jax.Array) -> jax.Array:
    return index.reshape(index.shape + (1,) * (like.ndim - index.ndim))


def check_history(err: OpError, name: str, value, expected: tuple, formula: str, dtype, *, inputs: str = "x's",
                  hint: str = "") -> None:
    """``value`` has shape ``expected`` (``formula`` spells it: ``"(B, (W - 1) * dilation, D)"``) and
    the dtype of the inputs it holds (``inputs`` names them in the message: ``"x's"``)."""
    if tuple(value.shape) != tuple(expected):
        raise err.value(f"{name} must be {formula} = {tuple(expected)}, got {tuple(value.shape)}{hint}")
    check_dtype(err, name, value, dtype, inputs=inputs)


def check_dtype(err: OpError, name: str, value, dtype, *, inputs: str = "x's", hint: str = "") -> None:
    """A history (a state, a pool, a stream's frames) holds past inputs: it has their dtype."""
    if np.dtype(value.dtype) != np.dtype(dtype):
        raise err.type(f"{name} must have {inputs} dtype {np.dtype(dtype)}, got {np.dtype(value.dtype)}{hint}")


jax.tree_util.register_dataclass(History, data_fields=["inputs", "segment_ids"], meta_fields=[])
