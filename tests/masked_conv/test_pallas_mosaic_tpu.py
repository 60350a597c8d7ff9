"""The ``pallas_mosaic_tpu`` backend's own tests: TPU lowering on CPU, the kernels interpreted, its limits, its config.

The shared suites (agreement, exactness, transforms) run the kernels through the
``pallas_mosaic_tpu_interpret`` backend (:mod:`support.implementations`), in the slow
tier; these cover what they cannot: the Mosaic lowering, several blocks and halos
(small configs), bfloat16 against the float64 reference, the channel selects of partial
taps, the refusals and the config. Without a TPU the kernels are lowered for one from
the CPU and run in Pallas' interpreter; on a TPU the same tests run them compiled.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lowering import count, kernel_jaxprs
from support.numerics import assert_close, assert_same_bits, random
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels import masked_conv_reference
from maskconv_kernels.ops.masked_conv import backends, implementation_for, pallas_mosaic_tpu
from maskconv_kernels.ops.masked_conv.kernel_problem import kernel_problem
from maskconv_kernels.ops.masked_conv.pallas_mosaic_tpu import Config
from maskconv_kernels.ops.masked_conv.pallas_mosaic_tpu.config import KERNELS, VMEM_BUDGET_BYTES, vmem_bytes
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference_vjp
from maskconv_kernels.ops.masked_conv.spec import make_spec

IMPL = "pallas_mosaic_tpu"
KERNEL_NAMES = ("maskconv_tpu_fwd", "maskconv_tpu_bwd_input", "maskconv_tpu_bwd_weight")
BF16 = np.dtype(jnp.bfloat16)
INTERPRET = jax.default_backend() != "tpu"  # compiled where they run, interpreted elsewhere


def _conv(mask, config=None, **kw):
    return lambda x, k: mk.masked_conv(x, k, mask, implementation=IMPL, interpret=INTERPRET, config=config, **kw)


# --------------------------------------------------------------------------- lowering for TPU


def _lower_for_tpu(f, *args) -> str:
    """StableHLO text of ``jax.jit(f)`` lowered for a TPU, on a machine without one."""
    return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


LOWERING_CASES = {
    "2d_N2_H16_W16_C64_k7A_bf16": ((2, 16, 16, 64), (7, 7, 64, 64), mk.pixelcnn_mask((7, 7), "A"), {}, jnp.bfloat16),
    "1d_N2_L33_C130_k3_CAUSAL_d2_f32_highest": (
        (2, 33, 130), (3, 130, 130), np.ones(3), dict(padding="CAUSAL", dilation=2, precision="highest"), jnp.float32,
    ),
    "2d_N1_H7_W7_C6_k3_rgbA_full_f32": ((1, 7, 7, 6), (3, 3, 6, 6), mk.channel_grouped_mask((3, 3), 6, 6, "A"), {},
                                        jnp.float32),
    "2d_N2_H40_W9_C8_k3B_d2_blocks": ((2, 40, 9, 8), (3, 3, 8, 300), mk.pixelcnn_mask((3, 3), "B"),
                                      dict(dilation=2, config=Config(block_pixels=64, block_channels=128, block_taps=2)),
                                      jnp.float32),
}


def test_implementation_none_lowered_for_tpu_holds_the_mosaic_kernels():
    """From a CPU host, as CI runs it: the default on a TPU is the three kernels for a 2-D
    layer of small boxes (3x3 and 5x5 type B), and the xla path's per-box convolutions for
    a 1-D one and for a mask with a box of 16 taps or more (7x7 type A: 21)."""
    def value_and_grad(mask, shape):
        x, k = jnp.zeros(shape, jnp.bfloat16), jnp.zeros((*mask.shape, shape[-1], 8), jnp.bfloat16)
        loss = lambda x, k: mk.masked_conv(x, k, mask).astype(jnp.float32).sum()  # noqa: E731
        return _lower_for_tpu(jax.value_and_grad(loss, argnums=(0, 1)), x, k)

    text = value_and_grad(mk.pixelcnn_mask((3, 3), "B"), (2, 9, 8, 8))
    assert len(re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text)) == 3
    assert "stablehlo.convolution" not in text
    text_1d = value_and_grad(mk.causal_mask(3), (2, 9, 8))
    assert "tpu_custom_call" not in text_1d and "stablehlo.convolution" in text_1d
    text_5x5 = value_and_grad(mk.pixelcnn_mask((5, 5), "B"), (2, 9, 8, 8))
    assert len(re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text_5x5)) == 3
    text_7x7 = value_and_grad(mk.pixelcnn_mask((7, 7), "A"), (2, 9, 8, 8))
    assert "tpu_custom_call" not in text_7x7 and "stablehlo.convolution" in text_7x7


@pytest.mark.parametrize("name", tiered(sorted(LOWERING_CASES), lambda n: n.startswith("2d_N1_H7")))
def test_value_and_grad_lowers_for_tpu_to_three_named_mosaic_kernels_and_no_convolution(name):
    x_shape, k_shape, mask, kw, dtype = LOWERING_CASES[name]
    x, k = jnp.zeros(x_shape, dtype), jnp.zeros(k_shape, dtype)

    def loss(x, k):
        return mk.masked_conv(x, k, mask, implementation=IMPL, **kw).astype(jnp.float32).sum()

    text = _lower_for_tpu(jax.value_and_grad(loss, argnums=(0, 1)), x, k)
    calls = re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text)
    assert len(calls) == 3, f"expected the three Mosaic kernels, found {len(calls)} tpu_custom_calls"
    for kernel in KERNEL_NAMES:
        assert len(re.findall(f'kernel_name = "{kernel}"', text)) == 1, f"kernel {kernel} not lowered exactly once"
    assert "stablehlo.convolution" not in text


def test_needs_a_tpu_or_interpret_mode():
    x, k, mask = jnp.ones((1, 5, 5, 2)), jnp.ones((3, 3, 2, 2)), mk.pixelcnn_mask((3, 3), "B")
    spec = make_spec(x, k, mask)
    record = backends.get(IMPL)
    assert record.unsupported(spec, "tpu") is None
    assert record.unsupported(spec, None) is None
    assert record.unsupported(spec, "cpu", interpret=True) is None
    for platform in ("cpu", "cuda", "rocm"):
        assert "lower for TPUs (tpu) only" in record.unsupported(spec, platform, interpret=False)
    # implementation=None: the TPU's default for the 2-D problems it runs, and only there.
    assert implementation_for(spec, platform="tpu") == IMPL
    assert IMPL not in (implementation_for(spec, platform="cpu"), implementation_for(spec, platform="cuda"))
    spec_1d = make_spec(jnp.ones((1, 9, 2)), jnp.ones((3, 2, 2)), mk.causal_mask(3))
    assert record.unsupported(spec_1d, "tpu") is None and "2-D" in record.not_preferred(spec_1d, "tpu")
    assert implementation_for(spec_1d, platform="tpu") == "xla"
    # Named, it traces anywhere and refuses only when lowered for a platform it cannot run on.
    f = jax.jit(lambda x, k: mk.masked_conv(x, k, mask, implementation=IMPL))
    with pytest.raises(NotImplementedError, match='lowered for platform "cpu".*interpret=True'):
        f.trace(x, k).lower(lowering_platforms=("cpu",))


# --------------------------------------------------------------------------- the kernels' code


def _kernel_jaxprs_of(spec, dtype) -> dict:
    """``{pallas_call name: kernel jaxpr}`` of the three kernels as the core runs them."""
    return kernel_jaxprs(pallas_mosaic_tpu, spec, dtype, "tpu", INTERPRET)


@pytest.mark.parametrize(
    "mask",
    [mk.pixelcnn_mask((5, 5), "A"), np.array([[1, 0, 1, 0, 1], [0, 1, 0, 1, 0], [1, 0, 0, 0, 0]], bool),
     mk.channel_grouped_mask((3, 3), 6, 6, "B")],
    ids=["5x5A", "3x5_scattered", "3x3_rgbB_full"],
)
def test_masked_taps_have_no_code(mask):
    """One MXU dot per active piece (forward, input gradient) or tap (weight gradient), none for a masked tap."""
    k_shape = mask.shape if mask.ndim == 4 else (*mask.shape, 6, 6)
    spec = make_spec(jax.ShapeDtypeStruct((2, 9, 11, k_shape[2]), jnp.float32),
                     jax.ShapeDtypeStruct(k_shape, jnp.float32), mask)
    p = kernel_problem(spec)
    kernels = _kernel_jaxprs_of(spec, jnp.float32)
    assert set(kernels) == set(KERNEL_NAMES)
    assert count(kernels["maskconv_tpu_fwd"], "dot_general") == len(p.pieces)
    assert count(kernels["maskconv_tpu_bwd_input"], "dot_general") == len(p.pieces)
    assert count(kernels["maskconv_tpu_bwd_weight"], "dot_general") == len(p.taps)


def test_highest_precision_reaches_the_kernel_dots():
    x, k = random(0, (1, 5, 6, 3)), random(1, (3, 3, 3, 4))
    mask = mk.pixelcnn_mask((3, 3), "B")
    jaxprs = lambda dtype, precision: " ".join(map(str, _kernel_jaxprs_of(
        make_spec(x.astype(dtype), k.astype(dtype), mask, precision=precision), dtype).values()))
    assert "HIGHEST" in jaxprs(jnp.float32, "highest")
    assert "HIGHEST" in jaxprs(jnp.float32, "high")  # at least the precision asked for
    assert "HIGHEST" not in jaxprs(jnp.float32, None)  # bfloat16 passes: the TPU's default, as lax.conv's
    assert "HIGHEST" not in jaxprs(jnp.bfloat16, "highest")  # 16-bit products are exact already
    # precision=None is what jax.default_matmul_precision sets, as for lax.conv (there it
    # was once ignored: the kernels ran bfloat16 passes where lax.conv ran float32 products).
    with jax.default_matmul_precision("highest"):
        assert "HIGHEST" in jaxprs(jnp.float32, None)
    with jax.default_matmul_precision("BF16_BF16_F32_X3"):
        assert "HIGHEST" in jaxprs(jnp.float32, None)
    with jax.default_matmul_precision("bfloat16"):
        assert "HIGHEST" not in jaxprs(jnp.float32, None)


# --------------------------------------------------------------------------- interpreted against float64


_TINY = Config(block_pixels=16, block_channels=128, block_taps=2)
# name: (x shape, C_out, mask, conv args, dtype, config). Awkward on purpose: odd sizes,
# channels that are not multiples of 128 (and one over a block of 128), halos,
# several row / column / channel / tap blocks.
AGREEMENT_CASES = {
    "2d_N2_H9_W7_C3_k3B_SAME_f32": ((2, 9, 7, 3), 5, mk.pixelcnn_mask((3, 3), "B"), {}, np.float32, None),
    "1d_N2_L37_C5_k4_CAUSAL_d2_bf16_tiny": ((2, 37, 5), 3, np.ones(4), dict(padding="CAUSAL", dilation=2), BF16, _TINY),
    "2d_N2_H17_W13_C3_k5A_tiny_f32": ((2, 17, 13, 3), 6, mk.pixelcnn_mask((5, 5), "A"), {}, np.float32, _TINY),
    "2d_N1_H11_W10_C4_k3B_VALID_d2_bf16": ((1, 11, 10, 4), 3, mk.pixelcnn_mask((3, 3), "B"),
                                           dict(padding="VALID", dilation=2), BF16, None),
    "2d_N1_H9_W8_C2_k3A_explicit_neg_d21_f32": ((1, 9, 8, 2), 3, mk.pixelcnn_mask((3, 3), "A"),
                                               dict(padding=((2, -1), (3, 0)), dilation=(2, 1)), np.float32, None),
    "2d_N1_H13_W6_C130_k3x2_explicit_tiny_bf16": ((1, 13, 6, 130), 131, np.array([[1, 1], [1, 0], [0, 1]], bool),
                                                  dict(padding=((1, 2), (0, 3))), BF16, _TINY),
    "2d_N1_H7_W7_C6_k3_rgbA_full_tiny_f32": ((1, 7, 7, 6), 6, mk.channel_grouped_mask((3, 3), 6, 6, "A"), {},
                                             np.float32, _TINY),
    "1d_N3_L50_C7_k5_causal_SAME_tiny_f32": ((3, 50, 7), 9, mk.causal_mask(5), {}, np.float32, _TINY),
    "2d_N1_H1_W20_C3_k3B_SAME_bf16": ((1, 1, 20, 3), 4, mk.pixelcnn_mask((3, 3), "B"), {}, BF16, None),
}
_FAST_AGREEMENT = ("2d_N2_H9_W7_C3_k3B_SAME_f32", "1d_N2_L37_C5_k4_CAUSAL_d2_bf16_tiny")


@pytest.mark.parametrize("name", tiered(sorted(AGREEMENT_CASES), lambda n: n in _FAST_AGREEMENT))
def test_forward_and_gradients_match_the_float64_reference(name):
    """Forward, input gradient and weight gradient, interpreted, within the dtype's bound for the reduction."""
    x_shape, c_out, mask, kw, dtype, config = AGREEMENT_CASES[name]
    mask = np.asarray(mask, bool)
    window, c_in = mask.shape[:len(x_shape) - 2], x_shape[-1]
    x = random(2, x_shape, dtype)
    k = random(3, (*window, c_in, c_out), dtype, scale=1 / np.sqrt(np.prod(window) * c_in))
    y, vjp = jax.vjp(_conv(mask, config, precision="highest", **kw), x, k)
    assert y.dtype == dtype
    taps = int(mask.sum()) if mask.ndim == len(window) else int(mask.any(axis=(-2, -1)).sum())
    mx = lambda a: float(np.abs(np.asarray(a, np.float64)).max())
    assert_close(y, masked_conv_reference(x, k, mask, **kw), dtype, taps * c_in, mx(x) * mx(k), precision="highest")
    dy = random(4, y.shape, dtype)
    dx, dk = vjp(dy)
    rdx, rdk = masked_conv_reference_vjp(x, k, mask, dy, **kw)
    assert_close(dx, rdx, dtype, taps * c_out, mx(dy) * mx(k), precision="highest")
    assert_close(dk, rdk, dtype, int(np.prod(y.shape[:-1])), mx(dy) * mx(x), precision="highest")
    dense = mask if mask.ndim == len(window) + 2 else np.broadcast_to(mask[..., None, None], k.shape)
    assert (np.asarray(dk)[~dense] == 0.0).all()


