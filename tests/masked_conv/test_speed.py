"""The CPU training step against ``lax.conv(kernel * mask)``, timed in one process: a
regression check with a generous floor, not a benchmark (``python -m maskconv_kernels.bench roofline`` is).

The 3x3 type-B layer keeps 5 of 9 taps, so an exact kernel that skips the other 4 can be
up to 1.8x faster than lax's convolution over all 9. Its forward+backward once fell to
0.84-1.32x of lax (issue 21: the weight gradient XLA derived from one convolution per
box ran at a third of the GEMM rate) and nothing failed. Samples are interleaved and
each round's two times are compared, so load from other processes slows both alike.
The floor, 1.0x, lies below the 1.23-1.39x measured on the 2-core x86 CPU (2026-12-07,
jax 0.10.2 and 0.12.1; docs/performance.md: 1.37-1.38x), but once in a CI run with
nothing else on the machine the median fell to 0.96x, its rounds spread over 0.88-1.18x.
So a run under the floor is measured once more, and the check fails only where both are
under it: a regression is, a noisy spell is not twice.
"""
from __future__ import annotations

import dataclasses
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskconv_kernels as mk
from maskconv_kernels.bench.conv import PRESETS
from maskconv_kernels.bench.timing import time_interleaved

FLOOR = 1.0


def _training_step(conv, mask):
    """``(y, dx, dk)`` for a fixed cotangent, jitted: one layer's share of a training step."""

    def step(x, k, dy):
        y, pull = jax.vjp(lambda x, k: conv(x, k, mask), x, k)
        return y, pull(dy)

    return jax.jit(step)


def _speedup(steps: dict, args: tuple) -> tuple[float, list[float]]:
    """lax's time over ours, the median of 11 interleaved rounds, and the rounds' ratios."""
    preset = dataclasses.replace(PRESETS["cpu"], samples=11, min_sample_s=0.0)
    times = time_interleaved(steps, [args], preset)
    ratios = [lax_t / ours for ours, lax_t in zip(times["masked_conv"], times["lax.conv(kernel*mask)"])]
    return statistics.median(ratios), ratios


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a check of the CPU path (the xla backend lowered for CPU)")
@pytest.mark.skipif(
    "PYTEST_XDIST_WORKER" in os.environ,
    reason="timed alone: another worker's tests would share the cores; run without -n (.ci/run does)",
)
def test_3x3_type_b_training_step_is_faster_than_lax_conv():
    mask = mk.pixelcnn_mask((3, 3), "B")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (16, 32, 32, 128))  # the shape: fwd+bwd about 0.1-0.3 s
    k = jax.random.normal(keys[1], (3, 3, 128, 128)) / np.sqrt(5 * 128)
    dy = jax.random.normal(keys[2], x.shape)
    steps = {
        "masked_conv": _training_step(lambda x, k, m: mk.masked_conv(x, k, m, implementation="xla"), mask),
        "lax.conv(kernel*mask)": _training_step(mk.leaky_masked_conv, mask),
    }
    for step in steps.values():  # compile outside the timed rounds
        jax.block_until_ready(step(x, k, dy))
    speedup, ratios = _speedup(steps, (x, k, jnp.asarray(dy)))
    if speedup < FLOOR:
        speedup, ratios = max((speedup, ratios), _speedup(steps, (x, k, jnp.asarray(dy))))
    assert speedup >= FLOOR, (
        f"masked_conv's forward+backward at 3x3 type B, N=16, 32x32, C=128 is {speedup:.2f}x lax.conv(kernel*mask) "
        f"(median of {len(ratios)} interleaved rounds: {', '.join(f'{r:.2f}' for r in ratios)}), under the floor "
        f"{FLOOR}x: a regression in the xla backend's CPU path; python -m maskconv_kernels.bench roofline shows "
        "which map"
    )
