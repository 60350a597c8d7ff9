"""Compile the Mosaic GPU kernels of masked_conv's value_and_grad to sm_90a cubins on a
CPU-only host, and print ptxas's register / shared-memory / spill figures per kernel.

No GPU or CUDA driver is needed. XLA's deviceless ahead-of-time path does the work: the
CUDA PJRT plugin makes a compile-only H200 "topology" from a GpuTargetConfigProto
(``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``),
``jit(...).lower(...).compile()`` for that device runs the Mosaic GPU custom call's
compile stage (its full MLIR pass pipeline, LLVM NVPTX, then ``ptxas -arch=sm_90a``)
with the compute capability taken from the target config and not from a device, and
``MOSAIC_GPU_DUMP_TO`` makes it write each kernel's PTX and ptxas log. This script then
assembles each PTX again with the same ptxas to keep a ``.cubin``. Nothing is run.

Install, in a fresh venv (never in the project's test venvs), the jax version under test:

    pip install "jax==0.12.0.1" "jaxlib==0.12.0.1" "jax-cuda13-plugin==0.12.0.1" \\
        nvidia-cuda-nvcc absl-py            # (or all three at 0.11.2)
    pip install nvidia-cuda-nvdisasm         # optional: --keep then has a .sass_ctrl listing per kernel
                                             # (without it, "nvdisasm invocation failed" lines are harmless)
    pip install -e .                         # or run from the repository root

``nvidia-cuda-nvcc`` provides ptxas (needed: Mosaic asks ptxas for its PTX ISA version
while lowering, and assembles with it). The plugin is installed without its CUDA
runtime extras (no cuDNN, cuBLAS, ...): ``JAX_PLATFORMS=cpu`` (set below) skips its
start-up version check. Checked on a 2-core CPU VM with jax 0.12.0.1 and 0.11.2.

    python benchmarks/mgpu_cubin.py                       # (2,32,32,64) x (7,7,64,64), 7x7 mask "A"
    python benchmarks/mgpu_cubin.py --x 8,64,64,128 --cout 128 --window 5,5 --mask-type B \\
        --keep /tmp/mgpu_cubins                           # keep .ptx/.cubin/.ptxas(/.sass_ctrl)
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Must precede the jax import: the plugin's version check needs CUDA libraries that a
# CPU-only venv lacks; the cuda topology is still available with JAX_PLATFORMS=cpu.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_DUMP = tempfile.mkdtemp(prefix="mgpu_cubin_")
os.environ["MOSAIC_GPU_DUMP_TO"] = _DUMP  # PTX + ptxas log (+ pass logs, deleted below)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import maskconv_kernels as mk  # noqa: E402

# The fields XLA and Mosaic GPU read, from XLA's h200 target spec
# (xla/backends/gpu/target_config/specs/h200.txtpb), trimmed to fields old protos know.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 151397597184
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200"
"""


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(p) for p in s.split(","))


def _ptxas() -> str:
    """The ptxas that jax's Mosaic GPU uses: the pip CUDA toolkit's, else one on PATH."""
    try:
        from jax._src import lib as _lib
        roots = [_lib.cuda_path] if _lib.cuda_path else []
    except Exception:
        roots = []
    import site
    for sp in site.getsitepackages():
        roots += sorted(glob.glob(os.path.join(sp, "nvidia", "cu1*"))) + [os.path.join(sp, "nvidia", "cuda_nvcc")]
    for root in roots:
        path = os.path.join(root, "bin", "ptxas")
        if os.access(path, os.X_OK):
            return path
    path = shutil.which("ptxas")
    if path is None:
        sys.exit("ptxas not found: pip install nvidia-cuda-nvcc")
    return path


