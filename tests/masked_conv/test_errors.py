"""Bad input gets an error that names the argument, what was expected and what was given."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.implementations import suite_dtype

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import backends
from maskconv_kernels.ops.masked_conv.spec import make_spec

X = jnp.ones((1, 8, 8, 4))
K = jnp.ones((3, 3, 4, 6))
M = mk.pixelcnn_mask((3, 3), "B")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(x=jnp.ones((8, 4))), ValueError, r"x must be \(N, \*spatial, C_in\).*\(8, 4\)"),
        (dict(kernel=jnp.ones((3, 4, 6))), ValueError, r"kernel must be .* 2 window dims.*\(3, 4, 6\)"),
        (dict(kernel=jnp.ones((3, 3, 5, 6))), ValueError, r"kernel has 5 input channels but x has C_in=4"),
        (dict(mask=np.ones((2, 3))), ValueError, r"mask has shape \(2, 3\) but the kernel window is \(3, 3\)"),
        (dict(mask=np.full((3, 3), 0.5)), ValueError, r"mask must hold only 0 and 1.*0\.5"),
        (dict(mask=np.full((3, 3), 2)), ValueError, r"mask must hold only 0 and 1"),
        (dict(mask=np.array([["a"] * 3] * 3)), TypeError, r"mask must hold bools or 0/1 numbers"),
        (dict(x=jnp.ones((1, 8, 8, 4), jnp.int32), kernel=jnp.ones((3, 3, 4, 6), jnp.int32)), TypeError, r"x must have a floating dtype.*int32"),
        (dict(strides=0), ValueError, r"strides must be positive, got 0"),
        (dict(strides=(1, 2, 3)), ValueError, r"strides must be an int or a tuple of 2 ints"),
        (dict(dilation=-1), ValueError, r"dilation must be positive"),
        (dict(padding="FULL"), ValueError, r"padding must be 'SAME', 'SAME_LOWER', 'VALID', 'CAUSAL'.*'FULL'"),
        (dict(padding="CAUSAL"), ValueError, r"CAUSAL.*1-D.*2 spatial dims"),
        (dict(padding=((1, 1),)), ValueError, r"one \(lo, hi\) pair per spatial dim \(2\)"),
        (dict(feature_group_count=3), ValueError, r"feature_group_count=3 must divide both C_in=4 and C_out=6"),
        (dict(feature_group_count=0), ValueError, r"feature_group_count must be a positive int"),
        (dict(implementation="cudnn"), ValueError, r"implementation must be None or one of .*'cudnn'"),
        (dict(padding=((-9, 0), (0, 0))), ValueError, r"padding \(\(-9, 0\), \(0, 0\)\) crops more than .* \(8, 8\)"),
        (dict(preferred_element_type=jnp.int32), TypeError, r"preferred_element_type must be a floating dtype"),
        # What a new user tried (issue 11): each names the argument and what it accepts.
        (dict(x=None), TypeError, r"x must be an array or array-like.*NoneType"),
        (dict(kernel=None), TypeError, r"kernel must be an array or array-like.*NoneType"),
        (dict(x=[[1.0, 2.0], [3.0]]), TypeError, r"x must be an array or array-like.*list"),
        (dict(kernel="abc"), TypeError, r"kernel must be an array or array-like.*str"),
        (dict(x=1.5), ValueError, r"x must be \(N, \*spatial, C_in\).*got shape \(\)"),
        (dict(kernel=2.0), ValueError, r"kernel must be \(\*window, C_in // groups, C_out\).*got shape \(\)"),
        (dict(x=np.ones((1, 8, 8, 4)).tolist(), kernel=np.ones((3, 3, 4, 6), int).tolist()), TypeError, r"kernel must have a floating dtype.*int32"),
        (dict(strides=1.5), TypeError, r"strides must be an int or a tuple of 2 ints, got 1.5"),
        (dict(strides=True), TypeError, r"strides must be an int or a tuple of 2 ints, got True"),
        (dict(dilation=(1, 2.0)), TypeError, r"dilation must be an int or a tuple of 2 ints, got \(1, 2.0\)"),
        (dict(x=jnp.ones((1, 8, 8, 0)), kernel=jnp.ones((3, 3, 0, 6))), ValueError, r"at least one channel.*C_in=0"),
        (dict(kernel=jnp.ones((3, 3, 4, 0))), ValueError, r"at least one channel.*C_out=0"),
        (dict(kernel=jnp.ones((0, 3, 4, 6)), mask=np.ones((0, 3))), ValueError, r"kernel window must be at least 1.*\(0, 3, 4, 6\)"),
        (dict(x=X.astype(jnp.float8_e4m3fn), kernel=K.astype(jnp.float8_e4m3fn)), TypeError, r"x must have a floating dtype \(float32, bfloat16 or float16.*float8_e4m3fn"),
        (dict(padding=((1.7, 1), (1, 1))), TypeError, r"padding must be .*pair of ints.*1.7"),
        (dict(padding=((True, 1), (1, 1))), TypeError, r"padding must be .*pair of ints"),
        (dict(feature_group_count=True), ValueError, r"feature_group_count must be a positive int, got True"),
        (dict(interpret="yes"), TypeError, r"interpret must be True or False, got 'yes'"),
        (dict(preferred_element_type="bogus"), TypeError, r"preferred_element_type must be a floating dtype.*'bogus'"),
        (dict(precision="bogus"), ValueError, r"precision must be None, a lax.Precision, one of 'default', 'high', 'highest'.*'bogus'"),
        (dict(mask=np.ones((3, 3, 4, 5))), ValueError, r"mask has the full kernel shape's rank but shape \(3, 3, 4, 5\).*C_out = 6"),
        # lax.conv_general_dilated's arguments (issue 20): the same limits as lax, said so.
        (dict(dimension_numbers="NCHW"), TypeError, r"dimension_numbers must be None \(channels-last, \('NHWC', 'HWIO', 'NHWC'\)\).*'NCHW'"),
        (dict(dimension_numbers=("NCHW", "OIHW")), TypeError, r"dimension_numbers must be .*three strings of length 4.*\('NCHW', 'OIHW', 'NCHW'\)"),
        (dict(dimension_numbers=("NCHW", "OIHW", "NCHX")), ValueError, r"dimension_numbers must be .*'NCHX'.*same set of spatial characters"),
        (dict(dimension_numbers=jax.lax.ConvDimensionNumbers((0, 3, 1, 1), (3, 2, 0, 1), (0, 3, 1, 2))), ValueError, r"ConvDimensionNumbers must order all 4 axes"),
        (dict(lhs_dilation=0), ValueError, r"lhs_dilation must be positive, got 0"),
        (dict(lhs_dilation=(2, 1.0)), TypeError, r"lhs_dilation must be an int or a tuple of 2 ints"),
        (dict(lhs_dilation=2), ValueError, r"padding='SAME' is a string, which is not defined with lhs_dilation=\(2, 2\).*\(lo, hi\) pair"),
        (dict(batch_group_count=0), ValueError, r"batch_group_count must be a positive int, got 0"),
        (dict(batch_group_count=2, x=jnp.ones((2, 8, 8, 2)), kernel=jnp.ones((3, 3, 1, 6)), feature_group_count=2), ValueError, r"at most one may be above 1"),
        (dict(batch_group_count=2), ValueError, r"batch_group_count=2 must divide the batch N=1 and C_out=6"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
@pytest.mark.parametrize("implementation", mk.IMPLEMENTATIONS)
def test_bad_input(kwargs, error, match, implementation):
    # Validation comes before dispatch: every backend gives the same error.
    args = dict(x=X, kernel=K, mask=M, implementation=implementation) | kwargs
    if implementation != "xla":
        args.setdefault("interpret", True)
    with pytest.raises(error, match=match):
        mk.masked_conv(args.pop("x"), args.pop("kernel"), args.pop("mask"), **args)


def test_array_likes_are_converted_as_jnp_asarray_would(conv):
    x, k = np.asarray(X), np.asarray(K)
    expected = conv(X, K, M)
    np.testing.assert_array_equal(conv(x.tolist(), k.tolist(), M), expected)
    np.testing.assert_array_equal(conv(x.astype(np.float64), k, M), expected)  # float64 -> float32 without x64


def test_precision_names_and_pairs_are_accepted():
    for precision in ("highest", "HIGHEST", jax.lax.Precision.HIGHEST, ("highest", "default"), ["high", "high"]):
        assert mk.masked_conv(X, K, M, precision=precision).shape == (1, 8, 8, 6)


@pytest.mark.parametrize("implementation", mk.IMPLEMENTATIONS)
def test_empty_batch_gives_an_empty_output_and_gradient(implementation):
    record = backends.get(implementation)
    dtype = suite_dtype(record, interpret=True)
    if dtype is None:
        probe = make_spec(np.zeros((1, 4, 4, 2), np.float32), np.zeros((3, 3, 2, 2), np.float32), np.ones((3, 3)))
        pytest.skip(f'implementation="{implementation}" cannot run here: {record.unsupported(probe, None, True)}')
    x, k = jnp.ones((0, 8, 8, 4), dtype), K.astype(dtype)
    f = lambda x, k: mk.masked_conv(x, k, M, implementation=implementation, interpret=implementation != "xla")
    y, (dx, dk) = jax.value_and_grad(lambda x, k: f(x, k).astype(np.float32).sum(), (0, 1))(x, k)
    assert f(x, k).shape == (0, 8, 8, 6) and y == 0.0 and dx.shape == x.shape and not np.asarray(dk).any()


@pytest.mark.parametrize("implementation", [i for i in mk.IMPLEMENTATIONS if i != "xla"])
def test_kernel_backends_say_they_take_one_dtype(implementation):
    """Mixed x/kernel dtypes run on xla (tests/test_segments.py); a kernel backend names them."""
    with pytest.raises(NotImplementedError, match=r"x in bfloat16 with a float32 kernel.*implementation='xla'"):
        mk.masked_conv(X.astype(jnp.bfloat16), K, M, implementation=implementation, interpret=True)


def test_traced_mask_says_why_masks_are_static():
    with pytest.raises(TypeError, match=r"mask must be static.*decided when it is traced"):
        jax.jit(lambda m: mk.masked_conv(X, K, m))(jnp.ones((3, 3)))


def test_all_false_mask_is_valid_and_gives_zeros():
    y, (dx, dk) = jax.value_and_grad(lambda x, k: mk.masked_conv(x, k, np.zeros((3, 3))).sum(), (0, 1))(X, K)
    assert y == 0.0 and not np.asarray(dx).any() and not np.asarray(dk).any()


def test_concrete_jax_array_mask_is_accepted():
    np.testing.assert_array_equal(mk.masked_conv(X, K, jnp.asarray(M)), mk.masked_conv(X, K, M))
