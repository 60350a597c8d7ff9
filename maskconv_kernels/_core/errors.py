"""Errors in an op's words: ``causal_conv1d_update: x must be ...``.

Each public function builds one :class:`OpError` with its own name and hands it to the
checks it shares with other functions, so that a message names the function the user
called, not the one that happened to check.
"""
from __future__ import annotations

__all__ = ["OpError"]


class OpError:
    """Raises errors in an op's words: ``causal_conv: ...`` (or ``causal_conv_stream: ...``)."""

    def __init__(self, op: str):
        self.op = op

    def value(self, message: str) -> ValueError:
        return ValueError(f"{self.op}: {message}")

    def type(self, message: str) -> TypeError:
        return TypeError(f"{self.op}: {message}")

    def reworded(self, error: Exception) -> Exception:
        """A shared normaliser's error (it names the argument) with the op in front."""
        return type(error)(f"{self.op}: {error}")
