"""The fused Pallas (Triton) kernels of ``causal_conv1d(implementation="pallas_triton")``.

Compiled on a GPU, in the Pallas interpreter elsewhere: the forward and final state
against the float64 oracle :func:`causal_conv1d_reference`; the gradients (x, weight,
bias, initial state) against the library's ``xla`` path differentiated in float64;
exactness across documents (NaN isolation, exactly zero gradients, packed equals alone
bit for bit); run-to-run determinism. Without a GPU: the cuda lowering (the named Triton
kernels, no convolution) and an sm_90 compile (16-byte loads, no spills). Interpreted
kernels are slow: one grid case and the exactness checks in the README's test command,
the grid and the derivatives of every order in the slow tier.
"""
from __future__ import annotations

import functools
import itertools
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.implementations import ON_GPU
from support.lowering import cuda_lowering, with_ttir_passes
from support.numerics import random
from support.short_conv_kernels import (
    check_against_oracles, check_derivatives_of_every_order, check_nan_isolation, check_packed_equals_alone,
)

from maskconv_kernels._core.hardware import COMPUTE_CAPABILITY
from maskconv_kernels.ops.causal_conv1d import causal_conv1d, causal_conv1d_reference
from maskconv_kernels.ops.causal_conv1d.pallas_triton import KERNELS, Config
from maskconv_kernels.ops.causal_conv1d.state import final_state

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)
INTERPRET = not ON_GPU
# Several position tiles, channel blocks and backward splits at test sizes.
SMALL = Config(block_positions=16, block_channels=16, backward_block_positions=16, backward_block_channels=16,
               backward_splits=3)


