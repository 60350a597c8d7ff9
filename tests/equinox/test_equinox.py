"""The Equinox drop-in: ``maskconv_kernels.equinox.Conv`` for ``equinox.nn.Conv``.

First Equinox's own convolution tests (``tests/test_nn.py``: ``test_conv1d``,
``test_conv2d``, ``test_conv3d``, ``test_conv_padding``, ``test_conv_circular``), ported
with ``eqx.nn.Conv*`` replaced by ours; their complex-valued case is refused, and says
so. Then what a drop-in promises: the same fields, the same parameters from the same
key, the same leaves (a serialised ``eqx.nn.Conv`` loads into it), the same outputs as
``eqx.nn.Conv`` with ``weight * mask`` for finite inputs, and exactness where that leaks.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import pytest
from support.numerics import assert_close, random
from support.tiers import tiered

import maskconv_kernels as mk

eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install '.[equinox]'")
mk_eqx = pytest.importorskip("maskconv_kernels.equinox")


# One compiled program per call (what a model's jitted step does), not one per operation.
_apply = eqx.filter_jit(lambda module, x: module(x))


@pytest.fixture
def getkey():
    keys = iter(jrandom.split(jrandom.key(0), 64))
    return lambda: next(keys)


# --------------------------------------------------------------------- Equinox's tests/test_nn.py


@pytest.mark.slow  # Equinox's 1-D test, replayed; its 2-D ones are the fast tier's
def test_conv1d(getkey):
    conv = mk_eqx.Conv1d(1, 3, 3, key=getkey())  # positional arguments
    assert _apply(conv, jrandom.normal(getkey(), (1, 32))).shape == (3, 30)
    conv = mk_eqx.Conv1d(1, out_channels=3, kernel_size=(3,), key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (1, 32))).shape == (3, 30)
    conv = mk_eqx.Conv1d(in_channels=1, out_channels=3, kernel_size=(3,), padding=1, use_bias=False, key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (1, 32))).shape == (3, 32)
    conv = mk_eqx.Conv1d(in_channels=3, out_channels=1, kernel_size=(3,), stride=2, padding=1, use_bias=True,
                         key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (3, 32))).shape == (1, 16)
    # Values
    conv = mk_eqx.Conv1d(1, 3, kernel_size=3, padding=1, key=getkey())
    new_weight = jnp.arange(9, dtype=jnp.float32).reshape(3, 1, 3)
    new_bias = jnp.array([1.0, 2.0, 3.0]).reshape(3, 1)
    data = jnp.arange(-3, 3, dtype=jnp.float32).reshape(1, -1)
    assert new_weight.shape == conv.weight.shape and new_bias.shape == conv.bias.shape
    conv = eqx.tree_at(lambda x: (x.weight, x.bias), conv, (new_weight, new_bias))
    answer = jnp.array([-6.0, -3.0, 0.0, 3.0, 6.0, 3.0, -20.0, -20.0, -8.0, 4.0, 16.0, 13.0,
                        -34.0, -37.0, -16.0, 5.0, 26.0, 23.0]).reshape(3, 6)
    assert jnp.allclose(_apply(conv, data), answer)


@pytest.mark.slow
def test_conv2d(getkey):
    conv = mk_eqx.Conv2d(1, 3, 3, key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (1, 32, 32))).shape == (3, 30, 30)
    conv = mk_eqx.Conv2d(1, out_channels=3, kernel_size=(3, 3), key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (1, 32, 32))).shape == (3, 30, 30)
    conv = mk_eqx.Conv2d(in_channels=1, out_channels=3, kernel_size=(3, 3), padding=1, use_bias=False, key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (1, 32, 32))).shape == (3, 32, 32)
    conv = mk_eqx.Conv2d(in_channels=3, out_channels=1, kernel_size=(3, 3), stride=2, padding=1, use_bias=True,
                         key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (3, 32, 32))).shape == (1, 16, 16)
    # Values
    conv = mk_eqx.Conv2d(1, 1, kernel_size=3, padding=1, key=getkey())
    new_weight = jnp.arange(9, dtype=jnp.float32).reshape(1, 1, 3, 3)
    new_bias = jnp.array([1], dtype=jnp.float32).reshape(1, 1, 1)
    data = jnp.arange(-4, 5, dtype=jnp.float32).reshape(1, 3, 3)
    conv = eqx.tree_at(lambda x: (x.weight, x.bias), conv, (new_weight, new_bias))
    answer = jnp.array([-37.0, -31.0, -9.0, 25.0, 61.0, 49.0, 23.0, 41.0, 27.0]).reshape(1, 3, 3)
    assert jnp.allclose(_apply(conv, data), answer)
    # Groups: the value case's weights twice, the second copy doubled, and another bias.
    conv = mk_eqx.Conv2d(2, 2, kernel_size=3, padding=1, key=getkey(), groups=2)
    new_weight = jnp.concatenate([1 * jnp.arange(9, dtype=jnp.float32).reshape(1, 1, 3, 3),
                                  2 * jnp.arange(9, dtype=jnp.float32).reshape(1, 1, 3, 3)], axis=0)
    new_bias = jnp.array([1.0, 2.0]).reshape(2, 1, 1)
    data = jnp.broadcast_to(jnp.arange(-4, 5, dtype=jnp.float32).reshape(1, 3, 3), (2, 3, 3))
    conv = eqx.tree_at(lambda x: (x.weight, x.bias), conv, (new_weight, new_bias))
    answer_part = jnp.array([-38.0, -32.0, -10.0, 24.0, 60.0, 48.0, 22.0, 40.0, 26.0]).reshape(1, 3, 3)
    assert jnp.allclose(_apply(conv, data), jnp.concatenate([1 * answer_part, 2 * answer_part], axis=0) + new_bias)


def test_conv2d_complex_is_refused(getkey):
    """Equinox's test_conv2d also runs a complex64 layer: masked_conv takes real floats, and says so."""
    with pytest.raises(TypeError, match=r"must have a floating dtype \(float32, bfloat16 or float16.*complex64"):
        mk_eqx.Conv2d(1, 1, 3, padding=1, dtype=jnp.complex64, key=getkey())(jnp.ones((1, 3, 3), jnp.complex64))


