"""An op's implementations table: its records, its default order and its one error, in the op's words.

An implementation is a module of the op's package (``ops/<op>/<name>``) that supplies

* ``Config``: its frozen, validated config (``None`` means the module's heuristic);
* ``unsupported(problem, platform, interpret) -> str | None``: why it cannot run
  ``problem`` lowered for ``platform`` (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``;
  ``None`` asks about the problem alone), ``None`` when it can;
* the kernels the op calls (their names are the op's business).

Modules are imported on first use, so an optional dependency (triton, jax-triton) is
needed only by those who use its implementation.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Sequence

import jax

__all__ = ["Implementation", "Registry", "lowering_platform", "NATIVE", "BATCH"]

# How an implementation meets XLA's SPMD partitioner.
NATIVE = "native"  # made of XLA ops: XLA partitions it itself, along any axis
BATCH = "batch"  # custom calls: split along the batch by custom_partitioning (_core.partitioning)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of an op.

    Attributes:
      name: the ``implementation=`` string; it says the lowering.
      module: the module supplying ``Config``, ``unsupported`` and the kernels.
      spmd: ``NATIVE`` (XLA partitions it) or ``BATCH`` (batch-partitioned custom calls).
      interpreter: how its ``interpret=True`` mode runs: ``None`` (traced inline, as
        Pallas' Triton interpreter is), ``"callback"`` (a host callback:
        ``jax.pure_callback``, Triton's interpreter in a worker process) or ``"effects"``
        (inline, carrying the ordered effect of Mosaic GPU's interpreter, whose
        simulated threads are host callbacks). Interpreted calls are not partitioned:
        host code gains nothing from it, and a callback inside ``custom_partitioning``
        segfaults on several CPU devices (jax 0.10.2 and 0.12.0).
      lowering_warnings: messages of warnings its lowering raises on purpose, filtered
        while (and only while) its kernels are lowered.
      traits: what else the op asks of it (for ``masked_conv``: ``"kernel_problem"``,
        ``"segments"``, ``"mixed_dtypes"``).
      requirements: the op's own check, set by its :class:`Registry`: why the op's needs
        (segment ids, mixed dtypes) rule it out, before its module is asked.
    """

    name: str
    module: str
    spmd: str = BATCH
    interpreter: str | None = None
    lowering_warnings: tuple[str, ...] = ()
    traits: frozenset = frozenset()
    requirements: Callable[["Implementation", Any], str | None] | None = dataclasses.field(default=None, compare=False)

    def load(self):
        return importlib.import_module(self.module)

    def config_class(self) -> type:
        return self.load().Config

    def unsupported(self, problem: Any, platform: str | None, interpret: bool = False) -> str | None:
        """Why it cannot run ``problem`` lowered for ``platform`` (``None``: asks about the problem alone)."""
        reason = None if self.requirements is None else self.requirements(self, problem)
        return reason if reason is not None else self.load().unsupported(problem, platform, interpret)


class Registry:
    """An op's implementations, tried in ``preference`` order by ``implementation=None``.

    ``op`` names the op in every error (``"causal_conv1d"``), so a user reads the words of
    the function they called.
    """

    def __init__(
        self, op: str, implementations: Sequence[Implementation], preference: Sequence[str],
        requirements: Callable[[Implementation, Any], str | None] | None = None,
    ):
        """``requirements(implementation, problem)``: why the op's own needs (segment ids,
        mixed dtypes) rule an implementation out, before its module is asked."""
        self.op = op
        self.by_name = {i.name: dataclasses.replace(i, requirements=requirements) for i in implementations}
        self.names = tuple(self.by_name)
        self.preference = tuple(preference)
        assert set(self.preference) <= set(self.names), (self.preference, self.names)

    def __iter__(self):
        return iter(self.by_name.values())

    def get(self, name: str, op: str | None = None) -> Implementation:
        try:
            return self.by_name[name]
        except (KeyError, TypeError):
            raise ValueError(f"{op or self.op}: implementation must be None or one of {self.names}, got {name!r}") \
                from None

    def check(self, name: str, problem: Any, interpret: bool, config: Any, op: str | None = None) -> Implementation:
        """The named implementation, if it takes ``problem`` and ``config`` (the platform is asked when lowered).

        ``op``: the public function called, in the errors, when another than the registry's
        op calls it (``causal_conv1d_update`` runs ``causal_conv1d``'s registry).
        """
        op = op or self.op
        implementation = self.get(name, op)
        cls = implementation.config_class()
        if config is not None and not isinstance(config, cls):
            raise TypeError(
                f'{op}(implementation="{name}") takes config={cls.__module__}.{cls.__qualname__}(...) or None, '
                f"got {type(config).__name__}"
            )
        reason = implementation.unsupported(problem, None, interpret)
        if reason is not None:
            raise NotImplementedError(f'{op}(implementation="{name}") does not support this problem: {reason}')
        return implementation

    def choose(self, problem: Any, platform: str, interpret: bool = False) -> Implementation:
        """The first implementation of ``preference`` that runs ``problem`` lowered for ``platform``."""
        reasons = []
        for name in self.preference:
            reason = self.by_name[name].unsupported(problem, platform, interpret)
            if reason is None:
                return self.by_name[name]
            reasons.append(f"{name}: {reason}")
        raise NotImplementedError(f"{self.op}: no implementation runs this problem on {platform}: " + "; ".join(reasons))

    def unavailable(self, name: str, platform: str, reason: str) -> NotImplementedError:
        """The error for an implementation named by the caller that cannot be lowered for ``platform``."""
        return NotImplementedError(
            f'{self.op}(implementation="{name}") cannot be lowered for platform "{platform}": {reason}'
        )


def lowering_platform(platform: str | None = None) -> str:
    """A platform as lowering names it: jax's ``"gpu"`` is ``"cuda"`` or ``"rocm"``; default: jax's."""
    platform = platform or jax.default_backend()
    if platform != "gpu":
        return platform
    try:
        version = jax.devices("gpu")[0].client.platform_version.lower()
    except Exception:  # pragma: no cover - no initialised GPU backend
        return "cuda"
    return "rocm" if "rocm" in version else "cuda"
