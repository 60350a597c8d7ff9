"""The audit's entry points: :func:`audit_causal`, :func:`assert_causal` and :func:`as_function`."""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .blackbox import blackbox_check
from .gradient import gradient_check, gradient_result
from .order import Forbidden, describe_rule, name_of, rank_units, resolve_include_current, sample_units
from .report import CHECKS, CausalityError, CausalityReport, device_text
from .units import Layout, single_leaf

__all__ = ["audit_causal", "assert_causal", "as_function"]


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
        return _named(lambda x: model(x, **apply_kwargs), name_of(model))
    return model


def audit_causal(
    f: Callable[[jax.Array], Any],
    x: Any,
    *,
    order: str | np.ndarray = "raster",
    visible: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    include_current: bool | None = None,
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
      include_current: with an order, whether output ``p`` may see input ``p`` itself.
        ``False``: the PixelCNN rule (its logits at ``p`` predict ``x_p``); ``True``: a
        causal layer, causal attention or a next-token model, which reads the current
        position. ``None`` (the default): learned from the model's ops of this library
        (:func:`~maskconv_kernels.audit.order.learn_include_current`): ``False`` if it
        calls ``masked_conv`` with a masked tap, else ``True`` if it calls
        ``causal_conv1d`` or ``causal_conv``, else ``False``. The report's rule line says
        which value was applied and why; pass it to pin the rule.
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
    layout = Layout.make(x, position_axes, sub_pixels)
    # One trace (what jax.eval_shape would do): the output's shape, and the ops the model calls.
    closed, y_struct = jax.make_jaxpr(lambda v: single_leaf(f(v)), return_shape=True)(x)
    layout.check_output(y_struct)
    if visible is not None and not (isinstance(order, str) and order == "raster"):
        raise ValueError("visible replaces order and include_current: pass either a predicate or an order "
                         "(with include_current), not both")
    include_current, source = resolve_include_current(include_current, visible, closed.jaxpr)
    ranks = rank_units(order, layout, visible)
    rule = describe_rule(order, visible, include_current, layout, source)
    forbidden = Forbidden(layout, ranks, visible, bool(include_current))
    checks = _checks(checks, x.dtype, y_struct.dtype)
    if "gradient" not in checks and method != "auto":
        raise ValueError(f"method={method!r} is how gradients are taken, but checks={checks} has no gradient check")
    if vocab_size is not None and not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"vocab_size is the range of integer tokens, but x is {x.dtype}")
    units, sample = sample_units(positions, layout, ranks, seed)
    # numpy draws: no compilation per shape, and the same values on every device.
    rng = np.random.default_rng(seed)
    results = []
    shared = {}  # the batched forward pass, compiled once for the NaN and perturbation checks
    method_text = "black-box (forward passes only)"
    for name in checks:
        t = time.perf_counter()
        if name == "gradient":
            grad, method_text = gradient_check(f, x, layout, y_struct, units, method, chunk_size, rng)
            results.append(gradient_result(grad, forbidden.rows(units), units, layout, ranks, worst,
                                           time.perf_counter() - t))
        else:
            results.append(blackbox_check(name, f, x, layout, y_struct, forbidden, units, ranks, vocab_size,
                                           chunk_size, rng, worst, t, shared))
    return CausalityReport(
        function=name_of(f),
        input_shape=tuple(x.shape),
        input_dtype=str(x.dtype),
        output_shape=tuple(y_struct.shape),
        output_dtype=str(y_struct.dtype),
        positions=layout.positions,
        sub_pixels=layout.groups,
        rule=rule,
        include_current=include_current,
        audited=units,
        sample=sample,
        method=method_text,
        checks=tuple(results),
        device=device_text(),
        seconds=time.perf_counter() - start,
    )


def assert_causal(f: Callable[[jax.Array], Any], x: Any, **kwargs) -> CausalityReport:
    """:func:`audit_causal`, raising :class:`CausalityError` (an ``AssertionError``) on any leak.

    The error's message is the report: the rule applied (with the ``include_current``
    value and where it came from), the table, the first offending ``(output p, input q)``
    pair with why the rule forbids it and the argument that changes the rule, and the
    worst pairs. Returns the report when the audit passes.
    """
    report = audit_causal(f, x, **kwargs)
    if not report.passed:
        raise CausalityError(report)
    return report


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