@pytest.mark.slow
def test_conv3d(getkey):
    conv = mk_eqx.Conv3d(1, 3, 3, key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (1, 3, 32, 32))).shape == (3, 1, 30, 30)
    conv = mk_eqx.Conv3d(1, out_channels=3, kernel_size=(3, 3, 3), key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (1, 3, 32, 32))).shape == (3, 1, 30, 30)
    conv = mk_eqx.Conv3d(in_channels=1, out_channels=3, kernel_size=(3, 3, 3), padding=1, use_bias=False,
                         key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (1, 3, 32, 32))).shape == (3, 3, 32, 32)
    conv = mk_eqx.Conv3d(in_channels=3, out_channels=1, kernel_size=(3, 3, 3), stride=2, padding=1, use_bias=True,
                         key=getkey())
    assert _apply(conv, jrandom.normal(getkey(), (3, 3, 32, 32))).shape == (1, 2, 16, 16)
    # Values
    conv = mk_eqx.Conv3d(1, 1, kernel_size=(2, 1, 1), padding=(1, 0, 0), key=getkey())
    new_weight = jnp.arange(2, dtype=jnp.float32).reshape(1, 1, 2, 1, 1)
    new_bias = jnp.array([1.0]).reshape(1, 1, 1, 1)
    data = jnp.arange(-4, 4, dtype=jnp.float32).reshape(1, 2, 2, 2)
    conv = eqx.tree_at(lambda x: (x.weight, x.bias), conv, (new_weight, new_bias))
    answer = jnp.array([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 1.0, 1.0, 1.0, 1.0]).reshape(1, 3, 2, 2)
    assert jnp.allclose(_apply(conv, data), answer)


def test_conv_padding(getkey):
    x = jrandom.normal(getkey(), (3, 32, 32))
    conv = mk_eqx.Conv2d(3, 8, 1, 2, padding=((0, 1), (0, 3)), key=getkey())
    assert _apply(conv, x).shape == (8, 17, 18)


def test_conv_circular(getkey):
    conv = mk_eqx.Conv1d(in_channels=1, out_channels=1, kernel_size=3, padding="SAME", padding_mode="CIRCULAR",
                         key=getkey())
    x = jrandom.normal(getkey(), (1, 6))
    assert jnp.allclose(_apply(conv, x), jnp.roll(_apply(conv, jnp.roll(x, 2)), -2))