@pytest.mark.parametrize("dtype", tiered([np.float32, BF16], lambda d: d == BF16), ids=str)
def test_float32_output_from_bfloat16_inputs_and_float32_cotangents(dtype):
    """``preferred_element_type=float32``: one rounding less; a float32 cotangent widens the kernel exactly."""
    mask = mk.pixelcnn_mask((3, 3), "A")
    x, k = random(5, (2, 8, 9, 4), dtype), random(6, (3, 3, 4, 5), dtype, scale=0.3)
    y, vjp = jax.vjp(_conv(mask, preferred_element_type=np.float32, precision="highest"), x, k)
    assert y.dtype == np.float32
    mx = lambda a: float(np.abs(np.asarray(a, np.float64)).max())
    assert_close(y, masked_conv_reference(x, k, mask), np.float32, 4 * 4, mx(x) * mx(k), precision="highest")
    dy = random(7, y.shape, np.float32)
    dx, dk = vjp(dy)
    assert dx.dtype == dtype and dk.dtype == dtype
    rdx, rdk = masked_conv_reference_vjp(x, k, mask, dy)
    assert_close(dx, rdx, dtype, 4 * 5, mx(dy) * mx(k), precision="highest")
    assert_close(dk, rdk, dtype, 2 * 8 * 9, mx(dy) * mx(x), precision="highest")


