"""The gradient check: ``|dy_p / dx_q|`` at every forbidden input ``q`` of each audited output ``p``.

Reverse mode takes one VJP per audited output (batched with ``vmap``, in chunks);
forward mode one JVP per input unit, where that is cheaper and ``f`` allows it. Both
take the largest entry over a unit's features, exactly (one basis vector per feature,
up to :data:`MAX_BASIS`) or through one random projection, and measure in float32
whatever the model's dtype. The figure per output is :func:`~maskconv_kernels.leaks.forbidden_gradient`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import leaks
from .order import equations
from .report import CheckResult, Offence
from .units import chunk_length, padded, unit_function, unit_index

__all__ = ["gradient_check", "gradient_result", "MAX_BASIS"]

# Exact per-feature Jacobian entries up to this many basis vectors per position;
# beyond it, one random projection per position (stated in the report).
MAX_BASIS = 16


def _basis(n_dims: int, rng: np.random.Generator, count: int) -> tuple[np.ndarray | jax.Array, bool]:
    """Per-unit vectors ``(B, n_dims)``: the identity (exact entries) or one random unit-variance vector."""
    if n_dims <= MAX_BASIS:
        return jnp.eye(n_dims, dtype=jnp.float32), True
    return jnp.asarray(rng.standard_normal((count, 1, n_dims), np.float32)), False


def _supports_forward(g, xu) -> bool:
    """Whether ``g`` can be differentiated in forward mode: no ``custom_vjp`` anywhere inside.

    Read from the jaxpr (nested jaxprs included): a ``custom_vjp`` may sit under
    platform-dependent code, where tracing a ``jvp`` succeeds and only lowering fails.
    (``masked_conv`` has forward mode: its primitives carry JVP rules.)
    """
    try:
        jaxpr = jax.make_jaxpr(g)(xu)
    except Exception:
        return False
    blocking = ("custom_vjp_call", "custom_vjp_call_jaxpr", "pure_callback")
    return not any(eqn.primitive.name in blocking for eqn in equations(jaxpr.jaxpr))


def gradient_check(f, x, layout, y_struct, units, method, chunk_size, rng):
    """float64 ``(S, U)``: the largest ``|dy_s / dx_q|`` of each audited output ``s`` and input unit ``q``
    (every input; :func:`gradient_result` keeps the forbidden ones), and the method in words."""
    if method not in ("auto", "reverse", "forward"):
        raise ValueError(f'method must be "auto", "reverse" or "forward", got {method!r}')
    g = unit_function(f, x, layout, cast=True)
    xu = layout.to_units(x.astype(jnp.float32))
    n_units, k_in = xu.shape
    f_out = int(np.prod(y_struct.shape)) // n_units
    every = len(units) == n_units
    cost_rev = f_out if f_out <= MAX_BASIS else 1
    cost_fwd = k_in if k_in <= MAX_BASIS else 1
    if method == "forward":
        if not every:
            raise ValueError("method='forward' measures every output at once, so it needs positions='all'")
        if not _supports_forward(g, xu):
            raise ValueError("method='forward' cannot differentiate f forward (a custom_vjp or a callback "
                             "inside); use method='reverse'")
    use_forward = method == "forward" or (
        method == "auto" and every and cost_fwd < cost_rev and _supports_forward(g, xu))
    if use_forward:
        grad, text = _forward_leaks(g, xu, f_out, chunk_size, rng)
        grad = grad[units]
    else:
        grad, text = _reverse_leaks(g, xu, units, f_out, chunk_size, rng)
    dtype_note = "" if x.dtype == jnp.float32 else f"; {x.dtype} model, gradients taken in float32 at its boundary"
    return grad, text + dtype_note


def _reverse_leaks(g, xu, units, f_out, chunk_size, rng):
    """``(S, U)``: max over the unit's output features (or one projection) of ``max_K |dy_s/dx_q|``."""
    n_units, k_in = xu.shape
    vectors, exact = _basis(f_out, rng, len(units))
    b = vectors.shape[-2]
    chunk = min(chunk_length(chunk_size, n_units * max(f_out, k_in), b), len(units))

    @jax.jit
    def rows(xu, s, vec):
        _, vjp = jax.vjp(g, xu)
        # One cotangent per (output unit, basis vector): nonzero only on that unit's row.
        s_rep = jnp.repeat(s, b)
        ct = jnp.zeros((s_rep.size, n_units, f_out), jnp.float32).at[jnp.arange(s_rep.size), s_rep].set(
            vec.reshape(-1, f_out))
        (dx,) = jax.vmap(vjp)(ct)
        return jnp.abs(dx).max(-1).reshape(s.size, b, n_units).max(1)

    out = np.empty((len(units), n_units))
    for i in range(0, len(units), chunk):
        s = padded(units[i: i + chunk], chunk)
        vec = jnp.broadcast_to(vectors, (chunk, b, f_out)) if exact else vectors[padded(np.arange(i, min(
            i + chunk, len(units))), chunk)]
        out[i: i + chunk] = np.asarray(rows(xu, jnp.asarray(s), vec), np.float64)[: min(chunk, len(units) - i)]
    what = (f"exact entries: one VJP per output feature, {b} per position" if exact else
            f"one VJP per position with a random N(0, 1) projection of its {f_out} output features "
            "(nonzero iff some feature leaks, almost surely)")
    return out, f"reverse mode (vmap over outputs, chunks of {chunk}); {what}"


