"""The Mosaic GPU kernels of ``causal_conv1d(implementation="pallas_mosaic_gpu")``.

In Mosaic GPU's interpreter on CPU (compiled on a GPU): the shared cases of
test_causal_conv1d.py (its ``GRID``: widths, dilations, dtypes, bias, SiLU, segment ids,
states), the forward and final state against the float64 reference, the gradients (x,
weight, bias, initial state) against the ``xla`` implementation differentiated in
float64; exactness across documents (NaN isolation, exactly zero gradients, packed equals
alone bit for bit); derivatives above the first through the op's primitives. Without a
GPU: the cuda lowering (three named Mosaic GPU kernels, no convolution) and, where the
CUDA plugin is installed (.ci/run's sm_90a stage), a compile to sm_90a without spills.

jax 0.10 has no ``plgpu.kernel`` interpreter: every test but the import check skips
there. Every test's id holds "mosaic" (the module's name), which .ci/run selects on.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_causal_conv1d as shared  # the shared cases: this directory is on sys.path
from support.implementations import ON_GPU
from support.lowering import cuda_lowering
from support.numerics import assert_close, random
from support.short_conv_kernels import (
    check_against_oracles, check_derivatives_of_every_order, check_nan_isolation, check_packed_equals_alone,
)
from support.tiers import tiered

from maskconv_kernels.ops.causal_conv1d import backends, causal_conv1d
from maskconv_kernels.ops.causal_conv1d.checks import make_problem
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_gpu import DTYPES, KERNELS, Config

NAME = "pallas_mosaic_gpu"
RECORD = backends.REGISTRY.get(NAME)
BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)
INTERPRET = not ON_GPU
_WHY = RECORD.unsupported(make_problem(np.zeros((1, 4, 8), np.float32), np.zeros((3, 8), np.float32))[0], None, True)
needs_mosaic = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))
# Several position tiles (the state's included) and channel blocks at test sizes.
SMALL = Config(block_channels=16, backward_block_channels=16)
REPO = pathlib.Path(__file__).resolve().parents[2]


def conv(implementation=NAME, config=SMALL, **kw):
    """``causal_conv1d`` by ``implementation``: this backend interpreted off a GPU, xla as it is."""
    if implementation == NAME:
        kw = dict(kw, interpret=INTERPRET, config=config)
    return lambda x, w, b=None, **more: causal_conv1d(x, w, b, implementation=implementation, **kw, **more)


def _check(case, config=SMALL, seed=0, batch=2):
    """Forward, final state and every gradient of one case against the oracles."""
    width, dim, length, dilation, bias, activation, x_dtype, w_dtype, segmented, stateful = case
    x, w, b, state = shared._inputs(seed, batch, length, dim, width, x_dtype, w_dtype, dilation)
    dy = random(seed + 4, x.shape, x_dtype)
    ids = shared._ids(seed + 5, batch, length) if segmented else None
    check_against_oracles(lambda x, w, b, **kw: conv(config=config)(x, w, b, **kw), x, w, b if bias else None,
                          state if stateful else None, dy, ids, activation=activation, dilation=dilation)


# The shared grid; the README's command runs Mamba's case (16-bit activations, float32
# weights, segments and a state) and a dilated float16 one, the slow tier the rest.
FAST = [shared.GRID[-2], shared.GRID[-1]]


@needs_mosaic
@pytest.mark.parametrize("case", tiered(shared.GRID, lambda c: c in FAST), ids=shared._grid_id)
def test_mosaic_matches_the_shared_grid(case):
    _check(case)


@needs_mosaic
@pytest.mark.slow
def test_mosaic_default_tiles_and_wide_tiles_match_the_oracles():
    """Config.get_default (channels fitted to D), and 128-position tiles (the state in one)."""
    case = (4, 20, 37, 3, True, "silu", F32, F32, True, True)
    _check(case, config=None, batch=1)
    _check(case, config=Config(block_positions=128, block_channels=16, backward_block_positions=128,
                               backward_block_channels=16), batch=1)


# --------------------------------------------------------------------------- exactness


@needs_mosaic
def test_mosaic_nan_in_one_document_reaches_no_other_and_gradients_stay_inside():
    batch, length, dim, width = 2, 30, 16, 4
    x, w, b, state = shared._inputs(7, batch, length, dim, width, F32, F32)
    ids = shared._ids(8, batch, length)
    ids[0] = np.where(ids[0] >= 0, ids[0] + 100, ids[0])  # row 0's documents are not row 1's
    check_nan_isolation(lambda x, s: conv(segment_ids=ids, activation="silu")(x, w, b, initial_state=s), x, state, ids)


@needs_mosaic
@pytest.mark.parametrize("dtype", [F32, pytest.param(BF16, marks=pytest.mark.slow)], ids=str)
def test_mosaic_packed_documents_equal_documents_run_alone_bit_for_bit(dtype):
    check_packed_equals_alone(lambda x, w, b, ids: conv(segment_ids=ids, activation="silu")(x, w, b), dtype)


# --------------------------------------------------------------------------- derivatives through the op's primitives


@needs_mosaic
@pytest.mark.slow
def test_mosaic_derivatives_of_every_order_match_the_xla_implementation():
    """Forward mode, reverse over reverse, a Hessian and a transposed JVP through the
    kernels, against the xla implementation's: the backend supplies a forward and a
    backward, the op's primitives every derivative above the first."""
    x, w, b, state = shared._inputs(21, 2, 11, 16, 3, F32, F32, dilation=2)
    ids = jnp.asarray(shared._ids(26, 2, 11))
    kw = dict(segment_ids=ids, activation="silu", dilation=2)
    mosaic = lambda x, w, b, s: conv(**kw)(x, w, b, initial_state=s)  # noqa: E731
    xla = lambda x, w, b, s: conv("xla", **kw)(x, w, b, initial_state=s)  # noqa: E731
    check_derivatives_of_every_order(mosaic, xla, x, w, b, state)


