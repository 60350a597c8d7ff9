"""What is ``causal_conv1d(implementation="pallas_mosaic_gpu")``'s alone: its Mosaic GPU kernels.

The shared suite (test_causal_conv1d.py) runs these kernels, in Mosaic GPU's interpreter on
CPU (compiled on a GPU), against the oracles, through exactness, determinism and the
derivatives above the first. Here: its default and wide tiles against the oracles;
without a GPU the cuda lowering (three named Mosaic GPU kernels, no convolution) and,
where the CUDA plugin is installed (.ci/run's sm_90a stage), a compile to sm_90a
without spills; its dispatch, refusals and config.

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
from support.harness import ON_GPU
from support.lowering import cuda_lowering
from support.short_conv import F32, MISSING, check_against_oracles, ids, inputs

from maskconv_kernels.ops.causal_conv1d import backends, causal_conv1d
from maskconv_kernels.ops.causal_conv1d.checks import make_problem
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_gpu import DTYPES, KERNELS, Config

NAME = "pallas_mosaic_gpu"
RECORD = backends.REGISTRY.get(NAME)
BF16, F16 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
needs_mosaic = pytest.mark.skipif(NAME in MISSING, reason=MISSING.get(NAME, ""))
REPO = pathlib.Path(__file__).resolve().parents[2]


@needs_mosaic
@pytest.mark.slow
@pytest.mark.parametrize("config", [None, Config(block_positions=128, block_channels=16, backward_block_positions=128,
                                                 backward_block_channels=16)], ids=["default", "wide"])
def test_mosaic_default_tiles_and_wide_tiles_match_the_oracles(config):
    """Config.get_default (channels fitted to D), and 128-position tiles (the state in one)."""
    x, w, b, state, dy = inputs(0, 1, 37, 20, 4, F32, F32, dilation=3)
    conv = lambda x, w, b=None, **kw: causal_conv1d(x, w, b, implementation=NAME, interpret=not ON_GPU,  # noqa: E731
                                                    config=config, **kw)
    check_against_oracles(conv, x, w, b, state, dy, ids(5, 1, 37), activation="silu", dilation=3)


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
    """No platform's PREFERENCE holds it (GPUs' stays ("xla",)): a Mosaic GPU default needs
    a GPU measurement. Named, the backend lowers for cuda, and elsewhere only interpreted."""
    assert NAME in backends.IMPLEMENTATIONS
    assert all(NAME not in names for names in backends.PREFERENCE.values())
    assert backends.PREFERENCE["cuda"] == ("xla",)
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