def _ids(seed, batch, length):
    """Documents of random lengths, trailing padding in some rows, padding inside one."""
    rng = np.random.default_rng(seed)
    ids = np.full((batch, length), -1, np.int32)
    for row in ids:
        end = max(length - int(rng.integers(0, 4)), 0)
        cuts = np.sort(rng.choice(np.arange(1, max(end, 2)), min(2, max(end - 1, 0)), replace=False))
        row[:end] = 10 + np.searchsorted(cuts, np.arange(end), side="right")
    if length > 6:
        ids[0, length // 2] = -1  # a padding position between two of a document's
    return ids


def _case(seed, batch, length, dim, width, dilation, x_dtype, w_dtype):
    x = random(seed, (batch, length, dim), x_dtype)
    w = random(seed + 1, (width, dim), w_dtype, scale=0.5)
    b = random(seed + 2, (dim,), w_dtype, scale=0.5)
    state = random(seed + 3, (batch, (width - 1) * dilation, dim), x_dtype)
    dy = random(seed + 4, (batch, length, dim), x_dtype)
    return x, w, b, state, dy


def _fused(x, w, b=None, config=SMALL, **kw):
    return causal_conv1d(x, w, b, implementation="pallas_triton", interpret=INTERPRET, config=config, **kw)


def _check(case, config=SMALL, seed=0, batch=2):
    """Forward, final state and every gradient of one case against the oracles."""
    width, dim, length, dilation, bias, activation, x_dtype, w_dtype, segmented, stateful = case
    x, w, b, state, dy = _case(seed, batch, length, dim, width, dilation, x_dtype, w_dtype)
    ids = _ids(seed + 5, batch, length) if segmented else None
    check_against_oracles(functools.partial(_fused, config=config), x, w, b if bias else None,
                          state if stateful else None, dy, ids, activation=activation, dilation=dilation)


def _grid_id(case):
    w, d, l, dil, bias, act, xd, wd, seg, st = case
    return (f"W{w}_D{d}_L{l}_d{dil}{'_bias' if bias else ''}{'_silu' if act else ''}_{xd}-{wd}"
            f"{'_seg' if seg else ''}{'_state' if st else ''}")


# width, dim, length, dilation, bias, activation, x dtype, weight dtype, segments, initial state
FAST = [
    (3, 24, 21, 2, False, None, BF16, F32, True, False),  # Mamba's mixed dtypes, segments, dilation
]
GRID = [
    *itertools.product((2, 3, 4, 8), (20,), (1, 37), (1,), (True,), ("silu",), (F32,), (F32,), (True,), (True,)),
    (4, 20, 37, 3, True, "silu", F32, F32, True, True),
    (8, 17, 50, 2, False, "silu", F32, F32, False, True),
    (4, 33, 16, 1, True, None, F32, F32, False, False),
    (4, 20, 37, 1, False, "silu", F32, F32, True, False),
    (4, 20, 29, 1, True, "silu", BF16, BF16, True, True),
    (4, 20, 29, 1, True, "silu", F16, F16, False, True),
    (4, 20, 29, 1, True, "silu", BF16, F32, True, True),
    (2, 20, 29, 4, True, None, F16, F32, True, True),
]


@pytest.mark.parametrize("case", FAST, ids=_grid_id)
def test_fused_kernels_match_the_oracles(case):
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_fused_kernels_match_the_oracles_over_the_grid(case):
    _check(case)


@pytest.mark.slow
def test_default_tiles_match_the_oracles():
    """One tile of positions and of channels, one split (Config.get_default at a small shape)."""
    _check((4, 20, 37, 1, True, "silu", F32, F32, True, True), config=None, batch=1)


# --------------------------------------------------------------------------- exactness and determinism


@pytest.mark.slow  # interpreted; the xla suite's NaN isolation is the fast tier's
def test_nan_in_one_document_reaches_no_other_and_gradients_stay_inside():
    batch, length, dim, width = 2, 30, 16, 4
    x, w, b, state, _ = _case(7, batch, length, dim, width, 1, F32, F32)
    ids = _ids(8, batch, length)
    ids[0] = np.where(ids[0] >= 0, ids[0] + 100, ids[0])  # row 0's documents are not row 1's
    check_nan_isolation(lambda x, s: _fused(x, w, b, segment_ids=ids, initial_state=s, activation="silu"), x, state,
                        ids)


@pytest.mark.parametrize("dtype", [F32, pytest.param(BF16, marks=pytest.mark.slow)], ids=str)
def test_packed_documents_equal_documents_run_alone_bit_for_bit(dtype):
    """The packed-vs-unpacked check."""
    check_packed_equals_alone(lambda x, w, b, ids: _fused(x, w, b, segment_ids=ids, activation="silu"), dtype)


@pytest.mark.slow
def test_two_runs_are_bit_identical():
    x, w, b, state, dy = _case(9, 2, 45, 20, 4, 1, BF16, F32)
    ids = _ids(10, 2, 45)
    def run():
        loss = lambda x, w, b, s: causal_conv1d(  # noqa: E731
            x, w, b, segment_ids=ids, initial_state=s, activation="silu", implementation="pallas_triton",
            interpret=INTERPRET, config=SMALL)
        y, vjp = jax.vjp(loss, x, w, b, state)
        return [np.asarray(a) for a in (y, *vjp(dy))]

    for first, second in zip(run(), run()):
        np.testing.assert_array_equal(first, second)


# --------------------------------------------------------------------------- final state, wiring, errors


@pytest.mark.parametrize("stateful", [False, True], ids=["zeros", "state"])
@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "seg"])
@pytest.mark.parametrize("length", [1, 2, 9])
def test_final_state_by_gathers_matches_the_reference(length, segmented, stateful):
    x, w, _, state, _ = _case(11, 3, length, 5, 4, 2, F32, F32)
    ids = _ids(12, 3, length) if segmented else None
    if segmented:
        ids[2] = -1  # an all-padding row
    got = final_state(x, state if stateful else None, None if ids is None else jnp.asarray(ids), 6)
    _, expected = causal_conv1d_reference(x, w, segment_ids=ids, initial_state=state if stateful else None,
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
    package as at run time (its TTIR passes first: :func:`conftest.with_ttir_passes`),
    then assembled by its ptxas with ``-v``: every kernel reads x and dy in 16-byte
    vectors (channels contiguous) and spills no register.
    """
    triton = pytest.importorskip("triton", reason="compiling the kernels' Triton IR needs triton")
    from jax._src.pallas.triton import lowering  # the one place jax exposes the Triton module it lowers to
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    if not hasattr(triton.knobs.runtime, "add_stages_inspection_hook"):
        pytest.skip(f"triton {triton.__version__} has no stages hook to run the TTIR passes as at run time")
    modules = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    monkeypatch.setattr(triton.knobs.runtime, "add_stages_inspection_hook", with_ttir_passes)
    batch, length, dim = 4, 2048, 1536
    x = jax.ShapeDtypeStruct((batch, length, dim), dtype)
    state = jax.ShapeDtypeStruct((batch, 3, dim), dtype)
    w, b = jax.ShapeDtypeStruct((4, dim), jnp.float32), jax.ShapeDtypeStruct((dim,), jnp.float32)
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    loss = lambda x, w, b, state, ids: causal_conv1d(  # noqa: E731
        x, w, b, segment_ids=ids, initial_state=state, activation="silu", implementation="pallas_triton",
    ).astype(jnp.float32).sum()
    with cuda_lowering():
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).trace(x, w, b, state, ids).lower(
            lowering_platforms=("cuda",))
    blocks = Config.get_default(length, dim)
    warps = {name: blocks.tile(backward=name != KERNELS[0])[2] for name in KERNELS}
    assert len(modules) == len(KERNELS), len(modules)
    for module in modules:
        name = next(n for n in sorted(KERNELS, key=len, reverse=True) if n in module)
        path = tmp_path / f"{name}.ttir"
        path.write_text(module)
        options = dict(num_warps=warps[name], num_stages=1, enable_fp_fusion=True)
        ptx = triton.compile(str(path), target=GPUTarget("cuda", COMPUTE_CAPABILITY, 32), options=options).asm["ptx"]
        assert "ld.global.v4.b32" in ptx, f"{name}: no 16-byte vector loads"
        (tmp_path / f"{name}.ptx").write_text(ptx)
        ptxas = get_ptxas(COMPUTE_CAPABILITY).path
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


@pytest.mark.slow
def test_derivatives_of_every_order_match_the_xla_implementation():
    """Forward mode, reverse over reverse, a Hessian and a transposed JVP through the fused
    kernels, against the xla implementation's (same math; the fused backward runs the
    first reverse derivative, the xla maps the ones above it)."""
    x, w, b, state, _ = _case(21, 2, 11, 16, 3, 2, F32, F32)
    ids = jnp.asarray(_ids(26, 2, 11))
    kw = dict(segment_ids=ids, activation="silu", dilation=2)
    check_derivatives_of_every_order(lambda x, w, b, s: _fused(x, w, b, initial_state=s, **kw),
                                     lambda x, w, b, s: causal_conv1d(x, w, b, initial_state=s, implementation="xla", **kw),
                                     x, w, b, state)


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


def test_vmap_over_examples_folds_into_the_batch():
    x, w, b, _, _ = _case(13, 2, 9, 16, 3, 1, F32, F32)
    f = lambda x: causal_conv1d(x, w, b, activation="silu", implementation="pallas_triton",  # noqa: E731
                                interpret=INTERPRET, config=SMALL)
    stacked = jnp.stack([x, 2 * x])
    np.testing.assert_array_equal(jax.vmap(f)(stacked), jnp.stack([f(x), f(2 * x)]))


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
