"""Context parallelism against the all-gather baseline: bytes each device receives per layer call, and time.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.context_parallel [--quick] [--out PREFIX]

For each layer, on a mesh of all devices along the sequence (or time) axis, two ways to run
it on a split sequence:

* ours: ``sequence_sharded_causal_conv1d`` (contiguous and zigzag) and
  ``time_sharded_causal_conv``: each device receives the ``(W - 1) * dilation`` inputs
  before each of its chunks by ``ppermute``;
* the baseline: ``jax.lax.all_gather`` of the whole sequence onto every device, the op on
  it, and each device keeping its own positions' outputs.

The bytes are read from each compiled program (every collective's result shape: a
collective-permute receives its operand, an all-gather its output less the device's own
part), so they are the program's, not a formula's. Times are medians of interleaved
samples (``bench.timing``) in one process; on forced CPU devices they say what the
exchange costs against recomputation on a shared host, not what a GPU interconnect does.
Writes ``PREFIX.jsonl`` (rows with the run's metadata) and ``PREFIX.md``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import maskconv_kernels as mk
from maskconv_kernels import parallel
from maskconv_kernels.bench.machine import metadata
from maskconv_kernels.bench.timing import median_times

AXIS = "seq"
# name: (op, x shape, weight shape, layer keywords); the sequence (time) axis is 1.
LAYERS = {
    "mamba2_B2_L8192_D1024_W4": ("causal_conv1d", (2, 8192, 1024), (4, 1024), {}),
    "video_vae_T32_32x32_C32_k3": ("causal_conv", (1, 32, 32, 32, 32), (3, 3, 3, 32, 32), {"padding": "SAME"}),
}
QUICK = {
    "mamba2_B2_L512_D64_W4": ("causal_conv1d", (2, 512, 64), (4, 64), {}),
    "video_vae_T32_8x8_C8_k3": ("causal_conv", (1, 32, 8, 8, 8), (3, 3, 3, 8, 8), {"padding": "SAME"}),
}
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def received_bytes(hlo: str, devices: int) -> dict[str, int]:
    """Bytes one device receives per call, by collective, from a compiled program's text."""
    out = {"collective-permute": 0, "all-gather": 0}
    for kind in out:
        for dtype, dims in re.findall(rf"= (\w+)\[([\d,]*)\]\{{[^}}]*\}} {kind}\(", hlo):
            size = _BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            out[kind] += size if kind == "collective-permute" else size * (devices - 1) // devices
    return out


def ours(op: str, kernel, mesh, layout: str, kw: dict):
    if op == "causal_conv1d":
        return lambda x: parallel.sequence_sharded_causal_conv1d(x, kernel, mesh=mesh, axis_name=AXIS, layout=layout,
                                                                 **kw)
    return lambda x: parallel.time_sharded_causal_conv(x, kernel, mesh=mesh, axis_name=AXIS, layout=layout, **kw)


def all_gather_baseline(op: str, kernel, mesh, kw: dict):
    """Every device gathers the whole sequence, runs the op on it and keeps its own outputs."""
    run = (lambda x: mk.causal_conv1d(x, kernel, **kw)) if op == "causal_conv1d" else (
        lambda x: mk.causal_conv(x, kernel, **kw))

    def local(x):
        whole = lax.all_gather(x, AXIS, axis=1, tiled=True)
        size = x.shape[1]
        return lax.dynamic_slice_in_dim(run(whole), lax.axis_index(AXIS) * size, size, axis=1)

    return lambda x: jax.shard_map(local, mesh=mesh, in_specs=P(None, AXIS), out_specs=P(None, AXIS))(x)


def measure(name: str, op: str, x_shape, w_shape, kw: dict, samples: int, meta: dict) -> list[dict]:
    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), (AXIS,))
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), x_shape), NamedSharding(mesh, P(None, AXIS)))
    kernel = 0.1 * jax.random.normal(jax.random.PRNGKey(1), w_shape)
    fns = {"all_gather": all_gather_baseline(op, kernel, mesh, kw)}
    for layout in ("contiguous", "zigzag"):
        fns[layout] = ours(op, kernel, mesh, layout, kw)
    compiled = {k: jax.jit(f).lower(x).compile() for k, f in fns.items()}
    # One call per sample, blocked: XLA:CPU's collectives deadlock (a rendezvous that 6 of 8
    # device threads reach) when several programs' calls are in flight at once on 2 cores.
    times = median_times(compiled, [(x,)], samples=samples, min_sample_s=0.0)
    rows = []
    for k, c in compiled.items():
        got = received_bytes(c.as_text(), devices)
        rows.append({**meta, "layer": name, "op": op, "x_shape": list(x_shape), "devices": devices, "how": k,
                     "received_bytes": sum(got.values()), "by_collective": got, "median_s": times[k]})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| layer | how | bytes received per device | median time | vs all-gather |", "|---|---|---:|---:|---:|"]
    for r in rows:
        base = next(b for b in rows if b["layer"] == r["layer"] and b["how"] == "all_gather")
        lines.append(f"| {r['layer']} | {r['how']} | {r['received_bytes']:,} | {1e3 * r['median_s']:.2f} ms | "
                     f"{base['median_s'] / r['median_s']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny layers (the tests' smoke run)")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--out", default="context_parallel", help="PREFIX of PREFIX.jsonl and PREFIX.md")
    args = parser.parse_args(argv)
    if jax.device_count() < 2:
        print("needs several devices: XLA_FLAGS=--xla_force_host_platform_device_count=8", file=sys.stderr)
        return 2
    meta = metadata("quick" if args.quick else "cpu", " ".join(["python -m benchmarks.context_parallel", *(argv or [])]))
    rows = []
    with open(f"{args.out}.jsonl", "w") as f:
        for name, (op, x_shape, w_shape, kw) in (QUICK if args.quick else LAYERS).items():
            for row in measure(name, op, x_shape, w_shape, kw, args.samples, meta):
                rows.append(row)
                f.write(json.dumps(row) + "\n")
    table = markdown(rows)
    with open(f"{args.out}.md", "w") as f:
        f.write(f"# Context parallelism against the all-gather baseline\n\n{meta['device']}, "
                f"{rows[0]['devices']} devices, jax {jax.__version__}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
