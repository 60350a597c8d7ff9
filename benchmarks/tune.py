"""Per-kernel timings on the headline shapes: cuDNN's pieces beside each of our kernels.

    python -m benchmarks.tune --out benchmarks/results/gpu-check/tune.json

Where ``python -m maskconv_kernels.bench`` times whole training steps, this splits one step
into its three GEMMs so that a slow step can be traced to its kernel, and sweeps the Pallas
block sizes (``pallas_triton.Config``) per kernel, since the heuristic has only
ever been chosen, not measured. For each shape and dtype it times:

* ``baseline``: cuDNN's forward, input gradient (``vjp`` in ``x`` only) and weight
  gradient (``vjp`` in the kernel only) of ``lax.conv_general_dilated(x, kernel*mask)``;
* ``pallas_triton``: each kernel alone (``masked_conv`` for the forward, its
  ``jax.linear_transpose`` in ``x`` for the input gradient and in the kernel for the
  weight gradient: each runs one kernel), once per candidate tile passed as
  ``config=pallas_triton.Config(...)`` (``CANDIDATES``; the heuristic's pick is marked ``default``);
* ``triton``: each kernel's autotune timings (``triton.ops.timings()``) and the chosen
  config (``triton.ops.tuned()``), re-timed with the same timer as the others through
  ``config=triton.Config(...)``;
* ``pallas_mosaic_gpu``: the three kernels with the default ``Config`` first, then each
  kernel with the tiles of ``MGPU_CANDIDATES`` passed as ``config=Config(...)``, each row
  beside its prediction (``benchmarks.predict_mgpu``, full batch only).

A backend that reports the problem unsupported (``backends.get(name).unsupported``:
float32 for Mosaic GPU, Triton off a GPU) is skipped with its reason printed and written.

Public names only: what a user tuning a config would call.

Candidates are compiled in parallel threads (XLA and Triton compile outside the GIL)
and timed one after the other. Writes one JSON file and prints a table per shape.
GPU only: the kernels are compiled, not interpreted.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import maskconv_kernels as mk
from maskconv_kernels.bench.machine import metadata
from maskconv_kernels.bench.shapes import HEADLINE_SHAPES, BenchShape
from maskconv_kernels.bench.timing import DTYPES, median_times
from maskconv_kernels.ops.masked_conv import backends
from maskconv_kernels.ops.masked_conv.pallas_mosaic_gpu import Config as MosaicConfig
from maskconv_kernels.ops.masked_conv.pallas_triton import Config as PallasConfig
from maskconv_kernels.ops.masked_conv.spec import make_spec

KINDS = ("fwd", "dx", "dw")
KERNEL_NAMES = {"fwd": "forward", "dx": "input_grad", "dw": "weight_grad"}  # pallas_triton.Config.get_default's

# (block_m, block_n, block_k, num_warps, num_stages) of one GEMM: for the forward
# m = output pixels, n = C_out, k = C_in; for the input gradient m = input pixels,
# n = C_in, k = C_out; for the weight gradient m = C_in, n = C_out, k = pixels.
CANDIDATES = {
    2: [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (128, 128, 32, 4, 4),
        (64, 64, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 256, 64, 8, 3)],
    4: [(64, 64, 32, 4, 2), (128, 64, 32, 4, 3), (128, 128, 32, 8, 3), (64, 128, 32, 4, 3),
        (128, 128, 16, 8, 4), (64, 64, 64, 4, 2)],
}


# Mosaic GPU tiles around the default ((128, 128, 64, 3), warp-specialized, at these
# shapes). fwd / dx: (tile_pixels, tile_n, block_k, max_concurrent_steps, warp_specialized);
# tile_pixels * tile_n is at most 128 * 128 (one warpgroup's accumulator), and
# warp-specialized a CTA's tile is 2 * tile_pixels rows (two consumer warpgroups). Stages
# are capped by shared memory (at 128x128x64 warp-specialized, 3 is the most), so the
# candidates avoid counts that would clamp to another's kernel. warp_specialized=False
# runs the same tiles with one warpgroup: the first comparison to read. The weight
# gradient reads neither tile_pixels, block_k nor warp_specialized (its tiles are
# weight_grad_c_in input channels x tile_n, reduced over 64-pixel chunks with 128-channel
# tiles, the grid's 64/128-pixel chunks with 64), so its sweep is (weight_grad_c_in,
# tile_n, max_concurrent_steps, weight_grad_splits): splits is a cap, the kernel takes the
# divisor of its chunk count up to it that wastes least of the last wave, ties to fewer.
MGPU_CANDIDATES = {
    "fwd": [(128, 128, 64, 3, False), (128, 128, 64, 4, False), (64, 256, 64, 4, False),
            (128, 128, 32, 6, True), (64, 128, 64, 4, True), (64, 256, 64, 3, True), (128, 64, 64, 4, True),
            (128, 128, 64, 2, True)],
    "dw": [(64, 128, 3, None), (128, 64, 3, None), (64, 256, 2, None), (128, 128, 2, None), (128, 128, 4, None),
           (128, 128, 3, 1), (128, 128, 3, 4), (128, 128, 3, 16)],
}
MGPU_CANDIDATES["dx"] = MGPU_CANDIDATES["fwd"]


def mgpu_key(kind: str, t: MosaicConfig) -> tuple:
    """The fields of ``t`` that ``kind``'s kernel reads (rows' ``tile``)."""
    if kind == "dw":
        return (t.weight_grad_c_in, t.tile_n, t.max_concurrent_steps, t.weight_grad_splits)
    return (t.tile_pixels, t.tile_n, t.block_k, t.max_concurrent_steps, t.warp_specialized)


def mgpu_tiles(kind: str, cand) -> MosaicConfig:
    """A ``pallas_mosaic_gpu.Config`` for one candidate (raises ``ValueError`` for one it rejects)."""
    if kind == "dw":
        ci, tn, steps, splits = cand
        # tile_pixels is unread by the weight gradient; 64 keeps tile_pixels * tile_n valid.
        return MosaicConfig(tile_pixels=64, tile_n=tn, block_k=64, max_concurrent_steps=steps,
                            weight_grad_splits=splits, weight_grad_c_in=ci)
    tm, tn, bk, steps, ws = cand
    return MosaicConfig(tile_pixels=tm, tile_n=tn, block_k=bk, max_concurrent_steps=steps, warp_specialized=ws)


def predicted_ms(shape: BenchShape, kind: str, tiles: MosaicConfig):
    """``benchmarks.predict_mgpu``'s time for one kernel (with its XLA copies), or None."""
    try:  # imported here: it reads the backend's internals, and must never stop the timings
        from . import predict_mgpu

        return predict_mgpu.predict(shape, (kind,), tiles)[0]["total_s"] * 1e3
    except Exception:  # noqa: BLE001 - a prediction is an aside; the timing is the result
        return None


