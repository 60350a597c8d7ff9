"""The xla backend's strategies: the CPU convolutions over boxes at every offset and
padding, and the "gemm" strategy's blocks, config, fallbacks and memory.

jaxlib 0.10's CPU convolution reads garbage when a low padding is negative, in the
forward pass or in the input gradient (whose low padding is ``window - 1 - lo``), and
the garbage changes from run to run. A box of active taps has its own padding, shifted
by its offset in the window, so every offset, padding and stride is swept here with the
"conv" strategy (what CPUs run) against the float64 reference.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cases import CASES
from support.numerics import assert_close, random
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import xla
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference, masked_conv_reference_vjp
from maskconv_kernels.ops.masked_conv.spec import make_spec
from maskconv_kernels.ops.masked_conv.xla import blocks as xla_blocks

WIDTH = 5


def _box_masks():
    """Every run of 1 or 2 active taps in a 1x5 window."""
    boxes = []
    for start, size in itertools.product(range(WIDTH), (1, 2)):
        if start + size <= WIDTH:
            bits = np.zeros((1, WIDTH), bool)
            bits[0, start : start + size] = True
            boxes.append(pytest.param(bits, id=f"taps{start}-{start + size - 1}"))
    return boxes


def _check(bits, padding, stride, dilation):
    x, k = random(0, (1, 3, 9, 2)), random(1, (1, WIDTH, 2, 3))
    kw = dict(padding=padding, strides=(1, stride), dilation=(1, dilation))
    f = jax.jit(lambda x, k: mk.masked_conv(x, k, bits, implementation="xla", config=xla.Config("conv"), **kw))
    y, vjp = jax.vjp(f, x, k)
    dy = random(2, y.shape)
    dx, dk = jax.jit(vjp)(dy)
    rdx, rdk = masked_conv_reference_vjp(x, k, bits, dy, **kw)
    taps = int(bits.sum())
    scale = lambda a: float(np.abs(a).max())  # noqa: E731
    assert_close(y, masked_conv_reference(x, k, bits, **kw), np.float32, taps * 2, scale(x) * scale(k))
    assert_close(dx, rdx, np.float32, taps * 3, scale(dy) * scale(k))
    assert_close(dk, rdk, np.float32, int(np.prod(y.shape[:-1])), scale(dy) * scale(x))


@pytest.mark.parametrize("bits", _box_masks())
@pytest.mark.parametrize("lo", [0, 2, 4])
def test_box_at_every_offset_with_low_padding(bits, lo):
    _check(bits, ((0, 0), (lo, 4 - lo)), stride=1, dilation=1)


@pytest.mark.slow
@pytest.mark.parametrize("bits", _box_masks())
@pytest.mark.parametrize("lo, hi", [(-1, 3), (1, -1), (3, 0), (5, -2)])
@pytest.mark.parametrize("stride, dilation", [(1, 2), (2, 1)])
def test_box_at_every_offset_with_any_padding_stride_and_dilation(bits, lo, hi, stride, dilation):
    _check(bits, ((0, 0), (lo, hi)), stride=stride, dilation=dilation)


# --------------------------------------------------------------------------- the blocked strategies
#
# The shared suites run "gemm" ("xla_gemm") and "conv_blocks" ("xla_conv_blocks") on
# blocks of whole images. Here: blocks of rows (an image's patches larger than the
# block), with a remainder; the per-map config; where they fall back; and the memory
# they promise.

BLOCKED = list(xla_blocks.STRATEGIES)

GEMM_CASES = [c for c in CASES if c.groups == 1 and c.name in (
    "1d_N2_L17_C3_k3_causal_SAME", "1d_N2_L16_C5_k3_CAUSAL_s2", "2d_N2_H11_W7_C5_k3B",
    "2d_N1_H12_W9_C3_k3B_s21_d2", "2d_N1_H9_W8_C2_k3A_pad_neg", "2d_N1_H7_W7_C6_k5_rgbB_full",
    "2d_N1_H2_W2_C2_k1x7_padding_only_tap", "3d_N1_D4_H5_W5_C3_k3B_s2",
)]


def _block_rows(case, block_bytes):
    """The forward's (images, rows) per block (xla_blocks' choice), to show a case is not vacuous."""
    spec = make_spec(np.zeros(case.x_shape, np.float32), np.zeros(case.kernel_shape, np.float32), case.mask, **case.conv_args)
    width = sum(p.width(spec.c_in) for p in xla_blocks._gemm_pieces(spec))
    return xla_blocks._block_shape(case.x_shape[0], spec.out_spatial, width * 4, block_bytes)


@pytest.mark.parametrize("block_bytes", [
    pytest.param(1, id="one_row", marks=pytest.mark.slow),
    pytest.param(1500, id="rows_and_remainder"),  # several rows a block and a shorter last one: the fast tier's
    pytest.param(1 << 30, id="all_images", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("case", tiered(GEMM_CASES, lambda c: c in GEMM_CASES[1::2]), ids=lambda c: c.name)
@pytest.mark.parametrize("strategy", BLOCKED)
def test_blocks_of_rows_match_reference(strategy, case, block_bytes):
    x = random(0, case.x_shape)
    k = random(1, case.kernel_shape, scale=1 / np.sqrt(np.prod(case.kernel_shape[:-1])))
    config = xla.Config(strategy, block_bytes=block_bytes)
    f = jax.jit(lambda x, k: mk.masked_conv(x, k, case.mask, implementation="xla", config=config, **case.conv_args))
    y, vjp = jax.vjp(f, x, k)
    dy = random(2, y.shape)
    dx, dk = jax.jit(vjp)(dy)
    rdx, rdk = masked_conv_reference_vjp(x, k, case.mask, dy, **case.conv_args)
    scale = lambda a: float(np.abs(a).max())  # noqa: E731
    reduction = case.reduction()
    assert_close(y, masked_conv_reference(x, k, case.mask, **case.conv_args), np.float32, reduction, scale(x) * scale(k))
    assert_close(dx, rdx, np.float32, reduction * case.kernel_shape[-1], scale(dy) * scale(k))
    assert_close(dk, rdk, np.float32, int(np.prod(y.shape[:-1])), scale(dy) * scale(x))


def test_the_row_block_cases_have_a_remainder():
    case = next(c for c in GEMM_CASES if c.name == "2d_N2_H11_W7_C5_k3B")
    images, rows = _block_rows(case, 1500)
    assert images == 1 and 11 % rows, (images, rows)


@pytest.mark.parametrize("block_bytes", [1, 1500], ids=["one_row", "rows_and_remainder"])
@pytest.mark.parametrize("strategy", BLOCKED)
def test_row_blocks_never_read_a_masked_tap(strategy, block_bytes):
    """NaN at every input the centre output reaches only through masked taps (or not at
    all): its value and its input gradient are bit-identical, on blocks of rows."""
    case = next(c for c in CASES if c.name == "2d_N2_H11_W7_C5_k3B")
    config = xla.Config(strategy, block_bytes=block_bytes)
    x, k = random(3, case.x_shape), random(4, case.kernel_shape)
    spec = make_spec(x, k, case.mask)
    centre = tuple(o // 2 for o in spec.out_spatial)
    field = np.zeros(spec.in_spatial, bool)
    for tap in spec.mask.active_taps:
        field[tuple(o - lo + t for o, (lo, _), t in zip(centre, spec.padding, tap))] = True
    poisoned = np.array(x)
    poisoned[:, ~field] = np.nan
    f = jax.jit(lambda x: mk.masked_conv(x, k, case.mask, implementation="xla", config=config)[(0, *centre)].sum())
    assert np.asarray(f(x)).tobytes() == np.asarray(f(jnp.asarray(poisoned))).tobytes()
    dx = np.asarray(jax.jit(jax.grad(f))(x))[0]
    assert (dx[~field] == 0.0).all() and (dx[field] != 0.0).any()


def _convolutions(config, mask=None, platform="cpu", **conv_args):
    """How many convolutions the lowering of a value and its two gradients for ``platform`` holds."""
    mask = MASK_3X3B if mask is None else mask
    x, k = random(0, (2, 8, 9, 8)), random(1, (*mask.shape, 8 // conv_args.get("feature_group_count", 1), 8))
    loss = lambda x, k: mk.masked_conv(x, k, mask, implementation="xla", config=config, **conv_args).sum()
    text = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(x, k).lower(lowering_platforms=(platform,)).as_text()
    return text.count("stablehlo.convolution")


MASK_3X3B = mk.pixelcnn_mask((3, 3), "B")


def test_each_map_runs_its_own_strategy():
    # 3x3 type B: a 1x3 box (a convolution on the "conv" strategy) and a 1x2 box (an
    # im2col GEMM beside it), in each of the three maps; "gemm": GEMMs only.
    assert _convolutions(xla.Config("conv")) == 3
    assert _convolutions(xla.Config("gemm")) == 0
    assert _convolutions(xla.Config("gemm", weight_grad="conv")) == 1
    assert _convolutions(xla.Config("conv", forward="gemm", input_grad="matmul")) == 1
    # "conv_blocks": a convolution per box in the forward and the input gradient, the
    # weight gradient's GEMMs.
    assert _convolutions(xla.Config("conv_blocks")) == 4
    # "auto" on CPU: "conv" (a convolution per map at 8 channels); from 128 x 128
    # channels the weight gradient's GEMMs.
    assert _convolutions(None) == 3
    assert _convolutions(None, mask=np.ones((2, 3), bool)) == 3
    assert xla.cpu_strategy(make_spec(np.zeros((1, 4, 4, 128)), np.zeros((3, 3, 128, 128)), MASK_3X3B), "weight_grad") == "gemm"
    assert xla.cpu_strategy(make_spec(np.zeros((1, 4, 4, 64)), np.zeros((3, 3, 64, 64)), MASK_3X3B), "weight_grad") == "conv"


def test_blocked_strategies_fall_back_where_they_do_not_apply():
    # Feature groups: every map on CPU's other strategy, convolutions.
    assert _convolutions(xla.Config("gemm"), feature_group_count=2) == 3
    # Strides: the input gradient only.
    assert _convolutions(xla.Config("gemm"), strides=2) == 1


def test_a_tpu_runs_per_box_convolutions():
    """Lowered for a TPU (docs/design/tpu.md): "auto" is "conv" for every map, the blocked
    strategies too (they are the CPU's), and "matmul" when asked for."""
    assert _convolutions(None, platform="tpu") == 3
    assert _convolutions(None, mask=np.ones((2, 3), bool), platform="tpu") == 3
    for strategy in BLOCKED:
        assert _convolutions(xla.Config(strategy), platform="tpu") == 3
    assert _convolutions(xla.Config("matmul"), platform="tpu") == 0
    assert _convolutions(xla.Config("auto", weight_grad="matmul"), platform="tpu") == 2
    assert set(xla.DIRECT_CONVOLUTION) == {"cpu", "tpu"}


@pytest.mark.parametrize("strategy", ["auto", "conv", "matmul", *BLOCKED])
def test_no_strategy_lowered_for_cuda_has_a_convolution(strategy):
    x, k = random(0, (2, 8, 9, 8)), random(1, (3, 3, 8, 8))
    for kw in ({}, {"strides": 2}, {"feature_group_count": 2}):
        kernel = k[..., : 8 // kw.get("feature_group_count", 1), :]
        config = xla.Config(strategy)
        loss = lambda x, k: mk.masked_conv(x, k, MASK_3X3B, implementation="xla", config=config, **kw).sum()
        text = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(x, kernel).lower(lowering_platforms=("cuda",)).as_text()
        assert "stablehlo.convolution" not in text, kw
        assert "stablehlo.dot_general" in text, kw


@pytest.mark.parametrize("which", tiered(["forward", "input_grad", "weight_grad"], lambda w: w == "forward"))
@pytest.mark.parametrize("strategy", BLOCKED)
def test_blocked_extra_memory_is_less_than_x(strategy, which):
    """7x7 type A: the im2col of every active tap would be 24 times x, and one
    convolution per box over the whole batch sums two outputs the size of x; one block
    holds less than x. ("auto" on CPU is "conv", that sum: faster on an idle CPU.)"""
    x = jax.ShapeDtypeStruct((16, 32, 32, 64), np.float32)
    k = jax.ShapeDtypeStruct((7, 7, 64, 64), np.float32)
    mask = mk.pixelcnn_mask((7, 7), "A")
    conv = lambda x, k: mk.masked_conv(x, k, mask, implementation="xla", config=xla.Config(strategy))
    fn = {
        "forward": conv,
        "input_grad": lambda x, k: jax.vjp(lambda x: conv(x, k), x)[1](jnp.ones(x.shape))[0],
        "weight_grad": lambda x, k: jax.vjp(lambda k: conv(x, k), k)[1](jnp.ones(x.shape))[0],
    }[which]
    temp = jax.jit(fn).lower(x, k).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 16 * 32 * 32 * 64 * 4, f"{which}: {temp / 2**20:.1f} MiB of temporaries, x is 4 MiB"


def test_xla_config_validates_every_field():
    for bad in ({"forward": "winograd"}, {"weight_grad": "auto "}, {"block_bytes": 0}, {"block_bytes": True},
                {"block_bytes": 2.5}):
        with pytest.raises(ValueError, match=f"Config.{next(iter(bad))}"):
            xla.Config(**bad)
