"""The exactness contract, bit for bit: masked taps do not exist for outputs or gradients."""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import random
from support.cases import CASES
from support.lax_oracle import dense_mask, lax_conv64, lax_dimension_numbers
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv.spec import make_spec


def _input_pixel(spec, out_index, tap):
    """The input pixel output ``out_index`` reads through ``tap``, or ``None`` in the padding."""
    pos = tuple(o * s - lo + t * d for o, s, (lo, _), t, d in zip(out_index, spec.strides, spec.padding, tap, spec.dilation))
    return pos if all(0 <= p < n for p, n in zip(pos, spec.in_spatial)) else None


def _receptive_field(spec, out_index, co):
    """Bool ``(*spatial, C_in)``: inputs that output ``out_index``, channel ``co`` reads through active entries."""
    cig, cog = spec.c_in // spec.groups, spec.c_out // spec.groups
    dense = spec.mask.dense(cig, spec.c_out)
    field = np.zeros((*spec.in_spatial, spec.c_in), bool)
    g = co // cog
    for tap in itertools.product(*(range(k) for k in spec.window)):
        ci = np.flatnonzero(dense[tap][:, co])
        pos = _input_pixel(spec, out_index, tap)
        if ci.size and pos is not None:
            field[(*pos, g * cig + ci)] = True
    return field


EXACT_CASES = [c for c in CASES if c.small]


