"""Flax modules: the parameters, outputs and gradients of flax's ``Conv(mask=...)``, exactly causal.

Each case builds ``MaskedConv`` and ``flax.linen.Conv`` (or their nnx forms) with the same
fields and checks: identical parameter trees (names, shapes, dtypes; one key initialises
both to the same values), and, given ``nn.Conv``'s parameters, outputs and gradients equal
up to rounding for finite inputs, with masked kernel entries' gradients exactly 0.0. Then
the gated PixelCNN of ``examples/pixelcnn`` trains, and its receptive field is causal bit
for bit.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.numerics import assert_close
from support.tiers import tiered
from flax import nnx

import maskconv_kernels as mk
from maskconv_kernels.flax import MaskedConv
from maskconv_kernels.flax import nnx as mk_nnx


def _load_example_model():
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "pixelcnn" / "model.py"
    spec = importlib.util.spec_from_file_location("pixelcnn_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (linen modules) look their module up there
    spec.loader.exec_module(module)
    return module


pixelcnn = _load_example_model()


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    x_shape: tuple[int, ...]  # with the batch dims the module sees (none, one or two)
    features: int
    kernel_size: tuple[int, ...]
    mask: np.ndarray  # window-shaped or full; nn.Conv gets it broadcast to the kernel's shape
    fields: dict = dataclasses.field(default_factory=dict)
    dtype: np.dtype = np.dtype("float32")

    @property
    def c_in(self) -> int:
        return self.x_shape[-1]

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        return (*self.kernel_size, self.c_in // self.fields.get("feature_group_count", 1), self.features)

    def full_mask(self) -> np.ndarray:
        if self.mask.ndim == len(self.kernel_size):
            return np.broadcast_to(self.mask[..., None, None], self.kernel_shape)
        return self.mask


CASES = [
    Case("N2_H9_W7_C3_F5_k3_A", (2, 9, 7, 3), 5, (3, 3), mk.pixelcnn_mask((3, 3), "A")),
    Case("N2_H8_W8_C3_F6_k5_rgbB_full", (2, 8, 8, 3), 6, (5, 5), mk.channel_grouped_mask((5, 5), 3, 6, "B")),
    Case("N1_H11_W13_C2_F3_k5_B_s2_d2_valid", (1, 11, 13, 2), 3, (5, 5), mk.pixelcnn_mask((5, 5)),
         dict(strides=2, kernel_dilation=2, padding="VALID")),
    Case("N2_H7_W7_C4_F6_k3_B_g2", (2, 7, 7, 4), 6, (3, 3), mk.pixelcnn_mask((3, 3)), dict(feature_group_count=2)),
    Case("N2_H6_W5_C1_F4_k3_vstack_circular", (2, 6, 5, 1), 4, (3, 3), mk.vertical_stack_mask((3, 3)),
         dict(padding="CIRCULAR")),
    Case("N2_H5_W6_C2_F3_k3_A_reflect_nobias", (2, 5, 6, 2), 3, (3, 3), mk.pixelcnn_mask((3, 3), "A"),
         dict(padding="REFLECT", use_bias=False)),
    Case("N2_H5_W4_C2_F3_k3_B_idil2_pad", (2, 5, 4, 2), 3, (3, 3), mk.pixelcnn_mask((3, 3)),
         dict(input_dilation=2, padding=((1, 2), (0, 1)))),
    Case("N3_T17_C2_F4_k4_gap_causalpad", (3, 17, 2), 4, (4,), np.array([1, 0, 1, 1], bool),
         dict(padding="CAUSAL")),
    Case("N2_H8_W7_C2_F3_k4x2_same_lower_s2", (2, 8, 7, 2), 3, (4, 2), np.array([[1, 1], [1, 1], [1, 0], [0, 0]], bool),
         dict(padding="SAME_LOWER", strides=2)),
    Case("nobatch_H8_W8_C2_F3_k3_A", (8, 8, 2), 3, (3, 3), mk.pixelcnn_mask((3, 3), "A")),
    Case("N2x3_H6_W6_C2_F3_k3_B_batchdims", (2, 3, 6, 6, 2), 3, (3, 3), mk.pixelcnn_mask((3, 3))),
    Case("N2_D4_H5_W5_C2_F3_k3_3d_A", (2, 4, 5, 5, 2), 3, (3, 3, 3), mk.pixelcnn_mask((3, 3, 3), "A")),
    Case("N2_H9_W7_C3_F5_k3_A_bf16", (2, 9, 7, 3), 5, (3, 3), mk.pixelcnn_mask((3, 3), "A"),
         dict(dtype=jnp.bfloat16), np.dtype(jnp.bfloat16)),
]

# IEEE float32 products on GPUs too (their default is TF32), as the tolerances assume.
COMMON = dict(precision="highest")


def _modules(case: Case):
    ours = MaskedConv(case.features, case.kernel_size, mask=case.mask, **COMMON, **case.fields)
    theirs = nn.Conv(case.features, case.kernel_size, mask=case.full_mask(), **COMMON, **case.fields)
    return ours, theirs


def _bounds(case: Case, x, kernel, dy):
    """``(reduction, scale)`` for outputs, kernel gradients and input gradients."""
    active = int(case.full_mask().sum(axis=tuple(range(len(case.kernel_size)))).max())  # per output channel
    out_pixels = int(np.prod(dy.shape[:-1]))
    mx, mk_, mdy = (float(jnp.abs(a.astype(jnp.float32)).max()) for a in (x, kernel, dy))
    return {
        "out": (active, mx * mk_ + 4.0),  # + |bias|, drawn from N(0, 1)
        "kernel": (out_pixels, mx * mdy),
        "bias": (out_pixels, mdy),
        "x": (int(np.prod(case.kernel_size)) * case.features, mk_ * mdy),
    }


def random(seed, shape, dtype=np.float32, scale=1.0):
    """Standard normal values drawn by NumPy, cast: jax.random would compile per shape."""
    return jnp.asarray((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32), dtype)


def random_params(shapes, seed=7):
    """Parameters of the given shapes: kernels ~ N(0, 1 / fan_in), biases ~ N(0, 1).

    Cheaper than ``init``, whose random number generation takes a second to compile.
    """
    leaves, tree = jax.tree.flatten(shapes)
    return jax.tree.unflatten(tree, [
        random(seed + i, a.shape, a.dtype, 1.0 / np.sqrt(np.prod(a.shape[:-1])) if len(a.shape) > 1 else 1.0)
        for i, a in enumerate(leaves)
    ])


def _apply_and_grad(module, dy):
    """Jitted ``(grads wrt (params, x), output)`` of ``sum(module(x) * dy)``.

    One program per module: op-by-op dispatch of many small convolutions is slower.
    """

    def loss(params, x):
        y = module.apply(params, x)
        return jnp.sum(y.astype(jnp.float32) * dy), y

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("case", tiered(CASES, lambda c: c in CASES[::2]), ids=lambda c: c.name)
def test_linen_matches_flax_conv(case):
    ours, theirs = _modules(case)
    x = random(1, case.x_shape)
    shapes = jax.eval_shape(theirs.init, jax.random.key(0), x)
    assert jax.tree.structure(jax.eval_shape(ours.init, jax.random.key(0), x)) == jax.tree.structure(shapes)
    assert jax.eval_shape(ours.init, jax.random.key(0), x) == shapes  # names, shapes and dtypes
    params = random_params(shapes)

    dy = random(2, jax.eval_shape(theirs.apply, params, x).shape)
    g_ours, y_ours = _apply_and_grad(ours, dy)(params, x)  # nn.Conv's params, loaded into MaskedConv
    g_theirs, y_theirs = _apply_and_grad(theirs, dy)(params, x)
    assert y_ours.dtype == y_theirs.dtype
    bounds = _bounds(case, x, params["params"]["kernel"], dy)
    assert_close(y_ours, y_theirs, case.dtype, *bounds["out"], **COMMON)
    for name in params["params"]:
        assert_close(g_ours[0]["params"][name], g_theirs[0]["params"][name], case.dtype, *bounds[name], **COMMON)
    assert_close(g_ours[1], g_theirs[1], case.dtype, *bounds["x"], **COMMON)
    masked = ~case.full_mask()
    assert (np.asarray(g_ours[0]["params"]["kernel"])[masked] == 0).all()


def test_linen_init_gives_flax_conv_params():
    """One key, the same parameters: a checkpoint of either module loads into the other."""
    case = CASES[1]
    ours, theirs = _modules(case)
    x = random(1, case.x_shape)
    ours_params, params = ours.init(jax.random.key(0), x), theirs.init(jax.random.key(0), x)
    assert jax.tree.structure(ours_params) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, ours_params, params)


NNX_CASES = [c for c in CASES if c.name.startswith(("N2_H9_W7_C3_F5_k3_A", "N2_H8_W8", "N2_H7_W7", "N3_T17"))]


@pytest.mark.parametrize("case", tiered(NNX_CASES, lambda c: c in NNX_CASES[::2]), ids=lambda c: c.name)
def test_nnx_matches_flax_nnx_conv(case):
    fields = dict(case.fields, **COMMON)
    ours = mk_nnx.MaskedConv(case.c_in, case.features, case.kernel_size, mask=case.mask, rngs=nnx.Rngs(0), **fields)
    theirs = nnx.Conv(case.c_in, case.features, case.kernel_size, mask=jnp.asarray(case.full_mask()),
                      rngs=nnx.Rngs(0), **fields)
    # nnx.Conv also keeps its mask array in its state; the parameters are the same.
    p_ours, p_theirs = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
    assert jax.tree.structure(p_ours) == jax.tree.structure(p_theirs)
    jax.tree.map(np.testing.assert_array_equal, p_ours, p_theirs)
    nnx.update(ours, nnx.state(theirs, nnx.Param))  # a checkpoint of one loads into the other

    x = random(1, case.x_shape)
    y_theirs = nnx.jit(lambda m, x: m(x))(theirs, x)
    dy = random(2, y_theirs.shape)

    def loss(module, x):
        return jnp.sum(module(x).astype(jnp.float32) * dy)

    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)))
    g_ours, g_theirs = grad(ours, x), grad(theirs, x)
    bounds = _bounds(case, x, theirs.kernel[...], dy)
    assert_close(nnx.jit(lambda m, x: m(x))(ours, x), y_theirs, case.dtype, *bounds["out"], **COMMON)
    assert_close(g_ours[0]["kernel"][...], g_theirs[0]["kernel"][...], case.dtype, *bounds["kernel"], **COMMON)
    assert_close(g_ours[0]["bias"][...], g_theirs[0]["bias"][...], case.dtype, *bounds["bias"], **COMMON)
    assert_close(g_ours[1], g_theirs[1], case.dtype, *bounds["x"], **COMMON)


def test_linen_module_with_array_mask_is_hashable_and_clonable():
    a = MaskedConv(4, (3, 3), mask=mk.pixelcnn_mask((3, 3), "A"))
    b = MaskedConv(4, (3, 3), mask=jnp.asarray(mk.pixelcnn_mask((3, 3), "A"), jnp.float32))
    c = MaskedConv(4, (3, 3), mask=mk.pixelcnn_mask((3, 3), "B"))
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a.clone(features=5).mask == a.mask
    x = random(1, (2, 6, 6, 2))
    jitted = nn.jit(MaskedConv)(4, (3, 3), mask=mk.pixelcnn_mask((3, 3), "A"))
    params = jitted.init(jax.random.key(0), x)
    # Jitted and eager are two programs: equal up to float32 rounding of 4 taps x 2 channels.
    scale = float(jnp.abs(x).max() * jnp.abs(params["params"]["kernel"]).max()) + 1.0  # + |bias| (zeros)
    assert_close(jitted.apply(params, x), a.apply(params, x), np.float32, 4 * 2, scale)


def test_mask_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"mask has shape \(2, 3\) but kernel_size is \(3, 3\)"):
        MaskedConv(4, (3, 3), mask=np.ones((2, 3)))
    full = MaskedConv(4, (3, 3), mask=np.ones((3, 3, 5, 4)))
    with pytest.raises(ValueError, match=r"shape \(3, 3, 5, 4\), and the kernel is \(3, 3, 2, 4\).*C_in // feature_group_count = 2"):
        full.init(jax.random.key(0), jnp.ones((1, 6, 6, 2)))
    # A full mask with the wrong output channel count says so, not that the window is wrong.
    with pytest.raises(ValueError, match=r"full kernel shape \(3, 3, 2, 5\) but features .* is 4"):
        MaskedConv(4, (3, 3), mask=np.ones((3, 3, 2, 5)))
    with pytest.raises(ValueError, match=r"full kernel shape \(3, 3, 2, 5\) but features .* is 4"):
        mk_nnx.MaskedConv(2, 4, (3, 3), mask=np.ones((3, 3, 2, 5)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"C_in // feature_group_count = 2"):
        mk_nnx.MaskedConv(2, 4, (3, 3), mask=np.ones((3, 3, 3, 4)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="input_dilation"):
        MaskedConv(4, (3, 3), mask=mk.pixelcnn_mask((3, 3)), input_dilation=2).init(
            jax.random.key(0), jnp.ones((1, 6, 6, 2))
        )
    layer = mk_nnx.MaskedConv(2, 4, (3, 3), mask=mk.pixelcnn_mask((3, 3)), rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="out_sharding"):
        layer(jnp.ones((1, 6, 6, 2)), out_sharding=jax.sharding.PartitionSpec())
    with pytest.raises(ValueError, match=r"inputs have 3 channels .* in_features=2"):
        layer(jnp.ones((1, 6, 6, 3)))


def test_empty_output_as_flax_gives_it():
    """A VALID window wider than the input: nn.Conv's zero-size output, and zero-size gradients, on both modules."""
    x, mask = jnp.ones((1, 2, 1)), np.array([1, 0, 1], bool)
    layer = MaskedConv(4, (3,), padding="VALID", mask=mask)
    params = layer.init(jax.random.key(0), x)
    expected = nn.Conv(4, (3,), padding="VALID").apply(params, x)
    grads = jax.grad(lambda p, x: layer.apply(p, x).sum(), (0, 1))(params, x)
    assert layer.apply(params, x).shape == expected.shape == (1, 0, 4)
    assert grads[1].shape == x.shape and not np.asarray(grads[0]["params"]["kernel"]).any()
    module = mk_nnx.MaskedConv(1, 4, (3,), padding="VALID", mask=mask, rngs=nnx.Rngs(0))
    assert module(x).shape == (1, 0, 4)
    assert nnx.grad(lambda m: m(x).sum())(module)["kernel"][...].shape == (3, 1, 4)