# --------------------------------------------------------------------- the drop-in


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ndim: int
    c_in: int
    c_out: int
    kernel_size: tuple
    mask: np.ndarray  # window-shaped or the weight's (O, I // groups, *kernel_size)
    fields: dict = dataclasses.field(default_factory=dict)
    spatial: tuple = ()


CASES = [
    Case("2d_k3A_same", 2, 3, 4, (3, 3), mk.pixelcnn_mask((3, 3), "A"), dict(padding="SAME"), (7, 6)),
    Case("2d_k5B_s2_d2_reflect", 2, 2, 3, (5, 5), mk.pixelcnn_mask((5, 5)), dict(stride=2, dilation=2, padding=4,
                                                                                padding_mode="REFLECT"), (13, 11)),
    Case("2d_k3_rgbA_full_groups_replicate", 2, 4, 6, (3, 3),
         np.transpose(mk.channel_grouped_mask((3, 3), 2, 6, "A", groups=2), (3, 2, 0, 1)),
         dict(groups=2, padding="SAME_LOWER", padding_mode="REPLICATE"), (6, 7)),
    Case("1d_k4_causal_circular", 1, 2, 3, (4,), np.array([1, 1, 0, 0], bool), dict(padding=((3, 0),),
                                                                                   padding_mode="CIRCULAR"), (9,)),
    Case("3d_k3A_nobias", 3, 2, 2, (3, 3, 3), mk.pixelcnn_mask((3, 3, 3), "A"), dict(padding=1, use_bias=False),
         (4, 5, 4)),
]


def _pair(case, key=jrandom.key(3)):
    ours = mk_eqx.Conv(case.ndim, case.c_in, case.c_out, case.kernel_size, mask=case.mask, key=key, **case.fields)
    theirs = eqx.nn.Conv(case.ndim, case.c_in, case.c_out, case.kernel_size, key=key, **case.fields)
    return ours, theirs


def _full(case, theirs) -> np.ndarray:
    """The mask broadcast to the weight's shape: what eqx.nn.Conv's weight is multiplied by."""
    bits = np.asarray(case.mask, bool)
    return bits if bits.ndim == theirs.weight.ndim else np.broadcast_to(bits, theirs.weight.shape)


@pytest.mark.parametrize("case", tiered(CASES, lambda c: c is CASES[0]), ids=lambda c: c.name)
def test_same_fields_parameters_and_outputs_as_equinox(case):
    ours, theirs = _pair(case)
    assert isinstance(ours, eqx.nn.Conv)
    fields = {f.name for f in dataclasses.fields(theirs)}
    assert fields | {"mask", "implementation"} == {f.name for f in dataclasses.fields(ours)}
    for name in fields - {"weight", "bias"}:
        assert getattr(ours, name) == getattr(theirs, name), name
    # One key, the same parameters: Equinox's own initialisation runs.
    jax.tree.map(np.testing.assert_array_equal, (ours.weight, ours.bias), (theirs.weight, theirs.bias))

    leaky = eqx.tree_at(lambda m: m.weight, theirs, theirs.weight * _full(case, theirs))
    x = random(4, (case.c_in, *case.spatial))
    dy = random(5, jax.eval_shape(leaky, x).shape)
    loss = lambda m, x: jnp.sum(m(x) * dy)
    grad = eqx.filter_jit(eqx.filter_grad(lambda m, x: loss(m, x)))
    y_ours, y_theirs = eqx.filter_jit(lambda m, x: m(x))(ours, x), eqx.filter_jit(lambda m, x: m(x))(leaky, x)
    full = _full(case, theirs)
    active = int(full.reshape(full.shape[0], -1).sum(-1).max())
    scale = float(jnp.abs(x).max() * jnp.abs(theirs.weight).max()) + (1.0 if case.fields.get("use_bias", True) else 0.0)
    assert_close(y_ours, y_theirs, np.float32, active, scale)
    g_ours = grad(ours, x)
    g_theirs = jax.jit(jax.grad(lambda w: loss(eqx.tree_at(lambda m: m.weight, theirs, w * full), x)))(theirs.weight)
    assert_close(g_ours.weight, g_theirs, np.float32, int(np.prod(dy.shape[1:])), float(jnp.abs(x).max() * jnp.abs(dy).max()))
    assert (np.asarray(g_ours.weight)[~full] == 0.0).all()


