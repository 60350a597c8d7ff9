"""A model whose Flax convolutions are swapped for the library's restores the old checkpoint.

The swap is one line per layer, the rest of the model (auto-named submodules in a compact
parent, spectral and weight norm wrappers and their collections) unchanged: each test
builds one model twice, with ``nn.Conv`` / ``nnx.Conv`` and with the drop-in, saves the
first with Flax's own checkpointing (``flax.serialization`` for linen, orbax for nnx, as
Flax's guides do) and restores it into the second.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from support.numerics import random
from flax import nnx, serialization

import maskconv_kernels as mk
from maskconv_kernels.flax import linen as mk_linen
from maskconv_kernels.flax import nnx as mk_nnx

WINDOW = mk.pixelcnn_mask((3, 3), "A")


def _full(window, c_in, c_out):
    """What nn.Conv takes: the window mask broadcast to the kernel's shape, as a float array.

    NumPy, not jax.numpy: nnx.eval_shape traces the model's constructor, and a mask made
    there with jax.numpy is traced; the drop-in needs its taps when it is built.
    """
    return np.broadcast_to(window[..., None, None], (*window.shape, c_in, c_out)).astype(np.float32)


class LinenNet(nn.Module):
    """Auto-named convolutions, one under spectral norm, one under weight norm."""

    ours: bool

    def conv(self, features, c_in, window):
        if self.ours:  # the one-line swap: a window-shaped mask suffices
            return mk_linen.Conv(features, window.shape, mask=window)
        return nn.Conv(features, window.shape, mask=_full(window, c_in, features))

    @nn.compact
    def __call__(self, x, update_stats: bool = False):
        x = nn.relu(self.conv(8, 2, WINDOW)(x))
        x = nn.SpectralNorm(self.conv(8, 8, mk.pixelcnn_mask((3, 3), "B")))(x, update_stats=update_stats)
        return nn.WeightNorm(self.conv(4, 8, np.ones((1, 1), bool)))(x)


def test_linen_class_keeps_flax_name_for_auto_naming():
    assert mk_linen.MaskedConv is mk_linen.Conv and mk_linen.Conv.__name__ == nn.Conv.__name__ == "Conv"
    x = jnp.ones((1, 5, 5, 2))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.eval_shape(LinenNet(ours=True).init, jax.random.key(0), x))[0]]
    assert "['params']['Conv_0']['kernel']" in paths
    assert "['batch_stats']['SpectralNorm_0']['Conv_1/kernel/sigma']" in paths
    assert "['params']['WeightNorm_0']['Conv_2/kernel/scale']" in paths


def _stats_update(model):
    return jax.jit(lambda variables, x: model.apply(variables, x, update_stats=True, mutable=["batch_stats"])[1])


@pytest.mark.slow  # the fast tier checks linen's auto-named paths (eval_shape)
def test_linen_swap_restores_the_flax_checkpoint():
    x = random(0, (1, 5, 4, 2))
    theirs, ours = LinenNet(ours=False), LinenNet(ours=True)
    init_ours, update_ours, update_theirs = jax.jit(ours.init), _stats_update(ours), _stats_update(theirs)
    # One key, the same variables: every path, shape and value.
    variables = jax.jit(theirs.init)(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, init_ours(jax.random.key(0), x), variables)
    # A checkpoint after a stats update, written by Flax and read with the swapped model as the target.
    saved = {**variables, **update_theirs(variables, x)}
    restored = serialization.from_bytes(init_ours(jax.random.key(1), x), serialization.to_bytes(saved))
    jax.tree.map(np.testing.assert_array_equal, restored, saved)
    # The wrappers' statistics come from the restored kernels alone: bit-identical updates.
    jax.tree.map(np.testing.assert_array_equal, update_ours(restored, x), update_theirs(saved, x))


class NnxNet(nnx.Module):
    def __init__(self, ours: bool, rngs: nnx.Rngs):
        conv = mk_nnx.Conv if ours else nnx.Conv
        self.conv = conv(2, 8, (3, 3), mask=_full(WINDOW, 2, 8), rngs=rngs)
        self.sn = nnx.SpectralNorm(conv(8, 8, (3, 3), mask=_full(mk.pixelcnn_mask((3, 3), "B"), 8, 8), rngs=rngs),
                                   rngs=rngs)
        self.wn = nnx.WeightNorm(conv(8, 4, (1, 1), rngs=rngs), rngs=rngs)

    def __call__(self, x, update_stats: bool = False):
        x = nnx.relu(self.conv(x))
        return self.wn(self.sn(x, update_stats=update_stats))


@nnx.jit
def _call(model, x):
    return model(x, update_stats=True)


def _trained(ours: bool, seed: int, x):
    """A model after one call: weight norm's scales are made on the first call."""
    model = NnxNet(ours, nnx.Rngs(seed))
    _call(model, x)
    return model


@pytest.mark.slow  # linen's round trip is the fast tier's
def test_nnx_swap_restores_the_orbax_checkpoint(tmp_path):
    """The state holds the parameters and the mask array where nnx.Conv's does: the same tree, the same values."""
    assert mk_nnx.MaskedConv is mk_nnx.Conv
    x = random(1, (1, 5, 4, 2))
    theirs = _trained(False, 0, x)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(_trained(True, 0, x)), nnx.state(theirs))
    _, state = nnx.split(theirs)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    # The target is a built model, not nnx.eval_shape's: nnx.WeightNorm keeps its scales in a
    # plain dict, which eval_shape drops (for nnx.Conv as for ours).
    graphdef, target = nnx.split(_trained(True, 1, x))
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    assert _call(nnx.merge(graphdef, restored), x).shape == _call(theirs, x).shape == (1, 5, 4, 4)


def test_nnx_mask_built_in_a_trace_says_how_to_make_it_concrete():
    """In nnx.eval_shape (orbax's restore target) a jax.numpy mask is traced: a clear error, and the fix it names works."""
    build = lambda: mk_nnx.Conv(2, 4, (3, 3), mask=jnp.tril(jnp.ones((3, 3, 2, 4))), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"mask is a traced value .*NumPy .*jax.ensure_compile_time_eval"):
        nnx.eval_shape(build)

    def build_concrete():
        with jax.ensure_compile_time_eval():
            return build()

    layer = nnx.eval_shape(build_concrete)
    assert layer.static_mask == mk.masks.as_mask(np.tril(np.ones((3, 3, 2, 4))), (3, 3, 2, 4))


@pytest.mark.parametrize("mask", [None, WINDOW, np.ones((3, 3, 2, 4), np.float32)], ids=["none", "window", "full"])
def test_nnx_mask_is_kept_as_given(mask):
    """The state holds what nnx.Conv's would (nothing, or the array given); the taps read come from it at build time."""
    layer = mk_nnx.Conv(2, 4, (3, 3), mask=mask, rngs=nnx.Rngs(0))
    assert layer.mask is mask
    assert (layer.static_mask is None) == (mask is None)
