"""One harness for every op's shared suite: each implementation the op's registry holds,
called as the suites call it.

An :class:`Op` says how the suites reach one op: its public function, its registry, and
how to turn a call's arguments into what the registry's records judge (``unsupported``).
:func:`implementations` builds, from the registry, one :class:`Implementation` per
implementation that runs here: ``"xla"`` as it is, a kernel backend compiled on a GPU and
in its interpreter elsewhere, in the dtype it takes (:func:`suite_dtype`). One that cannot
run here (a missing package, an older jax) is left out with its reason (its own
test module skips with it). A suite then parametrizes its cases over
:func:`params` and calls the :class:`Implementation`, which skips a case the
implementation does not take with the implementation's own reason (its
``NotImplementedError`` is tested once, in the op's own tests).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskconv_kernels._core.registry import Registry, lowering_platform

__all__ = ["ON_GPU", "PLATFORM", "Op", "Implementation", "compiled_here", "suite_dtype", "implementations", "params", "cases"]

ON_GPU = jax.default_backend() == "gpu"
PLATFORM = lowering_platform()
F32, BF16 = np.dtype("float32"), np.dtype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Op:
    """One op, as the suites reach it.

    Attributes:
      function: the public function (``masked_conv``, ``causal_conv``, ``causal_conv1d``).
      registry: its implementations table.
      problem: ``problem(*args, **kwargs)``, the call's arguments (without
        ``implementation``, ``interpret``, ``config``) as the records' ``unsupported`` takes them.
      probe: ``probe(dtype)``, a small problem in ``dtype``: which dtype a backend runs.
    """

    function: Callable
    registry: Registry
    problem: Callable[..., Any]
    probe: Callable[[np.dtype], Any]

    @property
    def name(self) -> str:
        return self.registry.op


@dataclasses.dataclass(frozen=True)
class Implementation:
    """How a suite calls one implementation: the op's signature, without ``implementation``.

    ``name`` is the test id (``"xla_gemm"``, ``"pallas_triton_interpret"``); ``dtype`` what
    the suites draw inputs in and bound errors by.
    """

    op: Op
    name: str
    implementation: str
    interpret: bool = False
    config: Any = None
    dtype: np.dtype = F32

    @property
    def slow(self) -> bool:
        """Interpreted: too slow for large or many cases."""
        return self.interpret

    def kwargs(self, **kw) -> dict:
        """``kw`` with this implementation's ``implementation=``, ``interpret=`` and ``config=``."""
        out = dict(kw, implementation=self.implementation, interpret=self.interpret)
        if self.config is not None:
            out["config"] = self.config
        if ON_GPU and kw.get("precision") is None:
            # Float32 dots on GPUs default to TF32 (10-bit mantissa), which the float32
            # tolerance does not cover: the suites ask for IEEE products. TF32 is what
            # the benchmarks time.
            out["precision"] = "highest"
        return out

    def unsupported(self, *args, **kw) -> str | None:
        """Why this implementation does not take the call ``op(*args, **kw)`` here, or ``None``."""
        kw = {k: v for k, v in kw.items() if k not in ("implementation", "interpret", "config")}
        record = self.op.registry.get(self.implementation)
        return record.unsupported(self.op.problem(*args, **kw), PLATFORM, self.interpret)

    def skip_unsupported(self, *args, **kw) -> None:
        reason = self.unsupported(*args, **kw)
        if reason is not None:
            pytest.skip(f'{self.op.name}(implementation="{self.implementation}") does not take this case: {reason}')

    def __call__(self, *args, **kw):
        """``op(*args, **kw)`` by this implementation; a case it does not take is skipped."""
        self.skip_unsupported(*args, **kw)
        return self.op.function(*args, **self.kwargs(**kw))


def compiled_here(record) -> bool:
    """Whether the suites run a kernel backend compiled here: on a GPU (as they always
    have), or where its kernels lower for this platform (the TPU kernels on a TPU);
    elsewhere they run in its interpreter."""
    return ON_GPU or PLATFORM in (record.platforms or ())


def suite_dtype(op: Op, record, interpret: bool = not ON_GPU) -> np.dtype | None:
    """The dtype the shared suites run a backend in: float32 where it takes it, else
    bfloat16 (the Mosaic GPU conv kernels: wgmma's float32 mode is TF32 on K-major
    operands); ``None`` where it runs neither here."""
    for dtype in (F32, BF16):
        if record.unsupported(op.probe(dtype), PLATFORM, interpret) is None:
            return dtype
    return None


def implementations(
    op: Op, variants: Iterable[Implementation] = (), kind: type[Implementation] = Implementation,
    configs: dict[str, Any] | None = None,
) -> tuple[dict[str, Implementation], dict[str, str]]:
    """``(found, missing)``: every implementation of ``op`` that runs here, by test id, and
    why each of the others does not (``missing``, by registry name).

    ``"xla"`` runs as it is, in float32; ``variants`` are more entries (an implementation
    under another config). Kernel backends run compiled where :func:`compiled_here` says
    and in their interpreters elsewhere (``<name>_interpret``), in :func:`suite_dtype`. ``kind``: the class of the
    entries, an op's :class:`Implementation` with more methods. ``configs``: a kernel
    backend's config by registry name (tiles small enough that test sizes take several).
    """
    configs = configs or {}
    found = {"xla": kind(op, "xla", "xla")}
    found.update((v.name, v) for v in variants)
    missing = {}
    for record in op.registry:
        if record.name == "xla":
            continue
        interpret = not compiled_here(record)
        dtype = suite_dtype(op, record, interpret)
        if dtype is None:
            missing[record.name] = str(record.unsupported(op.probe(F32), PLATFORM, interpret))
            continue
        name = f"{record.name}_interpret" if interpret else record.name
        found[name] = kind(op, name, record.name, interpret=interpret, config=configs.get(record.name), dtype=dtype)
    return found, missing


def params(found: dict[str, Implementation], slow: Callable[[Implementation], bool] = lambda impl: impl.slow) -> list:
    """Every implementation's test id as a pytest param, those ``slow`` says (by default
    the interpreted ones) in the slow tier, interpreted ones also marked ``interpreted``.
    The missing ones are not params: each backend's own test module skips with their reason."""
    out = []
    for name, impl in sorted(found.items()):
        marks = [pytest.mark.slow] if slow(impl) else []
        marks += [pytest.mark.interpreted] if impl.slow else []
        out.append(pytest.param(name, id=name, marks=marks))
    return out


def cases(found: dict[str, Implementation], values: Iterable, fast: Callable[[Implementation, Any], bool],
          case_id: Callable[[Any], str]) -> list:
    """``(implementation's test id, case)`` params for every implementation of ``found`` and
    case of ``values``: in the slow tier unless ``fast(impl, case)``, interpreted ones also
    marked ``interpreted``; ids ``<implementation>-<case>``."""
    values = list(values)
    out = []
    for name, impl in sorted(found.items()):
        for value in values:
            marks = [] if fast(impl, value) else [pytest.mark.slow]
            marks += [pytest.mark.interpreted] if impl.slow else []
            out.append(pytest.param(name, value, id=f"{name}-{case_id(value)}", marks=marks))
    return out
