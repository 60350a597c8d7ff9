"""Compile ``causal_conv1d(implementation="pallas_triton")``'s value and gradient for an H200 on a CPU-only host.

XLA's deviceless ahead-of-time path, as ``benchmarks/mgpu_cubin.py`` uses it for the
Mosaic GPU kernels: the CUDA PJRT plugin's compile-only H200 topology, then
``jit(...).lower(...).compile()``, which runs XLA's own Triton pipeline (the one the GPU
runs, not the ``triton`` package's) and ptxas for sm_90a on the three fused kernels.
Nothing is run. Fails unless the optimized module holds exactly the three named Triton
kernels and no convolution.

Install, in a fresh venv (never in the project's test venvs: with the plugin installed
jax needs ``JAX_PLATFORMS=cpu``, which this script sets):

    pip install "jax==0.11.2" "jaxlib==0.11.2" "jax-cuda13-plugin==0.11.2" nvidia-cuda-nvcc absl-py
    python benchmarks/short_conv_sm90.py                  # B=4, L=2048, D=1536, width 4, bfloat16 and float32
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax: the plugin's start-up check needs CUDA libraries
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from mgpu_cubin import H200_TARGET_CONFIG  # noqa: E402

from maskconv_kernels.ops.causal_conv1d import causal_conv1d  # noqa: E402
from maskconv_kernels.ops.causal_conv1d.pallas_triton import KERNELS  # noqa: E402


def compile_for_h200(batch: int, length: int, dim: int, width: int, dtype) -> str:
    """The optimized HLO of the value and gradient (x, weight, bias, state) with SiLU and segment ids."""
    topo = topologies.get_topology_desc("h200", platform="cuda", topology="1x1x1", target_config=H200_TARGET_CONFIG)
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    rep = NamedSharding(mesh, P())

    def loss(x, w, b, state, ids):
        y = causal_conv1d(x, w, b, segment_ids=ids, initial_state=state, activation="silu",
                          implementation="pallas_triton")
        return y.astype(jnp.float32).sum()

    shapes = [((batch, length, dim), dtype), ((width, dim), jnp.float32), ((dim,), jnp.float32),
              ((batch, width - 1, dim), dtype), ((batch, length), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, d, sharding=rep) for shape, d in shapes]
    ctx = jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else contextlib.nullcontext()
    with ctx:
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*args)
    return lowered.compile().as_text()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4,2048,1536", help="B,L,D (default 4,2048,1536)")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    batch, length, dim = (int(n) for n in args.shape.split(","))
    failed = False
    for name in args.dtypes:
        text = compile_for_h200(batch, length, dim, args.width, jnp.dtype(name))
        calls = re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', text)
        named = [k for k in KERNELS if re.search(rf"\b{k}\b", text)]
        ok = len(calls) == len(KERNELS) and len(named) == len(KERNELS) and "convolution(" not in text
        failed |= not ok
        print(f"jax {jax.__version__}, sm_90a (compile-only H200), {name}: {len(calls)} Triton kernels "
              f"({', '.join(named)}), {text.count('convolution(')} convolutions: {'ok' if ok else 'FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