# --------------------------------------------------------------------------- exactness: NaN isolation


@pytest.mark.parametrize("config", tiered([None, _TINY], lambda c: c is None), ids=["default", "tiny_blocks"])
def test_nan_reachable_only_through_masked_taps_reaches_nothing(config):
    """NaN in inputs only masked taps read, and in masked kernel entries: finite outputs, exact zero gradients.

    A 3x3 mask of its top row alone, SAME padding: input row ``i`` is read only by
    output row ``i + 1``'s top taps, so the last input row reaches no output. Blocks of
    16 pixels cut the image into row blocks with halos, and the weight gradient's padded
    rows read real input rows, which it must select away rather than multiply by zero.
    """
    mask = np.zeros((3, 3), bool)
    mask[0] = True
    x = np.array(random(8, (2, 7, 6, 3)))
    x[:, -1] = np.nan
    k = np.array(random(9, (3, 3, 3, 4), scale=0.3))
    k[1:] = np.nan  # every masked entry
    x, k = jnp.asarray(x), jnp.asarray(k)
    conv = _conv(mask, config, precision="highest")
    y, vjp = jax.vjp(conv, x, k)
    assert np.isfinite(np.asarray(y)).all()
    dx, dk = vjp(jnp.ones_like(y))
    dx, dk = np.asarray(dx), np.asarray(dk)
    assert (dx[:, -1] == 0.0).all()
    assert np.isfinite(dx).all()
    assert (dk[1:] == 0.0).all() and np.isfinite(dk[0]).all()


