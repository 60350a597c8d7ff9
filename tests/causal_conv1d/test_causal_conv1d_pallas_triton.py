"""What is ``causal_conv1d(implementation="pallas_triton")``'s alone: its fused Pallas (Triton) kernels.

The shared suite (test_causal_conv1d.py) runs these kernels, compiled on a GPU and in the
Pallas interpreter elsewhere, against the oracles, through exactness, determinism and
derivatives of every order. Here: its default tiles against the oracles, the final state
by gathers, and without a GPU the cuda lowering (the named Triton kernels, no
convolution) and an sm_90 compile (16-byte loads, no spills); its config.
"""
from __future__ import annotations

import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.harness import ON_GPU
from support.lowering import capture_triton_modules, compile_triton_modules, cuda_lowering
from support.short_conv import F32, check_against_oracles, ids, inputs

from maskconv_kernels._core.hardware import COMPUTE_CAPABILITY
from maskconv_kernels.ops.causal_conv1d import causal_conv1d, causal_conv1d_reference
from maskconv_kernels.ops.causal_conv1d.pallas_triton import KERNELS, Config
from maskconv_kernels.ops.causal_conv1d.state import final_state

BF16 = np.dtype(jnp.bfloat16)


@pytest.mark.slow
def test_default_tiles_match_the_oracles():
    """One tile of positions and of channels, one split (Config.get_default at a small shape)."""
    x, w, b, state, dy = inputs(0, 1, 37, 20, 4, F32, F32)
    conv = lambda x, w, b=None, **kw: causal_conv1d(x, w, b, implementation="pallas_triton",  # noqa: E731
                                                    interpret=not ON_GPU, **kw)
    check_against_oracles(conv, x, w, b, state, dy, ids(5, 1, 37), activation="silu", dilation=1)


# --------------------------------------------------------------------------- final state, wiring, errors


@pytest.mark.parametrize("stateful", [False, True], ids=["zeros", "state"])
@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "seg"])
@pytest.mark.parametrize("length", [1, 2, 9])
def test_final_state_by_gathers_matches_the_reference(length, segmented, stateful):
    x, w, _, state, _ = inputs(11, 3, length, 5, 4, F32, F32, dilation=2)
    doc = ids(12, 3, length) if segmented else None
    if segmented:
        doc[2] = -1  # an all-padding row
    got = final_state(x, state if stateful else None, None if doc is None else jnp.asarray(doc), 6)
    _, expected = causal_conv1d_reference(x, w, segment_ids=doc, initial_state=state if stateful else None,
                                          dilation=2, return_final_state=True)
    np.testing.assert_array_equal(np.asarray(got, np.float64), expected)


