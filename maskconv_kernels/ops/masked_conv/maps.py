"""``masked_conv``'s three linear maps as JAX primitives, written once for every backend.

A masked convolution is bilinear in ``(x, kernel)``, and so are its two gradients. Each
is a primitive, built as ``lax.conv_general_dilated`` is:

* ``masked_conv``:             ``y  = conv(x, k)``
* ``masked_conv_input_grad``:  ``dx = conv_dx(dy, k)``  (the transpose of ``conv`` in ``x``)
* ``masked_conv_weight_grad``: ``dk = conv_dk(x, dy)``  (the transpose of ``conv`` in ``k``)

with, for each, a JVP (bilinear: ``p(x, k; tx, tk) = p(tx, k) + p(x, tk)``), transpose
rules in terms of the other two,

* ``conv``:    ``x <- conv_dx(ct, k)``,  ``k <- conv_dk(x, ct)``
* ``conv_dx``: ``dy <- conv(ct, k)``,    ``k <- conv_dk(ct, dy)``
* ``conv_dk``: ``x <- conv_dx(dy, ct)``, ``dy <- conv(x, ct)``

and batching rules, so ``grad``, ``jvp``, ``jacfwd``, ``jacrev``, ``hessian``,
``linearize`` + ``linear_transpose``, ``vmap`` and ``checkpoint`` compose to any order,
and every derivative runs the same exact kernels (a kernel launch is never
differentiated). Forward mode keeps the exactness contract: each term of a JVP is one of
these maps, which never read a masked tap, so a tangent (even NaN) of an input reachable
only through masked taps changes no output tangent.

The backend is chosen when a primitive is **lowered**, per platform: with
``implementation=None`` the lowering for each platform takes the first backend of that
platform's :data:`~.backends.PREFERENCE` that supports the problem there, so one
``jax.export(..., platforms=("cpu", "cuda"))`` holds the ``xla`` path for CPU and the GPU
kernels for cuda; a named backend lowers for any platform it can run on and raises
``NotImplementedError`` (with the ``interpret=True`` hint) for one it cannot. Each
lowering traces the backend's kernel (:mod:`maskconv_kernels._core.primitives`); for
kernel backends in a process with several devices it is wrapped in ``custom_partitioning``
so that XLA splits it along the batch like a native op.

The backend supplies its three kernels and its support check (:mod:`.backends`); the
1-D lift, the fixed-order sum of weight-gradient splits and the scatter of active-tap
weight gradients into the dense kernel gradient happen here (:mod:`.kernel_problem`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from ..._core import primitives as prims
from ..._core.registry import Implementation
from . import backends as _backends
from .kernel_problem import KernelProblem, kernel_problem, lift, scatter_taps, sum_in_order
from .spec import ConvSpec

__all__ = ["Job", "KERNELS", "masked_conv", "conv_p", "conv_dx_p", "conv_dk_p"]


@dataclasses.dataclass(frozen=True)
class Job:
    """What a backend's kernel is given besides its operands."""

    spec: ConvSpec
    problem: KernelProblem | None  # the 2-D problem (kernel backends), else None
    config: Any  # the backend's config, or None (its default)
    interpret: bool
    platform: str  # the lowering platform: "cpu", "cuda", "rocm", "tpu"
    dtype: np.dtype  # the dtype of x and the kernel in the primal call (configs default from it)