@pytest.mark.parametrize("config", tiered([None, _TINY], lambda c: c is None), ids=["default", "tiny_blocks"])
def test_weight_gradient_of_a_tap_excludes_inputs_only_other_taps_read(config):
    """The weight gradient's padded result pixels (whole blocks, whole sublane tiles) have a
    zero cotangent, but their tap operands can be real inputs that only *other* taps read
    for a real result: there ``0 * nan`` must not happen (the kernel selects them away).

    The four corner taps of a 3x3 window, SAME padding, NaN in the last input row and
    column: the bottom and right taps read them for real outputs (their gradients are
    NaN, as the reference's), the top-left tap never does, yet at the padded rows and
    columns (7 rows of 5 pixels padded to 8 x 8) it reads them.
    """
    mask = np.zeros((3, 3), bool)
    mask[::2, ::2] = True
    x = np.array(random(12, (1, 7, 5, 2)))
    x[:, -1] = np.nan
    x[:, :, -1] = np.nan
    k = random(13, (3, 3, 2, 3), scale=0.3)
    _, vjp = jax.vjp(_conv(mask, config, precision="highest"), jnp.asarray(x), k)
    dy = random(14, (1, 7, 5, 3))
    dk = np.asarray(vjp(dy)[1])
    _, rdk = masked_conv_reference_vjp(x, k, mask, dy)
    assert np.isnan(rdk[2, 2]).all() and np.isnan(dk[2, 2]).all()
    mx = lambda a: float(np.nanmax(np.abs(np.asarray(a, np.float64))))
    assert_close(dk[0, 0], rdk[0, 0], np.float32, 7 * 5, mx(dy) * mx(x), precision="highest")