def skip_reason(name: str, spec, interpret: bool) -> str | None:
    """Why backend ``name`` does not run ``spec`` here; printed, so a skipped backend says why."""
    try:
        reason = backends.get(name).unsupported(spec, backends.lowering_platform(), interpret=interpret)
    except Exception as e:  # noqa: BLE001 - a backend that cannot even be imported here
        reason = f"{type(e).__name__}: {e}"
    if reason is not None:
        print(f"  {name} skipped: {reason}", flush=True)
    return reason


def blocks_for(kind: str, base: PallasConfig, cand) -> PallasConfig:
    m, n, k, warps, stages = cand
    fields = {
        "fwd": dict(block_pixels=m, block_c_out=n, block_c_in=k),
        "dx": dict(block_pixels=m, block_c_in=n, block_c_out=k),
        "dw": dict(block_c_in=m, block_c_out=n, block_pixels_reduce=k),
    }[kind]
    return dataclasses.replace(base, num_warps=warps, num_stages=stages, **fields)


def gemm_of(kind: str, b: PallasConfig):
    return {
        "fwd": (b.block_pixels, b.block_c_out, b.block_c_in),
        "dx": (b.block_pixels, b.block_c_in, b.block_c_out),
        "dw": (b.block_c_in, b.block_c_out, b.block_pixels_reduce),
    }[kind] + (b.num_warps, b.num_stages)


def time_fn(compiled, args, samples: int = 15, min_sample_s: float = 0.003, warmup: int = 2) -> float:
    """Median seconds per call; each sample is ``n`` back-to-back calls and one block (the benchmarks' loop)."""
    return median_times({"f": compiled}, [args], samples, min_sample_s, warmup)["f"]