def _forward_leaks(g, xu, f_out, chunk_size, rng):
    """``(U_out, U_in)``: max over output features of ``|d y_p / d x_q|`` (exact or one input projection)."""
    n_units, k_in = xu.shape
    vectors, exact = _basis(k_in, rng, n_units)
    b = vectors.shape[-2]
    chunk = min(chunk_length(chunk_size, n_units * max(f_out, k_in), b), n_units)

    @jax.jit
    def cols(xu, q, vec):
        q_rep = jnp.repeat(q, b)
        t = jnp.zeros((q_rep.size, n_units, k_in), jnp.float32).at[jnp.arange(q_rep.size), q_rep].set(
            vec.reshape(-1, k_in))
        dy = jax.vmap(lambda t: jax.jvp(g, (xu,), (t,))[1])(t)
        return jnp.abs(dy).max(-1).reshape(q.size, b, n_units).max(1)

    units = np.arange(n_units)
    out = np.empty((n_units, n_units))
    for i in range(0, n_units, chunk):
        q = padded(units[i: i + chunk], chunk)
        vec = jnp.broadcast_to(vectors, (chunk, b, k_in)) if exact else vectors[q]
        out[:, i: i + chunk] = np.asarray(cols(xu, jnp.asarray(q), vec), np.float64)[: min(chunk, n_units - i)].T
    what = (f"exact entries: one JVP per input channel, {b} per position" if exact else
            f"one JVP per input position with a random N(0, 1) projection of its {k_in} input elements")
    return out, f"forward mode (vmap over inputs, chunks of {chunk}; cheaper than reverse here); {what}"


def gradient_result(grad: np.ndarray, forbidden: np.ndarray, units, layout, ranks, worst: int,
                    seconds: float) -> CheckResult:
    """The check's result from ``grad`` (:func:`gradient_check`) and ``forbidden``, bool ``(S, U)``.

    An output fails when any forbidden input has a nonzero (or NaN) gradient; its figure
    is :func:`~maskconv_kernels.leaks.forbidden_gradient` over its row.
    """
    offending = forbidden & (grad != 0)  # NaN != 0: a NaN gradient is a leak
    value = np.where(offending, grad, 0.0)
    sortable = np.where(np.isnan(value), np.inf, value)
    worst_q = np.where(offending.any(1), sortable.argmax(1), -1)
    first_q = np.where(offending.any(1), np.argmin(np.where(offending, ranks[None, :], np.iinfo(np.int64).max), 1), -1)
    figure = leaks.forbidden_gradient(grad, forbidden, axis=1)
    failing = offending.any(1)
    idx = lambda u: unit_index(int(u), layout.positions, layout.groups)  # noqa: E731
    first = None
    if failing.any():
        i = int(np.argmax(failing))
        first = Offence("gradient", idx(units[i]), idx(first_q[i]), float(grad[i, first_q[i]]))
    bad = np.flatnonzero(failing)
    bad = bad[np.argsort(-np.where(np.isnan(figure[bad]), np.inf, figure[bad]), kind="stable")][:worst]
    offenders = tuple(Offence("gradient", idx(units[i]), idx(worst_q[i]), float(figure[i])) for i in bad)
    return CheckResult("gradient", failing, figure, worst_q, first_q, first, offenders, seconds)
