"""The pallas_mosaic_gpu backend: what only it has (the shared suites run it in its interpreter).

Checked without a GPU: lowering for cuda (Mosaic GPU's own checks run there: TMA box
alignment, wgmma operand layouts, shared memory), the grid geometry, dispatch and the
config. jax 0.10 has neither the kernel API nor the interpreter: the module skips.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lowering import cuda_lowering

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import backends, implementation_for
from maskconv_kernels.ops.masked_conv.kernel_problem import kernel_problem
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference_vjp
from maskconv_kernels.ops.masked_conv.spec import make_spec

_WHY = backends.get("pallas_mosaic_gpu").unsupported(
    make_spec(np.zeros((1, 4, 4, 2), jnp.bfloat16), np.zeros((3, 3, 2, 2), jnp.bfloat16), np.ones((3, 3))), None
)
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

if _WHY is None:
    from maskconv_kernels.ops.masked_conv.pallas_mosaic_gpu import Config, grid
    from maskconv_kernels.ops.masked_conv.pallas_mosaic_gpu.config import stages

KERNELS = ("maskconv_mgpu_forward", "maskconv_mgpu_input_grad", "maskconv_mgpu_weight_grad")

LOWERING_CASES = {
    "2d_N2_H32_W32_C256_k7A_bf16": ((2, 32, 32, 256), (7, 7, 256, 256), mk.pixelcnn_mask((7, 7), "A"), {}, jnp.bfloat16),
    "2d_N2_H9_W7_C3_k3B_f16": ((2, 9, 7, 3), (3, 3, 3, 20), mk.pixelcnn_mask((3, 3), "B"), {}, jnp.float16),
    "2d_N1_H12_W10_C40_k5A_d2_f32out": ((1, 12, 10, 40), (5, 5, 40, 24), mk.pixelcnn_mask((5, 5), "A"),
                                        dict(dilation=2, preferred_element_type=jnp.float32), jnp.bfloat16),
    "1d_N2_L1000_C64_k2_CAUSAL_d16": ((2, 1000, 64), (2, 64, 64), np.ones(2), dict(padding="CAUSAL", dilation=16),
                                      jnp.bfloat16),
    # R, G, B channel groups: one forward and one input-gradient kernel per group.
    "2d_N2_H16_W16_C96_k5_rgbA": ((2, 16, 16, 96), (5, 5, 96, 96), mk.channel_grouped_mask((5, 5), 96, 96, "A"), {},
                                  jnp.bfloat16),
}


def _kernel_modules(text: str) -> list[str]:
    """The Mosaic GPU custom calls of a lowered module, each with its kernel module (MLIR bytecode)."""
    return re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(.*", text)


@pytest.mark.parametrize("specialized", [True, False], ids=["warp_specialized", "one_warpgroup"])
@pytest.mark.parametrize("name", sorted(LOWERING_CASES))
def test_value_and_grad_lowers_for_cuda_to_three_tma_wgmma_kernels_and_no_convolution(name, specialized):
    x_shape, k_shape, mask, kw, dtype = LOWERING_CASES[name]
    config = dataclasses.replace(
        Config.get_default(make_spec(np.zeros(x_shape, dtype), np.zeros(k_shape, dtype), mask, **kw)),
        warp_specialized=specialized,
    )
    loss = lambda x, k: mk.masked_conv(
        x, k, mask, implementation="pallas_mosaic_gpu", config=config, **kw
    ).astype(jnp.float32).sum()
    args = jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(k_shape, dtype)
    with cuda_lowering():
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = _kernel_modules(text)
    groups = 3 if "rgb" in name else 1  # channel classes: a forward and an input gradient each
    assert len(calls) == 2 * groups + 1, f"expected forward, input-gradient and weight-gradient kernels, found {len(calls)}"
    for call in calls:
        assert "cp.async.bulk.tensor" in call, "no TMA copy in a kernel"
        assert "wgmma" in call, "no wgmma in a kernel"
    for kernel in KERNELS:
        assert kernel in text
    assert "stablehlo.convolution" not in text


@pytest.mark.parametrize(
    "x_shape,k_shape,mask,kw,dtype,expected",
    [
        ((1, 6, 6, 4), (3, 3, 4, 4), mk.pixelcnn_mask((3, 3), "B"), {}, np.float32, "float32 inputs"),
        ((1, 6, 6, 4), (3, 3, 4, 4), mk.pixelcnn_mask((3, 3), "B"), dict(strides=2), jnp.bfloat16, "strides=(2, 2)"),
        ((1, 4, 5, 5, 2), (3, 3, 3, 2, 2), np.ones((3, 3, 3)), {}, jnp.bfloat16, "3-D"),
        ((1, 6, 6, 4), (3, 3, 2, 4), np.ones((3, 3)), dict(feature_group_count=2), jnp.bfloat16, "feature_group_count"),
    ],
    ids=["f32", "strided", "3d", "groups"],
)
def test_unsupported_problems_name_why_and_none_takes_the_next_backend(x_shape, k_shape, mask, kw, dtype, expected):
    x, k = jnp.ones(x_shape, dtype), jnp.ones(k_shape, dtype)
    with pytest.raises(NotImplementedError, match=re.escape(expected)):
        mk.masked_conv(x, k, mask, implementation="pallas_mosaic_gpu", interpret=True, **kw)
    assert implementation_for(make_spec(x, k, mask, **kw), platform="cuda") != "pallas_mosaic_gpu"


def test_implementation_none_takes_pallas_triton_first_and_it_needs_interpret_elsewhere():
    """Measured on an H200, pallas_triton's kernels beat these at the headline shapes, and take every problem
    these take: implementation=None never picks them (named, they run)."""
    x, k, mask = jnp.ones((1, 6, 6, 4), jnp.bfloat16), jnp.ones((3, 3, 4, 4), jnp.bfloat16), mk.pixelcnn_mask((3, 3), "B")
    spec = make_spec(x, k, mask)
    cuda = backends.PREFERENCE["cuda"]
    assert cuda.index("pallas_triton") < cuda.index("pallas_mosaic_gpu")
    assert implementation_for(spec, platform="cuda") == "pallas_triton"
    assert implementation_for(make_spec(x.astype(np.float32), k.astype(np.float32), mask), "cuda") == "pallas_triton"
    assert implementation_for(spec, platform="cpu") == "xla"
    assert "interpret=True" in backends.get("pallas_mosaic_gpu").unsupported(spec, "cpu")
    f = jax.jit(lambda x, k: mk.masked_conv(x, k, mask, implementation="pallas_mosaic_gpu"))
    with pytest.raises(NotImplementedError, match='lowered for platform "cpu".*interpret=True'):
        f.trace(x, k).lower(lowering_platforms=("cpu",))


def test_a_config_reaches_the_kernels_and_gives_the_same_result():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 7, 9, 20)), jnp.bfloat16)
    k = jnp.asarray(np.random.default_rng(1).standard_normal((3, 3, 20, 24)) / 9, jnp.bfloat16)
    mask = mk.pixelcnn_mask((3, 3), "B")
    run = lambda config: np.asarray(
        mk.masked_conv(x, k, mask, implementation="pallas_mosaic_gpu", interpret=True, config=config,
                       preferred_element_type=jnp.float32)
    )
    small = Config(tile_pixels=64, tile_n=16, block_k=16, max_concurrent_steps=2)  # 2 N tiles, 2 K blocks per tap
    expected = mk.masked_conv_reference(x, k, mask)
    # Products of bfloat16 values are exact in float32; the sums of 5 taps x 20 channels
    # round by a few float32 ulps: the three pipelines agree with the reference as closely.
    bound = 2.0**-20 * np.sqrt(5 * 20) * np.abs(np.asarray(x, np.float32)).max() * np.abs(np.asarray(k, np.float32)).max()
    for config in (small, None, Config(warp_specialized=False), dataclasses.replace(small, warp_specialized=False)):
        np.testing.assert_allclose(run(config), expected, rtol=0, atol=bound, err_msg=str(config))


@pytest.mark.parametrize("c_in_tile", [64, 128])
def test_weight_gradient_tiles_agree_with_the_reference(c_in_tile):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 6, 9, 20)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((3, 3, 20, 24)) / 9, jnp.bfloat16)
    # A float32 cotangent is rounded to bfloat16 by the kernels: draw one that is exact there.
    dy = rng.standard_normal((2, 6, 9, 24)).astype(jnp.bfloat16).astype(np.float32)
    mask = mk.pixelcnn_mask((3, 3), "B")
    config = Config(tile_n=16, weight_grad_c_in=c_in_tile, weight_grad_splits=3)
    loss = lambda k: (mk.masked_conv(x, k, mask, implementation="pallas_mosaic_gpu", interpret=True, config=config,
                                     preferred_element_type=jnp.float32) * dy).sum()
    dk = np.asarray(jax.grad(loss)(k), np.float64)
    _, expected = masked_conv_reference_vjp(x, k, mask, dy)
    # dk is rounded to bfloat16 (the kernel's dtype): half an ulp of the largest entry, and
    # float32 sums of 108 pixels below that.
    np.testing.assert_allclose(dk, expected, rtol=0, atol=2.0**-8 * np.abs(expected).max())


# --------------------------------------------------------------------------- the grid


WINDOWS = [
    (mk.pixelcnn_mask((7, 7), "A"), (1, 1), ((3, 3), (3, 3))),
    (mk.pixelcnn_mask((3, 3), "B"), (2, 3), ((2, 2), (3, 3))),
    (mk.vertical_stack_mask((5, 5)), (1, 1), ((2, 2), (2, 2))),
    (np.ones((1, 4)), (1, 5), ((0, 0), (15, 0))),
]


@pytest.mark.parametrize("mask,dilation,padding", WINDOWS, ids=["7A", "3B_d23", "vstack", "row_d5"])
@pytest.mark.parametrize("which", ["forward", "input_grad", "weight_grad"])
def test_every_box_starts_on_a_multiple_of_8_rows(mask, dilation, padding, which):
    x, k = np.zeros((2, 13, 11, 3), jnp.bfloat16), np.zeros((*np.shape(mask), 3, 5), jnp.bfloat16)
    p = kernel_problem(make_spec(x, k, mask, dilation=dilation, padding=padding))
    g = getattr(grid, f"{which}_grid")(p)
    assert g.width % 8 == 0 and g.image_rows % 8 == 0
    assert all(s % 8 == 0 for s in g.shifts())
    assert len(g.distinct_copies) <= np.shape(mask)[-1]
    if which == "weight_grad":
        assert (g.out_hw[0] * g.width) % g.chunk == 0  # whole chunks, no row past the valid ones


def test_copies_put_each_tap_at_its_shift_and_zeros_past_the_output_width():
    mask = mk.pixelcnn_mask((3, 3), "B")
    a = np.arange(1, 2 * 5 * 6 * 2 + 1, dtype=np.float32).reshape(2, 5, 6, 2)
    p = kernel_problem(make_spec(a, np.zeros((3, 3, 2, 4), np.float32), mask))
    g = grid.forward_grid(p)
    copies = np.asarray(grid.copies(jnp.asarray(a), g, channels=4, tail=8))
    padded = np.pad(a, ((0, 0), (1, 1), (1, 1), (0, 0)))  # SAME for 3x3
    for (th, tw), shift, d in zip(p.taps, g.shifts(), g.copy_index):
        for n, oh, ow in [(0, 0, 0), (1, 4, 5), (1, 2, 3)]:
            row = n * g.image_rows + oh * g.width + ow + shift
            np.testing.assert_array_equal(copies[d, row, :2], padded[n, oh + th, ow + tw])
            np.testing.assert_array_equal(copies[d, row, 2:], 0)  # padded channels
    columns = copies[:, : 2 * g.image_rows].reshape(len(g.distinct_copies), 2, g.height, g.width, 4)
    assert (columns[:, :, :, g.out_hw[1]:] == 0).all()
    assert (copies[:, 2 * g.image_rows:] == 0).all()  # the tail


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("tile_pixels", 96, "tile_pixels"),
        ("tile_n", 48, "tile_n"),
        ("block_k", 128, "block_k"),
        ("max_concurrent_steps", 0, "max_concurrent_steps"),
        ("weight_grad_splits", 0, "weight_grad_splits"),
        ("tile_n", True, "tile_n"),
        ("warp_specialized", 1, "warp_specialized"),
        ("weight_grad_c_in", 32, "weight_grad_c_in"),
    ],
)
def test_tiles_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        Config(**{field: value})


def test_the_accumulator_must_fit_one_warpgroup():
    with pytest.raises(ValueError, match="registers"):
        Config(tile_pixels=128, tile_n=256)
    with pytest.raises(ValueError, match="registers"):
        Config(tile_pixels=64, tile_n=256, weight_grad_c_in=128)


def test_tiles_are_frozen_hashable_and_fit_the_channels():
    t = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.tile_n = 128
    assert hash(t) == hash(Config())
    spec = make_spec(np.zeros((1, 4, 4, 3), jnp.bfloat16), np.zeros((3, 3, 3, 5), jnp.bfloat16), np.ones((3, 3)))
    assert Config.get_default(spec) == Config(tile_pixels=64, tile_n=16, block_k=16)


@pytest.mark.parametrize("programs,chunks", [(40, 640), (392, 128), (5, 96), (1, 7), (200, 1)])
def test_weight_grad_splits_divide_the_reduction_and_fill_the_last_wave(programs, chunks):
    from maskconv_kernels._core.hardware import SM_COUNT
    from maskconv_kernels.ops.masked_conv.pallas_mosaic_gpu.config import weight_grad_splits

    splits = weight_grad_splits(Config(), programs, chunks)
    assert chunks % splits == 0 and (splits == 1 or chunks // splits >= 8)
    time = lambda s: -(-programs * s // SM_COUNT) / s  # in units of one unsplit program
    others = [s for s in range(1, chunks + 1) if chunks % s == 0 and chunks // s >= 8 and s <= splits]
    assert all(time(splits) <= time(s) for s in others)
    assert weight_grad_splits(Config(weight_grad_splits=1), programs, chunks) == 1


def test_pipeline_stages_shrink_to_what_shared_memory_holds():
    tiles = Config(tile_pixels=64, tile_n=256, block_k=64, max_concurrent_steps=8)
    # The weight gradient's step at these tiles: 128 pixels x (64 + 256) channels, bf16;
    # its epilogue a float32 64 x 256 tile.
    assert stages(tiles, 128 * 320 * 2, 64 * 256 * 4) == 2
    assert stages(tiles, 1024, 0) == 8
    x, k = jax.ShapeDtypeStruct((1, 64, 64, 256), jnp.bfloat16), jax.ShapeDtypeStruct((3, 3, 256, 256), jnp.bfloat16)
    config = Config(tile_pixels=64, tile_n=256, block_k=64, max_concurrent_steps=8)
    f = jax.grad(lambda k, x: mk.masked_conv(x, k, np.ones((3, 3)), implementation="pallas_mosaic_gpu",
                                             config=config).astype(jnp.float32).sum())
    with cuda_lowering():
        # Stages shrink to what fits; the lowering succeeds.
        jax.jit(f).trace(k, x).lower(lowering_platforms=("cuda",))