# --------------------------------------------------------------------- the gated PixelCNN


def _stripes(key, n, h, w):
    """Binary images whose rows are constant: after the first pixel of a row, predictable."""
    rows = jax.random.bernoulli(jax.random.key(key), 0.5, (n, h, 1))
    return jnp.broadcast_to(rows, (n, h, w)).astype(jnp.int32)


@pytest.mark.slow
def test_short_training_run_lowers_the_loss():
    model = pixelcnn.GatedPixelCNN(levels=2, features=8, layers=2, first_window=3)
    data = _stripes(0, 16, 6, 6)
    params = random_params(jax.eval_shape(model.init, jax.random.key(0), pixelcnn.to_input(data, 2)))
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(pixelcnn.nll_nats)(params, model, data)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(30):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    # Chance is ln 2 = 0.69 nats; a row's first pixel stays a coin flip (1/6 of the pixels).
    assert losses[-1] < 0.6 * losses[0], losses


H, W = 7, 9  # odd, unequal sizes on purpose
POSITIONS = [(3, 4), (0, 0), (0, 5), (6, 8)]


@pytest.fixture(scope="module")
def net():
    """A small gated PixelCNN with random parameters (biases too), a clean input, jitted maps."""
    model = pixelcnn.GatedPixelCNN(levels=4, features=8, layers=3)
    leaky = pixelcnn.GatedPixelCNN(levels=4, features=8, layers=3, leaky=True)
    x = random(3, (2, H, W, 1))
    params = random_params(jax.eval_shape(model.init, jax.random.key(1), x))

    @jax.jit
    def input_grad(cotangent):
        """Gradient wrt x of ``sum(logits * cotangent)``: one program for every output pixel."""
        return jax.vjp(lambda x: model.apply(params, x), x)[1](cotangent)[0]

    apply = jax.jit(lambda x: model.apply(params, x))
    apply_leaky = jax.jit(lambda x: leaky.apply(params, x))
    return model, x, input_grad, apply, apply_leaky


