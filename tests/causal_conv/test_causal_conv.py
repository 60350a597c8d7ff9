"""``causal_conv`` and ``causal_conv_transpose``: the definition, the contract along time, errors, dispatch.

Every implementation of the op's registry runs the shared cases (the ``causal`` fixture):
against the float64 oracles written from the definition; NaN and inf in later frames
never reaching earlier outputs (bit for bit); gradients into later frames exactly 0.0.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax
from support.causal import CASES, IMPLS, INTERPRETED, TRANSPOSED, Case, bits, case_params, scale
from support.lowering import cuda_lowering
from support.numerics import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels.ops.causal_conv import causal_conv_reference, causal_conv_transpose_reference

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)


def _skip_heavy(causal, case):
    if causal.slow and not case.small:
        pytest.skip("large for an interpreter: the xla implementation runs it")


@pytest.mark.parametrize("case", case_params(CASES))
def test_matches_the_definition(causal, case):
    _skip_heavy(causal, case)
    x, k, b = case.inputs(0, causal.dtype)
    y = causal.conv(x, k, b, **case.kw)
    expected = causal_conv_reference(x, k, b, **case.kw)
    assert y.dtype == x.dtype and y.shape == expected.shape
    assert y.shape[1] == (case.x_shape[1] - 1) // case.stride + 1
    assert_close(y, expected, causal.dtype, case.reduction() + 1, scale(x, k) + 0.5)


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("case", [CASES[0], pytest.param(CASES[8], marks=pytest.mark.slow)], ids=lambda c: c.name)
def test_xla_every_dtype_and_mixed_weights(case, dtype):
    x, k, b = case.inputs(1, dtype)
    y = mk.causal_conv(x, k, b, **case.kw)
    assert y.dtype == dtype
    assert_close(y, causal_conv_reference(x, k, b, **case.kw), dtype, case.reduction() + 1, scale(x, k) + 0.5)
    # float32 weights for 16-bit activations: products in float32, the output in x's dtype.
    k32 = k.astype(jnp.float32)
    y = mk.causal_conv(x, k32, b, **case.kw)
    assert y.dtype == dtype
    assert_close(y, causal_conv_reference(x, k32, b, **case.kw), dtype, case.reduction() + 1, scale(x, k) + 0.5)


@pytest.mark.parametrize("name", INTERPRETED)
def test_each_interpreted_kernel_backend_smoke(name):
    """The default run's one case per interpreter (the shared suites run them in the slow tier):
    the definition, a NaN in the future, and a stream of two chunks equal to the full pass
    (bit for bit where ``exact_stream``)."""
    impl = IMPLS[name]
    x, k, b = random(40, (2, 9, 3), impl.dtype), random(41, (3, 3, 4), impl.dtype, scale=0.5), None
    y = impl.conv(x, k, b)
    assert_close(y, causal_conv_reference(x, k), impl.dtype, 9 + 1, scale(x, k))
    poisoned = impl.conv(_poisoned(x, 5, np.nan), k, b)
    np.testing.assert_array_equal(bits(poisoned[:, :5]), bits(y[:, :5]))
    y0, state = impl.stream(x[:, :1], None, k, b)
    y1, _ = impl.stream(x[:, 1:], state, k, b)
    streamed = jnp.concatenate([y0, y1], axis=1)
    if impl.exact_stream:
        np.testing.assert_array_equal(bits(streamed), bits(y))
    else:
        assert_close(streamed, causal_conv_reference(x, k), impl.dtype, 9 + 1, scale(x, k))


def test_xla_float64_with_x64():
    case = CASES[6]  # 2-D, feature groups, replicate
    with jax.enable_x64(True):
        x, k, b = (jnp.asarray(a, jnp.float64) for a in case.inputs(42, F32))
        y = mk.causal_conv(x, k, b, **case.kw)
        assert y.dtype == jnp.float64
        assert_close(y, causal_conv_reference(x, k, b, **case.kw), np.float64, case.reduction() + 1, scale(x, k) + 0.5)


def _poisoned(x, cut: int, value: float):
    """x with every frame from ``cut`` on replaced by ``value`` (NaN or inf)."""
    return x.at[:, cut:].set(jnp.asarray(value, x.dtype))


@pytest.mark.parametrize("case", case_params(CASES))
def test_later_frames_never_reach_earlier_outputs(causal, case):
    _skip_heavy(causal, case)
    x, k, b = case.inputs(2, causal.dtype)
    frames, s = case.x_shape[1], case.stride
    cut = max(1, frames // 2)
    seen = (cut - 1) // s + 1  # outputs t with t * s < cut read frames before the cut only
    clean = causal.conv(x, k, b, **case.kw)
    for value in (np.nan, np.inf):
        poisoned = causal.conv(_poisoned(x, cut, value), k, b, **case.kw)
        np.testing.assert_array_equal(bits(poisoned[:, :seen]), bits(clean[:, :seen]))

    # Gradients of the outputs before `seen` into the frames after `cut - 1`: exactly 0.0.
    cotangent = random(3, clean[:, :seen].shape, np.float32)
    loss = lambda x: (causal.conv(x, k, b, **case.kw)[:, :seen].astype(jnp.float32) * cotangent).sum()  # noqa: E731
    dx = np.asarray(jax.grad(loss)(x), np.float32)
    assert (dx[:, cut:] == 0.0).all() and np.isfinite(dx).all()
    assert np.abs(dx[:, :cut]).max() > 0  # the frames the outputs do read


@pytest.mark.parametrize("case", case_params(TRANSPOSED))
def test_transpose_matches_the_definition_and_is_causal(causal, case):
    _skip_heavy(causal, case)
    x, k, b = case.inputs(4, causal.dtype)
    y = causal.transpose(x, k, b, **case.kw)
    expected = causal_conv_transpose_reference(x, k, b, **case.kw)
    assert y.shape == expected.shape == (case.x_shape[0], case.x_shape[1] * case.stride, *y.shape[2:])
    taps = -(-case.window[0] // case.stride)  # the most taps an output sums along time
    reduction = taps * int(np.prod(case.kernel_shape[1:-1])) + 1
    assert_close(y, expected, causal.dtype, reduction, scale(x, k) + 0.5)
    # Output u reads input frames up to u // s: a NaN from frame `cut` on stays after u = cut * s.
    cut, s = case.x_shape[1] // 2, case.stride
    poisoned = causal.transpose(_poisoned(x, cut, np.nan), k, b, **case.kw)
    np.testing.assert_array_equal(bits(poisoned[:, : cut * s]), bits(y[:, : cut * s]))
    dx = jax.grad(lambda x: causal.transpose(x, k, b, **case.kw)[:, : cut * s].astype(jnp.float32).sum())(x)
    assert (np.asarray(dx[:, cut:], np.float32) == 0.0).all()


def test_transpose_is_pytorchs_conv_transpose_trimmed():
    """EnCodec's and Mimi's causal SConvTranspose1d: ConvTranspose1d, then the last k - s outputs dropped.

    ConvTranspose1d written from its formula as lax computes it: the input dilated by s,
    padded by k - 1 on both sides, correlated with the flipped kernel.
    """
    x, k = random(5, (2, 6, 3), np.float32), random(6, (8, 3, 4), np.float32, scale=0.5)  # k = 2 s, s = 4
    full = lax.conv_general_dilated(
        x, jnp.flip(k, 0), (1,), ((7, 7),), lhs_dilation=(4,), dimension_numbers=("NWC", "WIO", "NWC"),
        precision="highest",
    )
    assert full.shape[1] == (6 - 1) * 4 + 8
    assert_close(mk.causal_conv_transpose(x, k, strides=4), full[:, : 6 * 4], F32, 2 * 3, scale(x, k))


def _clips(frames):
    """Two clips and trailing padding along time: ids ``(1, T)``."""
    first = frames // 3
    ids = np.full((1, frames), -1, np.int32)
    ids[0, :first] = 7
    ids[0, first : frames - 2] = 9
    return ids, first


SEGMENTED = [
    CASES[1],
    Case("spec_T8_F6_k2x3_d1x2_pairs", (2, 8, 6, 2), (2, 3), 3, dict(padding=((2, 2),), dilation=(1, 2))),
    CASES[7],
]


@pytest.mark.parametrize("case", case_params(SEGMENTED))
def test_packed_clips_run_as_if_alone(case):
    x, k, b = case.inputs(7, F32)
    x = x[:1]
    frames = x.shape[1]
    ids2, first = _clips(frames)
    ids = jnp.asarray(np.broadcast_to(ids2.reshape(1, frames, *(1,) * (x.ndim - 3)), x.shape[:-1]))
    y = mk.causal_conv(x, k, b, segment_ids=ids, **case.kw)
    expected = causal_conv_reference(x, k, b, segment_ids=ids, **case.kw)
    assert_close(y, expected, F32, case.reduction() + 1, scale(x, k) + 0.5)
    alone = mk.causal_conv(x[:, first : frames - 2], k, b, **case.kw)
    assert_close(y[:, first : frames - 2], alone, F32, case.reduction() + 1, scale(x, k) + 0.5)
    assert (np.asarray(y[:, frames - 2 :]) == 0).all()  # padding frames
    # The first clip's outputs never see the second clip, nor the padding.
    poisoned = mk.causal_conv(_poisoned(x, first, np.nan), k, b, segment_ids=ids, **case.kw)
    np.testing.assert_array_equal(bits(poisoned[:, :first]), bits(y[:, :first]))
    dx = jax.grad(lambda x: mk.causal_conv(x, k, b, segment_ids=ids, **case.kw)[:, first:].sum())(x)
    assert (np.asarray(dx[:, :first]) == 0.0).all()  # a later clip takes nothing from an earlier one
    # The transposed convolution: output u in input frame u // s's clip.
    yt = mk.causal_conv_transpose(x, k, b, segment_ids=ids, strides=2, **_no_stride(case.kw))
    assert_close(yt, causal_conv_transpose_reference(x, k, b, segment_ids=ids, strides=2, **_no_stride(case.kw)),
                 F32, case.reduction() + 1, scale(x, k) + 0.5)


def _no_stride(kw):
    out = {key: v for key, v in kw.items() if key != "strides"}
    if isinstance(out.get("dilation"), int) or (out.get("dilation") and out["dilation"][0] != 1):
        d = out["dilation"]
        out["dilation"] = 1 if isinstance(d, int) else (1, *d[1:])
    return out


def test_dimension_numbers_put_time_first_among_the_layouts_spatial_axes():
    x, k, b = CASES[7].inputs(8, F32)  # (N, T, H, W, C), (kT, kH, kW, I, O)
    y = mk.causal_conv(x, k, b, padding_mode="replicate")
    xc, kc = jnp.moveaxis(x, -1, 1), jnp.transpose(k, (4, 3, 0, 1, 2))
    yc = mk.causal_conv(xc, kc, b, padding_mode="replicate", dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))
    np.testing.assert_array_equal(bits(jnp.moveaxis(yc, 1, -1)), bits(y))
    # The layout's first spatial axis is time, wherever it lies in x: lax orders the
    # spatial axes as the kernel's spec names them, so with "WHIO" it is W, x's axis 2.
    x2, ks = x[:, :, :, 0], k[:, :, 0]  # (N, T, H, C), (kT, kH, I, O)
    ys = mk.causal_conv(jnp.swapaxes(x2, 1, 2), ks, dimension_numbers=("NHWC", "WHIO", "NHWC"))
    expected = causal_conv_reference(x2, ks)
    assert_close(jnp.swapaxes(ys, 1, 2), expected, F32, 9 * 3, scale(x, k))


def test_replicate_equals_edge_padding_without_a_padded_copy_of_x():
    x, k, b = random(9, (1, 64, 16, 16, 32), F32), random(10, (3, 3, 3, 32, 8), F32, scale=0.2), None
    dn = ("NDHWC", "DHWIO", "NDHWC")

    def users_code(x, k):  # what Cosmos' and CogVideoX's ports write
        padded = jnp.pad(x, ((0, 0), (2, 0), (0, 0), (0, 0), (0, 0)), mode="edge")
        return lax.conv_general_dilated(padded, k, (1, 1, 1), ((0, 0), (1, 1), (1, 1)), dimension_numbers=dn,
                                        precision="highest")

    ours = lambda x, k: mk.causal_conv(x, k, padding_mode="replicate")  # noqa: E731
    assert_close(ours(x, k), users_code(x, k), F32, 27 * 32, scale(x, k))
    temp = jax.jit(ours).lower(x, k).compile().memory_analysis().temp_size_in_bytes
    # x's bytes as this platform stores it (x.nbytes on CPU; a TPU pads C = 32 to its tiles):
    # a few frames, not a padded copy of x.
    stored = jax.jit(jnp.negative).lower(x).compile().memory_analysis().output_size_in_bytes
    assert temp < stored / 4, (temp, stored, x.nbytes)


# --------------------------------------------------------------------------- errors


def _xk(ndim=3, c=4):
    return random(11, (1, 5, *(4,) * (ndim - 1), c), F32), random(12, (3, *(3,) * (ndim - 1), c, 4), F32)


@pytest.mark.parametrize("implementation", ["pallas_triton", "triton", "pallas_mosaic_gpu"])
def test_a_named_kernel_backend_refuses_video_in_causal_convs_words(implementation):
    x, k = _xk(3)
    with pytest.raises(NotImplementedError, match=re.escape(
            f'causal_conv(implementation="{implementation}") does not support this problem: ')) as e:
        mk.causal_conv(x, k, implementation=implementation, interpret=True)
    assert "masked_conv" not in str(e.value)
    if implementation != "pallas_mosaic_gpu" or int(jax.__version__.split(".")[1]) >= 11:
        assert "3-D" in str(e.value)


def test_a_named_kernel_backend_refuses_segments_and_mosaic_refuses_strides():
    x, k = _xk(1)
    ids = jnp.zeros(x.shape[:-1], jnp.int32)
    with pytest.raises(NotImplementedError, match=r'causal_conv\(implementation="pallas_triton"\).*segment_ids'):
        mk.causal_conv(x, k, segment_ids=ids, implementation="pallas_triton", interpret=True)
    if int(jax.__version__.split(".")[1]) >= 11:
        with pytest.raises(NotImplementedError,
                           match=r'^causal_conv_stream\(implementation="pallas_mosaic_gpu"\).*strides'):
            mk.causal_conv_stream(x.astype(jnp.bfloat16), None, k.astype(jnp.bfloat16), strides=2,
                                  implementation="pallas_mosaic_gpu", interpret=True)


ERRORS = [
    (dict(padding_mode="reflect"), ValueError, r"causal_conv: padding_mode must be 'zeros'.*'reflect' reads frames after 0"),
    (dict(padding="FULL"), ValueError, r"causal_conv: padding must be 'SAME', 'VALID' or"),
    (dict(padding="CAUSAL"), ValueError, r"causal_conv: padding='CAUSAL' is nn.Conv's padding of a 1-D .*'SAME'"),
    (dict(padding=((1, 1), (1, 1))), ValueError, r"causal_conv: padding needs one \(lo, hi\) pair per spatial dim \(1\)"),
    (dict(strides=(1, 2, 3)), ValueError, r"causal_conv: strides must be an int or a tuple of 2 ints"),
    (dict(dilation=0), ValueError, r"causal_conv: dilation must be positive"),
    (dict(implementation="cudnn"), ValueError, r"causal_conv: implementation must be None or one of \('xla'"),
    (dict(config=object()), ValueError, r"causal_conv: config= is the config of one implementation"),
    (dict(implementation="xla", config=object()), TypeError, r'causal_conv\(implementation="xla"\) takes config='),
    (dict(interpret=1), TypeError, r"causal_conv: interpret must be True or False"),
    (dict(feature_group_count=3), ValueError, r"causal_conv: feature_group_count=3 must divide"),
    (dict(segment_ids=np.zeros((1, 5), np.int32)), ValueError, r"causal_conv: segment_ids must have"),
    (dict(segment_ids=np.zeros((1, 5, 4), np.int32), strides=(2, 1)), ValueError,
     r"causal_conv: segment_ids need strides\[0\] = 1"),
    (dict(segment_ids=np.zeros((1, 5, 4), np.int32), padding_mode="replicate"), ValueError,
     r"causal_conv: segment_ids take padding_mode='zeros'"),
    (dict(segment_ids=np.zeros((1, 5, 4), np.int32), padding="VALID"), ValueError,
     r"causal_conv: segment_ids name x's positions"),
]


@pytest.mark.parametrize("kw, error, message", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_bad_arguments_are_named_in_causal_convs_words(kw, error, message):
    x, k = _xk(2)
    with pytest.raises(error, match=message):
        mk.causal_conv(x, k, **kw)


def test_bad_shapes_are_named_in_causal_convs_words():
    x, k = _xk(1)
    with pytest.raises(ValueError, match=r"causal_conv: x must be \(N, T, \*spatial, C_in\).*x\[None\]"):
        mk.causal_conv(x[0], k)
    with pytest.raises(ValueError, match=r"causal_conv: kernel must be \(k_T, \*k_spatial, C_in // groups, C_out\)"):
        mk.causal_conv(x, k[None])
    with pytest.raises(ValueError, match=r"causal_conv: bias must be \(C_out,\) = \(4,\)"):
        mk.causal_conv(x, k, jnp.zeros(3))
    with pytest.raises(ValueError, match=r"causal_conv: x needs at least one frame"):
        mk.causal_conv(x[:, :0], k)
    with pytest.raises(TypeError, match=r"causal_conv: x must have a floating dtype"):
        mk.causal_conv(x.astype(jnp.int32), k)
    with pytest.raises(ValueError, match=r"causal_conv_transpose: strides=\(2, 2\): the transposed convolution "
                                         r"upsamples time only"):
        mk.causal_conv_transpose(*_xk(2), strides=(2, 2))
    with pytest.raises(ValueError, match=r"causal_conv_transpose: dilation=2: the transposed convolution takes no "
                                         r"time dilation"):
        mk.causal_conv_transpose(*_xk(1), dilation=2)


# --------------------------------------------------------------------------- dispatch

TRITON_CALL = "__gpu$xla.gpu.triton"


def _exported(f, *args, kernels=True):
    """``f`` exported for CPU and cuda; ``kernels=False``: a function no kernel backend takes, which
    lowers for cuda without naming the target GPU (jax 0.12's abstract mesh, which the Pallas
    Triton lowering needs, also types the arrays a function makes inside it)."""
    export_ = export.export(jax.jit(f), platforms=("cpu", "cuda"),
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])
    if not kernels:
        return export_(*args).mlir_module()
    with cuda_lowering():
        return export_(*args).mlir_module()


def test_implementation_none_picks_per_platform_and_video_falls_back_to_xla():
    loss = lambda x, k: mk.causal_conv(x, k, strides=(2, 1)).sum()  # noqa: E731
    text = _exported(jax.value_and_grad(loss, argnums=(0, 1)), *_xk(2, 16))
    # 2-D: the cuda branch holds the Pallas kernels; the cpu branch is xla's.
    assert 'name = "maskconv_fwd"' in text and "stablehlo.convolution" in text
    loss3 = lambda x, k: mk.causal_conv(x, k, padding_mode="replicate").sum()  # noqa: E731
    text3 = _exported(jax.grad(loss3), *_xk(3, 16), kernels=False)
    assert "maskconv_fwd" not in text3 and TRITON_CALL not in text3  # no kernel backend takes 3-D
    assert "stablehlo.dot_general" in text3  # xla's exact GEMMs on the GPU branch
