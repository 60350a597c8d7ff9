"""Ops computed by one forward and one backward kernel: three primitives, the backend chosen
when lowered, and derivatives of every order through the op's reference.

``masked_conv`` is bilinear in its operands and is written as three bilinear maps (its
``maps`` module). An op that is not (``causal_conv1d``: bias, SiLU, a state) is written
here, once for all its backends, as

* ``<op>_fwd(P) -> y``: the backend's forward kernel;
* ``<op>_tangent(P, T) -> ty``: the forward's tangent, linear in ``T``;
* ``<op>_bwd(P, dy) -> cotangents``: the backend's backward kernel, linear in ``dy``;

where ``P`` are the operands given, by name, and ``T`` the tangents of the differentiable
ones (all but the op's ``data``: segment ids). The rules close the set:

* the forward's JVP is ``(fwd(P), tangent(P, T))``;
* the tangent transposes to the backward and the backward to the tangent (each is the
  other's adjoint), so ``jax.grad`` runs the backend's backward kernel, and
  ``jax.linear_transpose`` of a gradient the tangent;
* the JVPs of the tangent and of the backward (second derivatives) are those of the op's
  **reference**, a JAX function of the operands differentiable to any order
  (``causal_conv1d``'s ``xla`` implementation), and the tangent is lowered as the
  reference's JVP.

So a kernel backend is a forward and a backward kernel, and every derivative above the
first is exact because the reference is: it never reads what the kernels never read.

The backend is chosen when the forward or the backward is **lowered**, per platform, as
``masked_conv``'s maps are (both are :class:`~.primitives.Kernels`): ``implementation=None``
takes the first implementation of the platform's preference that runs the problem there,
so one ``jax.export`` for ``("cpu", "cuda")`` holds a path for each; a named
implementation that cannot be lowered for a platform raises ``NotImplementedError``
there. On several devices a kernel implementation's forward and backward are split
along the batch (the per-example operands; the shared operands' cotangents summed), and
a depthwise op's (``channels``) along the channels too. A
backend module supplies, besides
``Config`` and ``unsupported`` (:mod:`.registry`),

* ``forward(operands, *, problem, config, interpret) -> y``;
* ``backward(operands, dy, *, problem, config, interpret) -> cotangents``: those of the
  differentiable operands, in the operands' order;

where ``operands`` is a dict of arrays by name. :func:`backward_by_vjp` writes the
backward of a backend made of JAX ops.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable

import jax
from jax.interpreters import ad

from . import primitives as prims
from .registry import Implementation, Registry

__all__ = ["Call", "FusedOp", "backward_by_vjp"]


@dataclasses.dataclass(frozen=True)
class Call(prims.Call):
    """:class:`~.primitives.Call` with ``names``: the operands given, in order."""

    names: tuple[str, ...] = ()


def backward_by_vjp(forward: Callable, data: Iterable[str]) -> Callable:
    """A backend's ``backward`` as the VJP of its ``forward`` (a backend made of JAX ops);
    ``data``: the operands with no cotangent."""
    data = frozenset(data)

    def backward(operands: dict, dy, *, problem, config=None, interpret: bool = False):
        diff = [n for n in operands if n not in data]

        def f(*values):
            return forward({**operands, **dict(zip(diff, values))}, problem=problem, config=config,
                           interpret=interpret)

        return list(jax.vjp(f, *(operands[n] for n in diff))[1](dy))

    return backward


class FusedOp:
    """An op's three primitives and their rules.

    Args:
      name: the op; the primitives are ``<name>_fwd``, ``<name>_tangent``, ``<name>_bwd``.
      registry: its implementations (each module a backend as above), and the preference
        ``implementation=None`` takes per lowering platform.
      reference: ``reference(operands, problem) -> y``, differentiable to any order.
      data: operands with no tangent (integers: segment ids).
      shared: operands not per example (weights, bias): a ``vmap`` over them maps the
        primitive; a ``vmap`` over the others alone folds into the batch.
      channels: for a depthwise op, each operand's channel axis by name (``"y"``: the
        output's; an operand without channels absent), so that on several devices its
        kernels also split along the channels XLA chose to shard
        (:func:`.partitioning.custom_partitioned`); ``None``: along the batch only.
      local: with ``channels``, ``local(problem, operands) -> problem``: the problem of one
        device's slice (the kernels' static parameters follow its shapes).
    """

    def __init__(self, name: str, registry: Registry, reference: Callable, *, data=(), shared=(), channels=None,
                 local=None):
        self.name, self.registry, self.reference = name, registry, reference
        self.data, self.shared = frozenset(data), frozenset(shared)
        self.channels, self.local = channels, local
        self.kernels = prims.Kernels(registry)
        # The kernels' two primitives in their two flavours (prims.Kernels); the tangent is
        # the reference's, XLA operations, which XLA partitions itself.
        self._fwd = self.kernels.primitives(f"{name}_fwd", multiple_results=True)
        self._bwd = self.kernels.primitives(f"{name}_bwd", multiple_results=True)
        self.fwd, self.bwd = self._fwd[0], self._bwd[0]
        self.tangent = prims.primitive(f"{name}_tangent", multiple_results=True)
        self._register()

    def __call__(self, operands: dict, *, problem, backend: Implementation | None, interpret: bool, config):
        """``y`` of the named ``operands`` (checked by the op), by ``backend`` or, for ``None``,
        by the one chosen per lowering platform."""
        call = Call(problem, backend, bool(interpret), config, names=tuple(operands))
        (y,) = self._bind(self.fwd, *operands.values(), call=call)
        return y

    def _bind(self, prim, *operands, call: Call):
        """``prim`` bound in the flavour of the moment (a kernel primitive) or as it is (the tangent)."""
        return prims.bind(prim if prim is self.tangent else self.kernels.flavour(prim), *operands, call=call)

    # ----------------------------------------------------------------------- naming

    def _diff(self, call: Call) -> tuple[str, ...]:
        return tuple(n for n in call.names if n not in self.data)

    def _named(self, call: Call, operands) -> dict:
        return dict(zip(call.names, operands))

    def _of_diff(self, call: Call, named: dict) -> Callable:
        """``f(*differentiable) -> y``: the reference with the data held fixed."""

        def f(*values):
            return self.reference({**named, **dict(zip(self._diff(call), values))}, call.problem)

        return f

    # ----------------------------------------------------------------------- lowering

    def _kernel_rule(self, prim, platform: str, *, call: Call):
        backend = self.kernels.implementation(platform, call)
        module = backend.load()
        forward = prim in self._fwd
        per_example = self._per_example(call.names)

        def run(*operands):
            named = self._named(call, operands if forward else operands[:-1])
            # On one device's slice of a split (the channels), the slice's problem.
            problem = call.problem if self.local is None else self.local(call.problem, named)
            static = dict(problem=problem, config=call.config, interpret=call.interpret)
            if forward:
                return [module.forward(named, **static)]
            return list(module.backward(named, operands[-1], **static))

        # Batch-partitioned on several devices: the per-example operands (and dy) are split,
        # the cotangents of shared operands (weights, bias) summed across devices; a
        # depthwise op's channels stay split where XLA split them.
        batched_in = per_example if forward else (*per_example, True)
        batched_out = (True,) if forward else self._per_example(self._diff(call))
        channels_in = channels_out = None
        if self.channels is not None:
            channels_in = [self.channels.get(n) for n in (call.names if forward else (*call.names, "y"))]
            channels_out = [self.channels.get(n) for n in (("y",) if forward else self._diff(call))]
        return self.kernels.rule(prim, backend, call, run, multiple_results=True, batched_in=batched_in,
                                 batched_out=batched_out, channels_in=channels_in, channels_out=channels_out)

    def _tangent_rule(self, platform: str, *, call: Call):
        n = len(call.names)

        def tangent(*operands):
            named = self._named(call, operands[:n])
            diff = tuple(named[m] for m in self._diff(call))
            return [jax.jvp(self._of_diff(call, named), diff, tuple(operands[n:]))[1]]

        return prims.kernel_rule(tangent, multiple_results=True)

    def _effects(self, *, call: Call) -> frozenset:
        return self.kernels.effects(call)

    # ----------------------------------------------------------------------- derivatives

    def _fwd_jvp(self, primals, tangents, *, call: Call):
        named = self._named(call, primals)
        by_name = self._named(call, tangents)
        diff = self._diff(call)
        ts = _instantiate([by_name[m] for m in diff], [named[m] for m in diff])
        y = self._bind(self.fwd, *primals, call=call)
        return y, self._bind(self.tangent, *primals, *ts, call=call)

    def _tangent_jvp(self, primals, tangents, *, call: Call):
        """Second order: the reference's derivative of its own tangent map."""
        n, diff_names = len(call.names), self._diff(call)
        named = self._named(call, primals[:n])

        def tangent(diff, ts):
            return jax.jvp(self._of_diff(call, named), diff, ts)[1]

        diff = tuple(named[m] for m in diff_names)
        t_named = self._named(call, tangents[:n])
        d_diff = _instantiate([t_named[m] for m in diff_names], diff)
        d_ts = _instantiate(tangents[n:], primals[n:])
        out, d_out = jax.jvp(tangent, (diff, tuple(primals[n:])), (d_diff, d_ts))
        return [out], [d_out]

    def _bwd_jvp(self, primals, tangents, *, call: Call):
        """Second order: the reference's derivative of its own backward map; the values are the
        backend's backward kernel's."""
        n, diff_names = len(call.names), self._diff(call)
        named = self._named(call, primals[:n])

        def backward(diff, dy):
            return jax.vjp(self._of_diff(call, named), *diff)[1](dy)

        diff = tuple(named[m] for m in diff_names)
        t_named = self._named(call, tangents[:n])
        d_diff = _instantiate([t_named[m] for m in diff_names], diff)
        (d_dy,) = _instantiate(tangents[n:], primals[n:])
        _, d_out = jax.jvp(backward, (diff, primals[n]), (d_diff, d_dy))
        return self._bind(self.bwd, *primals, call=call), list(d_out)

    def _tangent_transpose(self, cts, *operands, call: Call):
        """The tangent ``T -> ty`` transposed: the backward kernel of ``ct``."""
        n = len(call.names)
        primals, tangents = operands[:n], operands[n:]
        assert not any(ad.is_undefined_primal(p) for p in primals), "the tangent map is linear in its tangents only"
        (ct,) = cts
        if type(ct) is ad.Zero:
            return [None] * len(operands)
        grads = self._bind(self.bwd, *primals, ct, call=call)
        return [None] * n + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, tangents)]

    def _bwd_transpose(self, cts, *operands, call: Call):
        """The backward ``dy -> cotangents`` transposed: the tangent of ``cts``."""
        n = len(call.names)
        primals, dy = operands[:n], operands[n]
        assert ad.is_undefined_primal(dy) and not any(ad.is_undefined_primal(p) for p in primals)
        (ty,) = self._bind(self.tangent, *primals, *_instantiate(cts, cts), call=call)
        return [None] * n + [ty]

    # ----------------------------------------------------------------------- registration

    def _per_example(self, names) -> tuple[bool, ...]:
        return tuple(name not in self.shared for name in names)

    def _register(self) -> None:
        y_shape = lambda *avals, call: [(avals[0].shape, avals[0].dtype)]  # noqa: E731

        def cotangent_shapes(*avals, call):
            named = self._named(call, avals)
            return [(named[m].shape, named[m].dtype) for m in self._diff(call)]

        for fwd in self._fwd:
            prims.def_abstract_eval(fwd, y_shape, effects=self._effects)
            prims.register_lowering(fwd, functools.partial(self._kernel_rule, fwd), effects=self._effects)
            ad.primitive_jvps[fwd] = self._fwd_jvp
            prims.def_batching(fwd, lambda n, *, call: self._per_example(call.names), foldable=True)
        for bwd in self._bwd:
            prims.def_abstract_eval(bwd, cotangent_shapes, effects=self._effects)
            prims.register_lowering(bwd, functools.partial(self._kernel_rule, bwd), effects=self._effects)
            ad.primitive_jvps[bwd] = self._bwd_jvp
            ad.primitive_transposes[bwd] = self._bwd_transpose
            # The backward's cotangents of shared operands sum over the examples: mapped.
            prims.def_batching(bwd, lambda n, *, call: self._per_example(call.names + ("dy",)), foldable=False)
        prims.def_abstract_eval(self.tangent, y_shape)
        prims.register_lowering(self.tangent, self._tangent_rule)
        ad.primitive_jvps[self.tangent] = self._tangent_jvp
        ad.primitive_transposes[self.tangent] = self._tangent_transpose
        prims.def_batching(
            self.tangent, lambda n, *, call: self._per_example(call.names + self._diff(call)), foldable=True)


def _instantiate(tangents, primals):
    return tuple(ad.instantiate_zeros(t) if type(t) is ad.Zero else t for t, _ in zip(tangents, primals))