@needs_mosaic
def test_mosaic_second_derivative_in_the_weight_runs():
    """A gradient of a gradient through the op's primitives (the fast tier's one): the
    backend's backward kernel gives the first, the op's reference the second."""
    x, w, b, _ = shared._inputs(3, 1, 9, 8, 3, F32, F32)
    inner = lambda f: lambda w: jnp.sum(jax.grad(lambda x: jnp.sum(f(x, w, b) ** 2))(x) ** 2)  # noqa: E731
    got = jax.grad(inner(conv(activation="silu")))(w)
    want = jax.grad(inner(conv("xla", activation="silu")))(w)
    assert_close(got, want, F32, 9 * 3 * 2, float(np.abs(np.asarray(want)).max()) + 1)


@needs_mosaic
@pytest.mark.slow
def test_mosaic_vmap_over_examples_folds_into_the_batch():
    x, w, b, _ = shared._inputs(13, 2, 9, 16, 3, F32, F32)
    f = lambda x: conv(activation="silu")(x, w, b)  # noqa: E731
    np.testing.assert_array_equal(jax.vmap(f)(jnp.stack([x, 2 * x])), jnp.stack([f(x), f(2 * x)]))


@needs_mosaic
def test_mosaic_empty_sequences_give_empty_outputs_and_zero_gradients():
    x, w = jnp.ones((2, 0, 8), jnp.float32), jnp.ones((4, 8), jnp.float32)
    state = jnp.ones((2, 3, 8), jnp.float32)
    y = conv()(x, w, initial_state=state)
    assert y.shape == (2, 0, 8)
    gw, gs = jax.grad(lambda w, s: conv()(x, w, initial_state=s).sum(), (0, 1))(w, state)
    assert not np.asarray(gw).any() and not np.asarray(gs).any()


# --------------------------------------------------------------------------- lowering and compiling for sm_90a


def _loss(x, w, b, state, ids):
    y = causal_conv1d(x, w, b, segment_ids=ids, initial_state=state, activation="silu", implementation=NAME)
    return y.astype(jnp.float32).sum()


def _mamba(dtype, batch=4, length=2048, dim=1536, width=4):
    """Mamba's shape: x, weight, bias, state and segment ids as shapes."""
    shapes = [((batch, length, dim), dtype), ((width, dim), jnp.float32), ((dim,), jnp.float32),
              ((batch, width - 1, dim), dtype), ((batch, length), jnp.int32)]
    return [jax.ShapeDtypeStruct(shape, d) for shape, d in shapes]