def masked_conv(
    x, kernel, spec: ConvSpec, *, backend: Implementation | None, interpret: bool = False, config=None, segment_ids=None
):
    """``y = conv(x, kernel)`` through the three primitives.

    Args:
      x: ``(N, *spatial, C_in)``.
      kernel: ``(*window, C_in // groups, C_out)``.
      spec: the validated problem.
      backend: the backend record, or ``None`` to choose one per lowering platform.
      interpret: run kernel backends in their interpreters.
      config: the backend's frozen config, or ``None`` for its default.
      segment_ids: ``None``, or integers ``(N, *spatial)`` when ``spec.segmented``: a third
        operand of every primitive, data to the maps (they are linear in the other two).
    """
    out_shape = (x.shape[0], *spec.out_spatial, spec.c_out)
    if 0 in x.shape or 0 in kernel.shape or not spec.mask.active_taps:
        # Every output is an empty sum: exact zeros, and zero gradients, with nothing read.
        return jnp.zeros(out_shape, spec.out_dtype)
    call = prims.Call(spec, backend, bool(interpret), config)
    ids = () if segment_ids is None else (segment_ids,)
    bind = lambda x, k, *ids: _bind(conv_p, x, k, *ids, call=call, out_dtype=np.dtype(spec.out_dtype))
    mesh = _explicit_mesh((x, kernel))
    if mesh is None:
        return bind(x, kernel, *ids)
    # Explicit mesh axes type every value by its sharding, which the primitives (and the
    # kernels' refs) do not take: inside auto_axes the types are plain and XLA's
    # partitioner (custom_partitioning for kernel backends) decides the split.
    batch = jax.sharding.PartitionSpec(_batch_axis(x))
    out_sharding = jax.sharding.NamedSharding(mesh, batch)
    return jax.sharding.auto_axes(bind, out_sharding=out_sharding)(x, kernel, *ids)


def _explicit_mesh(args):
    """The abstract mesh of the arguments' types when it has Explicit axes, else None."""
    for a in args:
        mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def _batch_axis(x):
    spec = jax.typeof(x).sharding.spec
    return spec[0] if len(spec) else None


# --------------------------------------------------------------------------- the primitives

KERNELS = prims.Kernels(_backends.REGISTRY)
# Each map in its two flavours, (partitioned, ahead of time): prims.Kernels binds the first but
# ahead of time. conv_p, conv_dx_p and conv_dk_p name the maps.
_FLAVOURS = {
    kind: KERNELS.primitives(name)
    for kind, name in (("forward", "masked_conv"), ("input_grad", "masked_conv_input_grad"),
                       ("weight_grad", "masked_conv_weight_grad"))
}
conv_p, conv_dx_p, conv_dk_p = (_FLAVOURS[k][0] for k in ("forward", "input_grad", "weight_grad"))
_KIND = {p: kind for kind, pair in _FLAVOURS.items() for p in pair}


def _out_shape(kind: str, a, call: prims.Call) -> tuple[int, ...]:
    s = call.problem
    if kind == "forward":
        return (a.shape[0], *s.out_spatial, s.c_out)
    if kind == "input_grad":
        return (a.shape[0], *s.in_spatial, s.c_in)
    return (*s.window, s.c_in // s.groups, s.c_out)


def _effects(call: prims.Call, out_dtype) -> frozenset:
    return KERNELS.effects(call)


for _prim, _kind in _KIND.items():
    prims.def_abstract_eval(
        _prim,
        lambda a, b, *ids, call, out_dtype, kind=_kind: (_out_shape(kind, a, call), out_dtype),
        effects=_effects,
    )


# --------------------------------------------------------------------------- transposes and JVPs


def _dtype(v) -> np.dtype:
    return np.dtype(v.aval.dtype)


def _bind(prim, a, b, *segment_ids, **params):
    return prims.bind(KERNELS.flavour(prim), a, b, *segment_ids, **params)


def _bilinear_transpose(lhs, rhs):
    """Transposes in the first or the second operand; segment ids (data) pass through unchanged.

    ``ad.defbilinear`` takes exactly two operands; this is its rule for two or three.
    """

    def rule(ct, a, b, *segment_ids, call, out_dtype):
        assert ad.is_undefined_primal(a) ^ ad.is_undefined_primal(b)
        rest = [None] * len(segment_ids)
        if ad.is_undefined_primal(a):
            out = ad.Zero(a.aval.to_ct_aval()) if type(ct) is ad.Zero else _transposed(lhs(ct, a, b), call, segment_ids)
            return [out, None, *rest]
        out = ad.Zero(b.aval.to_ct_aval()) if type(ct) is ad.Zero else _transposed(rhs(ct, a, b), call, segment_ids)
        return [None, out, *rest]

    return rule


def _bilinear_jvp(prim, primals, tangents, **params):
    """``jvp(p)(a, b; ta, tb) = p(ta, b) + p(a, tb)``, each term one exact map; segment ids
    are integers, with no tangent."""
    a, b, *ids = primals
    ta, tb = tangents[:2]
    out = _bind(prim, a, b, *ids, **params)
    terms = [_bind(prim, ta, b, *ids, **params)] if type(ta) is not ad.Zero else []
    if type(tb) is not ad.Zero:
        terms.append(_bind(prim, a, tb, *ids, **params))
    # JAX calls a JVP rule only when some tangent is nonzero.
    return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]