@pytest.mark.parametrize("case", EXACT_CASES, ids=lambda c: c.name)
def test_gradient_is_exactly_zero_outside_active_receptive_field(conv, case):
    x = random(1, case.x_shape, dtype=conv.dtype)
    k = random(2, case.kernel_shape, dtype=conv.dtype)
    spec = make_spec(x, k, case.mask, **case.conv_args)
    out_index = tuple(o // 2 for o in spec.out_spatial)
    co = spec.c_out - 1

    def one_output(x):
        return conv(x, k, case.mask, **case.conv_args)[(0, *out_index, co)]

    dx = np.asarray(jax.jit(jax.grad(one_output))(x))[0]
    field = _receptive_field(spec, out_index, co)
    assert (dx[~field] == 0.0).all(), f"gradient leaked to {int((dx[~field] != 0).sum())} masked-only inputs"
    # Not vacuous: inputs inside the field do get gradient (random kernel, so nonzero).
    assert (dx[field] != 0.0).all()


@pytest.mark.parametrize("poison", [
    pytest.param(np.nan, id="nan"), pytest.param(np.inf, id="inf", marks=pytest.mark.slow),
    pytest.param(-np.inf, id="-inf", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("case", EXACT_CASES, ids=lambda c: c.name)
def test_poisoned_masked_inputs_leave_output_bit_identical(conv, case, poison):
    x = random(3, case.x_shape, dtype=conv.dtype)
    k = random(4, case.kernel_shape, dtype=conv.dtype)
    spec = make_spec(x, k, case.mask, **case.conv_args)
    out_index = tuple(o // 2 for o in spec.out_spatial)
    co = 0
    field = _receptive_field(spec, out_index, co)
    poisoned = np.array(x)
    poisoned[0][~field] = poison
    f = jax.jit(lambda x: conv(x, k, case.mask, **case.conv_args)[(0, *out_index, co)])
    clean, dirty = np.asarray(f(x)), np.asarray(f(jnp.asarray(poisoned)))
    assert np.isfinite(clean)
    assert clean.tobytes() == dirty.tobytes(), f"output changed from {clean} to {dirty}"


def _read_anywhere(spec):
    """Bool ``(*spatial,)``: input pixels some active tap of some output reads."""
    read = np.zeros(spec.in_spatial, bool)
    for tap in spec.mask.active_taps:
        for out in itertools.product(*(range(o) for o in spec.out_spatial)):
            pos = _input_pixel(spec, out, tap)
            if pos is not None:
                read[pos] = True
    return read


@pytest.mark.parametrize("case", EXACT_CASES, ids=lambda c: c.name)
def test_inputs_no_tap_reads_leave_the_weight_gradient_bit_identical(conv, case):
    """NaN in pixels that no active tap of any output reads (the bottom-right corner of a
    causal mask, say): the kernel gradient sums products over valid outputs and active
    taps only, so it cannot change; a kernel that multiplied them by a zero cotangent
    (0 * nan) would make it NaN."""
    x = random(11, case.x_shape, dtype=conv.dtype)
    k = random(12, case.kernel_shape, dtype=conv.dtype)
    spec = make_spec(x, k, case.mask, **case.conv_args)
    unread = ~_read_anywhere(spec)
    if not unread.any():
        pytest.skip(f"{case.name}: every input pixel is read")
    poisoned = np.array(x)
    poisoned[:, unread] = np.nan
    dk = jax.jit(jax.grad(lambda k, x: conv(x, k, case.mask, **case.conv_args).astype(np.float32).sum()))
    clean = np.asarray(dk(k, x))
    assert np.isfinite(clean).all()
    assert np.asarray(dk(k, jnp.asarray(poisoned))).tobytes() == clean.tobytes()


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_poisoned_masked_kernel_entries_are_never_read(conv, poison):
    case = next(c for c in CASES if c.name == "2d_N2_H17_W13_C3_k5A")
    x, k = random(5, case.x_shape, dtype=conv.dtype), np.array(random(6, case.kernel_shape, dtype=conv.dtype))
    f = jax.jit(lambda x, k: conv(x, k, case.mask, **case.conv_args))
    clean = np.asarray(f(x, k))
    k[~case.mask.astype(bool)] = poison
    assert np.asarray(f(x, jnp.asarray(k))).tobytes() == clean.tobytes()


def test_seed_experiment_gradient_of_centre_pixel(conv):
    """The report's first experiment: 3x3, last row masked, 128 channels."""
    x = random(42, (1, 5, 5, 128), dtype=conv.dtype)
    k = random(43, (3, 3, 128, 128), scale=1 / np.sqrt(9 * 128), dtype=conv.dtype)
    mask = np.array([[1, 1, 1], [1, 1, 1], [0, 0, 0]])
    g = jax.jit(jax.grad(lambda x: conv(x, k, mask)[:, 2, 2, :].sum()))(x)
    g = np.abs(np.asarray(g)).mean(-1)[0]
    expected = np.zeros((5, 5), bool)
    expected[1:3, 1:4] = True
    assert (g[~expected] == 0.0).all(), g
    assert (g[expected] > 0).all(), g


def test_seed_experiment_zeros_over_ones(conv):
    """The report's second experiment: the centre row reads only zeros, so it is exactly 0."""
    x = jnp.concatenate([jnp.zeros((1, 3, 5, 128)), jnp.ones((1, 2, 5, 128))], axis=1).astype(conv.dtype)
    k = random(43, (3, 3, 128, 128), scale=1 / np.sqrt(9 * 128), dtype=conv.dtype)
    mask = np.array([[1, 1, 1], [1, 1, 1], [0, 0, 0]])
    y = np.asarray(jax.jit(lambda x: conv(x, k, mask))(x))
    assert (y[0, :3] == 0.0).all()
    assert (np.abs(y[0, 3:]).mean(-1) > 0.1).all()


def test_deep_pixelcnn_stack_is_exactly_causal(conv):
    """Type A then five type B layers: the centre output never sees the centre or later pixels."""
    if conv.slow:
        pytest.skip(f"six layers of 16 channels is too slow for the interpret-mode backend {conv.name}")
    h = w = 9
    c = 16
    masks = [mk.pixelcnn_mask((7, 7), "A")] + [mk.pixelcnn_mask((3, 3), "B")] * 5
    kernels = [random(10 + i, (*m.shape, 3 if i == 0 else c, c), scale=0.3, dtype=conv.dtype) for i, m in enumerate(masks)]

    def net(x):
        for m, k in zip(masks, kernels):
            x = jnp.tanh(conv(x, k, m))
        return x

    x = random(9, (1, h, w, 3), dtype=conv.dtype)
    centre = (h // 2, w // 2)
    g = np.asarray(jax.jit(jax.grad(lambda x: net(x)[(0, *centre)].sum()))(x))[0]
    raster = np.arange(h * w).reshape(h, w)
    future = raster >= raster[centre]
    assert (g[future] == 0.0).all(), f"{int((g[future] != 0).sum())} future inputs got gradient"
    assert (np.abs(g[~future]).sum(-1) > 0).sum() > h * w // 4  # the past does get gradient
    # And poisoning the whole future leaves the centre output bit-identical.
    poisoned = np.array(x)
    poisoned[0][future] = np.nan
    f = jax.jit(lambda x: net(x)[(0, *centre)])
    assert np.asarray(f(x)).tobytes() == np.asarray(f(jnp.asarray(poisoned))).tobytes()


# --------------------------------------------------------------------- lax's layout arguments
#
# dimension_numbers, lhs_dilation (transposed convolution), "SAME_LOWER" and batch groups
# go through a layout adapter around the backends' channels-last problem (issue 20). The
# receptive field comes from lax here, not from the library: the input gradient of one
# output of lax.conv(x, ones * mask) in float64 is a count of the active taps that reach
# each input, positive exactly on the field.


@dataclasses.dataclass(frozen=True)
class LayoutCase:
    name: str
    x_shape: tuple
    kernel_shape: tuple  # in the kernel's own layout
    mask: np.ndarray  # window-shaped (the kernel's spatial axes, in its order) or the kernel's shape
    conv_args: dict


def _oihw(mask):
    """A full (H, W, I, O) mask in OIHW."""
    return np.transpose(mask, (3, 2, 0, 1))


NCHW = ("NCHW", "OIHW", "NCHW")
LAYOUT_CASES = [
    LayoutCase("nchw_oihw_k3A", (2, 3, 7, 6), (4, 3, 3, 3), mk.pixelcnn_mask((3, 3), "A"), dict(dimension_numbers=NCHW)),
    LayoutCase("nhwc_oihw_nchw_rgbB_full", (1, 6, 7, 6), (6, 6, 3, 3), _oihw(mk.channel_grouped_mask((3, 3), 6, 6, "B")),
               dict(dimension_numbers=("NHWC", "OIHW", "NCHW"))),
    # Spatial dims listed in reverse: a window mask follows the kernel's axes (5 then 3).
    LayoutCase("convdimnums_spatial_reversed_k5x3", (1, 6, 7, 2), (5, 3, 2, 3), np.tril(np.ones((5, 3), bool), -1),
               dict(dimension_numbers=jax.lax.ConvDimensionNumbers((0, 3, 2, 1), (3, 2, 1, 0), (0, 3, 2, 1)))),
    LayoutCase("lhs_dilation2_k3A", (1, 5, 4, 2), (3, 3, 2, 3), mk.pixelcnn_mask((3, 3), "A"),
               dict(lhs_dilation=2, padding=((1, 2), (2, 1)))),
    LayoutCase("transposed_1d_causal_s2", (2, 9, 3), (4, 3, 2), mk.causal_mask(4), dict(lhs_dilation=2, padding=((3, 3),))),
    LayoutCase("same_lower_s2_k4", (1, 9, 8, 2), (4, 4, 2, 3), np.arange(16).reshape(4, 4) % 3 != 1,
               dict(padding="SAME_LOWER", strides=2)),
    LayoutCase("batch_groups2_nchw_k3B", (4, 2, 6, 5), (4, 2, 3, 3), mk.pixelcnn_mask((3, 3), "B"),
               dict(dimension_numbers=NCHW, batch_group_count=2)),
]


@functools.cache
def _field(case_name, out_index):
    """Bool over x: the inputs output ``out_index`` reads through active taps (lax, float64)."""
    case = next(c for c in LAYOUT_CASES if c.name == case_name)
    y, vjp = lax_conv64(np.zeros(case.x_shape), np.ones(case.kernel_shape), case.mask, **case.conv_args)
    dy = np.zeros(y.shape)
    dy[out_index] = 1.0
    return vjp(dy)[0] > 0


def _centre(case, x_shape, k_shape, channel):
    """The output index at the centre of the output's spatial dims, batch 0, output channel ``channel`` (may be -1)."""
    dn = lax_dimension_numbers(x_shape, k_shape, case.conv_args.get("dimension_numbers"))
    out_shape = jax.eval_shape(lambda x, k: mk.masked_conv(x, k, case.mask, **case.conv_args),
                               jax.ShapeDtypeStruct(x_shape, np.float32), jax.ShapeDtypeStruct(k_shape, np.float32)).shape
    index = [0] * len(out_shape)
    index[dn.out_spec[1]] = channel % out_shape[dn.out_spec[1]]
    for axis in dn.out_spec[2:]:
        index[axis] = out_shape[axis] // 2
    return tuple(index)


@pytest.mark.parametrize("case", tiered(LAYOUT_CASES, lambda c: c in LAYOUT_CASES[::2]), ids=lambda c: c.name)
def test_layouts_gradient_is_exactly_zero_outside_active_receptive_field(conv, case):
    x = random(21, case.x_shape, dtype=conv.dtype)
    k = random(22, case.kernel_shape, dtype=conv.dtype)
    out_index = _centre(case, x.shape, k.shape, channel=-1)
    dx = np.asarray(jax.jit(jax.grad(lambda x: conv(x, k, case.mask, **case.conv_args)[out_index]))(x))
    field = _field(case.name, out_index)
    assert field.any() and (~field).any(), "the case must have inputs on both sides"
    assert (dx[~field] == 0.0).all(), f"gradient leaked to {int((dx[~field] != 0).sum())} masked-only inputs"
    assert (dx[field] != 0.0).all()


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.name)
def test_layouts_nan_in_masked_inputs_leaves_output_bit_identical(conv, case):
    x = random(23, case.x_shape, dtype=conv.dtype)
    k = random(24, case.kernel_shape, dtype=conv.dtype)
    out_index = _centre(case, x.shape, k.shape, channel=0)
    poisoned = np.array(x)
    poisoned[~_field(case.name, out_index)] = np.nan
    f = jax.jit(lambda x: conv(x, k, case.mask, **case.conv_args)[out_index])
    clean, dirty = np.asarray(f(x)), np.asarray(f(jnp.asarray(poisoned)))
    assert np.isfinite(clean)
    assert clean.tobytes() == dirty.tobytes(), f"output changed from {clean} to {dirty}"


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.name)
def test_layouts_masked_kernel_entries_are_never_read(conv, case):
    """In the kernel's own layout: their gradient is exactly 0.0 and NaN there changes no output."""
    x = random(25, case.x_shape, dtype=conv.dtype)
    k = np.array(random(26, case.kernel_shape, dtype=conv.dtype))
    masked = ~dense_mask(case.mask, k.shape, lax_dimension_numbers(x.shape, k.shape, case.conv_args.get("dimension_numbers")))
    f = jax.jit(lambda x, k: conv(x, k, case.mask, **case.conv_args))
    clean = np.asarray(f(x, k))
    dk = np.asarray(jax.jit(jax.grad(lambda k: f(x, k).astype(np.float32).sum()))(jnp.asarray(k)))
    assert (dk[masked] == 0.0).all() and (dk[~masked] != 0.0).any()
    k[masked] = np.nan
    assert np.asarray(f(x, jnp.asarray(k))).tobytes() == clean.tobytes()
