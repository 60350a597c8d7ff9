"""The causal order: each unit's rank, which inputs each output must not see, and which outputs to audit.

An order ranks the units (raster order over the position axes, or a given permutation;
sub-pixels after their pixel); an output may see the inputs ranked before it (and itself
with ``include_current``), or whatever a ``visible(p, q)`` predicate allows. The audited
outputs are all of them up to :data:`DEFAULT_MAX_POSITIONS`, else a stated sample.

Whether an output may read its own position depends on what the model is, not on its
shapes: a PixelCNN's logits at ``p`` predict ``x_p`` (they must not read it), while a
causal layer, causal attention or a next-token model reads its current position.
:func:`learn_include_current` reads that from the ops of this library in the model's
jaxpr, where it is unambiguous (:func:`resolve_include_current` says which).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from .units import Layout, unit_indices

__all__ = ["rank_units", "describe_rule", "resolve_include_current", "learn_include_current", "equations",
           "Forbidden", "sample_units", "name_of", "DEFAULT_MAX_POSITIONS", "DEFAULT_SAMPLE"]

# By default every output is audited up to this many (a 32x32 image: 18-20 s for an
# 8-layer, 64-channel PixelCNN on 2 loaded AMD EPYC cores), else a sample of DEFAULT_SAMPLE.
DEFAULT_MAX_POSITIONS = 1024
DEFAULT_SAMPLE = 256


def rank_units(order, layout: Layout, visible) -> np.ndarray:
    """int64 ``(U,)``: each unit's place in the order (raster when a predicate is given)."""
    n_pos = int(np.prod(layout.positions))
    if visible is not None or (isinstance(order, str) and order == "raster"):
        pos_rank = np.arange(n_pos)
    elif isinstance(order, str):
        raise ValueError(f'order must be "raster" or an int array of shape {layout.positions}, got {order!r}')
    else:
        pos_rank = np.asarray(order)
        if pos_rank.shape != layout.positions or not np.issubdtype(pos_rank.dtype, np.integer):
            raise ValueError(f"order must be an int array of shape {layout.positions} (each position's rank), "
                             f"got {pos_rank.dtype} {pos_rank.shape}")
        pos_rank = pos_rank.reshape(-1).astype(np.int64)
        if len(np.unique(pos_rank)) != n_pos:
            raise ValueError("order must give every position a distinct rank (a permutation)")
    return (pos_rank[:, None] * layout.groups + np.arange(layout.groups)).reshape(-1)


def describe_rule(order, visible, include_current: bool, layout: Layout, source: str = "") -> str:
    """The rule in words; ``source`` says where ``include_current`` came from (given, learned, the default)."""
    if visible is not None:
        return f"output p sees input q iff {name_of(visible)}(p, q)"
    what = "raster order" if isinstance(order, str) else "the given order"
    sub = f", {layout.groups} sub-pixels after each position" if layout.groups > 1 else ""
    sees = "strictly before p and p itself" if include_current else "strictly before p"
    return f"{what}{sub}: output p sees inputs {sees} (include_current={include_current}, {source or 'given'})"


# Primitives of this library's ops, as they appear in a model's jaxpr; causal_conv runs
# masked_conv (every tap active) under a name scope of its own (ops.causal_conv.api.SCOPE).
_MASKED_CONV = ("masked_conv", "masked_conv_unpartitioned")  # the forward map, both flavours
_CAUSAL_CONV1D = "causal_conv1d_"
_CAUSAL_CONV_SCOPE = re.compile(r"(^|[/(])causal_conv([)/]|$)")


def equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations (jit, scan, cond, custom rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def learn_include_current(jaxpr) -> tuple[bool, str]:
    """Whether output ``p`` may read input ``p``, from the ops of this library that ``jaxpr`` calls.

    A ``masked_conv`` with a masked tap makes it a masked (PixelCNN-style) model, whose
    outputs at ``p`` predict ``x_p``: ``False``, whatever else it calls, so a type-B mask
    where type A belongs is still caught. Otherwise ``causal_conv1d`` or ``causal_conv``
    (its ``masked_conv`` with every tap active, under the ``causal_conv`` name scope)
    make it a causal model, which reads its current position: ``True``. With neither,
    ``False``, the stricter rule, so an unknown model is never let off: a plain unmasked
    ``masked_conv`` proves nothing (a PixelCNN++-style shifted convolution is one, and
    its missing shift must be caught); the report names ``include_current=True`` when
    the current position is all that fails. Read from the jaxpr, the model is traced once
    (as ``jax.eval_shape`` would) and nothing runs; jitted functions, ``scan`` bodies and
    Flax or Equinox modules are read through.

    Returns:
      ``(include_current, why)``, ``why`` in words for the report's rule line.
    """
    masked = causal = False
    called = []
    for eqn in equations(jaxpr):
        name = eqn.primitive.name
        if name in _MASKED_CONV:
            bits = getattr(getattr(getattr(eqn.params.get("call"), "problem", None), "mask", None), "bits", None)
            if bits is None:
                continue
            if not np.all(bits):
                masked = True
            elif _CAUSAL_CONV_SCOPE.search(str(getattr(eqn.source_info, "name_stack", ""))):
                causal = True
                _add(called, "causal_conv")
        elif name.startswith(_CAUSAL_CONV1D):
            causal = True
            _add(called, "causal_conv1d")
    if masked:
        return False, ("learned from the model, which calls masked_conv with masked taps: the PixelCNN rule, "
                       "its outputs at p predict x_p")
    if causal:
        return True, f"learned from the model, which calls {' and '.join(called)}: a causal layer reads position p"
    return False, "the default: the model calls no op of this library to learn from"


def resolve_include_current(include_current, visible, jaxpr) -> tuple[bool | None, str]:
    """``include_current`` as given, or learned from ``jaxpr`` when ``None``; and where it came from.

    ``None`` with a ``visible`` predicate: the predicate is the whole rule.
    """
    if include_current is not None and not isinstance(include_current, (bool, np.bool_)):
        raise TypeError("include_current must be True, False or None (learned from the model), "
                        f"got {include_current!r}")
    if visible is not None:
        if include_current is not None:
            raise ValueError("visible replaces order and include_current: pass either a predicate or an order "
                             "(with include_current), not both")
        return None, "the predicate"
    if include_current is None:
        return learn_include_current(jaxpr)
    return bool(include_current), "given"


def _add(items: list, item: str) -> None:
    if item not in items:
        items.append(item)


@dataclasses.dataclass(frozen=True, eq=False)
class Forbidden:
    """Rows of the forbidden matrix: ``rows(s)[i, q]`` is True when output ``s[i]`` must not see input ``q``."""

    layout: Layout
    ranks: np.ndarray
    visible: Callable | None
    include_current: bool

    def rows(self, units: np.ndarray) -> np.ndarray:
        if self.visible is None:
            r_out = self.ranks[units][:, None]
            return self.ranks[None, :] > r_out if self.include_current else self.ranks[None, :] >= r_out
        idx = unit_indices(self.layout)
        seen = np.asarray(self.visible(idx[units][:, None, :], idx[None, :, :]), bool)
        return ~np.broadcast_to(seen, (len(units), len(idx)))


def sample_units(positions, layout: Layout, ranks: np.ndarray, seed: int) -> tuple[np.ndarray, str]:
    """Audited output units in the order, and the sentence saying how they were chosen."""
    n = layout.n_units
    by_rank = np.argsort(ranks, kind="stable")
    what = "output positions" if layout.groups == 1 else f"output units (positions x {layout.groups} sub-pixels)"
    if positions is None:
        positions = "all" if n <= DEFAULT_MAX_POSITIONS else DEFAULT_SAMPLE
    if isinstance(positions, str):
        if positions != "all":
            raise ValueError(f'positions must be None, "all", an int or a list of output indices, got {positions!r}')
        return by_rank, f"all {n} {what}"
    if isinstance(positions, (int, np.integer)):
        k = int(positions)
        if k < 1:
            raise ValueError(f"positions={k}: a sample needs at least one output")
        if k >= n:
            return by_rank, f"all {n} {what}"
        spaced = np.unique(np.round(np.linspace(0, n - 1, (k + 1) // 2)).astype(int))
        rest = np.setdiff1d(np.arange(n), spaced)
        extra = np.random.default_rng(seed).choice(rest, k - len(spaced), replace=False)
        chosen = by_rank[np.sort(np.concatenate([spaced, extra]))]
        return chosen, (f"a sample of {k} of {n} {what} ({len(spaced)} evenly spaced in the order, "
                        f"including the first and last, and {k - len(spaced)} uniform, seed {seed})")
    units = []
    for index in positions:
        index = tuple(int(i) for i in np.atleast_1d(index))
        d = len(layout.positions) + (layout.groups > 1)
        if len(index) != d or any(not 0 <= i < s for i, s in
                                  zip(index, layout.positions + ((layout.groups,) if layout.groups > 1 else ()))):
            raise ValueError(f"output index {index} is not an index into positions {layout.positions}"
                             + (f" x {layout.groups} sub-pixels" if layout.groups > 1 else ""))
        pos = int(np.ravel_multi_index(index[: len(layout.positions)], layout.positions))
        units.append(pos * layout.groups + (index[-1] if layout.groups > 1 else 0))
    units = np.unique(np.asarray(units, np.int64))
    if not len(units):
        raise ValueError("positions is empty: name at least one output index")
    units = units[np.argsort(ranks[units], kind="stable")]
    return units, f"{len(units)} given {what} of {n}"


def name_of(f) -> str:
    for obj in (f, getattr(f, "__wrapped__", None), getattr(f, "func", None)):
        name = getattr(obj, "__name__", None)
        if isinstance(name, str):
            return name
    return type(f).__name__
