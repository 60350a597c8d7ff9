"""Every failure the fuzzers found, kept as an explicit case (issue 36, item 5).

Each case is the drawn problem, written out (the arrays as literals), and the backend it
failed on; the fuzz module of its op runs it through the same check as its ``@given``
test. A case that shows a library bug not yet fixed is a strict ``xfail`` with the reason:
when the fix lands it passes, the strict xfail fails, and the mark comes off.
"""
from __future__ import annotations

import dataclasses

import pytest

__all__ = ["Case", "param_list", "MASKED_CONV", "CAUSAL_CONV1D", "CAUSAL_CONV", "INVALID", "KNOWN_INVALID"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One failing example: ``check(backend, *args)`` (or ``check(*args)`` when ``backend`` is None)."""

    name: str
    backend: str | None
    args: tuple
    check: str = "problem"  # which of the module's checks runs it
    xfail: str | None = None  # the library bug it shows, until fixed

    def run(self, checks):
        check = checks[self.check] if isinstance(checks, dict) else checks
        return check(*self.args) if self.backend is None else check(self.backend, *self.args)


def param_list(cases, available=None) -> list:
    """``cases`` as pytest params: ids their names, strict xfails where a bug is open, those
    whose backend does not run here left out (its environment runs them)."""
    out = []
    for case in cases:
        if case.backend is not None and available is not None and case.backend not in available:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
        out.append(pytest.param(case, id=case.name, marks=marks))
    if not out:
        out.append(pytest.param(None, id="none", marks=pytest.mark.skip(reason="no failure found so far")))
    return out


# masked_conv: check_problem(backend, seed, x_shape, kernel_shape, x dtype, kernel dtype, mask bits, segment_ids, args)
MASKED_CONV: list[Case] = []

# causal_conv1d: see test_fuzz_causal_conv1d.py's checks ("full", "chunks", "update")
CAUSAL_CONV1D: list[Case] = []

# causal_conv: see test_fuzz_causal_conv.py's checks ("full", "stream")
CAUSAL_CONV: list[Case] = []

# Bad inputs: test_fuzz_invalid.py's check_invalid(op, seed, perturbation, require_prefix=None), found by
# its first run (2026-12, jax 0.10.2 and 0.11.2: the same on both), each a library bug,
# fixed by wording every argument error through the op's OpError (OpError.words):
# - x not an array (None, a string, a ragged list): as_operand's TypeError had no op name;
# - causal_conv1d took an integer bias silently, and an integer weight failed when lowered,
#   as masked_conv's "kernel must have a floating dtype" (now: check_operands checks dtypes);
# - causal_conv1d's segment_ids errors had no op name;
# - causal_conv_stream's implementation check said "causal_conv: ..." (time_conv passed no op=);
# - masked_conv's argument errors had no "masked_conv: " in front, unlike the other ops'.
INVALID: list[Case] = [
    *(Case(f"{op}-x {what}", None, (op, 0, f"x {what}"))
      for op in ("causal_conv", "causal_conv1d", "causal_conv1d_update", "causal_conv_stream")
      for what in ("None", "string", "ragged list")),
    Case("causal_conv1d-bias int", None, ("causal_conv1d", 0, "bias int")),
    Case("causal_conv1d-weight int", None, ("causal_conv1d", 0, "weight int")),
    Case("causal_conv1d-segment_ids float", None, ("causal_conv1d", 0, "segment_ids float")),
    Case("causal_conv1d-segment_ids shape", None, ("causal_conv1d", 0, "segment_ids shape")),
    Case("causal_conv_stream-implementation unknown", None, ("causal_conv_stream", 0, "implementation unknown")),
    Case("causal_conv_stream-implementation empty", None, ("causal_conv_stream", 0, "implementation empty")),
    *(Case(f"masked_conv-named-{what}", None, ("masked_conv", 0, what, True))
      for what in ("strides zero", "padding unknown", "interpret string", "x None")),
]
# Pairs the fuzzer leaves out of its draws while their case is an open bug (a strict xfail).
KNOWN_INVALID = {(c.args[0], c.args[2]) for c in INVALID if c.xfail and len(c.args) == 3}
