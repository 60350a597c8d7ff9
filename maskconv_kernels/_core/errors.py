"""Errors in an op's words: ``causal_conv1d_update: x must be ...``.

Each public function builds one :class:`OpError` with its own name and hands it to the
checks it shares with other functions, so that a message names the function the user
called, not the one that happened to check.

Some arguments are data a jitted function sees only as tracers (a slot index, a
stream's state, request offsets): :meth:`OpError.check` raises for them when they are
concrete, and when traced leaves a ``jax.experimental.checkify`` check that reports the
same message under ``checkify.checkify`` and compiles to nothing without it.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = ["OpError"]


class OpError:
    """Raises errors in an op's words: ``causal_conv: ...`` (or ``causal_conv_stream: ...``)."""

    def __init__(self, op: str):
        self.op = op

    def value(self, message: str) -> ValueError:
        return ValueError(f"{self.op}: {message}")

    def type(self, message: str) -> TypeError:
        return TypeError(f"{self.op}: {message}")

    def check(self, ok, message: str, **values) -> None:
        """Requires every element of ``ok`` (bools, any shape) to be true.

        Concrete ``ok``: a ``ValueError`` with ``message`` formatted by ``values`` (arrays,
        written as NumPy writes them). Traced ``ok`` (under ``jit``, ``vmap``, ``scan``):
        ``checkify.debug_check``, so that a function wrapped in ``checkify.checkify``
        returns an error with the same message (and `` (`check` failed)`` after it); without
        ``checkify`` nothing is checked and nothing is computed for it. ``message`` is a
        ``str.format`` pattern over ``values``' names, its literal braces doubled.
        """
        if isinstance(ok, jax.core.Tracer) or any(isinstance(v, jax.core.Tracer) for v in values.values()):
            checkify.debug_check(jnp.all(ok), f"{self.op}: {message}", **{k: jnp.asarray(v) for k, v in values.items()})
        elif not np.all(np.asarray(ok)):
            raise self.value(message.format(**{k: np.asarray(v) for k, v in values.items()}))

    @contextlib.contextmanager
    def words(self):
        """Inside it, a shared normaliser's ``TypeError`` or ``ValueError`` (whose message names
        the argument) is raised again with the op in front, unless it already names the op."""
        try:
            yield
        except (TypeError, ValueError) as error:
            if str(error).startswith(self.op):
                raise
            raise self.reworded(error) from None

    def reworded(self, error: Exception) -> Exception:
        """A shared normaliser's error (it names the argument) with the op in front."""
        return type(error)(f"{self.op}: {error}")