def test_nan_in_channels_only_masked_entries_read_reaches_nothing():
    """A channel-partial mask: input channel 0 is read by no active entry, and only output
    channel 0 reads channel 1 (at the centre tap). NaN there stays out of every other output."""
    mask = np.zeros((3, 3, 3, 2), bool)
    mask[:, :, 2, :] = True  # every tap: input channel 2 into both outputs
    mask[1, 1, 1, 0] = True  # the centre tap also: input channel 1 into output channel 0 only
    x = np.array(random(10, (1, 6, 5, 3)))
    x[..., 0] = np.nan
    x[0, 2, 3, 1] = np.nan
    k = np.array(random(11, (3, 3, 3, 2), scale=0.3))
    k[~mask] = np.nan
    x, k = jnp.asarray(x), jnp.asarray(k)
    y, vjp = jax.vjp(_conv(mask, precision="highest"), x, k)
    y = np.asarray(y)
    assert np.isnan(y[0, 2, 3, 0])  # the one output that reads the NaN of channel 1
    finite = np.ones(y.shape, bool)
    finite[0, 2, 3, 0] = False
    assert np.isfinite(y[finite]).all()
    dy = np.ones(y.shape, np.float32)
    dy[0, 2, 3, 0] = 0.0  # the NaN output gets no cotangent: the rest is exact
    dx, dk = (np.asarray(g) for g in vjp(jnp.asarray(dy)))
    assert (dx[..., 0] == 0.0).all()
    assert (dk[~mask] == 0.0).all()
    assert np.isfinite(dk[mask & (np.arange(3)[:, None] == 2)]).all()


# --------------------------------------------------------------------------- limits


def _spec(x_shape, k_shape, dtype=np.float32, **kw):
    x, k = jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(k_shape, dtype)
    return make_spec(x, k, np.ones(k_shape[:-2], bool), **kw)


@pytest.mark.parametrize(
    "x_shape, k_shape, dtype, kw, expected",
    [
        ((1, 4, 5, 5, 2), (3, 3, 3, 2, 2), np.float32, {}, "3-D convolutions"),
        ((1, 6, 6, 4), (3, 3, 2, 4), np.float32, dict(feature_group_count=2), "feature_group_count=2"),
        ((1, 9, 9, 4), (3, 3, 4, 4), np.float32, dict(strides=2), "strides=(2, 2)"),
        ((1, 9, 4), (3, 4, 4), np.float16, {}, "float16 inputs"),
        ((1, 2048, 2048, 512), (3, 3, 512, 512), BF16, {}, "MiB of VMEM"),
    ],
    ids=["3d", "groups2", "strides2", "float16", "too_big_for_vmem"],
)
def test_unsupported_problems_say_why_and_none_falls_back_to_xla(x_shape, k_shape, dtype, kw, expected):
    spec = _spec(x_shape, k_shape, dtype, **kw)
    reason = pallas_mosaic_tpu.unsupported(spec, "tpu")
    assert reason is not None and expected in reason, reason
    assert "implementation=None uses xla" in reason
    assert pallas_mosaic_tpu.unsupported(spec, "cpu", interpret=True) == reason
    assert implementation_for(spec, platform="tpu") == "xla"


