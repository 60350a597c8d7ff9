"""A causality audit for any JAX model: :func:`audit_causal` and :func:`assert_causal`.

An autoregressive model ``f: x -> y`` is causal when the output at position ``p`` does
not depend on any input that ``p`` must not see (the future, in raster order for
images). "Does not depend" has an exact meaning, which the audit checks at every output
position (or a stated sample of them):

* **gradient**: ``|dy_p / dx_q|`` is exactly ``0.0`` for every forbidden input ``q``.
  One backward pass per output position (reverse mode, batched with ``vmap`` over the
  positions, in chunks), or one forward-mode pass per input position where that is
  cheaper. Gradients are measured in float32 whatever the model's dtype: the audit
  differentiates with respect to a float32 copy of ``x`` that is cast to ``x.dtype``
  on the way in, and casts ``y`` to float32 on the way out.
* **NaN isolation**: with every input forbidden to ``p`` replaced by NaN, the outputs at
  ``p`` are bit-identical to the clean ones. This is what ``lax.conv(kernel * mask)``
  fails on every platform (``0 * NaN = NaN``) although its gradient leak is 0 on CPU.
* **perturbation** (black-box mode, for models that are not differentiable in their
  input: integer tokens, sampling inside): every forbidden input is changed to another
  value (another token, another float) and the outputs at ``p`` must stay
  bit-identical; batched over ``p``.

The report names the first offending ``(p, q)`` pair (the earliest output that leaks,
and the earliest input it must not see but does) and the worst ones, with values; it
prints as a table and converts to JSON.

Layout: ``x`` is ``(N, *positions, C)`` (three or more dims), ``(N, L)`` (tokens) or
``(L,)``; ``y`` has the same sizes on the position axes (``position_axes`` overrides the
guess). Every other axis (the batch, channels, logits) belongs to the position: the
output "at p" is every element of ``y`` at ``p``, in every example of the batch, and an
input forbidden to ``p`` is forbidden in every example (so normalising over the batch
or the sequence is caught too). ``sub_pixels=3`` splits the last axis of ``x`` and of
``y`` into R, G, B groups ordered after the pixel (the original PixelCNN's order).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["audit_causal", "assert_causal", "CausalityReport", "CausalityError", "Offence", "as_function"]

CHECKS = ("gradient", "nan", "perturb")
CHECK_TITLES = {"gradient": "gradient", "nan": "NaN isolation", "perturb": "perturbation"}
# Exact per-feature Jacobian entries up to this many basis vectors per position;
# beyond it, one random projection per position (stated in the report).
MAX_BASIS = 16
# By default every output is audited up to this many (a 32x32 image: 18-20 s for an
# 8-layer, 64-channel PixelCNN on 2 loaded AMD EPYC cores), else a sample of DEFAULT_SAMPLE.
DEFAULT_MAX_POSITIONS = 1024
DEFAULT_SAMPLE = 256
# Budget for one chunk's largest batched tensor (cotangents, gradients, outputs): small
# enough that a chunk's activations stay in cache (on 2 CPU cores a 32x32 PixelCNN audits
# ~1.4x faster in chunks of 8 than of 64), large enough to amortise each call.
CHUNK_BYTES = 8 * 2**20


class CausalityError(AssertionError):
    """Raised by :func:`assert_causal`; ``.report`` holds the :class:`CausalityReport`."""

    def __init__(self, report: "CausalityReport"):
        super().__init__(str(report))
        self.report = report


@dataclasses.dataclass(frozen=True)
class Offence:
    """One output that sees what it must not.

    Attributes:
      check: ``"gradient"``, ``"nan"`` or ``"perturb"``.
      output: index of the output position ``p`` (position coordinates, then the
        sub-pixel when ``sub_pixels > 1``).
      input: index of an input ``q`` that ``p`` must not see but does (for the gradient
        check, the largest ``|dy_p/dx_q|``, or the earliest one for ``first``). The
        black-box checks single out ``q`` for their first offender only (changing one
        forbidden input at a time, in the order); ``None`` for the others, or when no
        single input changes the output alone.
      value: ``|dy_p/dx_q|`` (float32) for the gradient check; for the black-box checks,
        the number of output elements at ``p`` that changed.
    """

    check: str
    output: tuple[int, ...]
    input: tuple[int, ...] | None
    value: float

    def describe(self) -> str:
        pair = f"output {_fmt_index(self.output)}"
        if self.input is not None:
            pair += f" <- input {_fmt_index(self.input)}"
        if self.check == "gradient":
            return f"{pair}: |dy/dx| = {self.value:.3g}"
        return f"{pair}: {int(self.value)} output element(s) changed"

    def to_dict(self) -> dict:
        return {"check": self.check, "output": list(self.output),
                "input": None if self.input is None else list(self.input), "value": _json_float(self.value)}


@dataclasses.dataclass(frozen=True, eq=False)
class CheckResult:
    """One check over the audited outputs.

    Attributes:
      check: the check's name.
      failing: bool ``(S,)``, per audited output (``CausalityReport.audited``).
      value: float64 ``(S,)``: the largest ``|dy_p/dx_q|`` over forbidden ``q``
        (gradient; NaN if a gradient is NaN) or the number of changed output elements.
      worst_input: int ``(S,)``: flat input unit of that largest entry (-1: none).
      first_input: int ``(S,)``: the earliest (in the order) leaking input unit (-1: none
        or not localised).
      first: the first offending pair (earliest failing output), or ``None``.
      worst: the worst offenders, largest value first (gradient) or in order.
      seconds: wall time of the check, compilation included.
    """

    check: str
    failing: np.ndarray
    value: np.ndarray
    worst_input: np.ndarray
    first_input: np.ndarray
    first: Offence | None
    worst: tuple[Offence, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        return not bool(self.failing.any())


@dataclasses.dataclass(frozen=True, eq=False)
class CausalityReport:
    """What :func:`audit_causal` measured. ``str(report)`` is a table; ``to_json()`` the same as JSON.

    Attributes:
      function: the audited callable's name.
      input_shape, input_dtype, output_shape, output_dtype: of ``x`` and ``f(x)``.
      positions: the shape of the position grid (e.g. ``(H, W)``).
      sub_pixels: groups per position (3 for R, G, B).
      rule: the causality rule in words.
      audited: int ``(S,)``: flat output units audited (unit = position * sub_pixels +
        sub-pixel), in the order.
      sample: how they were chosen, in words ("all 64 output positions", or a sample).
      method: how gradients were taken, in words.
      checks: one :class:`CheckResult` per check run.
      device: the device the audit ran on, and the jax and jaxlib versions.
      seconds: total wall time, compilation included.
    """

    function: str
    input_shape: tuple[int, ...]
    input_dtype: str
    output_shape: tuple[int, ...]
    output_dtype: str
    positions: tuple[int, ...]
    sub_pixels: int
    rule: str
    audited: np.ndarray
    sample: str
    method: str
    checks: tuple[CheckResult, ...]
    device: str
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def check(self, name: str) -> CheckResult:
        """The result of check ``name`` (``"gradient"``, ``"nan"`` or ``"perturb"``)."""
        for c in self.checks:
            if c.check == name:
                return c
        raise KeyError(f"check {name!r} was not run; this audit ran {[c.check for c in self.checks]}")

    @property
    def first(self) -> Offence | None:
        """The first offending pair over all checks: the earliest failing output (gradient check preferred)."""
        found = [c.first for c in self.checks if c.first is not None]
        if not found:
            return None
        rank = {int(u): i for i, u in enumerate(self.audited)}
        return min(found, key=lambda o: (rank[self.unit(o.output)], o.input is None))

    def unit(self, index: Sequence[int]) -> int:
        """Flat unit of an output index ``(*position, [sub-pixel])``."""
        g = self.sub_pixels
        pos = tuple(index[: len(self.positions)])
        return int(np.ravel_multi_index(pos, self.positions)) * g + (int(index[-1]) if g > 1 else 0)

    def index(self, unit: int) -> tuple[int, ...]:
        """Output index ``(*position, [sub-pixel])`` of a flat unit."""
        return _unit_index(int(unit), self.positions, self.sub_pixels)

    def leak_map(self, check: str = "gradient") -> np.ndarray:
        """float64 ``(*positions[, sub_pixels])``: each audited output's figure, NaN where not audited."""
        c = self.check(check)
        out = np.full(int(np.prod(self.positions)) * self.sub_pixels, np.nan)
        out[self.audited] = c.value
        shape = self.positions + ((self.sub_pixels,) if self.sub_pixels > 1 else ())
        return out.reshape(shape)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "function": self.function,
            "input": {"shape": list(self.input_shape), "dtype": self.input_dtype},
            "output": {"shape": list(self.output_shape), "dtype": self.output_dtype},
            "positions": list(self.positions),
            "sub_pixels": self.sub_pixels,
            "rule": self.rule,
            "sample": self.sample,
            "method": self.method,
            "device": self.device,
            "seconds": round(self.seconds, 3),
            "first": None if self.first is None else self.first.to_dict(),
            "checks": [
                {
                    "check": c.check,
                    "passed": c.passed,
                    "audited": int(c.failing.size),
                    "failing": int(c.failing.sum()),
                    "max": _json_float(_max_figure(c)),
                    "first": None if c.first is None else c.first.to_dict(),
                    "worst": [o.to_dict() for o in c.worst],
                    "seconds": round(c.seconds, 3),
                    "per_output": [
                        {"output": list(self.index(u)), "value": _json_float(v), "failing": bool(bad)}
                        for u, v, bad in zip(self.audited, c.value, c.failing)
                    ],
                }
                for c in self.checks
            ],
        }

    def to_json(self, **kwargs) -> str:
        """The report as JSON (``json.dumps`` keyword arguments pass through)."""
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [
            f"causality audit of {self.function}: {'PASSED' if self.passed else 'FAILED'}",
            f"  input {self.input_dtype} {self.input_shape} -> output {self.output_dtype} {self.output_shape}"
            f" on {self.device}, {self.seconds:.2f} s",
            f"  rule: {self.rule}",
            f"  audited: {self.sample}",
            f"  method: {self.method}",
            "",
        ]
        header = ("check", "audited", "failing", "max figure", "first offending pair")
        rows = [header]
        for c in self.checks:
            rows.append((
                CHECK_TITLES[c.check],
                str(c.failing.size),
                str(int(c.failing.sum())),
                _fmt_figure(c),
                "-" if c.first is None else c.first.describe(),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for i, r in enumerate(rows):
            lines.append("  " + " | ".join(s.ljust(w) for s, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  " + "-+-".join("-" * w for w in widths))
        for c in self.checks:
            if c.worst:
                lines.append("")
                lines.append(f"  worst offenders ({CHECK_TITLES[c.check]}):")
                lines.extend(f"    {o.describe()}" for o in c.worst)
        return "\n".join(lines)


def as_function(model: Any, variables: Any = None, **apply_kwargs) -> Callable[[jax.Array], jax.Array]:
    """A function ``x -> y`` closing over a model's parameters, for :func:`audit_causal`.

    * Flax linen: ``as_function(module, variables, **apply_kwargs)`` is
      ``lambda x: module.apply(variables, x, **apply_kwargs)``.
    * Flax nnx: ``as_function(module)`` splits the module into its graph and state once
      and merges them on each call, so the audit's ``jit``/``vmap`` never mutate the
      module.
    * Equinox-style modules (callable pytrees), jitted functions and plain functions are
      returned as they are (with ``apply_kwargs`` bound, if any).
    """
    if variables is not None:
        if not hasattr(model, "apply"):
            raise TypeError(f"variables were given, but {type(model).__name__} has no .apply: pass variables "
                            "only with a flax.linen module")
        return _named(lambda x: model.apply(variables, x, **apply_kwargs), type(model).__name__)
    if _is_flax_module(model, "nnx"):
        from flax import nnx

        graphdef, state = nnx.split(model)
        return _named(lambda x: nnx.merge(graphdef, state)(x, **apply_kwargs), type(model).__name__)
    if _is_flax_module(model, "linen"):
        raise TypeError(f"{type(model).__name__} is a flax.linen module: it needs its variables, "
                        "as_function(module, variables)")
    if apply_kwargs:
        return _named(lambda x: model(x, **apply_kwargs), _name_of(model))
    return model


def audit_causal(
    f: Callable[[jax.Array], Any],
    x: Any,
    *,
    order: str | np.ndarray = "raster",
    visible: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    include_current: bool = False,
    sub_pixels: int = 1,
    position_axes: Sequence[int] | None = None,
    positions: None | str | int | Sequence[Sequence[int]] = None,
    checks: Sequence[str] | None = None,
    method: str = "auto",
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    worst: int = 5,
    seed: int = 0,
) -> CausalityReport:
    """Audit ``f`` for causality leaks at every output position (or a stated sample).

    Args:
      f: any JAX callable ``x -> y`` (jitted or not; wrap flax modules with
        :func:`as_function`). ``y`` may be a pytree with one array leaf.
      x: the input, ``(N, *positions, C)``, ``(N, L)`` or ``(L,)``; floating for the
        gradient and NaN checks, any dtype for the perturbation check.
      order: ``"raster"`` (row-major over the position axes) or an int array of shape
        ``positions`` giving each position's rank (a permutation; generation order).
      visible: instead of an order, a predicate ``visible(p, q) -> bool array``: may
        output ``p`` see input ``q``? Called with int arrays of indices, ``p`` of shape
        ``(S, 1, d)`` and ``q`` of shape ``(1, Q, d)`` (``d`` = position dims, plus one
        for the sub-pixel when ``sub_pixels > 1``); must broadcast. "First" then means
        first in raster order.
      include_current: with an order, whether output ``p`` may see input ``p`` itself
        (False: PixelCNN logits predict their own pixel; True: a causal layer or a
        causal-attention block, which sees the current token).
      sub_pixels: split the last axis of ``x`` and ``y`` into this many contiguous
        groups ordered after the pixel (3: R, G, B).
      position_axes: the axes of ``x`` (and ``y``) that index positions; default
        ``1 .. x.ndim - 2`` for 3+ dims, ``(1,)`` for 2 dims, ``(0,)`` for 1 dim.
      positions: ``None`` (every output unit up to 1024, else a sample of 256),
        ``"all"``, an int (a sample of that many: half evenly spaced in the order, half
        uniform, seeded), or explicit output indices.
      checks: any of ``"gradient"``, ``"nan"``, ``"perturb"``; by default gradient + NaN
        when ``x`` and ``y`` are floating, NaN + perturb when only ``x`` is (an argmax or
        sampling head), perturb for integer or bool ``x`` (the black-box mode).
      method: ``"reverse"`` (one VJP per audited output), ``"forward"`` (one JVP per
        input unit; needs every position audited and no ``custom_vjp`` inside;
        ``masked_conv`` is fine) or ``"auto"`` (forward only where it is cheaper and possible).
      vocab_size: integer inputs: replacement tokens are drawn from ``[0, vocab_size)``
        (default ``x.max() + 1``).
      chunk_size: outputs per batched call (default: from an 8 MiB budget for the
        largest batched tensor).
      worst: how many worst offenders each check lists.
      seed: for random projections, the sample and the replacement values.

    Returns:
      A :class:`CausalityReport`.
    """
    start = time.perf_counter()
    x = jnp.asarray(x)
    layout = _Layout.make(x, position_axes, sub_pixels)
    y_struct = jax.eval_shape(lambda v: _single_leaf(f(v)), x)
    layout.check_output(y_struct)
    if visible is not None and (include_current or not (isinstance(order, str) and order == "raster")):
        raise ValueError("visible replaces order and include_current: pass either a predicate or an order "
                         "(with include_current), not both")
    ranks = _ranks(order, layout, visible)
    rule = _rule(order, visible, include_current, layout)
    forbidden = _Forbidden(layout, ranks, visible, include_current)
    checks = _checks(checks, x.dtype, y_struct.dtype)
    if "gradient" not in checks and method != "auto":
        raise ValueError(f"method={method!r} is how gradients are taken, but checks={checks} has no gradient check")
    if vocab_size is not None and not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"vocab_size is the range of integer tokens, but x is {x.dtype}")
    units, sample = _sample(positions, layout, ranks, seed)
    # numpy draws: no compilation per shape, and the same values on every device.
    rng = np.random.default_rng(seed)
    results = []
    shared = {}  # the batched forward pass, compiled once for the NaN and perturbation checks
    method_text = "black-box (forward passes only)"
    for name in checks:
        t = time.perf_counter()
        if name == "gradient":
            raw, method_text = _gradient_check(f, x, layout, y_struct, forbidden, units, method, chunk_size, rng)
            results.append(_gradient_result(raw, units, layout, ranks, worst, time.perf_counter() - t))
        else:
            results.append(_blackbox_check(name, f, x, layout, y_struct, forbidden, units, ranks, vocab_size,
                                           chunk_size, rng, worst, t, shared))
    return CausalityReport(
        function=_name_of(f),
        input_shape=tuple(x.shape),
        input_dtype=str(x.dtype),
        output_shape=tuple(y_struct.shape),
        output_dtype=str(y_struct.dtype),
        positions=layout.positions,
        sub_pixels=layout.groups,
        rule=rule,
        audited=units,
        sample=sample,
        method=method_text,
        checks=tuple(results),
        device=_device(),
        seconds=time.perf_counter() - start,
    )


def assert_causal(f: Callable[[jax.Array], Any], x: Any, **kwargs) -> CausalityReport:
    """:func:`audit_causal`, raising :class:`CausalityError` (an ``AssertionError``) on any leak.

    The error's message is the report's table, with the first and the worst offending
    ``(output, input)`` pairs named. Returns the report when the audit passes.
    """
    report = audit_causal(f, x, **kwargs)
    if not report.passed:
        raise CausalityError(report)
    return report


# --------------------------------------------------------------------------------------
# Layout: x and y as (units, elements per unit)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How ``x`` and ``y`` map to ``(U, K)`` and ``(U, F)``: U = positions * groups units.

    ``to_units`` moves the position axes first, splits the channel axis (last) into
    ``groups`` and moves the group next to the position, then flattens the rest.
    """

    x_shape: tuple[int, ...]
    position_axes: tuple[int, ...]
    groups: int

    @staticmethod
    def make(x: jax.Array, position_axes, groups: int) -> "_Layout":
        if position_axes is None:
            position_axes = tuple(range(1, x.ndim - 1)) if x.ndim >= 3 else ((1,) if x.ndim == 2 else (0,))
        axes = tuple(sorted(a % x.ndim for a in position_axes)) if x.ndim else ()
        if not axes or len(set(axes)) != len(axes):
            raise ValueError(f"position_axes={position_axes} must name distinct axes of x, which has shape {x.shape}")
        if groups < 1:
            raise ValueError(f"sub_pixels must be a positive int, got {groups}")
        if groups > 1:
            if x.ndim - 1 in axes:
                raise ValueError("sub_pixels > 1 splits x's last axis (channels), so it cannot be a position axis; "
                                 "pass position_axes without it")
            if x.shape[-1] % groups:
                raise ValueError(f"sub_pixels={groups} must divide x's channels, {x.shape[-1]}")
        return _Layout(tuple(x.shape), axes, groups)

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(self.x_shape[a] for a in self.position_axes)

    @property
    def n_units(self) -> int:
        return int(np.prod(self.positions)) * self.groups

    def check_output(self, y) -> None:
        if y.ndim <= max(self.position_axes) or any(y.shape[a] != self.x_shape[a] for a in self.position_axes):
            raise ValueError(
                f"f(x) has shape {y.shape}, not aligned to x's positions: its axes {self.position_axes} must have "
                f"sizes {self.positions} (x has shape {self.x_shape}); pass position_axes if the positions are "
                "elsewhere")
        if self.groups > 1 and y.shape[-1] % self.groups:
            raise ValueError(f"sub_pixels={self.groups} must divide f(x)'s last axis, {y.shape[-1]}")

    def to_units(self, a: jax.Array) -> jax.Array:
        """``a`` (x- or y-shaped) -> ``(U, elements per unit)``."""
        rest = [i for i in range(a.ndim) if i not in self.position_axes]
        a = jnp.transpose(a, (*self.position_axes, *rest))
        p, r = int(np.prod(self.positions)), a.shape[len(self.position_axes):]
        if self.groups == 1:
            return a.reshape(p, -1)
        a = a.reshape(p, int(np.prod(r[:-1], dtype=int)), self.groups, r[-1] // self.groups)
        return jnp.transpose(a, (0, 2, 1, 3)).reshape(p * self.groups, -1)

    def from_units(self, u: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """Inverse of :meth:`to_units` for an array of ``shape``."""
        rest = [i for i in range(len(shape)) if i not in self.position_axes]
        moved = (*self.positions, *(shape[i] for i in rest))
        p = int(np.prod(self.positions))
        if self.groups > 1:
            u = u.reshape(p, self.groups, int(np.prod(moved[len(self.positions):-1], dtype=int)), -1)
            u = jnp.transpose(u, (0, 2, 1, 3))
        a = u.reshape(moved)
        return jnp.transpose(a, np.argsort((*self.position_axes, *rest)))


def _unit_index(unit: int, positions: tuple[int, ...], groups: int) -> tuple[int, ...]:
    pos, g = divmod(unit, groups)
    idx = tuple(int(i) for i in np.unravel_index(pos, positions))
    return idx + ((g,) if groups > 1 else ())


def _unit_indices(layout: _Layout) -> np.ndarray:
    """int ``(U, d)``: every unit's index (position coordinates, then the sub-pixel if any)."""
    pos = np.stack(np.unravel_index(np.arange(int(np.prod(layout.positions))), layout.positions), -1)
    if layout.groups == 1:
        return pos
    pos = np.repeat(pos, layout.groups, axis=0)
    return np.concatenate([pos, np.tile(np.arange(layout.groups), len(pos) // layout.groups)[:, None]], -1)


# --------------------------------------------------------------------------------------
# The rule: which inputs each output must not see


def _ranks(order, layout: _Layout, visible) -> np.ndarray:
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


def _rule(order, visible, include_current: bool, layout: _Layout) -> str:
    if visible is not None:
        return f"output p sees input q iff {_name_of(visible)}(p, q)"
    what = "raster order" if isinstance(order, str) else "the given order"
    sub = f", {layout.groups} sub-pixels after each position" if layout.groups > 1 else ""
    return f"{what}{sub}: output p sees inputs strictly before p" + (" and p itself" if include_current else "")


@dataclasses.dataclass(frozen=True, eq=False)
class _Forbidden:
    """Rows of the forbidden matrix: ``rows(s)[i, q]`` is True when output ``s[i]`` must not see input ``q``."""

    layout: _Layout
    ranks: np.ndarray
    visible: Callable | None
    include_current: bool

    def rows(self, units: np.ndarray) -> np.ndarray:
        if self.visible is None:
            r_out = self.ranks[units][:, None]
            return self.ranks[None, :] > r_out if self.include_current else self.ranks[None, :] >= r_out
        idx = _unit_indices(self.layout)
        seen = np.asarray(self.visible(idx[units][:, None, :], idx[None, :, :]), bool)
        return ~np.broadcast_to(seen, (len(units), len(idx)))


def _checks(checks, x_dtype, y_dtype) -> tuple[str, ...]:
    """The checks to run: by default every one that applies (gradient needs float in and out, NaN float in)."""
    float_in = jnp.issubdtype(x_dtype, jnp.floating)
    float_out = jnp.issubdtype(y_dtype, jnp.floating)
    if checks is None:
        if not float_in:
            return ("perturb",)
        return ("gradient", "nan") if float_out else ("nan", "perturb")
    checks = tuple(checks)
    unknown = [c for c in checks if c not in CHECKS]
    if unknown or not checks:
        raise ValueError(f"checks must be a non-empty subset of {CHECKS}, got {checks}")
    if not float_in and ("gradient" in checks or "nan" in checks):
        raise ValueError(f"x is {x_dtype}: the gradient and NaN checks need a floating input; use "
                         "checks=('perturb',), the black-box mode")
    if not float_out and "gradient" in checks:
        raise ValueError(f"f(x) is {y_dtype}, not differentiable: use checks=('nan', 'perturb'), the black-box mode")
    return checks


def _sample(positions, layout: _Layout, ranks: np.ndarray, seed: int) -> tuple[np.ndarray, str]:
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


# --------------------------------------------------------------------------------------
# The gradient check


def _unit_function(f, x: jax.Array, layout: _Layout, cast: bool):
    """``xu (U, K) float32 -> yu (U, F)``: f seen unit by unit, float32 at both ends if ``cast``."""

    def g(xu):
        a = layout.from_units(xu, x.shape)
        y = _single_leaf(f(a.astype(x.dtype) if cast else a))
        return layout.to_units(y.astype(jnp.float32) if cast else y)

    return g


def _basis(n_dims: int, rng: np.random.Generator, count: int) -> tuple[np.ndarray | jax.Array, bool]:
    """Per-unit vectors ``(B, n_dims)``: the identity (exact entries) or one random unit-variance vector."""
    if n_dims <= MAX_BASIS:
        return jnp.eye(n_dims, dtype=jnp.float32), True
    return jnp.asarray(rng.standard_normal((count, 1, n_dims), np.float32)), False


def _chunk(chunk_size, per_item_elements: int, basis: int) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return int(chunk_size)
    items = CHUNK_BYTES // max(1, 4 * per_item_elements * basis)
    return int(max(1, min(256, 2 ** int(math.log2(max(1, items))))))


def _supports_forward(g, xu) -> bool:
    """Whether ``g`` can be differentiated in forward mode: no ``custom_vjp`` anywhere inside.

    Read from the jaxpr (nested jaxprs included): a ``custom_vjp`` may sit under
    platform-dependent code, where tracing a ``jvp`` succeeds and only lowering fails.
    (``masked_conv`` has forward mode: its primitives carry JVP rules.)
    """
    try:
        jaxpr = jax.make_jaxpr(g)(xu)
    except Exception:
        return False
    return not _has_primitive(jaxpr.jaxpr, ("custom_vjp_call", "custom_vjp_call_jaxpr", "pure_callback"))


def _has_primitive(jaxpr, names) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            return True
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and _has_primitive(inner, names):
                    return True
    return False


def _gradient_check(f, x, layout, y_struct, forbidden, units, method, chunk_size, rng):
    """float64 leak matrix rows ``(S, U)`` (forbidden entries only; 0 elsewhere) and the method in words."""
    if method not in ("auto", "reverse", "forward"):
        raise ValueError(f'method must be "auto", "reverse" or "forward", got {method!r}')
    g = _unit_function(f, x, layout, cast=True)
    xu = layout.to_units(x.astype(jnp.float32))
    n_units, k_in = xu.shape
    f_out = int(np.prod(y_struct.shape)) // n_units
    every = len(units) == n_units
    cost_rev = f_out if f_out <= MAX_BASIS else 1
    cost_fwd = k_in if k_in <= MAX_BASIS else 1
    if method == "forward":
        if not every:
            raise ValueError("method='forward' measures every output at once, so it needs positions='all'")
        if not _supports_forward(g, xu):
            raise ValueError("method='forward' cannot differentiate f forward (a custom_vjp or a callback "
                             "inside); use method='reverse'")
    use_forward = method == "forward" or (
        method == "auto" and every and cost_fwd < cost_rev and _supports_forward(g, xu))
    if use_forward:
        leak, text = _forward_leaks(g, xu, f_out, chunk_size, rng)
        leak = leak[units]
    else:
        leak, text = _reverse_leaks(g, xu, units, f_out, chunk_size, rng)
    leak = np.where(forbidden.rows(units), leak, 0.0)
    dtype_note = "" if x.dtype == jnp.float32 else f"; {x.dtype} model, gradients taken in float32 at its boundary"
    return leak, text + dtype_note


def _reverse_leaks(g, xu, units, f_out, chunk_size, rng):
    """``(S, U)``: max over the unit's output features (or one projection) of ``max_K |dy_s/dx_q|``."""
    n_units, k_in = xu.shape
    vectors, exact = _basis(f_out, rng, len(units))
    b = vectors.shape[-2]
    chunk = min(_chunk(chunk_size, n_units * max(f_out, k_in), b), len(units))

    @jax.jit
    def rows(xu, s, vec):
        _, vjp = jax.vjp(g, xu)
        # One cotangent per (output unit, basis vector): nonzero only on that unit's row.
        s_rep = jnp.repeat(s, b)
        ct = jnp.zeros((s_rep.size, n_units, f_out), jnp.float32).at[jnp.arange(s_rep.size), s_rep].set(
            vec.reshape(-1, f_out))
        (dx,) = jax.vmap(vjp)(ct)
        return jnp.abs(dx).max(-1).reshape(s.size, b, n_units).max(1)

    out = np.empty((len(units), n_units))
    for i in range(0, len(units), chunk):
        s = _padded(units[i: i + chunk], chunk)
        vec = jnp.broadcast_to(vectors, (chunk, b, f_out)) if exact else vectors[_padded(np.arange(i, min(
            i + chunk, len(units))), chunk)]
        out[i: i + chunk] = np.asarray(rows(xu, jnp.asarray(s), vec), np.float64)[: min(chunk, len(units) - i)]
    what = (f"exact entries: one VJP per output feature, {b} per position" if exact else
            f"one VJP per position with a random N(0, 1) projection of its {f_out} output features "
            "(nonzero iff some feature leaks, almost surely)")
    return out, f"reverse mode (vmap over outputs, chunks of {chunk}); {what}"


def _forward_leaks(g, xu, f_out, chunk_size, rng):
    """``(U_out, U_in)``: max over output features of ``|d y_p / d x_q|`` (exact or one input projection)."""
    n_units, k_in = xu.shape
    vectors, exact = _basis(k_in, rng, n_units)
    b = vectors.shape[-2]
    chunk = min(_chunk(chunk_size, n_units * max(f_out, k_in), b), n_units)

    @jax.jit
    def cols(xu, q, vec):
        q_rep = jnp.repeat(q, b)
        t = jnp.zeros((q_rep.size, n_units, k_in), jnp.float32).at[jnp.arange(q_rep.size), q_rep].set(
            vec.reshape(-1, k_in))
        dy = jax.vmap(lambda t: jax.jvp(g, (xu,), (t,))[1])(t)
        return jnp.abs(dy).max(-1).reshape(q.size, b, n_units).max(1)

    units = np.arange(n_units)
    out = np.empty((n_units, n_units))
    for i in range(0, n_units, chunk):
        q = _padded(units[i: i + chunk], chunk)
        vec = jnp.broadcast_to(vectors, (chunk, b, k_in)) if exact else vectors[q]
        out[:, i: i + chunk] = np.asarray(cols(xu, jnp.asarray(q), vec), np.float64)[: min(chunk, n_units - i)].T
    what = (f"exact entries: one JVP per input channel, {b} per position" if exact else
            f"one JVP per input position with a random N(0, 1) projection of its {k_in} input elements")
    return out, f"forward mode (vmap over inputs, chunks of {chunk}; cheaper than reverse here); {what}"


def _gradient_result(leak: np.ndarray, units, layout, ranks, worst: int, seconds: float) -> CheckResult:
    offending = leak != 0  # NaN != 0: a NaN gradient is a leak
    value = np.where(offending, leak, 0.0)
    sortable = np.where(np.isnan(value), np.inf, value)
    worst_q = np.where(offending.any(1), sortable.argmax(1), -1)
    first_q = np.where(offending.any(1), np.argmin(np.where(offending, ranks[None, :], np.iinfo(np.int64).max), 1), -1)
    figure = np.where(np.isnan(value).any(1), np.nan, value.max(1, initial=0.0))
    failing = offending.any(1)
    idx = lambda u: _unit_index(int(u), layout.positions, layout.groups)  # noqa: E731
    first = None
    if failing.any():
        i = int(np.argmax(failing))
        first = Offence("gradient", idx(units[i]), idx(first_q[i]), float(leak[i, first_q[i]]))
    bad = np.flatnonzero(failing)
    bad = bad[np.argsort(-np.where(np.isnan(figure[bad]), np.inf, figure[bad]), kind="stable")][:worst]
    offenders = tuple(Offence("gradient", idx(units[i]), idx(worst_q[i]), float(figure[i])) for i in bad)
    return CheckResult("gradient", failing, figure, worst_q, first_q, first, offenders, seconds)


# --------------------------------------------------------------------------------------
# The black-box checks: NaN isolation and perturbation


def _replacement(name: str, xu: jax.Array, vocab_size, rng: np.random.Generator) -> jax.Array:
    """``(U, K)`` values that differ from ``xu`` everywhere: NaN, another token, another float."""
    if name == "nan":
        return jnp.full_like(xu, jnp.nan)
    host = np.asarray(xu)
    if host.dtype == np.bool_:
        return jnp.asarray(~host)
    if np.issubdtype(host.dtype, np.integer):
        vocab = int(vocab_size) if vocab_size is not None else int(host.max()) + 1
        if vocab < 2:
            raise ValueError(f"perturbing integer inputs needs at least 2 values to choose from; x.max() + 1 = "
                             f"{vocab}: pass vocab_size")
        shift = rng.integers(1, vocab, host.shape)
        return jnp.asarray(((host.astype(np.int64) + shift) % vocab).astype(host.dtype))
    # Another float, at least half a standard deviation away (in x's own dtype).
    x32 = host.astype(np.float32)
    scale = max(float(x32.std()), 1.0)
    noise = rng.standard_normal(host.shape).astype(np.float32)
    other = (x32 + np.where(noise >= 0, 1, -1) * (np.abs(noise) + 0.5) * scale).astype(host.dtype)
    return jnp.asarray(np.where(other == host, (-x32 - 1).astype(host.dtype), other))


def _bits(y: jax.Array) -> jax.Array:
    """Floats as their bit patterns (NaN payloads and signed zeros compared exactly)."""
    if jnp.issubdtype(y.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(y, {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[y.dtype.itemsize])
    return y


def _blackbox_check(name, f, x, layout, y_struct, forbidden, units, ranks, vocab_size, chunk_size, rng, worst, t0,
                    shared):
    xu = layout.to_units(x)
    n_units, k_in = xu.shape
    f_out = int(np.prod(y_struct.shape)) // n_units
    other = _replacement(name, xu, vocab_size, rng)
    chunk = _chunk(chunk_size, n_units * max(f_out, k_in), 1)

    chunk = min(chunk, len(units))
    if "batched" not in shared:
        g = _unit_function(f, x, layout, cast=False)
        shared["batched"] = jax.jit(lambda xs: _bits(jax.vmap(g)(xs)))
    batched = shared["batched"]
    # The clean reference runs through the same executable with the same batch shape, so
    # slot i of a poisoned batch is compared with slot i of a clean one, bit for bit.
    if chunk not in shared:
        shared[chunk] = batched(jnp.broadcast_to(xu[None], (chunk, *xu.shape)))
    reference = shared[chunk]

    def changed(replace, s):
        """Replace ``replace[i]`` (bool ``(U,)``) in copy i; changed output elements at unit ``s[i]``."""
        y = batched(_replaced(xu, other, jnp.asarray(replace)))
        return np.asarray(_count_changed(y, reference, jnp.asarray(s)))

    counts = np.zeros(len(units))
    for i in range(0, len(units), chunk):
        s = _padded(units[i: i + chunk], chunk)
        n = min(chunk, len(units) - i)
        counts[i: i + n] = changed(forbidden.rows(s), s)[:n]
    failing = counts > 0
    first_q = np.full(len(units), -1)
    idx = lambda u: _unit_index(int(u), layout.positions, layout.groups)  # noqa: E731
    first = None
    if failing.any():
        i = int(np.argmax(failing))
        first_q[i] = _localise(changed, units[i], forbidden, ranks, chunk)
        first = Offence(name, idx(units[i]), None if first_q[i] < 0 else idx(first_q[i]), float(counts[i]))
    offenders = tuple(
        Offence(name, idx(units[i]), None if first_q[i] < 0 else idx(first_q[i]), float(counts[i]))
        for i in np.flatnonzero(failing)[:worst])
    return CheckResult(name, failing, counts, np.full(len(units), -1), first_q, first, offenders,
                       time.perf_counter() - t0)


@jax.jit
def _replaced(xu, other, replace):
    """``(S, U, K)``: copy i of ``xu`` with the units ``replace[i]`` taken from ``other``."""
    return jnp.where(replace[:, :, None], other[None], xu[None])


@jax.jit
def _count_changed(y, reference, s):
    """int ``(S,)``: elements of unit ``s[i]`` that differ between copy i of ``y`` and of ``reference``."""
    rows = jnp.arange(s.size)
    return (y[rows, s] != reference[rows, s]).sum(-1)


def _localise(changed, unit: int, forbidden: _Forbidden, ranks, chunk: int) -> int:
    """The earliest forbidden input unit that changes output ``unit`` on its own (-1 if none does).

    Scans forbidden inputs in the order, one replaced input per batched copy, and stops
    at the first chunk with a hit: leaks usually come from just after the output.
    """
    candidates = np.flatnonzero(forbidden.rows(np.array([unit]))[0])
    candidates = candidates[np.argsort(ranks[candidates], kind="stable")]
    s = np.full((chunk,), unit)
    for i in range(0, len(candidates), chunk):
        q = candidates[i: i + chunk]
        replace = np.zeros((chunk, len(ranks)), bool)
        replace[np.arange(len(q)), q] = True
        hit = np.flatnonzero(changed(replace, s)[: len(q)] > 0)
        if len(hit):
            return int(q[hit[0]])
    return -1


# --------------------------------------------------------------------------------------
# Small helpers


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` repeated at its last entry up to length ``n``: every chunk has one shape, so one compilation."""
    return np.concatenate([a, np.repeat(a[-1:], n - len(a))]) if len(a) < n else a


def _single_leaf(y):
    leaves = jax.tree_util.tree_leaves(y)
    if len(leaves) != 1:
        raise ValueError(f"f(x) must return one array (or a pytree with one leaf), got {len(leaves)} leaves; "
                         "audit a function that selects the output aligned to x")
    return leaves[0]


def _is_flax_module(model, api: str) -> bool:
    """Whether ``model`` is a ``flax.linen`` or ``flax.nnx`` module, without importing flax if it is absent."""
    try:
        if api == "nnx":
            from flax import nnx

            return isinstance(model, nnx.Module)
        import flax.linen

        return isinstance(model, flax.linen.Module)
    except ImportError:
        return False


def _named(fn, name: str):
    fn.__name__ = name
    return fn


def _name_of(f) -> str:
    for obj in (f, getattr(f, "__wrapped__", None), getattr(f, "func", None)):
        name = getattr(obj, "__name__", None)
        if isinstance(name, str):
            return name
    return type(f).__name__


def _device() -> str:
    import jaxlib

    d = jax.devices()[0]
    return f"{d.platform}:{d.id} ({getattr(d, 'device_kind', d.platform)}; jax {jax.__version__}, jaxlib {jaxlib.__version__})"


def _fmt_index(index) -> str:
    return "(" + ", ".join(str(int(i)) for i in index) + ("," if len(index) == 1 else "") + ")"


def _max_figure(c: CheckResult) -> float:
    v = c.value
    return float("nan") if np.isnan(v).any() else float(v.max(initial=0.0))


def _fmt_figure(c: CheckResult) -> str:
    m = _max_figure(c)
    if c.check == "gradient":
        return "0 (exact)" if m == 0 else f"{m:.3g}"
    return f"{int(m)} element(s) changed" if m else "bit-identical"


def _json_float(v: float):
    v = float(v)
    return v if math.isfinite(v) else str(v)
