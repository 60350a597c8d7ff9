"""lax's own convolution tests, replayed against masked_conv.

JAX tests ``lax.conv_general_dilated`` on grids of shapes, layouts, paddings, dilations,
groups and dtypes: ``tests/lax_test.py`` (``testConv``, ``testConvWithGeneralPadding``,
``testConvGeneralDilated``, ``testConvTranspose1D/2D/2DT``, ``testConvPreferredElement``,
``testConvTransposePaddingList``) and ``tests/lax_autodiff_test.py`` (``testConvGrad``,
``testConvWithGeneralPaddingGrad``, ``testConvGeneralDilatedGrad``,
``testConvPreferredElementType``). Each grid here is theirs, with a mask added (a raster
prefix of the window's taps, or a full mask in the kernel's layout with a
channel-partial tap): ``masked_conv(x, k, mask, ...)`` must equal
``lax.conv_general_dilated(x, k * mask, ...)`` in float64 (``lax_oracle``) under
conftest's bounds, the output for lax_test's grids, the output, both gradients
(reverse mode) and the JVP (forward mode) for lax_autodiff_test's.

JAX runs a sample of each grid; so do we (``replay.py``): the README's command takes
``FAST`` cases of each grid, the slow tier ``SLOW`` more; ``MASKCONV_REPLAY=all`` (or a
number of cases per grid) runs more of them in the slow tier.

Not replayed, by design: the 0-D convolutions (``testConvGeneralDilated0D``,
``testConvTranspose0D``, ``testGradConv0D``; masked_conv takes 1-3 spatial dims, and says
so: ``test_zero_spatial_dims_are_refused``); the grids' integer, bool and complex dtypes
(refused with a TypeError naming the dtypes it takes: ``test_errors.py``,
``test_other_dtypes_are_refused``); the patches and local (unshared) convolutions, other
ops.
"""
from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close, random
from jax import lax
from support.lax_oracle import assert_jvp_matches_lax, assert_matches_lax, bounds, dense_mask, lax_conv64, lax_dimension_numbers
from support.replay import tiers

import maskconv_kernels as mk

BF16, F16, F32, F64 = (np.dtype(d) for d in (jnp.bfloat16, np.float16, np.float32, np.float64))
FLOATS = [BF16, F16, F32, F64]  # lax_test_util.float_dtypes
GRAD_FLOATS = [F32, F64]  # lax_autodiff_test's grad_inexact_dtypes, without complex
FAST, SLOW = 1, 1  # cases per grid: the README's command, the slow tier on top


def _tiers(name: str, grid: list[dict]) -> list:
    """Each case gets its index in the grid as the seed of its data and mask."""
    return tiers(name, [dict(case, seed=i) for i, case in enumerate(grid)], _id, fast=FAST, slow=SLOW)


def _id(case: dict) -> str:
    a = case["conv_args"]
    parts = ["x" + "x".join(map(str, case["x_shape"])), "k" + "x".join(map(str, case["k_shape"])), case["dtype"].name]
    for key in ("strides", "padding", "lhs_dilation", "dilation", "feature_group_count", "batch_group_count"):
        if key in a:
            value = a[key]
            parts.append(f"{key}={value if isinstance(value, str) else ''.join(str(v) for v in np.ravel(value))}")
    if "dimension_numbers" in a:
        parts.append("-".join(a["dimension_numbers"]))
    return "_".join(parts)


def _mask(k_shape, dimension_numbers, seed: int) -> np.ndarray:
    """A raster prefix of the window's taps (the kernel's spatial axes, in its order); every
    third case a full mask in the kernel's layout whose last active tap is channel-partial."""
    rng = np.random.default_rng(seed)
    dn = lax.conv_dimension_numbers(k_shape, k_shape, dimension_numbers)
    window = tuple(k_shape[a] for a in sorted(dn.rhs_spec[2:]))
    taps = int(np.prod(window))
    active = int(rng.integers(1, taps + 1))
    mask = (np.arange(taps) < active).reshape(window)
    if seed % 3:
        return mask
    full = np.array(dense_mask(mask, k_shape, dn))
    last = [slice(None)] * len(k_shape)
    for axis, t in zip(sorted(dn.rhs_spec[2:]), np.unravel_index(active - 1, window)):
        last[axis] = t
    part = full[tuple(last)]
    part &= rng.random(part.shape) < 0.5
    part.flat[0] = True
    full[tuple(last)] = part
    return full


def _x64(dtype):
    return jax.enable_x64(True) if dtype == F64 else contextlib.nullcontext()


