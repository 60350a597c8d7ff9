"""Primitives whose kernels are chosen and traced when they are lowered, per platform.

Every op's kernels enter JAX here. A kernel is a JAX function of arrays (a ``pallas_call``,
a jax-triton launch, plain ``lax`` ops); an op binds a primitive per linear map or kernel
and says, per lowering platform, which kernel lowers it. What this module adds, once:

* evaluation by lowering (``def_impl``) and abstract evaluation from a shape function,
  the outputs varying over the ``shard_map`` manual axes their operands vary over;
* :func:`bind`, which first casts the operands to vary alike (as lax's binary ops do), so
  that a replicated kernel's cotangent gets the ``psum`` it needs;
* lowering per platform (``mlir.lower_per_platform``: one ``jax.export`` may hold a CPU
  and a cuda path), each kernel traced on plain per-device values: a kernel is a custom
  call that knows nothing of manual axes (Pallas refuses output shapes without them when
  ``check_vma`` is on, and its interpreter's loops mix varying and plain carries);
* the warnings a kernel's lowering raises on purpose (the Pallas Triton deprecation),
  filtered while, and only while, it is lowered;
* the ordered effect of an interpreter made of host callbacks (Mosaic GPU's), declared
  as :data:`INTERPRETER_EFFECTS` so the kernel is traced inline with its tokens threaded,
  never run as a nested computation inside a callback (that nesting deadlocks XLA:CPU's
  thread pools), and so ``jax.checkpoint`` may recompute it (a simulated GPU has no side
  effect to repeat, where a user's ``io_callback`` may);
* batching: a map over the examples alone folds into the batch; anything else maps;
* batch partitioning of kernel calls on several devices (:mod:`.partitioning`);
* what every op's kernel primitives share (:class:`Call`, :class:`Kernels`): the
  implementation chosen per lowering platform from the op's registry, its support
  checked, its kernel lowered with its warnings filtered and, where its record says so,
  batch-partitioned; the interpreter's effect where one may lower the call; and the two
  flavours of each primitive, the partitioned one bound unless an abstract mesh of
  abstract devices (lowering ahead of time for hardware this host lacks) leaves no
  device assignment to partition over.

This is the only module that touches ``jax._src``: ``lower_per_platform``, the
``check_vma`` switch, ``auto_insert_reshard``, ``apply_primitive`` and the set of
primitives that need devices while lowered have no public spelling.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as _config
from jax._src import core as _jcore
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src.interpreters import mlir as _mlir
from jax.experimental import io_callback
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from . import partitioning
from .registry import BATCH

__all__ = [
    "PALLAS_TRITON_DEPRECATION", "primitive", "def_abstract_eval", "bind", "register_lowering", "kernel_rule",
    "def_batching", "zeros_varying", "INTERPRETER_EFFECTS", "several_devices", "Call", "Kernels",
]

# What the Pallas Triton lowering warns since jax 0.11 (filtered while our kernels lower).
PALLAS_TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


def primitive(name: str, *, multiple_results: bool = False, needs_devices: bool = False) -> Primitive:
    """A primitive evaluated by lowering it.

    ``needs_devices``: jit hands a lowering rule the device assignment only when the
    primitive says it needs it, which batch partitioning does; such a primitive cannot be
    lowered under an abstract mesh alone (ahead of time, for a GPU this host lacks).
    """
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(functools.partial(_dispatch.apply_primitive, prim))
    if needs_devices:
        _dispatch.prim_requires_devices_during_lowering.add(prim)
    return prim


def def_abstract_eval(prim: Primitive, shapes: Callable, effects: Callable | None = None) -> None:
    """Abstract evaluation from ``shapes(*avals, **params) -> (shape, dtype)`` (a list of them
    for a primitive with several results).

    Outputs vary over the manual axes of the first operand, which :func:`bind` made those
    of every operand. ``effects(**params)``: the effects a call carries (default none).
    """

    def rule(*avals, **params):
        out = shapes(*avals, **params)
        like = avals[0]
        outs = [like.update(shape=tuple(s), dtype=np.dtype(d), weak_type=False) for s, d in out] if (
            prim.multiple_results) else like.update(shape=tuple(out[0]), dtype=np.dtype(out[1]), weak_type=False)
        return outs, (effects(**params) if effects is not None else frozenset())

    prim.def_effectful_abstract_eval(rule)


def bind(prim: Primitive, *operands, **params):
    """``prim.bind`` on operands cast to vary over the same manual axes (inside ``shard_map``)."""
    return prim.bind(*_jcore.auto_insert_reshard(*operands), **params)


def zeros_varying(shape, dtype, like) -> jax.Array:
    """Zeros typed to vary over the manual axes ``like`` varies over (a transpose's primal
    point, a scan's carry inside ``shard_map``)."""
    return _jcore.auto_insert_reshard(like, jnp.zeros(shape, dtype))[1]


class _InterpreterEffect(_effects.Effect):
    """The ordered effect of a kernel interpreted by host callbacks, as a primitive carries it.

    Mosaic GPU's interpreter orders its simulated threads' ``io_callback``s with an
    ``OrderedIOEffect`` token. Our primitives carry this effect instead, and
    :func:`kernel_rule` hands its token to the interpreter's callbacks: the order is the
    same, but unlike a user's ``io_callback`` the kernel is a pure function of its
    operands, so rematerialisation (``jax.checkpoint``), custom derivatives and control
    flow may repeat or move it.
    """

    def __str__(self):
        return "KernelInterpreter"


_INTERPRETER = _InterpreterEffect()
for _set in (_effects.lowerable_effects, _effects.ordered_effects, _effects.control_flow_allowed_effects,
             _effects.remat_allowed_effects, _effects.custom_derivatives_allowed_effects):
    _set.add_type(_InterpreterEffect)

# What an op's primitives declare when an interpreter made of host callbacks may lower them.
INTERPRETER_EFFECTS = frozenset({_INTERPRETER})


@functools.lru_cache(maxsize=None)
def _ordered_io_effect():
    """The effect of an ordered ``io_callback``: what Mosaic GPU's interpreter threads."""
    jaxpr = jax.make_jaxpr(lambda: io_callback(lambda: np.int32(0), jax.ShapeDtypeStruct((), np.int32), ordered=True))()
    (effect,) = jaxpr.effects
    return effect


def register_lowering(prim: Primitive, rule_for: Callable[..., Callable], effects: Callable | None = None) -> None:
    """Lowers ``prim`` with ``rule_for(platform, **params)``, a rule per lowering platform.

    ``rule_for`` may raise (``NotImplementedError``: this platform cannot run the kernel);
    it returns a lowering rule, usually :func:`kernel_rule`'s.
    """

    def rule(ctx, *operands, **params):
        platforms = tuple(ctx.platforms or ctx.module_context.platforms)
        per_platform = {p: rule_for(p, **params) for p in platforms}
        carried = effects(**params) if effects is not None else frozenset()
        return _mlir.lower_per_platform(ctx, prim.name, per_platform, None, carried, *operands)

    mlir.register_lowering(prim, rule)


def kernel_rule(
    fn: Callable, *, multiple_results: bool, lowering_warnings: Sequence[str] = (), partitioned: Callable | None = None,
) -> Callable:
    """The lowering rule of a kernel ``fn(*arrays)``, traced on plain per-device values.

    ``partitioned``: ``fn`` as :func:`partitioning.custom_partitioned` wraps it, lowered
    instead where the module is lowered for several devices.
    """
    lowered = mlir.lower_fun(fn, multiple_results=multiple_results)
    split = None if partitioned is None else mlir.lower_fun(partitioned, multiple_results=multiple_results)

    def rule(ctx, *operands):
        plain = ctx.replace(avals_in=[_jcore.ShapedArray(a.shape, a.dtype, weak_type=a.weak_type) for a in ctx.avals_in])
        carried = ctx.tokens_in is not None and _INTERPRETER in ctx.tokens_in.effects()
        if carried:  # the interpreter's callbacks thread our token as theirs
            plain = plain.replace(tokens_in=_mlir.TokenSet({_ordered_io_effect(): ctx.tokens_in.get(_INTERPRETER)}))
        with warnings.catch_warnings(), _config._check_vma(False):
            for message in lowering_warnings:
                warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)
            out = (split if split is not None and several_devices(plain) else lowered)(plain, *operands)
        if carried:  # the token the interpreter threaded out, or ours unchanged where it threaded none
            token = ctx.tokens_in.get(_INTERPRETER)
            if plain.tokens_out is not None:
                token = plain.tokens_out.get(_ordered_io_effect())
            ctx.set_tokens_out(_mlir.TokenSet({_INTERPRETER: token}))
        return out

    return rule