def test_serialised_equinox_conv_loads_into_ours(tmp_path, getkey):
    """``eqx.tree_serialise_leaves`` of a model with eqx.nn.Conv layers loads into the swapped model."""
    key = getkey()
    build = lambda convs: [conv(2, 4, 3, padding=1, key=k) for conv, k in zip(convs, jrandom.split(key, 2))]
    theirs = build([eqx.nn.Conv2d, eqx.nn.Conv2d])
    trained = eqx.tree_at(lambda m: m[0].weight, theirs, theirs[0].weight + 1.0)
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", trained)
    ours = build([lambda *a, **kw: mk_eqx.Conv(2, *a, mask=mk.pixelcnn_mask((3, 3), "A"), **kw),
                  lambda *a, **kw: mk_eqx.Conv2d(*a, **kw)])
    restored = eqx.tree_deserialise_leaves(tmp_path / "model.eqx", ours)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.leaves(restored), jax.tree.leaves(trained))
    assert restored[0].mask == ours[0].mask and restored[1].mask is None


def test_nan_in_masked_inputs_changes_no_output():
    """Exact as the rest: the centre output of a type-A 3x3 conv does not see its own pixel or later ones."""
    conv = mk_eqx.Conv2d(2, 3, 3, padding=1, mask=mk.pixelcnn_mask((3, 3), "A"), key=jrandom.key(0))
    x = np.asarray(random(6, (2, 5, 5)))
    poisoned = x.copy()
    poisoned[:, 2, 2:] = np.nan
    poisoned[:, 3:] = np.nan
    f = eqx.filter_jit(lambda m, x: m(x)[:, 2, 2])
    assert np.asarray(f(conv, jnp.asarray(x))).tobytes() == np.asarray(f(conv, jnp.asarray(poisoned))).tobytes()
    leaky = eqx.nn.Conv2d(2, 3, 3, padding=1, key=jrandom.key(0))
    leaky = eqx.tree_at(lambda m: m.weight, leaky, leaky.weight * mk.pixelcnn_mask((3, 3), "A"))
    assert np.isnan(np.asarray(f(leaky, jnp.asarray(poisoned)))).all()  # 0 * NaN


def test_vmap_batches_and_empty_outputs():
    conv = mk_eqx.Conv1d(2, 3, 3, mask=np.array([1, 0, 1]), key=jrandom.key(1))
    x = random(7, (5, 2, 9))
    np.testing.assert_allclose(jax.vmap(conv)(x), jnp.stack([conv(xi) for xi in x]), rtol=1e-6, atol=1e-6)
    empty = conv(jnp.ones((2, 2)))  # width 2, a width-3 VALID window: lax's empty output
    assert empty.shape == (3, 0)
    g = eqx.filter_grad(lambda m, x: m(x).sum())(conv, jnp.ones((2, 2)))
    assert g.weight.shape == conv.weight.shape and not np.asarray(g.weight).any()


def test_mask_and_input_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"mask has shape \(2, 3\) but kernel_size is \(3, 3\).*\(4, 2, 3, 3\)"):
        mk_eqx.Conv2d(2, 4, 3, mask=np.ones((2, 3)), key=jrandom.key(0))
    conv = mk_eqx.Conv2d(2, 4, 3, key=jrandom.key(0))
    with pytest.raises(ValueError, match=r"rank 3 .*shape \(1, 2, 5, 5\): vmap over a batch"):
        conv(jnp.ones((1, 2, 5, 5)))
    assert mk_eqx.MaskedConv is mk_eqx.Conv and mk_eqx.Conv2d.__name__ == "Conv2d"


def test_a_traced_mask_says_how_to_make_it_concrete():
    """The Flax modules' rule and words (maskconv_kernels._modules): which taps are read is fixed when built."""
    def build(mask):
        return mk_eqx.Conv2d(1, 2, 3, padding=1, mask=mask, key=jax.random.key(0)).weight

    with pytest.raises(TypeError, match=r"mask is a traced value .*NumPy .*jax.ensure_compile_time_eval"):
        jax.jit(build)(jnp.ones((3, 3)))
