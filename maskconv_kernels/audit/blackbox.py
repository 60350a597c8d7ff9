"""The black-box checks: NaN isolation and perturbation, by forward passes only.

Each audited output ``p`` gets its own copy of ``x`` with every input forbidden to ``p``
replaced (by NaN, or by another value: another token, another float); the outputs at
``p`` must stay bit-identical to the clean ones (:func:`~maskconv_kernels.leaks.changed_elements`).
Copies are batched with ``vmap``, in chunks; the first offender is then localised to the
earliest forbidden input that changes it on its own.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import leaks
from .order import Forbidden
from .report import CheckResult, Offence
from .units import chunk_length, padded, unit_function, unit_index

__all__ = ["blackbox_check"]


def _replacement(name: str, xu: jax.Array, vocab_size, rng: np.random.Generator) -> jax.Array:
    """``(U, K)`` values that differ from ``xu`` everywhere: NaN, another token, another float."""
    if name == "nan":
        return jnp.full_like(xu, jnp.nan)
    host = np.asarray(xu)
    if host.dtype == np.bool_:
        return jnp.asarray(~host)
    if np.issubdtype(host.dtype, np.integer):
        vocab = int(vocab_size) if vocab_size is not None else int(host.max()) + 1
        if vocab < 2:
            raise ValueError(f"perturbing integer inputs needs at least 2 values to choose from; x.max() + 1 = "
                             f"{vocab}: pass vocab_size")
        shift = rng.integers(1, vocab, host.shape)
        return jnp.asarray(((host.astype(np.int64) + shift) % vocab).astype(host.dtype))
    # Another float, at least half a standard deviation away (in x's own dtype).
    x32 = host.astype(np.float32)
    scale = max(float(x32.std()), 1.0)
    noise = rng.standard_normal(host.shape).astype(np.float32)
    other = (x32 + np.where(noise >= 0, 1, -1) * (np.abs(noise) + 0.5) * scale).astype(host.dtype)
    return jnp.asarray(np.where(other == host, (-x32 - 1).astype(host.dtype), other))


def blackbox_check(name, f, x, layout, y_struct, forbidden: Forbidden, units, ranks, vocab_size, chunk_size, rng,
                   worst, t0, shared):
    """The ``"nan"`` or ``"perturb"`` check's result: per audited output, the elements that changed.

    ``shared`` holds the batched forward pass and its clean outputs, compiled once for
    both checks.
    """
    xu = layout.to_units(x)
    n_units, k_in = xu.shape
    f_out = int(np.prod(y_struct.shape)) // n_units
    other = _replacement(name, xu, vocab_size, rng)
    chunk = chunk_length(chunk_size, n_units * max(f_out, k_in), 1)

    chunk = min(chunk, len(units))
    if "batched" not in shared:
        g = unit_function(f, x, layout, cast=False)
        shared["batched"] = jax.jit(lambda xs: leaks.bits(jax.vmap(g)(xs)))
    batched = shared["batched"]
    # The clean reference runs through the same executable with the same batch shape, so
    # slot i of a poisoned batch is compared with slot i of a clean one, bit for bit.
    if chunk not in shared:
        shared[chunk] = batched(jnp.broadcast_to(xu[None], (chunk, *xu.shape)))
    reference = shared[chunk]

    def changed(replace, s):
        """Replace ``replace[i]`` (bool ``(U,)``) in copy i; changed output elements at unit ``s[i]``."""
        y = batched(_replaced(xu, other, jnp.asarray(replace)))
        return np.asarray(_count_changed(y, reference, jnp.asarray(s)))

    counts = np.zeros(len(units))
    for i in range(0, len(units), chunk):
        s = padded(units[i: i + chunk], chunk)
        n = min(chunk, len(units) - i)
        counts[i: i + n] = changed(forbidden.rows(s), s)[:n]
    failing = counts > 0
    first_q = np.full(len(units), -1)
    idx = lambda u: unit_index(int(u), layout.positions, layout.groups)  # noqa: E731
    first = None
    if failing.any():
        i = int(np.argmax(failing))
        first_q[i] = _localise(changed, units[i], forbidden, ranks, chunk)
        first = Offence(name, idx(units[i]), None if first_q[i] < 0 else idx(first_q[i]), float(counts[i]))
    offenders = tuple(
        Offence(name, idx(units[i]), None if first_q[i] < 0 else idx(first_q[i]), float(counts[i]))
        for i in np.flatnonzero(failing)[:worst])
    return CheckResult(name, failing, counts, np.full(len(units), -1), first_q, first, offenders,
                       time.perf_counter() - t0)


@jax.jit
def _replaced(xu, other, replace):
    """``(S, U, K)``: copy i of ``xu`` with the units ``replace[i]`` taken from ``other``."""
    return jnp.where(replace[:, :, None], other[None], xu[None])


@jax.jit
def _count_changed(y, reference, s):
    """int ``(S,)``: elements of unit ``s[i]`` that differ between copy i of ``y`` and of ``reference``."""
    rows = jnp.arange(s.size)
    return leaks.changed_elements(y[rows, s], reference[rows, s], axis=-1)


def _localise(changed, unit: int, forbidden: Forbidden, ranks, chunk: int) -> int:
    """The earliest forbidden input unit that changes output ``unit`` on its own (-1 if none does).

    Scans forbidden inputs in the order, one replaced input per batched copy, and stops
    at the first chunk with a hit: leaks usually come from just after the output.
    """
    candidates = np.flatnonzero(forbidden.rows(np.array([unit]))[0])
    candidates = candidates[np.argsort(ranks[candidates], kind="stable")]
    s = np.full((chunk,), unit)
    for i in range(0, len(candidates), chunk):
        q = candidates[i: i + chunk]
        replace = np.zeros((chunk, len(ranks)), bool)
        replace[np.arange(len(q)), q] = True
        hit = np.flatnonzero(changed(replace, s)[: len(q)] > 0)
        if len(hit):
            return int(q[hit[0]])
    return -1
