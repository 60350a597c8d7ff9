"""Exactness, and the values, measured on the executables a benchmark timed.

Every mode that times a convolution also runs the same compiled executable twice more:
once with a cotangent at one output only (what gradient reaches inputs that output may
not read?) and once with NaN in inputs some outputs may not read (did any of those
outputs change, bit for bit?). On a GPU this is the point of the columns: cuDNN's
algorithms may mix taps, so ``lax.conv`` can leak where ours cannot. The convolution
grid measures it over a mask (:func:`maskconv_kernels.bench.conv.exactness`); this
module does it along time, for the causal modes (``sequence``, ``causal_conv``); their
table cells are :mod:`.table`'s. :func:`differences` compares two executables' outputs
on the same inputs (the grid against cuDNN, ``sequence`` against the shift-and-add,
``causal_conv`` against ``jnp.pad`` + ``lax.conv``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import leaks


def along_time(compiled, mode: str, args, stride: int = 1) -> dict:
    """Causality along axis 1 of a timed executable ``compiled(x, *params, dy)``.

    Output frame ``t`` of a causal convolution with time stride ``stride`` may read input
    frames ``<= t * stride`` only (left padding, any width and padding mode).

    * ``bwd``, ``fwd+bwd``: the cotangent is nonzero only at the middle output frame
      ``t_o`` (random values); ``leak_max_abs`` is the largest ``|dx|`` at input frames
      after ``t_o * stride`` (exact: ``0.0``), ``leak_field_reached`` says frames up to it
      got gradient. ``bwd`` returns ``(dx, ...)``, ``fwd+bwd`` ``(y, (dx, ...))``.
    * ``fwd``, ``fwd+bwd``: input frames from the middle on become NaN; ``nan_changed``
      counts the elements of the outputs before them (which read none of them) that
      changed bit for bit (exact: 0), of ``nan_clean_outputs``.

    Args:
      compiled: the executable timed, ``(x (N, T, ..., C), *params, dy (N, T_out, ..., C'))``.
      mode: ``"fwd"``, ``"bwd"`` or ``"fwd+bwd"`` (others measure nothing: ``{}``).
      args: one argument set of ``compiled``.
      stride: the time stride.
    """
    x, params, dy = args[0], tuple(args[1:-1]), args[-1]
    frames_in, frames_out = x.shape[1], dy.shape[1]
    result = {}
    if mode in ("bwd", "fwd+bwd"):
        t_o = frames_out // 2
        cot = np.zeros(dy.shape, np.float32)
        cot[:, t_o] = np.random.default_rng(0).standard_normal(cot[:, t_o].shape)
        out = compiled(x, *params, jnp.asarray(cot, dy.dtype))
        dx = out[0] if mode == "bwd" else out[1][0]
        per_frame = np.asarray(jnp.max(jnp.abs(dx.astype(jnp.float32)), axis=_all_but_time(dx)), np.float64)
        forbidden = np.arange(frames_in) > t_o * stride
        result["leak_max_abs"] = leaks.forbidden_gradient(per_frame, forbidden)
        result["leak_field_reached"] = bool((per_frame[~forbidden] > 0).any())
    if mode in ("fwd", "fwd+bwd"):
        t_p = frames_in // 2
        poisoned = jnp.asarray(x).at[:, t_p:].set(jnp.nan)
        y0, y1 = compiled(x, *params, dy), compiled(poisoned, *params, dy)
        if mode == "fwd+bwd":
            y0, y1 = y0[0], y1[0]
        clean = np.arange(frames_out) * stride < t_p
        changed = np.asarray(leaks.changed_elements(y0, y1, axis=_all_but_time(y0)))[clean]
        result["nan_clean_outputs"] = int(clean.sum()) * (y0.size // frames_out)
        result["nan_changed"] = int(changed.sum())
        result["nan_isolated"] = bool(clean.any()) and not changed.any()
    return result


def differences(outputs, reference) -> dict:
    """How far ``outputs`` (a pytree of arrays) are from ``reference`` (the same structure), in float32:
    ``max_abs_diff`` over every leaf, and ``max_rel_diff``, each leaf's largest ``|difference|`` over its
    largest ``|reference|``, the worst leaf's. Two executables given the same inputs compute the same
    function where these are rounding only."""
    diffs, rels = [], []
    for a, b in zip(jax.tree_util.tree_leaves(outputs), jax.tree_util.tree_leaves(reference)):
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        diff, scale = float(jnp.max(jnp.abs(a - b))), float(jnp.max(jnp.abs(b)))
        diffs.append(diff)
        rels.append(diff / scale if scale > 0 else diff)
    return {"max_abs_diff": max(diffs), "max_rel_diff": max(rels)}


def _all_but_time(a) -> tuple[int, ...]:
    return tuple(i for i in range(a.ndim) if i != 1)


def measure(compiled, mode: str, args, row: dict, stride: int = 1) -> None:
    """:func:`along_time` into ``row``; a failure is recorded as ``exactness_error``, not raised."""
    try:
        row.update(along_time(compiled, mode, args, stride))
    except Exception as e:  # the timing stands; say why the exactness is missing
        row["exactness_error"] = f"{type(e).__name__}: {e}"[:300]
