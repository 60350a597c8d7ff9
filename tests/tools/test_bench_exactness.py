"""The causal benchmarks' exactness columns: they see a leak where there is one, and none where there is none."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskconv_kernels.bench.exactness import along_time
from maskconv_kernels.bench.table import leak_cell, nan_cell


def _conv(x, w, reach):
    """A depthwise conv along time whose output t reads frames t - W + 1 + reach .. t + reach."""
    width = w.shape[0]
    xp = jnp.pad(x, ((0, 0), (width - 1 - reach, reach), (0, 0)))
    return sum(xp[:, i: i + x.shape[1]] * w[i] for i in range(width))


def _mode_fn(reach, mode, stride=1):
    conv = lambda x, w: _conv(x, w, reach)[:, ::stride]  # noqa: E731
    if mode == "fwd":
        return jax.jit(lambda x, w, dy: conv(x, w))
    if mode == "bwd":
        return jax.jit(lambda x, w, dy: jax.vjp(conv, x, w)[1](dy))
    return jax.jit(lambda x, w, dy: (lambda y, pull: (y, pull(dy)))(*jax.vjp(conv, x, w)))


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
@pytest.mark.parametrize("stride", [1, 2])
def test_causal_is_exact_and_a_future_tap_leaks(mode, stride):
    x = jax.random.normal(jax.random.key(0), (2, 12, 3))
    w = jnp.arange(1.0, 4.0)[:, None] * jnp.ones((3, 3))
    dy = jnp.ones((2, 12 // stride, 3))
    exact = along_time(_mode_fn(0, mode, stride), mode, (x, w, dy), stride)
    leaky = along_time(_mode_fn(stride, mode, stride), mode, (x, w, dy), stride)  # reads `stride` frames ahead
    if mode != "fwd":
        assert exact["leak_max_abs"] == 0.0 and exact["leak_field_reached"]
        assert leaky["leak_max_abs"] > 0 and leak_cell(leaky).startswith("**")
    if mode != "bwd":
        assert exact["nan_isolated"] and exact["nan_changed"] == 0 and nan_cell(exact) == "yes"
        assert exact["nan_clean_outputs"] == 2 * 3 * (6 // stride)
        assert not leaky["nan_isolated"] and leaky["nan_changed"] == 2 * 3  # the last clean frame
    assert ("leak_max_abs" in exact) == (mode != "fwd") and ("nan_isolated" in exact) == (mode != "bwd")


def test_no_measurement_reads_as_a_dash():
    assert leak_cell({}) == nan_cell({}) == "—"
    assert along_time(None, "decode", (np.zeros((1, 2, 1)), np.zeros((1, 2, 1)))) == {}