@needs_mosaic
def test_mosaic_value_and_grad_lowers_for_cuda_to_the_three_named_kernels_and_no_convolution():
    f = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2, 3)))
    with cuda_lowering():
        text = f.trace(*_mamba(jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(", text)
    assert len(calls) == 3, f"expected the forward, pre-activation-cotangent and backward kernels, found {len(calls)}"
    for kernel in KERNELS:
        assert kernel in text
    assert "stablehlo.convolution" not in text


def _h200_target_config() -> str:
    """benchmarks/mgpu_cubin.py's H200 target config, read without running that script
    (it sets Mosaic GPU's dump folder for the whole process)."""
    tree = ast.parse((REPO / "benchmarks" / "mgpu_cubin.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "H200_TARGET_CONFIG" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("benchmarks/mgpu_cubin.py has no H200_TARGET_CONFIG")


@needs_mosaic
@pytest.mark.parametrize("dtype", [BF16, F32, F16], ids=str)
def test_mosaic_kernels_compile_for_sm90a_without_a_gpu_or_spills(dtype, monkeypatch, tmp_path):
    """XLA's deviceless compile for an H200 (the CUDA plugin's compile-only topology, as
    benchmarks/mgpu_cubin.py): Mosaic GPU's passes, LLVM and ptxas for sm_90a on the
    three kernels of Mamba's value and gradient; none spills a register. Needs
    jax-cuda13-plugin and nvidia-cuda-nvcc (.ci/run's sm_90a stage installs them), and
    JAX_PLATFORMS=cpu with the plugin on a host without a GPU."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    try:
        topology = topologies.get_topology_desc("h200", platform="cuda", topology="1x1x1",
                                                target_config=_h200_target_config())
    except Exception as e:  # no CUDA plugin here
        pytest.skip(f"compiling for sm_90a without a GPU needs the CUDA plugin (jax-cuda13-plugin): {e}")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))  # each kernel's PTX and ptxas log
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in _mamba(dtype)]
    f = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2, 3)))
    with jax.set_mesh(mesh):
        lowered = f.lower(*args)
    lowered.compile()  # Mosaic GPU's compile stage and ptxas; nothing runs
    logs = {re.sub(r"_\d+\.ptxas$", "", path.name): path.read_text() for path in tmp_path.glob("*.ptxas")}
    assert sorted(logs) == sorted(KERNELS), sorted(logs)
    for kernel, log in logs.items():
        assert "for 'sm_90a'" in log, f"{kernel}: {log}"
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        assert spills and not any(spills), f"{kernel}: register spills ({log})"


# --------------------------------------------------------------------------- dispatch, refusals, config


def test_mosaic_choosing_a_backend_imports_no_mosaic_gpu_module():
    """Asked whether it runs (here, and on jax 0.10, where it refuses), the backend imports
    neither its kernels nor jax's Mosaic GPU (jax 0.10's needs absl-py)."""
    code = (
        "import sys, numpy as np, maskconv_kernels as mk\n"
        "from maskconv_kernels.ops.causal_conv1d import backends, checks\n"
        "x, w = np.ones((1, 5, 8), np.float32), np.ones((4, 8), np.float32)\n"
        "mk.causal_conv1d(x, w)\n"
        "problem = checks.make_problem(x, w)[0]\n"
        "print('why:', backends.REGISTRY.get('pallas_mosaic_gpu').unsupported(problem, 'cuda'))\n"
        "prefixes = ('jax.experimental.mosaic', 'maskconv_kernels.ops.causal_conv1d.pallas_mosaic_gpu.kernels')\n"
        "print(sorted(m for m in sys.modules if m.startswith(prefixes)))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@needs_mosaic
def test_mosaic_is_never_the_default_and_needs_interpret_off_a_gpu():
    """PREFERENCE stays ("xla",): a Mosaic GPU default needs a GPU measurement. Named, the
    backend lowers for cuda, and elsewhere only interpreted."""
    assert NAME in backends.IMPLEMENTATIONS and NAME not in backends.PREFERENCE
    problem = make_problem(np.ones((1, 5, 16), np.float32), np.ones((4, 16), np.float32))[0]
    assert backends.REGISTRY.choose(problem, "cuda").name == "xla"
    assert RECORD.unsupported(problem, "cuda") is None
    assert "interpret=True" in RECORD.unsupported(problem, "cpu")
    f = jax.jit(lambda x: causal_conv1d(x, jnp.ones((4, 16)), implementation=NAME))
    with pytest.raises(NotImplementedError, match=r'causal_conv1d\(implementation="pallas_mosaic_gpu"\) cannot be '
                                                  r'lowered for platform "cpu".*interpret=True'):
        f.trace(jnp.ones((1, 5, 16))).lower(lowering_platforms=("cpu",))


@needs_mosaic
def test_mosaic_refuses_float64_by_name():
    with jax.enable_x64(True):
        x, w = jnp.ones((1, 5, 8), jnp.float64), jnp.ones((4, 8), jnp.float64)
        with pytest.raises(NotImplementedError, match=r"x in float64: its kernels take float32, bfloat16 and float16"):
            causal_conv1d(x, w, implementation=NAME, interpret=True)
    assert np.dtype(np.float64) not in DTYPES


@pytest.mark.parametrize(
    "field,value",
    [("block_positions", 32), ("backward_block_positions", 256), ("block_channels", 4), ("block_channels", 256),
     ("backward_block_channels", 24), ("block_positions", True), ("block_channels", 8.0)],
)
def test_mosaic_config_is_validated(field, value):
    with pytest.raises(ValueError, match=f"Config.{field}"):
        Config(**{field: value})


def test_mosaic_config_tiles_fit_registers_and_default_to_the_channels():
    with pytest.raises(ValueError, match="registers"):
        Config(block_positions=128, block_channels=64)
    assert Config.get_default(length=1, dim=5) == Config(block_channels=8, backward_block_channels=8)
    assert Config.get_default(length=8192, dim=1536) == Config()
    assert Config().tile(backward=True) == (64, 64)
    assert hash(Config()) == hash(Config())


@needs_mosaic
def test_mosaic_takes_only_its_own_config():
    with pytest.raises(TypeError, match=r"pallas_mosaic_gpu\.config\.Config"):
        causal_conv1d(jnp.ones((1, 4, 8)), jnp.ones((2, 8)), implementation=NAME, interpret=True,
                      config=dict(block_positions=64))