def several_devices(ctx) -> bool:
    """Whether the module is lowered for several devices whose assignment is known (jit, not export)."""
    axis_context = ctx.module_context.axis_context
    devices = getattr(axis_context, "device_assignment", None)
    if devices is None and getattr(axis_context, "mesh", None) is not None:
        devices = axis_context.mesh._flat_devices_tuple  # SPMDAxisContext (inside shard_map)
    return devices is not None and len(devices) > 1


def batch_partitioned(fn: Callable, batched_in: Sequence[bool], batched_out: Sequence[bool],
                      multiple_results: bool = False, channels_in=None, channels_out=None) -> Callable:
    """``fn`` split by XLA along the batch of its ``batched_in`` operands, and along the
    channels where ``channels_in`` / ``channels_out`` name their axes (:mod:`.partitioning`);
    its results as ``fn`` gives them (a list where ``multiple_results``)."""

    def run(*operands):
        outs = partitioning.custom_partitioned(lambda *ops: tuple(_results(fn(*ops))), batched_in, batched_out, operands,
                                               channels_in, channels_out)
        return list(outs) if multiple_results else outs[0]

    return run


def _results(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def def_batching(prim: Primitive, per_example: Callable[..., Sequence[bool]], foldable: bool) -> None:
    """Batching for a kernel primitive.

    ``per_example(n_operands, **params)``: for each operand, whether it is per example
    along its leading axis (an activation, a cotangent, segment ids) rather than shared
    (a kernel, a bias). ``foldable``: every result is per example too (a forward, an input
    gradient): a map over per-example operands alone then folds into the batch, one call
    on ``B * N`` examples. Anything else (a mapped kernel; a weight gradient, which sums
    over examples) maps the primitive with ``lax.map``.
    """

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        flags = per_example(len(args), **params)
        front = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        if foldable and all(d is None for d, per in zip(dims, flags) if not per):
            folded = [_fold(_broadcast(a, d, size)) if per else a for a, d, per in zip(front, dims, flags)]
            outs = _results(bind(prim, *folded, **params))
            outs = [o.reshape(size, -1, *o.shape[1:]) for o in outs]
        else:
            mapped = tuple(_broadcast(a, d, size) for a, d in zip(front, dims))
            outs = _results(lax.map(lambda ops: bind(prim, *ops, **params), mapped))
        if prim.multiple_results:
            return list(outs), [0] * len(outs)
        return outs[0], 0

    batching.primitive_batchers[prim] = rule


def _broadcast(a, d, size):
    return jnp.broadcast_to(a, (size, *a.shape)) if d is None else a


def _fold(a):
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


# --------------------------------------------------------------------------- an op's kernel primitives


@dataclasses.dataclass(frozen=True)
class Call:
    """The static parameters every kernel primitive of an op carries (hashable).

    ``problem``: the op's checked problem (what its registry's ``unsupported`` reads);
    ``backend``: the implementation's record, or ``None`` to choose one per lowering
    platform (``implementation=None``); ``interpret``: run a kernel implementation in its
    interpreter; ``config``: the implementation's config, or ``None`` for its default.
    """

    problem: Any
    backend: Any
    interpret: bool
    config: Any


class Kernels:
    """What an op's kernel primitives share, written once: the primitives in two flavours,
    the lowering per platform through the op's registry, and the interpreter's effect.

    Each primitive has a plain flavour and a partitioned one, whose kernel lowerings are
    batch-partitioned (:mod:`.partitioning`) wherever the module is lowered for several
    devices, which makes jit hand them the device assignment. :meth:`bind` takes the
    partitioned flavour but under an abstract mesh of abstract devices (lowering ahead of
    time for a GPU this host lacks, jax >= 0.12), where there is no assignment to
    partition over: the choice follows how the function is lowered, not how many devices
    this process has.
    """

    def __init__(self, registry):
        self.registry = registry
        self._flavours: dict[Primitive, tuple[Primitive, Primitive]] = {}

    def primitives(self, name: str, *, multiple_results: bool = False) -> tuple[Primitive, Primitive]:
        """``(partitioned, ahead_of_time)``: one kernel primitive in its two flavours, the first
        named ``name`` (what jaxprs show), the second ``name + "_unpartitioned"``."""
        split = primitive(name, multiple_results=multiple_results, needs_devices=True)
        plain = primitive(f"{name}_unpartitioned", multiple_results=multiple_results)
        self._flavours[plain] = self._flavours[split] = (split, plain)
        return split, plain

    def flavours(self, prim: Primitive) -> tuple[Primitive, Primitive]:
        """``(partitioned, ahead_of_time)``: the two flavours of ``prim`` (either of them)."""
        return self._flavours[prim]

    def flavour(self, prim: Primitive) -> Primitive:
        """The flavour of ``prim`` to bind now."""
        split, plain = self.flavours(prim)
        return plain if getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None) is not None else split

    def effects(self, call: Call) -> frozenset:
        """The ordered effect of an interpreter made of host callbacks, where one may lower ``call``."""
        if not call.interpret:
            return frozenset()
        return INTERPRETER_EFFECTS if any(b.interpreter == "effects" for b in self.registry.candidates(call.backend)) \
            else frozenset()

    def implementation(self, platform: str, call: Call):
        """The record that lowers ``call`` for ``platform``: the named one, or the platform's
        first preference that runs the problem; raises ``NotImplementedError`` where it cannot."""
        backend = call.backend or self.registry.choose(call.problem, platform, call.interpret)
        reason = backend.unsupported(call.problem, platform, call.interpret)
        if reason is not None:
            raise self.registry.unavailable(backend.name, platform, reason)
        return backend

    def rule(self, prim: Primitive, backend, call: Call, fn: Callable, *, multiple_results: bool,
             batched_in: Sequence[bool], batched_out: Sequence[bool], channels_in=None, channels_out=None) -> Callable:
        """The lowering rule of ``backend``'s kernel ``fn(*operands)`` for ``prim``.

        ``batched_in`` / ``batched_out``: for each operand / result, whether its leading
        axis is the batch (else replicated, or for a result a sum over the examples);
        ``channels_in`` / ``channels_out``: ``None``, or for a depthwise kernel each one's
        channel axis or ``None`` (:func:`.partitioning.custom_partitioned`). The
        partitioned flavour of a ``BATCH`` record's kernel is split along them where the
        module is lowered for several devices; an interpreter made of host callbacks is
        not (host code gains nothing, and a callback inside ``custom_partitioning``
        segfaults on several CPU devices, jax 0.10.2 and 0.12.0).
        """
        partitioned = None
        if prim is self.flavours(prim)[0] and backend.spmd == BATCH and not (call.interpret and backend.interpreter):
            partitioned = batch_partitioned(fn, batched_in, batched_out, multiple_results, channels_in, channels_out)
        return kernel_rule(fn, multiple_results=multiple_results, lowering_warnings=backend.lowering_warnings,
                           partitioned=partitioned)
