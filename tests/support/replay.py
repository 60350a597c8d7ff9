"""Sampling of other projects' test grids, replayed against ours (lax's, Flax's, Equinox's).

Those suites enumerate products of parameters, thousands of cases each; JAX itself runs
a sample of each grid (``JAX_NUM_GENERATED_CASES``, 10 by default). So do we, from a
shuffle fixed by the grid's name: ``fast`` cases in the README's command, ``slow`` more
in the slow tier. ``MASKCONV_REPLAY=all`` (or a number of cases per grid) replaces
``slow``: a full replay, for the counts issue 20 asked for.
"""
from __future__ import annotations

import os
import random

import pytest


def tiers(name: str, grid: list, ids, fast: int = 1, slow: int = 4) -> list:
    """``pytest.param``s of a fixed shuffle of ``grid``: ``fast`` unmarked, then ``slow`` (or
    ``MASKCONV_REPLAY``) marked slow. ``ids``: a case's readable id."""
    order = random.Random(name).sample(range(len(grid)), len(grid))
    more = os.environ.get("MASKCONV_REPLAY", str(slow))
    order = order[: len(grid) if more == "all" else fast + int(more)]
    return [
        pytest.param(grid[i], id=ids(grid[i]), marks=() if rank < fast else pytest.mark.slow)
        for rank, i in enumerate(order)
    ]
