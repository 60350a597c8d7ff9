"""The fused kernels as three primitives, differentiable to any order, forward and reverse.

* ``causal_conv1d_fwd(P) -> y``: the fused forward kernel;
* ``causal_conv1d_tangent(P, T) -> ty``: the forward's tangent, linear in ``T``;
* ``causal_conv1d_bwd(P, dy) -> cotangents``: the fused backward kernels, linear in ``dy``;

where ``P`` are the operands (x, weight, and the bias, segment ids and state given) and
``T`` the tangents of the differentiable ones (all but the ids). The rules close the set:

* the forward's JVP is ``(fwd(P), tangent(P, T))``;
* the tangent transposes to the backward, and the backward to the tangent (each is the
  other's adjoint), so ``jax.grad`` runs the fused backward kernels and ``jax.linear_transpose``
  of a gradient the tangent;
* the JVPs of the tangent and the backward (second derivatives) are those of the ``xla``
  implementation's same maps, which are themselves differentiable to any order.

So first derivatives in reverse mode run the fused kernels, and every higher derivative
is exact too: the ``xla`` implementation never reads across a document or from the future
either. The tangent itself (forward mode) is the ``xla`` implementation's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from ...._core import primitives as prims
from .. import xla
from ..backends import REGISTRY
from ..checks import Problem
from . import kernels
from .kernels import Static

__all__ = ["forward"]

_IMPLEMENTATION = REGISTRY.get("pallas_triton")


def _diff_names(s: Static) -> tuple[str, ...]:
    """The differentiable operands: all but the segment ids."""
    return tuple(n for n in s.operand_names() if n != "ids")


def _split(s: Static, operands):
    """``(primals by name, the rest)``."""
    names = s.operand_names()
    return dict(zip(names, operands)), tuple(operands[len(names):])


def _xla_forward(s: Static, problem: Problem, named: dict):
    """The ``xla`` implementation's ``y`` from the named operands."""
    return xla.forward(
        named["x"], named["w"], named.get("bias"), named.get("ids"), named.get("state"), problem=problem,
    )


def _as_function_of_diff(s: Static, problem: Problem, named: dict):
    """``f(*differentiable) -> y``, the ``xla`` forward with the ids held fixed."""

    def f(*diff):
        return _xla_forward(s, problem, {**named, **dict(zip(_diff_names(s), diff))})

    return f


# --------------------------------------------------------------------------- the primitives

_FWD = prims.primitive("causal_conv1d_fwd", multiple_results=True)
_TANGENT = prims.primitive("causal_conv1d_tangent", multiple_results=True)
_BWD = prims.primitive("causal_conv1d_bwd", multiple_results=True)


def _y_shape(*avals, s: Static, problem: Problem):
    return [(avals[0].shape, avals[0].dtype)]


def _cotangent_shapes(*avals, s: Static, problem: Problem):
    named, _ = _split(s, avals)
    return [(named[n].shape, named[n].dtype) for n in _diff_names(s)]


prims.def_abstract_eval(_FWD, _y_shape)
prims.def_abstract_eval(_TANGENT, _y_shape)
prims.def_abstract_eval(_BWD, _cotangent_shapes)


def _bind(prim, *operands, s: Static, problem: Problem):
    return prims.bind(prim, *operands, s=s, problem=problem)


# --------------------------------------------------------------------------- lowering


def _kernel_rule(kernel, platform: str, *, s: Static, problem: Problem):
    if not s.interpret:
        reason = _IMPLEMENTATION.unsupported(problem, platform, False)
        if reason is not None:
            raise REGISTRY.unavailable("pallas_triton", platform, reason)
    return prims.kernel_rule(
        functools.partial(kernel, s=s), multiple_results=True, lowering_warnings=_IMPLEMENTATION.lowering_warnings,
    )


def _tangent_by_xla(*operands, s: Static, problem: Problem):
    named, tangents = _split(s, operands)
    f = _as_function_of_diff(s, problem, named)
    return [jax.jvp(f, tuple(named[n] for n in _diff_names(s)), tangents)[1]]


prims.register_lowering(_FWD, functools.partial(_kernel_rule, kernels.forward))
prims.register_lowering(_BWD, functools.partial(_kernel_rule, kernels.backward))
prims.register_lowering(
    _TANGENT, lambda platform, *, s, problem: prims.kernel_rule(
        functools.partial(_tangent_by_xla, s=s, problem=problem), multiple_results=True,
    ),
)


# --------------------------------------------------------------------------- derivatives


def _instantiate(tangents, primals):
    return tuple(ad.instantiate_zeros(t) if type(t) is ad.Zero else t for t, _ in zip(tangents, primals))


def _fwd_jvp(primals, tangents, *, s: Static, problem: Problem):
    named = dict(zip(s.operand_names(), primals))
    diff = [named[n] for n in _diff_names(s)]
    by_name = dict(zip(s.operand_names(), tangents))
    ts = _instantiate([by_name[n] for n in _diff_names(s)], diff)
    y = _bind(_FWD, *primals, s=s, problem=problem)
    return y, _bind(_TANGENT, *primals, *ts, s=s, problem=problem)


