"""Two arguments accepted in silence before, now said: ``interpret=True`` where there is no
kernel to interpret, and a kernel narrower than ``x``.

* ``interpret=True`` with ``implementation="xla"`` (or ``causal_conv1d``'s
  ``implementation=None``, which runs ``xla`` only): a ``UserWarning`` from each op that
  takes ``interpret``, pointing at the user's line (under ``jit`` too), and the call runs
  as ``interpret=False`` would: the same primitive parameters, the same bits.
* A float16 kernel with float32 ``x`` (documented in ``masked_conv``'s docstring and
  docs/masked_conv.md): the kernel is widened exactly, so the output is bit for bit that
  of ``kernel.astype(float32)``; only the kernel's gradient is rounded, once, to float16.
"""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import TOLERANCE, random

import maskconv_kernels as mk

F16 = np.dtype("float16")
F32 = np.dtype("float32")
MASK = mk.pixelcnn_mask((3, 3), "B")


def _masked_conv(x, k, **kw):
    return mk.masked_conv(x, k, MASK, **kw)


def _causal_conv1d(x, w, **kw):
    return mk.causal_conv1d(x, w, activation="silu", **kw)


def _causal_conv1d_update(x, w, **kw):
    return mk.causal_conv1d_update(x[:, -1], x[:, :2], w, **kw)[0]  # one token, the state from the others


def _causal_conv(x, k, **kw):
    return mk.causal_conv(x, k, **kw)


def _causal_conv_stream(x, k, **kw):
    return mk.causal_conv_stream(x, None, k, **kw)[0]


# (op as the warning names it, call, x shape, kernel shape)
OPS = [
    ("masked_conv", _masked_conv, (1, 5, 6, 2), (3, 3, 2, 3)),
    ("causal_conv1d", _causal_conv1d, (2, 9, 4), (3, 4)),
    ("causal_conv1d_update", _causal_conv1d_update, (2, 3, 4), (3, 4)),
    ("causal_conv", _causal_conv, (1, 4, 3, 3, 2), (2, 3, 3, 2, 3)),
    ("causal_conv_stream", _causal_conv_stream, (1, 4, 3, 3, 2), (2, 3, 3, 2, 3)),
]
IDS = [op for op, *_ in OPS]


def _interpret_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, UserWarning) and "interpret=True" in str(w.message)]


@pytest.mark.parametrize("op, call, x_shape, k_shape", OPS, ids=IDS)
def test_interpret_with_xla_warns_at_the_users_line_and_changes_nothing(op, call, x_shape, k_shape):
    x, k = random(1, x_shape), random(2, k_shape)
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        plain = call(x, k, implementation="xla")
    assert not _interpret_warnings(quiet)
    message = (f'{op}: interpret=True has no effect with implementation="xla": XLA operations run on every '
               "platform, so there is no kernel to interpret. Drop interpret=True, or name a kernel implementation (")
    with pytest.warns(UserWarning, match=re.escape(message)) as record:
        interpreted = call(x, k, implementation="xla", interpret=True)
    (warning,) = _interpret_warnings(record)
    assert warning.filename == __file__  # the call above, not a line of the package
    assert '"pallas_triton"' in str(warning.message)
    np.testing.assert_array_equal(np.asarray(interpreted), np.asarray(plain))
    # Run as interpret=False runs: the very same program.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert str(jax.make_jaxpr(lambda x: call(x, k, implementation="xla", interpret=True))(x)) == \
            str(jax.make_jaxpr(lambda x: call(x, k, implementation="xla"))(x))


def test_interpret_with_kernel_implementations_says_nothing():
    """Where a kernel can run (named, or implementation=None, whose preference holds kernels:
    masked_conv's, and causal_conv1d's since its TPU kernels lead the TPU's), interpret=True
    does what it says: no warning. Traced only."""
    x, k = random(5, (1, 5, 6, 2)), random(6, (3, 3, 2, 3))
    h, w = random(7, (2, 9, 4)), random(8, (3, 4))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jax.eval_shape(lambda x: mk.masked_conv(x, k, MASK, interpret=True), x)
        jax.eval_shape(lambda x: mk.masked_conv(x, k, MASK, implementation="pallas_triton", interpret=True), x)
        jax.eval_shape(lambda h: mk.causal_conv1d(h, w, implementation="pallas_triton", interpret=True), h)
        jax.eval_shape(lambda h: mk.causal_conv1d(h, w, interpret=True), h)
    assert not _interpret_warnings(record)


