"""The Triton backend (``implementation="triton"``): kernels compiled for sm_90 on any machine.

On a CPU-only machine every Triton kernel is compiled to a cubin for Hopper
(``GPUTarget("cuda", 90, 32)``), which catches type, shape and constexpr errors without
a GPU, and the shared suites run the same kernels in Triton's interpreter
(``conftest.BACKENDS["triton_interpret"]``) for their numerics and exactness. On GPUs
the suites run them compiled (``"triton"``), with the GPU tests at the end of this file.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

triton = pytest.importorskip(
    "triton", reason="the Triton backend's tests need triton: pip install 'maskconv-kernels[triton]' (Linux)"
)
from support.numerics import random  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import maskconv_kernels as mk  # noqa: E402
from maskconv_kernels._core.hardware import COMPUTE_CAPABILITY  # noqa: E402
from maskconv_kernels.ops.masked_conv import backends  # noqa: E402
from maskconv_kernels.ops.masked_conv import triton as mk_triton  # noqa: E402
from maskconv_kernels.ops.masked_conv.spec import make_spec  # noqa: E402
from maskconv_kernels.ops.masked_conv.triton import config, ops  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(
    not ON_GPU,
    reason="compiled Triton kernels run on an NVIDIA GPU only; on CPU they are compile-checked, and the shared "
    "suites run them in Triton's interpreter (triton_interpret)",
)


@dataclasses.dataclass(frozen=True)
class CompileCase:
    name: str
    x_shape: tuple
    kernel_shape: tuple
    mask: np.ndarray
    dtype: object
    conv_args: dict = dataclasses.field(default_factory=dict)


COMPILE_CASES = [
    # Channels that are not powers of two (3 in, 130 out), stride 2, dilation (1, 2).
    CompileCase(
        "N2_H9_W11_C3x130_k5_A_s2_d12_bf16", (2, 9, 11, 3), (5, 5, 3, 130), mk.pixelcnn_mask((5, 5), "A"),
        jnp.bfloat16, dict(strides=2, dilation=(1, 2)),
    ),
    # f32 at the default precision: TF32 dots.
    CompileCase("N2_H16_W16_C64_k3_B_f32", (2, 16, 16, 64), (3, 3, 64, 64), mk.pixelcnn_mask((3, 3), "B"), np.float32),
    # f32 at HIGHEST: IEEE dots; explicit asymmetric padding.
    CompileCase(
        "N1_H7_W5_C17x9_k3_A_f32_highest", (1, 7, 5, 17), (3, 3, 17, 9), mk.pixelcnn_mask((3, 3), "A"),
        np.float32, dict(precision="highest", padding=((2, 0), (1, 1))),
    ),
    # 1-D: causal padding and dilation, float16 with a float32 output.
    CompileCase(
        "N2_W29_C5x7_k4_causal_d2_f16_out_f32", (2, 29, 5), (4, 5, 7), np.ones(4, bool), np.float16,
        dict(padding="CAUSAL", dilation=2, preferred_element_type=np.float32),
    ),
    # 1-D: a causal mask with stride 2, bf16.
    CompileCase("N3_W17_C1x130_k5_causal_s2_bf16", (3, 17, 1), (5, 1, 130), mk.causal_mask(5), jnp.bfloat16, dict(strides=2)),
]


def _problem(case: CompileCase):
    x = jax.ShapeDtypeStruct(case.x_shape, case.dtype)
    k = jax.ShapeDtypeStruct(case.kernel_shape, case.dtype)
    spec = make_spec(x, k, case.mask, **case.conv_args)
    assert mk_triton.unsupported(spec, None) is None  # the problem alone
    return ops.problem(spec, case.x_shape[0], case.dtype)


@pytest.mark.parametrize("kind", config.KINDS)
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: c.name)
def test_kernel_compiles_for_sm90(case, kind):
    p = _problem(case)
    cfg = config.heuristic(kind, *p.gemm(kind), np.dtype(case.dtype).itemsize, len(p.taps))
    args = ops.kernel_args(p, kind, cfg)
    compiled = _compile(args)
    assert len(compiled.asm["cubin"]) > 0
    assert ".target sm_90" in compiled.asm["ptx"]
    # One tl.dot in one loop over (active tap, channel block) pairs: the loop runs
    # len(taps) * channel blocks times, so masked taps have no iteration at all.
    ttir = compiled.asm["ttir"]
    assert ttir.count("tt.dot ") == 1
    if kind != "dw":
        k = p.c_in if kind == "fwd" else p.c_out
        trips = len(p.taps) * -(-k // cfg.block_k)
        assert re.search(rf"scf\.for %\S+ = %\S+ to %c{trips}_i32", ttir), f"no loop of {trips} trips"
    # TF32 only where asked for: f32 at default precision.
    uses_tf32 = "tf32" in compiled.asm["ttir"]
    assert uses_tf32 == (np.dtype(case.dtype) == np.float32 and "precision" not in case.conv_args)


def _compile(args):
    source = triton.compiler.ASTSource(
        fn=args["kernel"], signature=args["signature"], constexprs=args["constexprs"], attrs=args["attrs"]
    )
    return triton.compile(source, target=GPUTarget("cuda", COMPUTE_CAPABILITY, 32), options=args["options"])


@pytest.mark.parametrize("kind", config.KINDS)
@pytest.mark.parametrize("window, mask_type", [((7, 7), "A"), ((3, 3), "B")])
def test_acceptance_shapes_compile_to_pipelined_wgmma(window, mask_type, kind):
    """bf16, N=64, 32x32, C=256 (the GPU bar): async copies a few stages deep feeding Hopper's wgmma.

    A regression guard for the two things that make these kernels fast on an H200 and
    that a small change can silently lose: vectorised, software-pipelined loads
    (``cp.async``) and warp-group matrix instructions.
    """
    x = jax.ShapeDtypeStruct((64, 32, 32, 256), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((*window, 256, 256), jnp.bfloat16)
    p = ops.problem(make_spec(x, k, mk.pixelcnn_mask(window, mask_type)), 64, jnp.bfloat16)
    cfg = config.heuristic(kind, *p.gemm(kind), 2, len(p.taps))
    ptx = _compile(ops.kernel_args(p, kind, cfg)).asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx
    assert "wgmma.mma_async" in ptx


def _spec(x_shape, kernel_shape, mask, dtype=np.float32, **kw):
    # Shapes and dtypes only (float64 stays float64, as under jax_enable_x64).
    return make_spec(jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(kernel_shape, dtype), mask, **kw)


@pytest.mark.parametrize(
    "spec, reason",
    [
        (_spec((1, 4, 4, 4, 2), (3, 3, 3, 2, 2), mk.pixelcnn_mask((3, 3, 3))), "3-D convolutions"),
        (_spec((1, 8, 8, 4), (3, 3, 2, 4), mk.pixelcnn_mask((3, 3)), feature_group_count=2), "feature_group_count=2"),
        (_spec((1, 8, 8, 3), (3, 3, 3, 6), mk.channel_grouped_mask((3, 3), 3, 6, "A")), "channel-partial taps"),
        (_spec((1, 8, 8, 3), (3, 3, 3, 6), mk.pixelcnn_mask((3, 3)), np.float64), "float64"),
    ],
    ids=["3d", "groups", "channel_partial", "float64"],
)
def test_unsupported_names_the_problem(spec, reason):
    assert reason in mk_triton.unsupported(spec, None)


def test_full_mask_without_partial_taps_is_supported():
    full = np.broadcast_to(mk.pixelcnn_mask((3, 3), "B")[..., None, None], (3, 3, 3, 5))
    assert mk_triton.unsupported(_spec((1, 6, 6, 3), (3, 3, 3, 5), full), None) is None


def test_interpret_mode_runs_on_any_platform():
    spec = _spec((1, 8, 8, 3), (3, 3, 3, 6), mk.pixelcnn_mask((3, 3)))
    record = backends.get("triton")  # the platform is the record's to check, once for every backend
    assert record.unsupported(spec, "cpu", interpret=True) is None
    assert "lower for NVIDIA GPUs (cuda) only" in record.unsupported(spec, "cpu", interpret=False)


@pytest.mark.skipif(ON_GPU, reason="the interpreter is what CI runs without a GPU")
def test_interpreter_writes_every_output_element():
    """Interpreted outputs start as NaN: an element a kernel does not write would show."""
    x = random(0, (2, 5, 7, 3))
    k = random(1, (3, 3, 3, 20))
    mask = mk.pixelcnn_mask((3, 3), "B")
    y, vjp = jax.vjp(lambda x, k: mk.masked_conv(x, k, mask, implementation="triton", interpret=True), x, k)
    for out in (y, *vjp(random(2, y.shape))):
        assert np.isfinite(np.asarray(out)).all()


@pytest.mark.skipif(ON_GPU, reason="checks the error on a machine without a GPU")
def test_cpu_raises_not_implemented_with_reason():
    x = jnp.ones((1, 8, 8, 3))
    k = jnp.ones((3, 3, 3, 4))
    with pytest.raises(NotImplementedError, match=r'implementation="triton"\).*platform "cpu".*NVIDIA GPUs'):
        mk.masked_conv(x, k, mk.pixelcnn_mask((3, 3)), implementation="triton")


def test_core_package_imports_neither_triton_nor_jax_triton():
    code = (
        "import sys, maskconv_kernels, maskconv_kernels.ops.masked_conv.triton; "
        "maskconv_kernels.ops.masked_conv.implementation_for; "
        "print(sorted(m for m in ('triton', 'jax_triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_config_rejects_blocks_tl_dot_cannot_take():
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        config.Launch(block_m=64, block_n=64, block_k=8)


@pytest.mark.parametrize("kind", config.KINDS)
def test_candidates_start_with_the_heuristic_and_are_distinct(kind):
    shape = (64 * 32 * 32, 256, 256) if kind != "dw" else (256, 256, 64 * 32 * 32)
    cands = config.candidates(kind, *shape, 2)
    assert cands[0] == config.heuristic(kind, *shape, 2)
    assert len(set(cands)) == len(cands) >= 2


@pytest.mark.parametrize(
    "version, params, expected",
    [
        ("0.3", {"out_shape", "enable_fp_fusion", "num_warps"}, {"out_shape": "OUT", "enable_fp_fusion": True}),
        ("0.4", {"out_type", "backend_options", "num_warps"},
         {"out_type": "OUT", "backend_options": {"enable_fp_fusion": True}}),
    ],
)
def test_triton_call_keywords_follow_the_jax_triton_version(monkeypatch, version, params, expected):
    """0.3.x (the release for triton 3.6) and 0.4+ name the output and the fusion option differently."""
    monkeypatch.setattr(ops, "_call_parameters", lambda: frozenset(params))
    options = dict(num_warps=4, num_stages=3, enable_fp_fusion=True)
    assert ops._call_keywords("OUT", options) == {**expected, "num_warps": 4, "num_stages": 3}
    assert options["enable_fp_fusion"] is True  # the caller's dict is left alone


def test_weight_gradient_splits_cover_every_pixel_once():
    x = jax.ShapeDtypeStruct((3, 11, 13, 4), np.float32)
    k = jax.ShapeDtypeStruct((3, 3, 4, 5), np.float32)
    p = ops.problem(make_spec(x, k, mk.pixelcnn_mask((3, 3))), 3, np.float32)
    for split in (1, 2, 3, 7):
        cfg = config.Launch(16, 16, 16, split=split)
        chunk, splits = ops._dw_chunk(p, cfg)
        assert chunk % cfg.block_k == 0
        assert (splits - 1) * chunk < p.n * p.oh * p.ow <= splits * chunk


# ------------------------------------------------------------------ GPU only


@needs_gpu
def test_weight_gradient_is_deterministic():
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 32, 32, 64), jnp.bfloat16)
    k = jax.random.normal(jax.random.PRNGKey(1), (7, 7, 64, 64), jnp.bfloat16)
    mask = mk.pixelcnn_mask((7, 7), "A")
    grad = jax.jit(jax.grad(lambda k: mk.masked_conv(x, k, mask, implementation="triton").astype(jnp.float32).sum()))
    first, second = np.asarray(grad(k)), np.asarray(grad(k))
    assert np.array_equal(first.view(np.uint16), second.view(np.uint16))
    assert (first[~mask.astype(bool)] == 0).all()


@needs_gpu
def test_value_and_grad_runs_three_kernels_and_no_convolution():
    x = jnp.ones((2, 16, 16, 32), jnp.float32)
    k = jnp.ones((3, 3, 32, 32), jnp.float32)
    mask = mk.pixelcnn_mask((3, 3), "B")
    f = lambda x, k: mk.masked_conv(x, k, mask, implementation="triton").sum()
    hlo = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(x, k).as_text()
    assert "stablehlo.convolution" not in hlo
    assert hlo.count("triton_kernel_call") >= 3


@needs_gpu
def test_autotune_caches_one_config_per_problem():
    x = jnp.ones((2, 16, 16, 32), jnp.bfloat16)
    k = jnp.ones((3, 3, 32, 48), jnp.bfloat16)
    mk.masked_conv(x, k, mk.pixelcnn_mask((3, 3)), implementation="triton").block_until_ready()
    before = ops.tuned()
    mk.masked_conv(x, k, mk.pixelcnn_mask((3, 3)), implementation="triton").block_until_ready()
    assert ops.tuned() == before
    assert any(kind == "fwd" and p.c_out == 48 for kind, p in before)
