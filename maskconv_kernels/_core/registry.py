"""An op's implementations table: its records, its preference per platform and its one error, in the op's words.

An implementation is a module of the op's package (``ops/<op>/<name>``) that supplies

* ``Config``: its frozen, validated config (``None`` means the module's heuristic);
* ``unsupported(problem, platform, interpret) -> str | None``: why it cannot run
  ``problem`` (``platform``: the lowering platform, ``"cpu"``, ``"cuda"``, ``"rocm"``,
  ``"tpu"``, for what only that platform's hardware decides, a compute capability say;
  ``None`` asks about the problem alone), ``None`` when it can;
* the kernels the op calls (their names are the op's business);
* optionally ``not_preferred(problem, platform) -> str | None``: why ``implementation=None``
  should pass over it for a problem it runs (where it was measured slower, or not
  measured), ``None`` where its place in the platform's preference stands. Named, it
  runs whatever its ``unsupported`` allows.

Which platforms an implementation lowers for is its record's (:attr:`Implementation.platforms`),
checked here once for every module; ``interpret=True`` runs a kernel implementation in its
interpreter on any platform. Which implementation ``implementation=None`` takes is the
op's preference *for the platform it is lowered for*: a table per platform, so that a
kernel is never chosen for a platform it was not written for (``interpret=True`` included).

Modules are imported on first use, so an optional dependency (triton, jax-triton) is
needed only by those who use its implementation.
"""
from __future__ import annotations

import dataclasses
import importlib
import types
from typing import Any, Callable, Mapping, Sequence

import jax

from .interpret import nothing_to_interpret

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
      platforms: the lowering platforms its kernels compile for (``("cuda",)``,
        ``("tpu",)``), or ``None`` for every platform (XLA operations). Elsewhere it runs
        only with ``interpret=True``.
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
    platforms: tuple[str, ...] | None = None
    spmd: str = BATCH
    interpreter: str | None = None
    lowering_warnings: tuple[str, ...] = ()
    traits: frozenset = frozenset()
    requirements: Callable[["Implementation", Any], str | None] | None = dataclasses.field(default=None, compare=False)

    def load(self):
        return importlib.import_module(self.module)

    def config_class(self) -> type:
        return self.load().Config

    def lowers_for(self, platform: str) -> bool:
        """Whether its kernels compile for ``platform`` (a lowering platform; jax's ``"gpu"`` is cuda)."""
        return self.platforms is None or _PLATFORM_NAMES.get(platform, platform) in self.platforms

    def unsupported(self, problem: Any, platform: str | None, interpret: bool = False) -> str | None:
        """Why it cannot run ``problem`` lowered for ``platform`` (``None``: asks about the problem alone)."""
        reason = None if self.requirements is None else self.requirements(self, problem)
        if reason is None and platform is not None and not interpret and not self.lowers_for(platform):
            reason = (
                f'platform "{platform}": its kernels lower for {" and ".join(map(_words, self.platforms))} only '
                "(pass interpret=True to run them in their interpreter on any platform, slowly)"
            )
        return reason if reason is not None else self.load().unsupported(problem, platform, interpret)

    def not_preferred(self, problem: Any, platform: str) -> str | None:
        """Why ``implementation=None`` passes over it for ``problem`` on ``platform`` (its
        module's ``not_preferred``, where it has one), ``None`` where it does not."""
        module = self.load()
        return module.not_preferred(problem, platform) if hasattr(module, "not_preferred") else None


# jax's name for a platform -> the lowering platform the records name.
_PLATFORM_NAMES = {"gpu": "cuda"}


def _words(platform: str) -> str:
    return {"cuda": "NVIDIA GPUs (cuda)", "rocm": "AMD GPUs (rocm)", "tpu": "TPUs (tpu)"}.get(platform, platform)


class Registry:
    """An op's implementations and, per lowering platform, the order ``implementation=None`` tries them in.

    ``op`` names the op in every error (``"causal_conv1d"``), so a user reads the words of
    the function they called. ``preference``: ``{platform: names}`` for the lowering
    platforms (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``), each name one that lowers
    for its platform; a platform it does not name (a plugin's) tries the implementations
    that lower everywhere, in the order given.
    """

    def __init__(
        self, op: str, implementations: Sequence[Implementation], preference: Mapping[str, Sequence[str]],
        requirements: Callable[[Implementation, Any], str | None] | None = None,
    ):
        """``requirements(implementation, problem)``: why the op's own needs (segment ids,
        mixed dtypes) rule an implementation out, before its module is asked."""
        self.op = op
        self.by_name = {i.name: dataclasses.replace(i, requirements=requirements) for i in implementations}
        self.names = tuple(self.by_name)
        self.preference = types.MappingProxyType({p: tuple(names) for p, names in preference.items()})
        for platform, names in self.preference.items():
            assert all(n in self.by_name and self.by_name[n].lowers_for(platform) for n in names), (platform, names)

    def __iter__(self):
        return iter(self.by_name.values())

    def preference_for(self, platform: str) -> tuple[str, ...]:
        """The names ``implementation=None`` tries, in order, lowered for ``platform``."""
        platform = _PLATFORM_NAMES.get(platform, platform)
        if platform in self.preference:
            return self.preference[platform]
        return tuple(n for n, i in self.by_name.items() if i.platforms is None)

    def get(self, name: str, op: str | None = None) -> Implementation:
        try:
            return self.by_name[name]
        except (KeyError, TypeError):
            raise ValueError(f"{op or self.op}: implementation must be None or one of {self.names}, got {name!r}") \
                from None

    def resolve(self, problem: Any, implementation: str | None, interpret, config, op: str | None = None):
        """What a call asked for, checked: ``(record or None, interpret)``, in the words of ``op``
        (the public function called; default the registry's op).

        ``implementation=None`` is chosen per platform when lowered (``None`` returned) and
        takes no ``config``. A named implementation must take ``problem`` and ``config``
        (the platform is asked when lowered). ``interpret=True`` where every implementation
        the call can run is ``"xla"`` is void: a ``UserWarning`` says so, and ``False`` is
        returned.
        """
        op = op or self.op
        if not isinstance(interpret, bool):
            raise TypeError(f"{op}: interpret must be True or False, got {interpret!r}")
        backend = None
        if implementation is not None:
            backend = self.check(implementation, problem, interpret, config, op=op)
        elif config is not None:
            raise ValueError(f"{op}: config= is the config of one implementation: name it with implementation=")
        return backend, interpret and not nothing_to_interpret(op, self, implementation, interpret)

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
        """The first implementation of the platform's preference that runs ``problem`` there and
        is preferred for it (``interpret=True``: in its interpreter; it never brings in another
        platform's kernels)."""
        reasons = []
        for name in self.preference_for(platform):
            record = self.by_name[name]
            reason = record.unsupported(problem, platform, interpret) or record.not_preferred(problem, platform)
            if reason is None:
                return record
            reasons.append(f"{name}: {reason}")
        raise NotImplementedError(f"{self.op}: no implementation runs this problem on {platform}: " + "; ".join(reasons))

    def candidates(self, backend: Implementation | None) -> list[Implementation]:
        """The implementations a call may lower with: the named one, or every preferred one, on any platform."""
        if backend is not None:
            return [backend]
        names = dict.fromkeys(n for names in self.preference.values() for n in names)
        return [self.by_name[n] for n in names]

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
