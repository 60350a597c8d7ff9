"""Which parametrized cases run in the README's test command (the fast tier) and which in the slow tier.

The fast tier keeps a case of each kind; the slow tier (``.ci/run`` runs it after the fast
one) runs the rest, so no check is lost, only moved.
"""
from __future__ import annotations

from typing import Callable, Iterable

import pytest

__all__ = ["tiered"]


def tiered(values: Iterable, fast: Callable[[object], bool], *, spread: bool = False) -> list:
    """``values`` as parameters, those for which ``fast(value)`` is false marked slow.

    ``spread``: each value is a tuple of several arguments (``parametrize("a, b", ...)``).
    """
    def param(v, *marks):
        return pytest.param(*(v if spread else (v,)), marks=marks)

    return [param(v) if fast(v) else param(v, pytest.mark.slow) for v in values]