def _compile_all(fns: dict, args: dict, label: str, workers: int = 8) -> dict:
    """name -> compiled executable or the error's first line, compiled in parallel threads.

    Prints the wall time, so that a run cut short by its time limit still says where
    the time went.
    """

    def one(name):
        try:
            return jax.jit(fns[name]).lower(*args[name]).compile()
        except Exception as e:  # noqa: BLE001 - a config that does not fit is a result, not a crash
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        out = dict(zip(fns, pool.map(one, fns)))
    print(f"  compiled {len(fns)} {label} in {time.perf_counter() - t:.1f} s", flush=True)
    return out


def tune_shape(shape: BenchShape, dtype_name: str, deadline: float, cpu_check: bool = False, flush=None,
               implementations=("pallas_triton", "triton", "pallas_mosaic_gpu")) -> list[dict]:
    """Rows of timings for one shape and dtype; ``cpu_check``: tiny batch, interpreted (tests this script).

    ``flush(rows)`` is called after every kernel's rows, so a run cut short keeps them.
    """
    dtype = DTYPES[dtype_name]
    batch = 1 if cpu_check else shape.batch
    kx, kk, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, shape.x_shape(batch), jnp.float32).astype(dtype)
    k = (jax.random.normal(kk, shape.kernel_shape, jnp.float32) / np.sqrt(shape.active_taps * shape.c_in)).astype(dtype)
    spec = make_spec(x, k, shape.mask, **shape.conv_args)
    dy = jax.random.normal(kd, (batch, *spec.out_spatial, shape.c_out), jnp.float32).astype(dtype)
    flops = spec.flops(batch)  # one GEMM's multiply-adds on active taps, x2
    rows = []

    def row(impl, kind, seconds, **extra):
        r = dict(shape=shape.name, dtype=dtype_name, impl=impl, kind=kind, **extra)
        if isinstance(seconds, float):
            r.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
        else:
            r["error"] = seconds
        rows.append(r)
        if flush is not None:
            flush(rows)

    # cuDNN's three pieces (and a whole step) of the leaky baseline.
    leaky = lambda x, k: mk.leaky_masked_conv(x, k, shape.mask, **shape.conv_args)
    base_fns = {
        "fwd": lambda x, k, dy: leaky(x, k),
        "dx": lambda x, k, dy: jax.vjp(lambda x: leaky(x, k), x)[1](dy),
        "dw": lambda x, k, dy: jax.vjp(lambda k: leaky(x, k), k)[1](dy),
        "step": lambda x, k, dy: (lambda y, pull: (y, pull(dy)))(*jax.vjp(leaky, x, k)),
    }
    compiled = _compile_all(base_fns, {n: (x, k, dy) for n in base_fns}, f"{shape.name} {dtype_name} cuDNN")
    for kind, c in compiled.items():
        row("baseline", kind, c if isinstance(c, str) else time_fn(c, (x, k, dy)))

    def runs(impl, interpret) -> bool:
        """Whether ``impl`` was asked for and supports the problem here (if not, a row says why)."""
        if impl not in implementations:
            return False
        reason = skip_reason(impl, spec, interpret)
        if reason is not None:
            row(impl, "all", f"unsupported: {reason}")
        return reason is None

    # Mosaic GPU's default tiles first: the three kernels as they run untuned, before any
    # sweep spends the budget.
    mgpu = runs("pallas_mosaic_gpu", cpu_check)
    if mgpu:
        mgpu_default = MosaicConfig.get_default(spec, dtype)
        mgpu_sweep(shape, dtype_name, cpu_check, {kind: {mgpu_key(kind, mgpu_default): mgpu_default} for kind in KINDS},
                   mgpu_default, (x, k, dy), row)

    # Pallas: each kernel alone, per candidate tile.
    for kind in KINDS if runs("pallas_triton", cpu_check) else ():
        if time.perf_counter() > deadline:
            break
        default = PallasConfig.get_default(spec, dtype, KERNEL_NAMES[kind])
        cands = {gemm_of(kind, default): default}
        for cand in CANDIDATES[np.dtype(dtype).itemsize]:
            cands.setdefault(cand, blocks_for(kind, default, cand))
        fns = {cand: one_kernel(kind, shape, "pallas_triton", blocks, cpu_check) for cand, blocks in cands.items()}
        compiled = _compile_all(fns, {cand: (x, k, dy) for cand in fns}, f"{shape.name} {dtype_name} Pallas {kind} tiles")
        for cand, c in compiled.items():
            t = c if isinstance(c, str) else time_fn(c, (x, k, dy))
            row("pallas_triton", kind, t, tile=list(cand), default=cand == gemm_of(kind, default))

    if runs("triton", False):
        triton_autotune(shape, spec, batch, dtype, (x, k, dy), deadline, cpu_check, row)

    # Mosaic GPU's sweep, kernel by kernel while the budget lasts (a CPU check interprets
    # slowly: one candidate per kernel there).
    for kind in KINDS if mgpu else ():
        if time.perf_counter() > deadline:
            break
        cands = {}
        for cand in MGPU_CANDIDATES[kind][: 1 if cpu_check else None]:
            try:
                tiles = mgpu_tiles(kind, cand)
            except ValueError as e:
                print(f"  pallas_mosaic_gpu {kind} {cand} skipped: {e}", flush=True)
                continue
            if mgpu_key(kind, tiles) != mgpu_key(kind, mgpu_default):
                cands[mgpu_key(kind, tiles)] = tiles
        mgpu_sweep(shape, dtype_name, cpu_check, {kind: cands}, mgpu_default, (x, k, dy), row)
    return rows