def test_named_for_an_unsupported_problem_raises_naming_why():
    x, k, mask = jnp.ones((1, 9, 9, 2)), jnp.ones((3, 3, 2, 2)), np.ones((3, 3), bool)
    with pytest.raises(NotImplementedError, match=re.escape("strides=(2, 2)")):
        mk.masked_conv(x, k, mask, implementation=IMPL, interpret=INTERPRET, strides=2)


def test_a_config_too_large_for_vmem_is_refused():
    x, k, mask = jnp.ones((1, 64, 64, 1024)), jnp.ones((3, 3, 1024, 1024)), np.ones((3, 3), bool)
    config = Config(block_pixels=8192, block_channels=2048, block_taps=9)
    f = jax.jit(lambda x, k: mk.masked_conv(x, k, mask, implementation=IMPL, config=config))
    with pytest.raises(NotImplementedError, match="MiB of VMEM; pass a config with smaller blocks"):
        f.trace(x, k).lower(lowering_platforms=("tpu",))


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value, error, message",
    [
        ("block_pixels", 48, ValueError, "power of two"),
        ("block_pixels", 4, ValueError, "from 8"),
        ("block_pixels", 512.0, TypeError, "must be an int"),
        ("block_channels", 64, ValueError, "multiple of 128"),
        ("block_channels", 4096, ValueError, "to 2048"),
        ("block_taps", 0, ValueError, "at least 1"),
        ("block_taps", True, TypeError, "must be an int"),
    ],
)
def test_config_is_validated(field, value, error, message):
    with pytest.raises(error, match=message):
        Config(**{field: value})


def test_config_is_frozen_and_hashable():
    config = Config()
    with pytest.raises(AttributeError):
        config.block_pixels = 64  # type: ignore[misc]
    assert hash(config) == hash(Config())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("x_shape, c_out", [((4, 32, 32, 3), 3), ((8, 64, 64, 256), 256), ((2, 4096, 512), 512)],
                         ids=["C3", "C256", "1d_L4096_C512"])
def test_default_config_fits_the_vmem_budget(x_shape, c_out, dtype, kernel):
    window = (7,) * (len(x_shape) - 2)
    spec = _spec(x_shape, (*window, x_shape[-1], c_out), dtype)
    config = Config.get_default(spec, dtype, kernel)
    assert config == Config(**vars(config))  # a valid config
    assert vmem_bytes(kernel_problem(spec), kernel, np.dtype(dtype).itemsize, config) <= VMEM_BUDGET_BYTES


def test_default_config_shrinks_the_weight_gradient_taps_first():
    spec = _spec((8, 64, 64, 512), (7, 7, 512, 512), BF16)
    config = Config.get_default(spec, BF16, "weight_grad")
    assert config.block_taps < 49 and config.block_channels == 256
    assert Config.get_default(spec, BF16, "forward").block_taps == 49


def test_default_config_names_the_kernel():
    with pytest.raises(ValueError, match="kernel must be one of"):
        Config.get_default(_spec((1, 8, 8, 3), (3, 3, 3, 3)), np.float32, "backward")


# --------------------------------------------------------------------------- padding in the kernel

_PAD_CASES = {  # x shape, mask, keywords, whether the kernels pad (each of the three)
    "3x3B_SAME": ((2, 8, 16, 4), mk.pixelcnn_mask((3, 3), "B"), {}, True),
    "5x5A_SAME": ((2, 8, 16, 4), mk.pixelcnn_mask((5, 5), "A"), {}, True),
    "3x3A_dilated": ((1, 9, 32, 3), mk.pixelcnn_mask((3, 3), "A"), dict(dilation=2), True),
    "VALID_crops": ((2, 8, 16, 4), mk.pixelcnn_mask((3, 3), "B"), dict(padding="VALID"), False),
    "width_not_whole_tiles": ((2, 8, 12, 4), mk.pixelcnn_mask((3, 3), "B"), {}, False),
    "rows_in_two_steps": ((2, 8, 16, 4), mk.pixelcnn_mask((3, 3), "B"), dict(config=dict(block_pixels=64)), False),
    "1d": ((2, 32, 4), mk.causal_mask(3), dict(padding="CAUSAL"), False),
}


