"""What the audit found: :class:`CausalityReport`, its :class:`CheckResult` per check and :class:`Offence` pairs.

``str(report)`` is a table, ``report.to_json()`` the same as JSON;
:class:`CausalityError` carries a failed report out of :func:`~maskconv_kernels.assert_causal`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from typing import Sequence

import jax
import numpy as np

from .units import unit_index

__all__ = ["CausalityReport", "CheckResult", "Offence", "CausalityError", "CHECKS", "CHECK_TITLES", "device_text"]

CHECKS = ("gradient", "nan", "perturb")
CHECK_TITLES = {"gradient": "gradient", "nan": "NaN isolation", "perturb": "perturbation"}


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
      rule: the causality rule in words, with the ``include_current`` value applied and
        where it came from (given, learned from the model, or the default).
      include_current: whether an output could see its own position (``None``: the rule
        was a ``visible`` predicate).
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
    include_current: bool | None
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
        """The first offending pair over all checks, at the earliest failing output (gradient check preferred)."""
        found = [c.first for c in self.checks if c.first is not None]
        if not found:
            return None
        rank = {int(u): i for i, u in enumerate(self.audited)}
        return min(found, key=lambda o: (rank[self.unit(o.output)], o.input is None))

    def explanation(self) -> str:
        """Why the first offending pair breaks the rule, and the argument that changes the rule ("" if passed).

        An output reading its own position is a leak only under ``include_current=False``
        (a PixelCNN's logits at ``p`` predict ``x_p``); a causal layer reads it. That is
        the failure a correct model meets under the wrong rule, so it names the flag; an
        input after ``p`` is a leak under either value.
        """
        o = self.first
        if o is None:
            return ""
        p = _fmt_index(o.output)
        if o.input is None:
            return (f"output p = {p} changed when the inputs it must not see changed, though no single one of "
                    "them changed it alone.")
        pair = f"output p = {p} reads input q = {_fmt_index(o.input)}"
        if self.include_current is None:
            return f"{pair}, which the visible(p, q) predicate forbids: a leak, unless the predicate is too strict."
        if tuple(o.input) == tuple(o.output) and not self.include_current:
            return (f"{pair}, its own position, which include_current=False forbids: a leak if the outputs at p "
                    "predict x_p (PixelCNN logits). A causal layer, causal attention or a next-token model "
                    "may read position p: pass include_current=True.")
        return (f"{pair}, which comes after p in the order: a leak under either value of include_current "
                "(order= or visible= state another order).")

    def unit(self, index: Sequence[int]) -> int:
        """Flat unit of an output index ``(*position, [sub-pixel])``."""
        g = self.sub_pixels
        pos = tuple(index[: len(self.positions)])
        return int(np.ravel_multi_index(pos, self.positions)) * g + (int(index[-1]) if g > 1 else 0)

    def index(self, unit: int) -> tuple[int, ...]:
        """Output index ``(*position, [sub-pixel])`` of a flat unit."""
        return unit_index(int(unit), self.positions, self.sub_pixels)

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
            "include_current": self.include_current,
            "explanation": self.explanation(),
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
        if not self.passed:
            lines.append("")
            lines += textwrap.wrap(f"first leak: {self.explanation()}", 100, initial_indent="  ",
                                   subsequent_indent="    ")
        for c in self.checks:
            if c.worst:
                lines.append("")
                lines.append(f"  worst offenders ({CHECK_TITLES[c.check]}):")
                lines.extend(f"    {o.describe()}" for o in c.worst)
        return "\n".join(lines)


def device_text() -> str:
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