def triton_autotune(shape: BenchShape, spec, batch: int, dtype, args, deadline: float, cpu_check: bool, row):
    """Triton's rows: the autotuner's own timings (at the first lowering of each kernel),
    then its pick under this timer. The autotuner runs on a GPU only (never interpreted)."""
    x, k, dy = args
    try:
        from maskconv_kernels.ops.masked_conv.triton import Config as TritonConfig, ops as triton_ops

        jax.jit(jax.value_and_grad(
            lambda x, k: mk.masked_conv(x, k, shape.mask, implementation="triton", **shape.conv_args)
            .astype(jnp.float32).sum(), (0, 1))).lower(x, k)
    except Exception as e:  # noqa: BLE001 - no triton / jax-triton here
        row("triton", "all", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        return
    p = triton_ops.problem(spec, batch, dtype)
    tuned, timings = triton_ops.tuned(), triton_ops.timings()
    for kind in KINDS:
        if time.perf_counter() > deadline or (kind, p) not in tuned:
            break
        best = tuned[(kind, p)]
        try:
            c = jax.jit(one_kernel(kind, shape, "triton", TritonConfig(**{kind: best}), cpu_check))
            t = time_fn(c, (x, k, dy))
        except Exception as e:  # noqa: BLE001
            row("triton", kind, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
            continue
        row("triton", kind, t, tile=dataclasses.asdict(best),
            autotune={json.dumps(dataclasses.asdict(cfg)): s * 1e3 for cfg, s in timings.get((kind, p), {}).items()})


def mgpu_sweep(shape, dtype_name, cpu_check, by_kind: dict, default: MosaicConfig, args, row):
    """Compiles (in parallel) and times ``{kind: {key: Config}}`` of the Mosaic GPU kernels, one row each."""
    fns = {(kind, key): one_kernel(kind, shape, "pallas_mosaic_gpu", tiles, cpu_check)
           for kind, cands in by_kind.items() for key, tiles in cands.items()}
    if not fns:
        return
    compiled = _compile_all(fns, {name: args for name in fns}, f"{shape.name} {dtype_name} Mosaic GPU tiles")
    for (kind, key), c in compiled.items():
        # Interpreted (CPU check) calls take seconds each: one timed call is enough to test the script.
        t = c if isinstance(c, str) else time_fn(c, args, **(dict(samples=1, warmup=0) if cpu_check else {}))
        extra = dict(tile=list(key), default=key == mgpu_key(kind, default))
        if not cpu_check:  # the prediction is for the full batch
            extra["predicted_ms"] = predicted_ms(shape, kind, by_kind[kind][key])
        row("pallas_mosaic_gpu", kind, t, **extra)


def one_kernel(kind: str, shape: BenchShape, implementation: str, config, interpret: bool):
    """``(x, k, dy) -> out`` running one of the three kernels of ``implementation`` with ``config``.

    The input and weight gradients are the transposes of the forward in ``x`` and in the
    kernel (``jax.linear_transpose``): each is one kernel, with no forward beside it.
    """
    def conv(x, k):
        return mk.masked_conv(x, k, shape.mask, implementation=implementation, config=config, interpret=interpret,
                              **shape.conv_args)

    if kind == "fwd":
        return lambda x, k, dy: conv(x, k)
    if kind == "dx":
        return lambda x, k, dy: jax.linear_transpose(lambda x_: conv(x_, k), x)(dy)[0]
    return lambda x, k, dy: jax.linear_transpose(lambda k_: conv(x, k_), k)(dy)[0]


def table(rows: list[dict]) -> str:
    lines = []
    for (shape, dtype) in dict.fromkeys((r["shape"], r["dtype"]) for r in rows):
        sub = [r for r in rows if r["shape"] == shape and r["dtype"] == dtype]
        lines += [f"\n### {shape} {dtype}", "| impl | kernel | tile | ms | TFLOP/s | predicted ms |",
                  "|---|---|---|---:|---:|---:|"]
        for r in sub:
            tile = r.get("tile", "")
            if isinstance(tile, dict):
                tile = ",".join(str(tile[f]) for f in ("block_m", "block_n", "block_k", "num_warps", "num_stages"))
                tile += f" split={r['tile'].get('split', 1)}" if r["kind"] == "dw" else ""
            elif tile:
                tile = ",".join(map(str, tile)) + (" (default)" if r.get("default") else "")
            ms = f"{r['ms']:.3f}" if "ms" in r else r["error"][:80]
            tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
            pred = f"{r['predicted_ms']:.3f}" if r.get("predicted_ms") else ""
            lines.append(f"| {r['impl']} | {r['kind']} | {tile} | {ms} | {tf} | {pred} |")
        best = {}
        for r in sub:
            if "ms" in r and r["kind"] in ("fwd", "dx", "dw"):
                key = (r["impl"], r["kind"])
                best[key] = min(best.get(key, np.inf), r["ms"])
        for impl in ("pallas_triton", "triton", "pallas_mosaic_gpu"):
            if all((impl, kd) in best for kd in ("fwd", "dx", "dw")):
                ours = sum(best[(impl, kd)] for kd in ("fwd", "dx", "dw"))
                cudnn = sum(best.get(("baseline", kd), np.nan) for kd in ("fwd", "dx", "dw"))
                lines.append(f"\nbest {impl} fwd+dx+dw {ours:.3f} ms vs cuDNN {cudnn:.3f} ms: {cudnn / ours:.2f}x")
    lines += ["", "tile: pallas_triton (m,n,k,warps,stages); triton its config; pallas_mosaic_gpu fwd/dx "
              "(tile_pixels,tile_n,block_k,max_concurrent_steps,warp_specialized), dw (tile_n,max_concurrent_steps,weight_grad_splits)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    parser.add_argument("--budget", type=float, default=120.0, help="seconds; later shapes/kernels are skipped")
    parser.add_argument("--out", default="tune.json")
    parser.add_argument("--shapes", help="regex on the headline shapes' names (default: both)")
    ours = ["pallas_triton", "triton", "pallas_mosaic_gpu"]
    parser.add_argument("--implementations", nargs="+", default=ours, choices=ours,
                        help="ours to time (cuDNN always runs)")
    parser.add_argument("--cpu-check", action="store_true",
                        help="batch 1, kernels interpreted: checks this script on a machine without a GPU")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.cpu_check:
        print("benchmarks.tune times compiled GPU kernels; this machine has none", file=sys.stderr)
        return 1
    deadline = time.perf_counter() + args.budget
    command = " ".join(["python -m benchmarks.tune", *(sys.argv[1:] if argv is None else argv)])
    rows, meta = [], metadata("tune", command)
    for dtype_name in args.dtypes:
        for shape in [s for s in HEADLINE_SHAPES if args.shapes is None or re.search(args.shapes, s.name)]:
            if time.perf_counter() > deadline:
                break
            done = list(rows)
            write = lambda new, done=done: Path(args.out).write_text(
                json.dumps({"meta": meta, "rows": done + new}, indent=1))
            rows += tune_shape(shape, dtype_name, deadline, args.cpu_check, flush=write,
                               implementations=tuple(args.implementations))
            print(table([r for r in rows if r["shape"] == shape.name and r["dtype"] == dtype_name]), flush=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