def _operands(case):
    x = random(case["seed"], case["x_shape"], case["dtype"])
    fan_in = max(1, int(np.prod(case["k_shape"])) // max(1, case["k_shape"][_o_axis(case)]))
    k = random(case["seed"] + 1, case["k_shape"], case["dtype"], scale=1 / np.sqrt(fan_in))
    return x, k


def _o_axis(case) -> int:
    dn = case["conv_args"].get("dimension_numbers")
    return lax_dimension_numbers(case["x_shape"], case["k_shape"], dn).rhs_spec[0]


def _check_forward(case):
    with _x64(case["dtype"]):
        x, k = _operands(case)
        mask = _mask(case["k_shape"], case["conv_args"]["dimension_numbers"], case["seed"])
        assert_matches_lax(x, k, mask, case["dtype"], seed=case["seed"], grads=False, **case["conv_args"])


def _check_derivatives(case):
    with _x64(case["dtype"]):
        x, k = _operands(case)
        mask = _mask(case["k_shape"], case["conv_args"]["dimension_numbers"], case["seed"])
        assert_matches_lax(x, k, mask, case["dtype"], seed=case["seed"], **case["conv_args"])
        assert_jvp_matches_lax(x, k, mask, case["dtype"], seed=case["seed"] + 1, **case["conv_args"])


NCHW = ("NCHW", "OIHW", "NCHW")


def _case(x_shape, k_shape, dtype, **conv_args):
    conv_args.setdefault("dimension_numbers", NCHW)
    return dict(x_shape=tuple(int(n) for n in x_shape), k_shape=tuple(int(n) for n in k_shape), dtype=np.dtype(dtype),
                conv_args=conv_args)


# --------------------------------------------------------------------- tests/lax_test.py

BIJ = list(itertools.product([2, 3], repeat=3))

# testConv (lax.conv: NCHW, OIHW); testConvAgainstNumpy's grid is this one without SAME_LOWER.
CONV = [
    _case((b, i, 9, 10), (j, i, 4, 5), dtype, strides=strides, padding=padding)
    for b, i, j in BIJ for dtype in FLOATS for strides in [(1, 1), (1, 2), (2, 1)]
    for padding in ["VALID", "SAME", "SAME_LOWER"]
]

# testConvWithGeneralPadding (lax.conv_with_general_padding); its AgainstNumpy twin is the float32 part.
GENERAL_PADDING = [
    _case((b, i, 9, 10), (j, i, 4, 5), dtype, strides=strides, padding=padding, lhs_dilation=lhs_dil, dilation=rhs_dil)
    for b, i, j in itertools.product([1, 2, 3], repeat=3) for dtype in FLOATS
    for strides in [(1, 1), (1, 2), (2, 1)] for padding in [((0, 0), (0, 0)), ((1, 2), (2, 0))]
    for lhs_dil in [(1, 1), (1, 2), (2, 2)] for rhs_dil in [(1, 1), (1, 2), (2, 2)]
]

# testConvGeneralDilated: layouts, batch and feature groups, a zero width, large pads.
LAYOUTS = [(NCHW, [0, 1, 2, 3], [0, 1, 2, 3]), (("NHWC", "HWIO", "NHWC"), [0, 2, 3, 1], [2, 3, 1, 0]),
           (("NCHW", "HWIO", "NHWC"), [0, 1, 2, 3], [2, 3, 1, 0])]
GENERAL_DILATED = [
    _case(np.take((b * bgc, i * fgc, 9, w), lhs_perm), np.take((j * fgc * bgc, i, 4, 5), rhs_perm), dtype,
          strides=strides, padding=padding, lhs_dilation=lhs_dil, dilation=rhs_dil, dimension_numbers=dn,
          feature_group_count=fgc, batch_group_count=bgc)
    for bgc, fgc in [(1, 1), (2, 1), (1, 2)] for w in [0, 10] for b, i, j in BIJ
    for dn, lhs_perm, rhs_perm in LAYOUTS for dtype in FLOATS for strides in [(1, 1), (2, 1)]
    for padding in [((1, 2), (2, 0)), ((10, 8), (7, 13))]
    for lhs_dil in [(1, 1), (1, 2), (1, 4)] for rhs_dil in [(1, 1), (1, 2), (1, 4)]
]

# testConvPreferredElement: the float pairs of preferred_type_combinations.
PREFERRED = [
    _case((b, i, 9, 10), (j, i, 4, 5), dtype, padding="VALID", preferred_element_type=np.dtype(preferred))
    for b, i, j in BIJ
    for dtype, preferred in [(F16, F16), (F16, F32), (F16, F64), (BF16, BF16), (BF16, F32), (BF16, F64),
                             (F32, F32), (F32, F64), (F64, F64)]
]


@pytest.mark.parametrize("case", _tiers("testConv", CONV))
def test_conv(case):
    _check_forward(case)


@pytest.mark.parametrize("case", _tiers("testConvWithGeneralPadding", GENERAL_PADDING))
def test_conv_with_general_padding(case):
    _check_forward(case)


@pytest.mark.parametrize("case", _tiers("testConvGeneralDilated", GENERAL_DILATED))
def test_conv_general_dilated(case):
    _check_forward(case)


@pytest.mark.parametrize("case", _tiers("testConvPreferredElement", PREFERRED))
def test_conv_preferred_element(case):
    """16-bit and float32 inputs accumulate in float32 whatever the output dtype (lax
    accumulates float64 outputs in float64): the bound is float32's for wider outputs."""
    dtype, preferred = case["dtype"], case["conv_args"]["preferred_element_type"]
    bound = preferred if preferred.itemsize < 4 else np.promote_types(dtype, F32)
    with _x64(F64 if F64 in (dtype, preferred) else dtype):
        x, k = _operands(case)
        mask = _mask(case["k_shape"], NCHW, case["seed"])
        y = mk.masked_conv(x, k, mask, **case["conv_args"])
        args = {a: v for a, v in case["conv_args"].items() if a != "preferred_element_type"}
        expected, _ = lax_conv64(x, k, mask, **args)
        assert y.dtype == preferred
        assert_close(y, expected, bound, *bounds(x, k, mask, expected, **args)["y"], operands=dtype)


def test_conv_transpose_padding_list():
    """testConvTransposePaddingList: explicit zero pads, all ones, every output 9."""
    a, b = jnp.ones((28, 28)), jnp.ones((3, 3))
    mask = np.ones((3, 3), bool)
    c = mk.masked_conv(a[None, None], b[None, None], mask, strides=(1, 1), padding=[(0, 0), (0, 0)], lhs_dilation=(1, 1),
                       dimension_numbers=NCHW)
    np.testing.assert_array_equal(c, 9 * jnp.ones((1, 1, 26, 26)))
    # And masked: the taps left are counted, nothing else.
    c = mk.masked_conv(a[None, None], b[None, None], mk.pixelcnn_mask((3, 3), "A"), padding="VALID", dimension_numbers=NCHW)
    np.testing.assert_array_equal(c, 4 * jnp.ones((1, 1, 26, 26)))


# --------------------------------------------------------------------- conv_transpose


def _transpose_kernel(a, dn):
    """lax_test's _transpose_conv_kernel: spatial axes flipped, O and I swapped (a kernel or its mask)."""
    for axis in dn.rhs_spec[2:]:
        a = np.flip(a, axis)
    return np.swapaxes(a, dn.rhs_spec[0], dn.rhs_spec[1])


def _check_transpose(case):
    """``lax.conv_transpose(x, k * mask)`` in float64 against masked_conv given the
    parameters of the convolution lax runs (read from its jaxpr): ``lhs_dilation=strides``."""
    a = case["transpose_args"]
    with _x64(case["dtype"]):
        x, k = _operands(case)
        dn = lax.conv_dimension_numbers(x.shape, k.shape, a["dimension_numbers"])
        mask = _mask(k.shape, a["dimension_numbers"], case["seed"])
        full = dense_mask(mask, k.shape, dn)
        transpose = lambda x, k: lax.conv_transpose(x, k, **a)
        p = [e for e in jax.make_jaxpr(transpose)(x, k).eqns if e.primitive.name == "conv_general_dilated"][0].params
        rhs, rhs_mask = (_transpose_kernel(np.asarray(k), dn), _transpose_kernel(full, dn)) if a["transpose_kernel"] else (k, full)
        conv_args = dict(strides=p["window_strides"], padding=p["padding"], lhs_dilation=p["lhs_dilation"],
                         dilation=p["rhs_dilation"], dimension_numbers=p["dimension_numbers"])
        y = mk.masked_conv(x, jnp.asarray(rhs), rhs_mask, **conv_args)
        with jax.enable_x64(True):
            expected = np.asarray(transpose(jnp.asarray(np.asarray(x, np.float64)),
                                            jnp.asarray(np.asarray(k, np.float64) * full)))
        assert y.shape == expected.shape and y.dtype == case["dtype"]
        assert_close(y, expected, case["dtype"], *bounds(x, jnp.asarray(rhs), rhs_mask, expected, **conv_args)["y"])


def _transpose_case(x_shape, k_shape, dtype, **transpose_args):
    return dict(x_shape=x_shape, k_shape=k_shape, dtype=np.dtype(dtype),
                conv_args=dict(dimension_numbers=transpose_args["dimension_numbers"]), transpose_args=transpose_args)


PADS_2D = list(itertools.product(itertools.product([0, 1, 2], [0, 1, 2]), itertools.product([0, 1, 2], [0, 1, 2])))
TRANSPOSE_2D = [
    _transpose_case((b, 9, 10, i), (k, k, j, i) if flipped else (k, k, i, j), dtype, strides=strides, padding=padding,
                    rhs_dilation=rhs_dil, dimension_numbers=("NHWC", "HWIO", "NHWC"), transpose_kernel=flipped,
                    use_consistent_padding=True)
    for flipped in (True, False)  # testConvTranspose2DT, testConvTranspose2D
    for b, i, j, k in itertools.product([2, 3], [2, 3], [2, 3], [3, 4, 5]) for dtype in FLOATS
    for strides in [(1, 1), (1, 2), (2, 1), (2, 2), (3, 3)] for padding in PADS_2D + ["VALID", "SAME"]
    for rhs_dil in [None, (2, 2)]
]
TRANSPOSE_1D = [
    _transpose_case((b, 10, i), (k, i, j), dtype, strides=strides, padding=padding, rhs_dilation=rhs_dil,
                    dimension_numbers=("NHC", "HIO", "NHC"), transpose_kernel=False)
    for b, i, j, k in itertools.product([2, 3], [2, 3], [2, 3], [3, 4, 5]) for dtype in FLOATS
    for strides in [(1,), (2,), (3,)] for padding in ["VALID", "SAME"] for rhs_dil in [None, (2,)]
]


@pytest.mark.parametrize("case", _tiers("testConvTranspose2D", TRANSPOSE_2D))
def test_conv_transpose_2d(case):
    _check_transpose(case)


@pytest.mark.parametrize("case", _tiers("testConvTranspose1D", TRANSPOSE_1D))
def test_conv_transpose_1d(case):
    _check_transpose(case)


# --------------------------------------------------------------------- tests/lax_autodiff_test.py

CONV_GRAD = [
    _case(x_shape, k_shape, dtype, strides=strides, padding=padding, dimension_numbers=dn)
    for x_shape, k_shape, all_strides, dn in itertools.chain(
        [((b, i, 3, 4), (j, i, 1, 2), [(1, 1), (1, 2), (2, 1)], NCHW) for b, i, j in BIJ],
        [((4, 2, 1), (3, 2, 1), [(1,)], ("NCH", "OIH", "NCH"))])
    for strides in all_strides for dtype in FLOATS for padding in ["VALID", "SAME"]
]
GENERAL_PADDING_GRAD = [
    _case(x_shape, k_shape, dtype, strides=strides, padding=padding, lhs_dilation=lhs_dil, dilation=rhs_dil,
          dimension_numbers=dn)
    for x_shape, k_shape, all_strides, all_pads, lhs_dils, rhs_dils, dn in itertools.chain(
        [((b, i, 3, 4), (j, i, 1, 2), [(1, 1), (1, 2), (2, 1)], [((0, 0), (0, 0)), ((-1, 0), (0, -1)), ((1, 0), (0, 1))],
          [(1, 1), (2, 1)], [(1, 1)], NCHW) for b, i, j in BIJ],
        [((4, 2, 1), (3, 2, 1), [(1,)], [((1, 1),), ((0, 0),)], [(1,), (2,)], [(1,), (2,)], ("NCH", "OIH", "NCH"))])
    for strides in all_strides for rhs_dil in rhs_dils for lhs_dil in lhs_dils for padding in all_pads
    for dtype in FLOATS
]
GRAD_LAYOUTS = [(NCHW, [0, 1, 2, 3], [0, 1, 2, 3]), (("NHWC", "HWIO", "NHWC"), [0, 2, 3, 1], [2, 3, 1, 0]),
                (("NHWC", "OIHW", "NCHW"), [0, 2, 3, 1], [0, 1, 2, 3])]
GENERAL_DILATED_GRAD = [
    _case(np.take(x_shape, lhs_perm), np.take(k_shape, rhs_perm), dtype, strides=strides, padding=padding,
          lhs_dilation=lhs_dil, dilation=rhs_dil, dimension_numbers=dn, feature_group_count=fgc, batch_group_count=bgc)
    for bgc, fgc in [(1, 1), (2, 1), (1, 2)] for b, i, j in itertools.product([1, 2], repeat=3)
    for x_shape in [(b * bgc, i * fgc, 6, 7), (b * bgc, i * fgc, 0, 4)]
    for k_shape in [(j * bgc * fgc, i, 1, 2)]
    for strides in [(1, 1), (1, 2), (2, 1)] for rhs_dil in [(1, 1), (2, 2)] for lhs_dil in [(1, 1), (2, 1)]
    for padding in [((0, 0), (0, 0)), ((1, 0), (0, 1))] + ([((0, -1), (0, 0))] if x_shape[2] != 0 else [])
    for dn, lhs_perm, rhs_perm in GRAD_LAYOUTS for dtype in GRAD_FLOATS
]


@pytest.mark.parametrize("case", _tiers("testConvGrad", CONV_GRAD))
def test_conv_grad(case):
    _check_derivatives(case)


@pytest.mark.parametrize("case", _tiers("testConvWithGeneralPaddingGrad", GENERAL_PADDING_GRAD))
def test_conv_with_general_padding_grad(case):
    _check_derivatives(case)


@pytest.mark.parametrize("case", _tiers("testConvGeneralDilatedGrad", GENERAL_DILATED_GRAD))
def test_conv_general_dilated_grad(case):
    _check_derivatives(case)


def test_conv_preferred_element_type_grad():
    """testConvPreferredElementType (jax issue 31592): bfloat16 in, float32 out, NLC/LIO, gradients."""
    x = jnp.ones((1, 8, 4), dtype=jnp.bfloat16)
    w = jnp.ones((3, 4, 8), dtype=jnp.bfloat16)
    mask = np.array([1, 1, 0], bool)

    def f(x, w):
        return mk.masked_conv(x, w, mask, strides=(1,), padding="VALID", dilation=(1,),
                              dimension_numbers=("NLC", "LIO", "NLC"), preferred_element_type=jnp.float32).sum()

    dx, dw = jax.grad(f, argnums=(0, 1))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    # Each of the 6 outputs sums 2 active taps x 4 channels of ones. An input pixel gets 8 (one per
    # output channel) from each output that reads it through an active tap; the masked tap's weights 0.
    np.testing.assert_array_equal(np.asarray(dw[2], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(dw[:2], np.float32), 6.0)
    np.testing.assert_array_equal(np.asarray(dx, np.float32)[0, :, 0], [8, 16, 16, 16, 16, 16, 8, 0])


# --------------------------------------------------------------------- what is refused


@pytest.mark.parametrize("dimension_numbers", [("NC", "OI", "NC"), None])
def test_zero_spatial_dims_are_refused(dimension_numbers):
    """lax's 0-D convolutions are dots; masked_conv takes 1-3 spatial dims and says so."""
    with pytest.raises(ValueError, match=r"x must be \(N, \*spatial, C_in\) with 1, 2 or 3 spatial dims"):
        mk.masked_conv(jnp.ones((2, 5)), jnp.ones((5, 10)), np.ones((), bool), dimension_numbers=dimension_numbers)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8, np.bool_, np.complex64])
def test_other_dtypes_are_refused(dtype):
    x, k = jnp.ones((1, 3, 9, 10), dtype), jnp.ones((2, 3, 4, 5), dtype)
    with pytest.raises(TypeError, match=r"x must have a floating dtype \(float32, bfloat16 or float16"):
        mk.masked_conv(x, k, np.ones((4, 5), bool), dimension_numbers=NCHW)


def test_grids_are_lax_tests_sizes():
    """The grids hold as many cases as lax's tests enumerate before sampling (float dtypes only)."""
    assert (len(CONV), len(GENERAL_PADDING), len(GENERAL_DILATED), len(PREFERRED)) == (288, 5832, 20736, 72)
    assert (len(TRANSPOSE_2D), len(TRANSPOSE_1D)) == (2 * 24 * 4 * 5 * 83 * 2, 1152)
    assert (len(CONV_GRAD), len(GENERAL_PADDING_GRAD)) == ((8 * 3 + 1) * 4 * 2, (8 * 3 * 2 * 3 + 2 * 2 * 2) * 4)
    assert len(GENERAL_DILATED_GRAD) == 3 * 8 * (3 + 2) * 3 * 2 * 2 * 3 * 2  # 3 pads with a height, 2 without