def test_value_and_grad_lowers_for_cuda_to_the_three_named_triton_kernels_and_no_convolution():
    x = jax.ShapeDtypeStruct((4, 2048, 1536), jnp.bfloat16)
    w, b = jax.ShapeDtypeStruct((4, 1536), jnp.float32), jax.ShapeDtypeStruct((1536,), jnp.float32)
    state = jax.ShapeDtypeStruct((4, 3, 1536), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((4, 2048), jnp.int32)

    def loss(x, w, b, state, ids):
        y = causal_conv1d(x, w, b, segment_ids=ids, initial_state=state, activation="silu",
                          implementation="pallas_triton")
        return y.astype(jnp.float32).sum()

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    with cuda_lowering():  # the deprecation warning of the Triton lowering is an error here
        text = f.trace(x, w, b, state, ids).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton", text)
    assert len(calls) == 3, f"expected the forward, backward and state-gradient kernels, found {len(calls)}"
    for kernel in KERNELS:
        assert kernel in text
    assert "stablehlo.convolution" not in text


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_kernels_compile_for_sm90_to_vector_loads_without_spills(dtype, monkeypatch, tmp_path):
    """Mamba's shape (B=4, L=2048, D=1536, W=4, SiLU, segment ids, a state), default tiles.

    The Triton IR jax's lowering hands to XLA, compiled for sm_90 by the ``triton``
    package as at run time (its TTIR passes first: :func:`support.lowering.compile_triton_modules`),
    then assembled by its ptxas with ``-v``: every kernel reads x and dy in 16-byte
    vectors (channels contiguous) and spills no register.
    """
    pytest.importorskip("triton", reason="compiling the kernels' Triton IR needs triton")
    from triton.backends.nvidia.compiler import get_ptxas

    captured = capture_triton_modules(monkeypatch)
    batch, length, dim = 4, 2048, 1536
    x = jax.ShapeDtypeStruct((batch, length, dim), dtype)
    state = jax.ShapeDtypeStruct((batch, 3, dim), dtype)
    w, b = jax.ShapeDtypeStruct((4, dim), jnp.float32), jax.ShapeDtypeStruct((dim,), jnp.float32)
    doc = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    loss = lambda x, w, b, state, doc: causal_conv1d(  # noqa: E731
        x, w, b, segment_ids=doc, initial_state=state, activation="silu", implementation="pallas_triton",
    ).astype(jnp.float32).sum()
    with cuda_lowering():
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).trace(x, w, b, state, doc).lower(
            lowering_platforms=("cuda",))
    assert len(captured) == len(KERNELS), len(captured)
    modules = {next(n for n in sorted(KERNELS, key=len, reverse=True) if n in m): m for m in captured}
    blocks = Config.get_default(length, dim)
    options = {name: dict(num_warps=blocks.tile(backward=name != KERNELS[0])[2], num_stages=1) for name in KERNELS}
    ptxas = get_ptxas(COMPUTE_CAPABILITY).path
    for name, ptx in compile_triton_modules(modules, options, tmp_path, monkeypatch).items():
        assert "ld.global.v4.b32" in ptx, f"{name}: no 16-byte vector loads"
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / f"{name}.ptx"), "-o", str(tmp_path / "k.cubin")],
                             capture_output=True, text=True, check=True)
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", run.stdout + run.stderr)]
        assert spills and not any(spills), f"{name}: register spills ({run.stdout + run.stderr})"


def test_lowering_elsewhere_needs_interpret():
    x, w = jnp.ones((1, 5, 16), jnp.float32), jnp.ones((4, 16), jnp.float32)
    f = jax.jit(lambda x: causal_conv1d(x, w, implementation="pallas_triton"))
    with pytest.raises(NotImplementedError, match=r'causal_conv1d\(implementation="pallas_triton"\) cannot be lowered '
                                                  r'for platform "cpu".*interpret=True'):
        f.trace(x).lower(lowering_platforms=("cpu",))


def test_a_gradient_runs_the_fused_backward_kernel():
    """Lowered for cuda, the first reverse derivative is the fused backward kernel (the
    forward's output is not needed for it), with no convolution."""
    x, w = jnp.ones((2, 64, 32), jnp.bfloat16), jnp.ones((4, 32), jnp.float32)
    grad = jax.grad(lambda x, w: causal_conv1d(x, w, activation="silu", implementation="pallas_triton")
                    .astype(jnp.float32).sum(), argnums=(0, 1))
    with cuda_lowering():
        text = jax.jit(grad).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert f'name = "{KERNELS[1]}"' in text
    assert "stablehlo.convolution" not in text


@pytest.mark.parametrize(
    "field,value",
    [("block_positions", 24), ("backward_block_positions", 8), ("block_channels", 2048), ("block_channels", True),
     ("backward_block_channels", 48), ("num_warps", 3), ("backward_num_warps", 32), ("backward_splits", 0),
     ("backward_splits", 1.5)],
)
def test_block_sizes_are_validated(field, value):
    with pytest.raises(ValueError, match=f"Config.{field}"):
        Config(**{field: value})


def test_block_sizes_default_to_the_problem_and_splits_fill_the_sms():
    assert Config.get_default(length=1, dim=5) == Config(
        block_positions=16, block_channels=16, backward_block_positions=16, backward_block_channels=16)
    assert Config.get_default(length=8192, dim=4096) == Config()
    blocks = Config()
    # 32 channel blocks x 17 splits fill 132 SMs four times; each split a whole number of tiles.
    assert blocks.splits(32, 1024) == 17
    assert blocks.splits(32, 2) == 2 and blocks.splits(1, 7) == 7
    assert Config(backward_splits=1).splits(32, 1024) == 1
    with pytest.raises(TypeError, match=r"pallas_triton\.config\.Config"):
        causal_conv1d(jnp.ones((1, 4, 8)), jnp.ones((2, 8)), implementation="pallas_triton", interpret=True,
                      config=dict(block_positions=16))