def _before(position):
    """Bool ``(H, W)``: pixels strictly before ``position`` in raster order."""
    return np.arange(H * W).reshape(H, W) < position[0] * W + position[1]


@pytest.mark.parametrize("position", POSITIONS, ids=lambda p: f"at_{p[0]}_{p[1]}")
def test_pixelcnn_gradient_is_exactly_zero_at_and_after_the_pixel(net, position):
    model, x, input_grad, _, _ = net
    cotangent = np.zeros((2, H, W, model.levels), np.float32)
    cotangent[:, position[0], position[1]] = np.asarray(random(5, (model.levels,)))
    grad = np.asarray(input_grad(cotangent))[..., 0]
    before = _before(position)
    assert (grad[:, ~before] == 0.0).all()
    if before.any():
        # The pixel to the left and the one above are always in the field.
        i, j = position
        neighbours = [(i, j - 1)] if j > 0 else []
        neighbours += [(i - 1, j)] if i > 0 else []
        assert all((grad[:, a, b] != 0).all() for a, b in neighbours)


@pytest.mark.parametrize("position", POSITIONS, ids=lambda p: f"at_{p[0]}_{p[1]}")
def test_pixelcnn_nan_in_the_future_leaves_the_past_bit_identical(net, position):
    _, x, _, apply, apply_leaky = net
    future = ~_before(position)
    poisoned = jnp.where(future[None, :, :, None], jnp.nan, x)
    clean, out = np.asarray(apply(x)), np.asarray(apply(poisoned))
    # Outputs up to and including the pixel read inputs strictly before it only.
    upto = ~future | (np.arange(H * W).reshape(H, W) == position[0] * W + position[1])
    np.testing.assert_array_equal(out[:, upto], clean[:, upto])
    nxt = position[0] * W + position[1] + 1
    if nxt < H * W:  # the next pixel reads this one (its left or last-row neighbour): the poison arrives
        assert np.isnan(out[:, nxt // W, nxt % W]).all()
    # The same network from flax's Conv(mask=...) and the same params: the NaNs leak in.
    assert np.isnan(np.asarray(apply_leaky(poisoned))[:, position[0], position[1]]).all()