@pytest.mark.parametrize("name", tiered(sorted(_PAD_CASES), lambda n: n in ("3x3B_SAME", "width_not_whole_tiles")))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_padding_in_the_kernel_gives_the_same_bits(name, dtype):
    """``Config(pad_in_kernel=True)`` (the default): where a step holds a whole image whose
    width is whole sublane tiles and the padding crops nothing, the kernels read the
    unpadded operand and pad it in VMEM; forward, input and weight gradients are then
    ``pad_in_kernel=False``'s (XLA's padded copy) bit for bit, NaN where NaN; elsewhere
    nothing changes."""
    shape, mask, kw, pads = _PAD_CASES[name]
    kw = dict(kw)
    blocks = kw.pop("config", {})
    k = random(1, (*mask.shape, shape[-1], 5), dtype)
    problem = kernel_problem(make_spec(jnp.zeros(shape, dtype), k, mask, **kw).channels_last())
    itemsize = np.dtype(dtype).itemsize
    insides = [pallas_mosaic_tpu.config.geometry(problem, kernel, itemsize, Config(pad_in_kernel=True, **blocks)).inside
               for kernel in KERNELS]
    assert all((inside is not None) == pads for inside in insides), insides
    _assert_configs_agree(shape, mask, k, kw, Config(pad_in_kernel=True, **blocks), Config(pad_in_kernel=False, **blocks))


def _assert_configs_agree(shape, mask, k, kw, config, other):
    """masked_conv's value and gradients in x and ``k`` under ``config`` are ``other``'s
    bit for bit (NaN where NaN), on finite inputs (where a NaN cannot hide a wrong operand
    in the weight gradient) and with one NaN input (the first example's last column, its
    first channel: in 2-D, the future of the rest of the first row)."""
    finite = np.array(random(0, shape), np.float32)
    with_nan = finite.copy()
    with_nan[(0,) * (len(shape) - 2) + (-1, 0)] = np.nan

    def value_and_grad(config, x):
        def loss(x, k):
            y = mk.masked_conv(x, k, mask, implementation=IMPL, interpret=INTERPRET, config=config, **kw)
            return jnp.nansum(y.astype(jnp.float32) ** 2), y
        return jax.value_and_grad(loss, (0, 1), has_aux=True)(jnp.asarray(x, k.dtype), k)

    for x in (finite, with_nan):
        for got, expected in zip(jax.tree.leaves(value_and_grad(config, x)), jax.tree.leaves(value_and_grad(other, x))):
            assert_same_bits(got, expected)


def test_padding_in_the_kernel_leaves_no_padded_copy_when_lowered_for_tpu():
    """Lowered for a TPU from this host, forward and both gradients (``pad_in_kernel``, the
    default) hold the three Mosaic kernels and no ``pad`` of the image; with
    ``pad_in_kernel=False`` they hold one a kernel that reads an image."""
    mask, x, k = mk.pixelcnn_mask((3, 3), "B"), jnp.zeros((2, 9, 16, 8), jnp.bfloat16), jnp.zeros((3, 3, 8, 8), jnp.bfloat16)

    def lowered(config):
        loss = lambda x, k: mk.masked_conv(x, k, mask, implementation=IMPL, config=config).astype(jnp.float32).sum()  # noqa: E731
        return _lower_for_tpu(jax.value_and_grad(loss, argnums=(0, 1)), x, k)

    def pads(text):  # pads that add rows or columns (XLA drops those of zero widths)
        widths = re.findall(r"stablehlo\.pad .*low = \[([^\]]*)\], high = \[([^\]]*)\]", text)
        return [w for w in widths if any(int(n) for n in ",".join(w).split(","))]

    inside, padded = lowered(Config()), lowered(Config(pad_in_kernel=False))
    for text in (inside, padded):
        assert len(re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text)) == 3
    assert not pads(inside) and len(pads(padded)) >= 3, (pads(inside), pads(padded))