# Transposes in the first operand and in the second, as the other two maps (bound in the
# flavour of the moment by _bind).
_TRANSPOSES = {
    "forward": (lambda ct, x, k: (conv_dx_p, ct, k, x), lambda ct, x, k: (conv_dk_p, x, ct, k)),
    "input_grad": (lambda ct, dy, k: (conv_p, ct, k, dy), lambda ct, dy, k: (conv_dk_p, ct, dy, k)),
    "weight_grad": (lambda ct, x, dy: (conv_dx_p, dy, ct, x), lambda ct, x, dy: (conv_p, x, ct, dy)),
}
for _prim, _kind in _KIND.items():
    ad.primitive_transposes[_prim] = _bilinear_transpose(*_TRANSPOSES[_kind])
    ad.primitive_jvps[_prim] = functools.partial(_bilinear_jvp, _prim)


def _transposed(how, call: prims.Call, segment_ids):
    prim, a, b, primal = how
    return _bind(prim, a, b, *segment_ids, call=call, out_dtype=_dtype(primal))


# --------------------------------------------------------------------------- batching

# conv and conv_dx are per example in their first operand (and the segment ids): a map
# over those alone folds into the batch. conv_dk sums over examples, and a mapped kernel
# is a different kernel per map index: those map the primitive.
for _prim, _kind in _KIND.items():
    prims.def_batching(
        _prim, lambda n, **params: (True, False) + (True,) * (n - 2), foldable=_kind != "weight_grad",
    )


# --------------------------------------------------------------------------- lowering, per platform


def _platform_rule(platform: str, *, call: prims.Call, out_dtype, prim):
    kind, spec = _KIND[prim], call.problem
    backend = KERNELS.implementation(platform, call)
    problem = kernel_problem(spec) if "kernel_problem" in backend.traits else None
    job = Job(spec, problem, call.config, call.interpret, platform, np.dtype(spec.dtype))
    # conv and conv_dx: batched operand and output, replicated kernel; conv_dk: both
    # operands batched, the output a sum over examples (psum across devices).
    batched_in = ((True, True) if kind == "weight_grad" else (True, False)) + (True,) * int(spec.segmented)
    return KERNELS.rule(prim, backend, call, functools.partial(_run, kind, backend, job, np.dtype(out_dtype)),
                        multiple_results=False, batched_in=batched_in, batched_out=(kind != "weight_grad",))


def _run(kind: str, backend: Implementation, job: Job, out_dtype: np.dtype, a, b, *segment_ids):
    """One backend kernel on N-D operands: lifts to the 2-D problem and back for kernel backends."""
    module = backend.load()
    if segment_ids:
        # Only backends with the "segments" trait are chosen for segmented problems.
        assert "segments" in backend.traits and "kernel_problem" not in backend.traits, backend.name
        return getattr(module, kind)(a, b, job, out_dtype, segment_ids=segment_ids[0])
    if "kernel_problem" not in backend.traits:
        return getattr(module, kind)(a, b, job, out_dtype)
    p, s, batch = job.problem, job.spec, a.shape[0]
    if kind == "forward":
        y = module.forward(lift(a, p.x_shape(batch)), lift(b, p.kernel_shape()), job, out_dtype)
        return y.reshape(batch, *s.out_spatial, s.c_out)
    if kind == "input_grad":
        dx = module.input_grad(lift(a, p.y_shape(batch)), lift(b, p.kernel_shape()), job, out_dtype)
        return dx.reshape(batch, *s.in_spatial, s.c_in)
    parts = module.weight_grad(lift(a, p.x_shape(batch)), lift(b, p.y_shape(batch)), job, out_dtype)
    # Splits of the pixel reduction are added in a fixed order; masked taps were never
    # computed and are exact zeros.
    dk = scatter_taps(sum_in_order(parts), p).astype(out_dtype)
    return dk.reshape(*s.window, s.c_in, s.c_out)


for _prim in _KIND:
    prims.register_lowering(_prim, functools.partial(_platform_rule, prim=_prim), effects=_effects)