def _custom_call_modules(lowered) -> dict[str, dict]:
    """Per Mosaic GPU module name: the launch's dynamic shared memory and block size,
    read from the module serialized into each ``mosaic_gpu*`` custom call."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib.mlir import ir

    out: dict[str, dict] = {}
    module = lowered.compiler_ir("stablehlo")
    calls = []

    def walk(op, pred, acc):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if pred(o.operation):
                        acc.append(o.operation)
                    walk(o.operation, pred, acc)

    def target(op):
        if op.name != "stablehlo.custom_call":
            return False
        return ir.StringAttr(op.attributes["call_target_name"]).value.startswith("mosaic_gpu")

    walk(module.operation, target, calls)
    for call in calls:
        try:
            cfg = ir.DictAttr(call.attributes["mhlo.backend_config"])
            blob = ir.StringAttr(cfg["module"]).value_bytes
        except Exception:  # another jax's custom call layout: shared memory from ptxas only
            continue
        ctx = jmlir.make_ir_context()
        ctx.allow_unregistered_dialects = True
        with ctx:
            m = ir.Module.parse(blob)
            name = ir.StringAttr(m.operation.attributes["sym_name"]).value
            launches = []
            walk(m.operation, lambda op: op.name.endswith("gpu.launch"), launches)
            info = {}
            for launch in launches[:1]:
                consts = []
                for v in launch.operands:
                    owner = v.owner
                    attrs = getattr(owner, "attributes", None)
                    val = None
                    if attrs is not None and "value" in attrs:
                        try:
                            val = ir.IntegerAttr(attrs["value"]).value
                        except Exception:  # not an integer constant
                            val = None
                    consts.append((str(v.type), val))
                # gpu.launch operands: grid x,y,z and block x,y,z (index), optional cluster
                # (index), dynamic shared memory (the one i32).
                idx = [c for t, c in consts if t == "index"]
                i32 = [c for t, c in consts if t == "i32"]
                if len(idx) >= 6:
                    info["grid"] = tuple(idx[:3])
                    info["block"] = tuple(idx[3:6])
                if i32:
                    info["dynamic_smem"] = i32[0]
            out[name] = info
    return out


_PAT = {
    "registers": r"Used (\d+) registers",
    "barriers": r"used (\d+) barriers",
    "static_smem": r"(\d+) bytes smem",
    "stack": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
}


def _parse_ptxas(log: str) -> dict:
    stats = {}
    for key, pat in _PAT.items():
        m = re.search(pat, log)
        stats[key] = int(m.group(1)) if m else None
    stats["notes"] = sorted(set(re.findall(r"\((C\d+)\)", log)))
    stats["warnings"] = [ln.strip() for ln in log.splitlines() if "warning" in ln.lower()]
    return stats


def main(argv=None) -> int:
    try:
        return _main(argv)
    finally:
        shutil.rmtree(_DUMP, ignore_errors=True)  # the MLIR pass logs are megabytes each


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--x", type=_ints, default=(2, 32, 32, 64), help="input shape N,H,W,C (default 2,32,32,64)")
    ap.add_argument("--cout", type=int, default=64, help="output channels (default 64)")
    ap.add_argument("--window", type=_ints, default=(7, 7), help="kernel window (default 7,7)")
    ap.add_argument("--mask-type", default="A", help='pixelcnn_mask type, "A" or "B" (default A)')
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--keep", metavar="DIR", help="copy each kernel's .ptx, .ptxas, .cubin (and .sass_ctrl) here")
    ap.add_argument("--ptxas", help="ptxas to assemble with (default: the nvidia-cuda-nvcc wheel's, else PATH's)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    topo = topologies.get_topology_desc(
        "h200", platform="cuda", topology="1x1x1", target_config=H200_TARGET_CONFIG)
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    rep = NamedSharding(mesh, P())
    mask = mk.masks.pixelcnn_mask(args.window, args.mask_type)

    def loss(x, k):
        y = mk.masked_conv(x, k, mask, implementation="pallas_mosaic_gpu")
        return jnp.sum(y.astype(jnp.float32))

    x = jax.ShapeDtypeStruct(args.x, dtype, sharding=rep)
    k = jax.ShapeDtypeStruct((*args.window, args.x[-1], args.cout), dtype, sharding=rep)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), in_shardings=(rep, rep))
    # set_mesh gives the lowering an abstract mesh whose abstract device is the H200
    # (Pallas reads the SM count from it on jax >= 0.12).
    ctx = jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else contextlib.nullcontext()
    with ctx:
        lowered = f.lower(x, k)
    launches = _custom_call_modules(lowered)
    lowered.compile()  # runs Mosaic GPU's compile stage + ptxas; nothing is executed

    ptxas = args.ptxas or _ptxas()
    ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for ptx_path in sorted(glob.glob(os.path.join(_DUMP, "*.ptx"))):
            base = os.path.basename(ptx_path)[: -len(".ptx")]
            ptx = open(ptx_path).read()
            entry = re.search(r"\.visible \.entry (\w+)\(", ptx)
            kernel = entry.group(1) if entry else base
            module = kernel[: -len("_mosaic_gpu_kernel")] if kernel.endswith("_mosaic_gpu_kernel") else base
            log_path = os.path.join(_DUMP, base + ".ptxas")
            mosaic_log = open(log_path).read() if os.path.exists(log_path) else ""
            cubin = os.path.join(work, module + ".cubin")
            run = subprocess.run(
                [ptxas, "-arch=sm_90a", "--warn-on-spills", "-v", ptx_path, "-o", cubin],
                capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{module}: ptxas failed:\n{run.stderr}", file=sys.stderr)
                continue
            # Figures from this ptxas run (the version printed, the .cubin kept). Mosaic's own
            # log (kept as .ptxas) may come from another ptxas: it prefers one on PATH.
            stats = _parse_ptxas(run.stdout + run.stderr)
            mosaic_regs = _parse_ptxas(mosaic_log)["registers"] if mosaic_log else None
            if mosaic_regs is not None and mosaic_regs != stats["registers"]:
                stats["warnings"].append(f"Mosaic's own ptxas run reported {mosaic_regs} registers")
            launch = launches.get(module, {})
            row = {"kernel": module, **stats, "dynamic_smem": launch.get("dynamic_smem"),
                   "block": launch.get("block"), "grid": launch.get("grid"),
                   "cubin_bytes": os.path.getsize(cubin)}
            rows.append(row)
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
                for ext in (".ptx", ".ptxas", ".sass", ".sass_ctrl"):
                    src = os.path.join(_DUMP, base + ext)
                    if os.path.exists(src):
                        shutil.copy(src, os.path.join(args.keep, module + ext))
                shutil.copy(cubin, os.path.join(args.keep, module + ".cubin"))

    print(f"\njax {jax.__version__}, sm_90a (compile-only {topo.devices[0].device_kind}), {ptxas_version}")
    print(f"masked_conv value_and_grad: x {args.x} {dtype.name}, kernel {(*args.window, args.x[-1], args.cout)}, "
          f"pixelcnn_mask {args.window} {args.mask_type!r}")
    head = f"{'kernel':<28} {'regs':>5} {'smem dyn':>9} {'smem static':>11} {'spill st/ld':>12} {'stack':>6} {'block':>13} {'grid':>15}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['kernel']:<28} {r['registers']!s:>5} {r['dynamic_smem']!s:>9} {r['static_smem']!s:>11} "
              f"{str(r['spill_stores']) + '/' + str(r['spill_loads']):>12} {r['stack']!s:>6} "
              f"{str(r['block']):>13} {str(r['grid']):>15}")
        for w in r["warnings"]:
            print(f"    {w}")
        if r["notes"]:
            print(f"    ptxas notes: {', '.join(r['notes'])}")
    if args.keep:
        print(f"\nfiles in {args.keep}")
    if args.json:
        print(json.dumps(rows, indent=1))
    # A check CI can fail on: the forward, input-gradient and weight-gradient kernels, none spilling.
    if len(rows) < 3:
        print(f"expected three Mosaic GPU kernels, compiled {len(rows)}", file=sys.stderr)
        return 1
    spilled = [r["kernel"] for r in rows if r["spill_stores"] or r["spill_loads"]]
    if spilled:
        print(f"register spills in {spilled}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