# ----------------------------------------------------------------------- a narrower kernel


# (call, x shape, kernel shape, reduction length of one kernel gradient entry: the positions)
NARROW = [
    pytest.param(_masked_conv, (2, 7, 6, 3), (3, 3, 3, 4), 2 * 7 * 6, id="masked_conv"),
    pytest.param(_causal_conv1d, (2, 11, 8), (4, 8), 2 * 11, id="causal_conv1d"),
    pytest.param(_causal_conv, (1, 5, 4, 4, 2), (3, 3, 3, 2, 3), 5 * 4 * 4, id="causal_conv"),
]


@pytest.mark.parametrize("call, x_shape, k_shape, k_reduction", NARROW)
def test_float16_kernel_with_float32_x_is_widened_exactly(call, x_shape, k_shape, k_reduction):
    """The documented behaviour: output float32 and bit for bit that of the widened kernel
    (widening is exact: every product is the same); the kernel's gradient float16, the
    float32 one rounded once (half a float16 ulp, 2^-11 relative, or 2^-25 below its normal
    range), beside the float32 accumulations of two programs (TOLERANCE[float32])."""
    x, k16 = random(9, x_shape, F32), random(10, k_shape, F16)
    k32 = k16.astype(F32)
    y16, y32 = call(x, k16), call(x, k32)
    assert y16.dtype == F32
    np.testing.assert_array_equal(np.asarray(y16), np.asarray(y32))

    loss = lambda k: (call(x, k) ** 2).sum()  # noqa: E731
    g16, g32 = jax.grad(loss)(k16), np.asarray(jax.grad(loss)(k32), np.float64)
    assert g16.dtype == F16
    # dy = 2 y is the same in both programs (y16 == y32 above): only the weight gradient's
    # float32 accumulation over k_reduction positions differs before the rounding to float16.
    dy = 2 * float(np.abs(np.asarray(y32)).max())
    accumulation = TOLERANCE[F32] * np.sqrt(k_reduction) * float(np.abs(np.asarray(x)).max()) * dy
    error = np.abs(np.asarray(g16, np.float64) - g32)
    assert (error <= 2.0**-11 * np.abs(g32) + 2.0**-25 + accumulation).all(), error.max()


@pytest.mark.parametrize("implementation", ["pallas_mosaic_tpu", "pallas_triton"])
def test_a_narrower_kernel_runs_on_kernel_backends_as_the_widened_one(implementation):
    """The kernels take one dtype, so a float16 kernel with float32 x is widened before a
    backend is chosen: a kernel backend runs it (none refuses it), bit for bit the widened
    kernel's program, and the weight gradient comes back float16. Interpreted."""
    x, k16 = random(11, (1, 6, 5, 2), F32), random(12, (3, 3, 2, 3), F16)
    call = lambda k: _masked_conv(x, k, implementation=implementation, interpret=True)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(call(k16)), np.asarray(call(k16.astype(F32))))
    assert jax.grad(lambda k: call(k).sum())(k16).dtype == F16


def test_float16_kernel_gradient_overflows_where_float32_does_not():
    """What the docstring warns of: the kernel's gradient is rounded to float16, whose range
    ends at 65504. 300 * 256 positions = 76800 overflows; float32 weights keep it."""
    x = jnp.full((1, 16, 16, 1), 300.0, F32)
    k = jnp.full((1, 1, 1, 1), 0.5, F16)
    g16 = jax.grad(lambda k: mk.masked_conv(x, k).sum())(k)
    g32 = jax.grad(lambda k: mk.masked_conv(x, k).sum())(k.astype(F32))
    assert np.isinf(np.asarray(g16)).all() and float(g32[0, 0, 0, 0]) == 76800.0
