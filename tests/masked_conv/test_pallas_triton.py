"""The ``pallas_triton`` backend's own tests: GPU lowering on CPU, its limits, its config, channel tiles.

The shared suites (agreement, exactness, transforms) already run the kernels through the
``pallas_triton_interpret`` backend of ``conftest.py``; these cover what they cannot.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lowering import capture_triton_modules, compile_triton_modules, count, cuda_lowering, kernel_jaxprs
from support.numerics import assert_close, random
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels import masked_conv_reference
from maskconv_kernels.ops.masked_conv import backends, implementation_for, pallas_triton
from maskconv_kernels.ops.masked_conv.pallas_triton import Config
from maskconv_kernels.ops.masked_conv.pallas_triton.config import KERNELS
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference_vjp
from maskconv_kernels.ops.masked_conv.spec import make_spec

KERNEL_NAMES = ("maskconv_fwd", "maskconv_bwd_input", "maskconv_bwd_weight")


def _lower_for_cuda(f, *args) -> str:
    """StableHLO text of ``jax.jit(f)`` lowered for an NVIDIA GPU, on a machine without one."""
    with cuda_lowering():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


LOWERING_CASES = {
    "2d_N2_H16_W16_C64_k7A_bf16": ((2, 16, 16, 64), (7, 7, 64, 64), mk.pixelcnn_mask((7, 7), "A"), {}, jnp.bfloat16),
    "2d_N1_H9_W10_C3_k3B_s2_d2_f32": ((1, 9, 10, 3), (3, 3, 3, 5), mk.pixelcnn_mask((3, 3), "B"),
                                     dict(strides=2, dilation=2, precision="highest"), jnp.float32),
    "2d_N1_H7_W7_C6_k3_rgbA_full": ((1, 7, 7, 6), (3, 3, 6, 6), mk.channel_grouped_mask((3, 3), 6, 6, "A"), {},
                                    jnp.float32),
    "1d_N2_L33_C130_k3_CAUSAL_d2_f16": ((2, 33, 130), (3, 130, 130), np.ones(3), dict(padding="CAUSAL", dilation=2),
                                        jnp.float16),
}


@pytest.mark.parametrize("name", sorted(LOWERING_CASES))
def test_value_and_grad_lowers_for_cuda_to_three_kernels_and_no_convolution(name):
    x_shape, k_shape, mask, kw, dtype = LOWERING_CASES[name]
    x = jnp.zeros(x_shape, dtype)
    k = jnp.zeros(k_shape, dtype)

    def loss(x, k):
        return mk.masked_conv(x, k, mask, implementation="pallas_triton", **kw).astype(jnp.float32).sum()

    text = _lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), x, k)
    calls = re.findall(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(", text)
    assert len(calls) >= 3, f"expected the three Pallas kernels as Triton calls, found {len(calls)}"
    for kernel in KERNEL_NAMES:
        assert kernel in text, f"kernel {kernel} missing from the lowered module"
    assert "stablehlo.convolution" not in text


def _kernel_jaxprs_of(spec, dtype, platform="cuda") -> dict:
    """``{pallas_call name: kernel jaxpr}`` of the three kernels as the core lowers them for ``platform``."""
    return kernel_jaxprs(pallas_triton, spec, dtype, platform)


def test_highest_precision_reaches_the_kernel_dots():
    x, k = random(0, (1, 5, 6, 3)), random(1, (3, 3, 3, 4))
    mask = mk.pixelcnn_mask((3, 3), "B")
    jaxprs = lambda precision: " ".join(map(str, _kernel_jaxprs_of(make_spec(x, k, mask, precision=precision),
                                                                    np.float32).values()))
    assert "HIGHEST" in jaxprs("highest")
    assert "HIGHEST" not in jaxprs(None)  # TF32 on GPUs: Triton's default for float32 dots


@pytest.mark.parametrize(
    "mask",
    [mk.pixelcnn_mask((7, 7), "A"), np.array([[1, 0, 1, 0, 1], [0, 1, 0, 1, 0], [1, 0, 0, 0, 0]], bool)],
    ids=["7x7A_raster_run", "5x3_scattered"],
)
def test_kernel_code_does_not_grow_with_the_taps(mask):
    """One dot per kernel, in one loop over (active tap, channel block): 24 taps, not 24 copies.

    Unrolled per tap, the 7x7 type-A kernels took 7-10 s each to compile for sm_90, and
    the first H200 check spent its whole time limit compiling
    (benchmarks/results/h200-2026-11-30-first-run).
    """
    x = jax.ShapeDtypeStruct((2, 16, 16, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((*mask.shape, 64, 64), jnp.bfloat16)
    kernels = _kernel_jaxprs_of(make_spec(x, k, mask), jnp.bfloat16)
    assert set(kernels) == set(KERNEL_NAMES)
    for name, kernel in kernels.items():
        assert count(kernel, "dot_general") == 1, name


@pytest.mark.parametrize("window, mask_type", [((7, 7), "A"), ((3, 3), "B")])
def test_acceptance_shapes_compile_to_pipelined_wgmma(window, mask_type, monkeypatch, tmp_path):
    """bf16, N=64, 32x32, C=256: every kernel's loads are pipelined ``cp.async`` feeding ``wgmma``.

    The Triton IR that jax's Pallas lowering hands to XLA, captured and compiled for
    sm_90 by the ``triton`` package with the stages a kernel goes through at run time:
    Triton's own TTIR passes (``make_ttir``: inliner, canonicalizer, combine, CSE, loop
    unrolling; what XLA's Triton pipeline runs first), then TTGIR, LLVM IR and PTX. A
    file of IR alone would skip the TTIR passes (Triton takes a ``.ttir`` file as already
    through them), and that build differs from the one that runs: it keeps a separate
    accumulator and waits after every ``wgmma``. It guards what a small change can
    silently lose: clamping the channel index once turned the x and dy gathers into
    scalar loads with no pipelining (benchmarks/results/h200-2026-11-30-first-run).
    """
    pytest.importorskip("triton", reason="compiling the Pallas kernels' Triton IR needs triton")
    captured = capture_triton_modules(monkeypatch)
    x = jnp.zeros((64, 32, 32, 256), jnp.bfloat16)
    k = jnp.zeros((*window, 256, 256), jnp.bfloat16)
    mask = mk.pixelcnn_mask(window, mask_type)
    spec = make_spec(x, k, mask)
    loss = lambda x, k: mk.masked_conv(x, k, mask, implementation="pallas_triton").astype(jnp.float32).sum()
    _lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), x, k)
    assert len(captured) == 3, len(captured)
    # The three kernels' default tiles launch alike in 16-bit, so one set of options compiles what runs.
    (launch,) = {(b.num_warps, b.num_stages) for b in
                 (Config.get_default(spec, jnp.bfloat16, kernel) for kernel in KERNELS)}
    modules = {f"kernel{i}": module for i, module in enumerate(captured)}
    options = dict.fromkeys(modules, dict(num_warps=launch[0], num_stages=launch[1]))
    for i, ptx in compile_triton_modules(modules, options, tmp_path, monkeypatch).items():
        assert "cp.async.cg.shared.global" in ptx, f"{i}: loads are not pipelined async copies"
        assert "ld.global" not in ptx, f"{i}: some loads are plain (scalar or unpipelined) loads"
        assert "wgmma.mma_async" in ptx, f"{i}: no Hopper warp-group MMA"
        # What the TTIR passes give (and a .ttir file compiled without them lacks): the
        # accumulate fused into the wgmma, and one wgmma group kept in flight.
        assert "add.f32" not in ptx, f"{i}: the accumulator is added separately from the wgmma"
        assert "wgmma.wait_group.sync.aligned 1;" in ptx, f"{i}: every wgmma is waited for at once"


_SMALL_TILES = Config(block_pixels=16, block_c_in=16, block_c_out=16, block_pixels_reduce=16)
TILE_CASES = {
    # 2 * 12 * 11 output pixels in blocks of 16 are 17 reduction blocks: the weight
    # gradient splits them into two ranges, whose partial sums are added afterwards.
    "2d_N2_H12_W11_C40_k3A_tiles16": ((2, 12, 11, 40), 37, mk.pixelcnn_mask((3, 3), "A"), {}, _SMALL_TILES),
    "2d_N2_H12_W11_C40_k3A_s21_d12_explicit_tiles16": (
        (2, 12, 11, 40), 37, mk.pixelcnn_mask((3, 3), "A"),
        dict(strides=(2, 1), dilation=(1, 2), padding=((2, 0), (1, 3))), _SMALL_TILES,
    ),
    # C=130 with the default tiles: a remainder of 2 channels in the last tile.
    "1d_N1_L11_C130_k3_CAUSAL_d2_default": ((1, 11, 130), 130, np.ones(3, bool), dict(padding="CAUSAL", dilation=2),
                                            None),
}


@pytest.mark.parametrize("name", tiered(sorted(TILE_CASES), lambda n: n == sorted(TILE_CASES)[0]))
def test_several_channel_and_pixel_tiles(name):
    """Channel counts over the tile size, with a remainder: the reduction loops take several trips."""
    x_shape, c_out, mask, kw, blocks = TILE_CASES[name]
    c_in = x_shape[-1]
    x = random(2, x_shape)
    k = random(3, (*mask.shape, c_in, c_out), scale=1 / np.sqrt(mask.size * c_in))
    conv = lambda x, k: mk.masked_conv(x, k, mask, implementation="pallas_triton", interpret=True, config=blocks, **kw)
    y, vjp = jax.vjp(conv, x, k)
    reduction = int(mask.sum()) * c_in
    scale = float(jnp.abs(x).max() * jnp.abs(k).max())
    assert_close(y, masked_conv_reference(x, k, mask, **kw), np.float32, reduction, scale)
    dy = random(4, y.shape)
    dx, dk = vjp(dy)
    rdx, rdk = masked_conv_reference_vjp(x, k, mask, dy, **kw)
    assert_close(dx, rdx, np.float32, int(mask.sum()) * c_out, float(jnp.abs(dy).max() * jnp.abs(k).max()))
    assert_close(dk, rdk, np.float32, int(np.prod(y.shape[:-1])), float(jnp.abs(dy).max() * jnp.abs(x).max()))
    assert (np.asarray(dk)[~mask] == 0.0).all()


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    "x_shape,k_shape,kw,expected",
    [
        ((1, 4, 5, 5, 2), (3, 3, 3, 2, 2), {}, "3-D convolutions"),
        ((1, 6, 6, 4), (3, 3, 2, 4), dict(feature_group_count=2), "feature_group_count=2"),
    ],
    ids=["3d", "groups2"],
)
def test_unsupported_problems_raise_naming_why_and_none_falls_back_to_xla(x_shape, k_shape, kw, expected):
    x, k = jnp.ones(x_shape), jnp.ones(k_shape)
    mask = np.ones(k_shape[:-2], bool)
    with pytest.raises(NotImplementedError, match=re.escape(expected)):
        mk.masked_conv(x, k, mask, implementation="pallas_triton", interpret=True, **kw)
    spec = make_spec(x, k, mask, **kw)
    assert implementation_for(spec, interpret=True) == "xla"
    assert implementation_for(spec, platform="gpu") == "xla"


def test_needs_a_gpu_or_interpret_mode():
    x, k, mask = jnp.ones((1, 5, 5, 2)), jnp.ones((3, 3, 2, 2)), mk.pixelcnn_mask((3, 3), "B")
    spec = make_spec(x, k, mask)
    record = backends.get("pallas_triton")
    assert "interpret=True" in record.unsupported(spec, "cpu", interpret=False)
    assert record.unsupported(spec, "cpu", interpret=True) is None
    assert record.unsupported(spec, "cuda", interpret=False) is None
    assert "lower for NVIDIA GPUs (cuda) only" in record.unsupported(spec, "rocm", interpret=False)
    # implementation=None: Pallas where it runs, xla elsewhere; interpret=True never brings
    # a GPU kernel to another platform.
    assert implementation_for(spec, platform="cpu") == "xla"
    assert implementation_for(spec, platform="cuda") == "pallas_triton"
    assert implementation_for(spec, platform="cpu", interpret=True) == "xla"
    assert implementation_for(spec, platform="tpu", interpret=True) == "pallas_mosaic_tpu"  # the TPU's own
    # Named, it traces anywhere and refuses only when lowered for a platform it cannot run on.
    f = jax.jit(lambda x, k: mk.masked_conv(x, k, mask, implementation="pallas_triton"))
    with pytest.raises(NotImplementedError, match='lowered for platform "cpu".*interpret=True'):
        f.trace(x, k).lower(lowering_platforms=("cpu",))


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("block_pixels", 48, "power of two"),
        ("block_c_in", 8, "from 16"),
        ("block_c_out", 1024, "to 512"),
        ("block_pixels_reduce", 64.0, "must be an int"),
        ("num_warps", 3, "num_warps"),
        ("num_stages", 0, "num_stages"),
    ],
)
def test_block_sizes_are_validated(field, value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Config(**{field: value})


def test_block_sizes_are_frozen_and_hashable():
    blocks = Config()
    with pytest.raises(AttributeError):
        blocks.block_pixels = 32  # type: ignore[misc]
    assert hash(blocks) == hash(Config())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("c", [1, 3, 130, 256])
def test_default_block_sizes_fit_the_problem(c, dtype, kernel):
    x, k = jnp.ones((1, 8, 8, c), dtype), jnp.ones((3, 3, c, c), dtype)
    blocks = Config.get_default(make_spec(x, k, np.ones((3, 3))), dtype, kernel)
    assert blocks == Config(**vars(blocks))  # a valid config
    assert blocks.block_c_in <= max(16, 2 * c) and blocks.block_c_out <= max(16, 2 * c)
    if c <= 3:  # a tile shrunk to the channels gets 4 warps, not 8
        assert blocks.num_warps == 4


# The GEMM tiles (m, n, k, warps, stages) that won each kernel's sweep on an H200 at the headline shapes
# (N=64, 32x32, C=256; benchmarks/results/h200-2026-12-04/tune_long.json).
H200_BEST = {
    (jnp.bfloat16, "forward"): (128, 256, 64, 8, 3), (jnp.bfloat16, "input_grad"): (128, 256, 64, 8, 3),
    (jnp.bfloat16, "weight_grad"): (128, 256, 64, 8, 3), (jnp.float32, "forward"): (128, 64, 32, 4, 3),
    (jnp.float32, "input_grad"): (128, 128, 32, 8, 3), (jnp.float32, "weight_grad"): (128, 128, 16, 8, 4),
}


@pytest.mark.parametrize("dtype, kernel", list(H200_BEST), ids=[f"{d.__name__}-{k}" for d, k in H200_BEST])
def test_default_tiles_at_the_headline_shape_are_the_measured_best(dtype, kernel):
    x, k = jnp.ones((64, 32, 32, 256), dtype), jnp.ones((7, 7, 256, 256), dtype)
    b = Config.get_default(make_spec(x, k, mk.pixelcnn_mask((7, 7), "A")), dtype, kernel)
    gemm = {"forward": (b.block_pixels, b.block_c_out, b.block_c_in),
            "input_grad": (b.block_pixels, b.block_c_in, b.block_c_out),
            "weight_grad": (b.block_c_in, b.block_c_out, b.block_pixels_reduce)}[kernel]
    assert gemm + (b.num_warps, b.num_stages) == H200_BEST[dtype, kernel]


def test_default_block_sizes_name_the_kernel():
    x, k = jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 4, 4))
    with pytest.raises(ValueError, match="kernel must be one of"):
        Config.get_default(make_spec(x, k, np.ones((3, 3))), jnp.float32, "backward")


def test_block_sizes_must_be_a_config():
    x, k = jnp.ones((1, 5, 5, 2)), jnp.ones((3, 3, 2, 2))
    with pytest.raises(TypeError, match=r"pallas_triton\.config\.Config"):
        mk.masked_conv(x, k, np.ones((3, 3)), implementation="pallas_triton", interpret=True,
                       config={"block_pixels": 32})
    with pytest.raises(ValueError, match="implementation="):
        mk.masked_conv(x, k, np.ones((3, 3)), config=Config())