def _tangent_jvp(primals, tangents, *, s: Static, problem: Problem):
    """Second order: the ``xla`` implementation's derivative of its own tangent map."""
    n = len(s.operand_names())
    named = dict(zip(s.operand_names(), primals[:n]))
    diff_names = _diff_names(s)

    def tangent(diff, ts):
        f = _as_function_of_diff(s, problem, named)
        return jax.jvp(f, diff, ts)[1]

    diff = tuple(named[m] for m in diff_names)
    t_named = dict(zip(s.operand_names(), tangents[:n]))
    d_diff = _instantiate([t_named[m] for m in diff_names], diff)
    d_ts = _instantiate(tangents[n:], primals[n:])
    out, d_out = jax.jvp(tangent, (diff, tuple(primals[n:])), (d_diff, d_ts))
    return [out], [d_out]


def _bwd_jvp(primals, tangents, *, s: Static, problem: Problem):
    """Second order: the ``xla`` implementation's derivative of its own backward map; the
    values are the fused kernels'."""
    n = len(s.operand_names())
    named = dict(zip(s.operand_names(), primals[:n]))
    diff_names = _diff_names(s)

    def backward(diff, dy):
        f = _as_function_of_diff(s, problem, named)
        return jax.vjp(f, *diff)[1](dy)

    diff = tuple(named[m] for m in diff_names)
    t_named = dict(zip(s.operand_names(), tangents[:n]))
    d_diff = _instantiate([t_named[m] for m in diff_names], diff)
    (d_dy,) = _instantiate(tangents[n:], primals[n:])
    _, d_out = jax.jvp(backward, (diff, primals[n]), (d_diff, d_dy))
    return _bind(_BWD, *primals, s=s, problem=problem), list(d_out)


def _tangent_transpose(cts, *operands, s: Static, problem: Problem):
    """The tangent ``T -> ty`` transposed: the fused backward of ``ct``."""
    n = len(s.operand_names())
    primals, tangents = operands[:n], operands[n:]
    assert not any(ad.is_undefined_primal(p) for p in primals), "the tangent map is linear in its tangents only"
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None] * len(operands)
    grads = _bind(_BWD, *primals, ct, s=s, problem=problem)
    return [None] * n + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, tangents)]


def _bwd_transpose(cts, *operands, s: Static, problem: Problem):
    """The backward ``dy -> cotangents`` transposed: the tangent of ``cts``."""
    n = len(s.operand_names())
    primals, dy = operands[:n], operands[n]
    assert ad.is_undefined_primal(dy) and not any(ad.is_undefined_primal(p) for p in primals)
    (ty,) = _bind(_TANGENT, *primals, *_instantiate(cts, cts), s=s, problem=problem)
    return [None] * n + [ty]


ad.primitive_jvps[_FWD] = _fwd_jvp
ad.primitive_jvps[_TANGENT] = _tangent_jvp
ad.primitive_jvps[_BWD] = _bwd_jvp
ad.primitive_transposes[_TANGENT] = _tangent_transpose
ad.primitive_transposes[_BWD] = _bwd_transpose


# --------------------------------------------------------------------------- batching


def _per_example(names):
    return tuple(name not in ("w", "bias") for name in names)


prims.def_batching(_FWD, lambda n, *, s, problem: _per_example(s.operand_names()), foldable=True)
prims.def_batching(_TANGENT, lambda n, *, s, problem: _per_example(s.operand_names() + _diff_names(s)), foldable=True)
# The backward's weight and bias gradients sum over the examples: mapped.
prims.def_batching(_BWD, lambda n, *, s, problem: _per_example(s.operand_names("dy")), foldable=False)


# --------------------------------------------------------------------------- the entry point


def forward(x, weight, bias, segment_ids, initial_state, *, problem: Problem, config=None, interpret: bool = False):
    """``y (B, L, D)`` in x's dtype from the fused kernels (float32 accumulation, bias and
    SiLU in float32, rounded once); the arguments were checked by the API."""
    from .config import Config

    s = Static(
        width=problem.width, dilation=problem.dilation, silu=problem.silu, has_bias=problem.has_bias,
        has_ids=problem.segmented, has_state=problem.has_state,
        blocks=config or Config.get_default(problem.length, problem.dim), interpret=bool(interpret),
    )
    if 0 in x.shape:
        return jnp.zeros(x.shape, x.dtype)
    optional = ((bias, s.has_bias), (None if segment_ids is None else segment_ids.astype(jnp.int32), s.has_ids),
                (initial_state, s.has_state))
    operands = (x, weight, *(a for a, present in optional if present))
    (y,) = _bind(_FWD, *operands, s=s, problem=problem)
    return y
