"""Each linear map of the ``xla`` backend against a GEMM of the same FLOPs: how close to the machine's limit.

    python -m maskconv_kernels.bench roofline --out DIR

For each shape of :data:`.shapes.ROOFLINE_SHAPES` and each dtype, in one process with
samples interleaved (:mod:`.timing`), it times:

* each map alone, as a jitted vjp with a fixed cotangent: the forward, the input
  gradient and the weight gradient, for each strategy of the ``xla`` backend's ``Config``
  (``auto``, what ``masked_conv`` runs by default, then ``conv``, ``matmul``, ``gemm``,
  ``conv_blocks``, and ``gemm`` at other block sizes with ``--blocks``) and for
  ``lax.conv(kernel * mask)``
  (XLA's own three maps, over every tap);
* per map, one dense GEMM with the map's active-tap FLOPs and natural shape, operands
  already in memory: forward ``(N*P, T*Ci) @ (T*Ci, Co)``, input gradient
  ``(N*P, T*Co) @ (T*Co, Ci)``, weight gradient ``(T*Ci, N*P) @ (N*P, Co)``;
  its rate is the roofline: ``efficiency = GEMM time / map time`` (1.0: the GEMM's rate),
  the median over rounds of the two times measured in the same round;
* the forward+backward (``y, dx, dk``) of ``masked_conv`` with its default config and of
  ``lax.conv(kernel * mask)``: their ratio against the tap ratio (all taps / active taps);
* each map's peak extra memory: ``compiled.memory_analysis()``'s temporaries, beside
  the size of ``x``.

FLOPs count active taps only. Writes ``PREFIX.jsonl`` (a row per shape x dtype x map x
strategy, each with the machine's metadata and the load average when it was measured)
and ``PREFIX.md``; prints the table. The library's goals are printed beside the figures:
each map at 0.75 of its GEMM's rate, forward+backward at 0.85 x the tap ratio of
``lax.conv(kernel * mask)``'s speed, extra memory at most the size of ``x``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..ops.masked_conv import masked_conv, xla
from ..ops.masked_conv.reference import leaky_masked_conv
from ..ops.masked_conv.spec import make_spec
from .conv import PRESETS
from .chart import publish
from .machine import header, loadavg, metadata
from .shapes import ROOFLINE_SHAPES, BenchShape
from .table import mib
from .timing import DTYPES, Preset, memory, quantile, time_interleaved


MAPS = ("fwd", "dx", "dw")
STRATEGIES = xla.STRATEGIES  # "auto" first: what masked_conv runs by default
LAX = "lax.conv(kernel*mask)"
# The goals: each map at this fraction of the GEMM's rate; fwd+bwd against lax at this
# fraction of the tap ratio; extra memory per map at most the size of x.
EFFICIENCY_TARGET = 0.75
RATIO_TARGET = 0.85
# Samples per implementation, each at least this long; interleaved, so a load spike
# slows every implementation of a shape alike.
TIMING = dataclasses.replace(PRESETS["cpu"], samples=9, min_sample_s=0.1, warmup=1)


def _conv(shape: BenchShape, config):
    if config == LAX:
        return lambda x, k: leaky_masked_conv(x, k, shape.mask, **shape.conv_args)
    return lambda x, k: masked_conv(x, k, shape.mask, implementation="xla", config=config, **shape.conv_args)


def map_fn(conv, which: str):
    """``f(x, k, dy)``: one map alone (the vjp's unused parts are dead code XLA removes)."""
    if which == "fwd":
        return lambda x, k, dy: conv(x, k)
    if which == "dx":
        return lambda x, k, dy: jax.vjp(lambda x: conv(x, k), x)[1](dy)[0]
    if which == "dw":
        return lambda x, k, dy: jax.vjp(lambda k: conv(x, k), k)[1](dy)[0]

    def fwd_bwd(x, k, dy):
        y, pull = jax.vjp(conv, x, k)
        return y, pull(dy)

    return fwd_bwd


def gemm_shapes(spec, batch: int) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """Per map, the operand shapes of the dense GEMM with its active-tap FLOPs."""
    pixels = batch * math.prod(spec.out_spatial)
    taps = len(spec.mask.active_taps)
    ci, co = spec.c_in, spec.c_out
    return {
        "fwd": ((pixels, taps * ci), (taps * ci, co)),
        "dx": ((pixels, taps * co), (taps * co, ci)),
        "dw": ((taps * ci, pixels), (pixels, co)),
    }


def _strategies(block_sizes) -> dict[str, xla.Config]:
    configs = {s: xla.Config(s) for s in STRATEGIES}
    for size in block_sizes:  # MiB
        configs[f"gemm {size:g} MiB"] = xla.Config("gemm", block_bytes=int(size * 2**20))
        configs[f"conv_blocks {size:g} MiB"] = xla.Config("conv_blocks", block_bytes=int(size * 2**20))
    return configs


def measure_shape(shape: BenchShape, dtype_name: str, block_sizes, meta: dict, timing: Preset = TIMING) -> list[dict]:
    dtype = DTYPES[dtype_name]
    batch = shape.batch
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], shape.x_shape(batch), jnp.float32).astype(dtype)
    k = (jax.random.normal(keys[1], shape.kernel_shape, jnp.float32) / np.sqrt(shape.active_taps * shape.c_in)).astype(dtype)
    spec = make_spec(x, k, shape.mask, **shape.conv_args)
    dy = jax.random.normal(keys[2], (batch, *spec.out_spatial, shape.c_out), jnp.float32).astype(dtype)
    flops = spec.flops(batch)

    fns, args, rows = {}, {}, {}
    base = {
        "shape": shape.name, "dtype": dtype_name, "batch": batch, "x_shape": list(x.shape),
        "kernel_shape": list(k.shape), "conv_args": dict(shape.conv_args), "active_taps": shape.active_taps,
        "taps": int(np.prod(shape.window)), "x_bytes": int(x.nbytes), **meta,
    }

    def add(name, fn, operands, **fields):
        compiled = jax.jit(fn).lower(*operands).compile()
        fns[name], args[name] = compiled, operands
        rows[name] = dict(base, **fields, **memory(compiled))

    for which, (a_shape, b_shape) in gemm_shapes(spec, batch).items():
        a = jax.random.normal(keys[0], a_shape, jnp.float32).astype(dtype)
        b = jax.random.normal(keys[1], b_shape, jnp.float32).astype(dtype)
        # In the accumulation dtype, as the maps accumulate.
        gemm = lambda a, b: jax.lax.dot(a, b, preferred_element_type=spec.acc_dtype)
        add(f"GEMM {which}", gemm, (a, b), map=which, strategy="GEMM", flops=flops)
    for label, config in {**_strategies(block_sizes), LAX: LAX}.items():
        for which in MAPS:
            add(f"{label} {which}", map_fn(_conv(shape, config), which), (x, k, dy), map=which, strategy=label,
                flops=flops)
    for label, config in {"default": None, LAX: LAX}.items():
        add(f"{label} fwd+bwd", map_fn(_conv(shape, config), "fwd+bwd"), (x, k, dy), map="fwd+bwd",
            strategy=label, flops=3 * flops)

    times = _time(fns, args, timing)
    load = loadavg()
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name].update(median_s=med, p20_s=quantile(ts, 0.2), p80_s=quantile(ts, 0.8), samples=len(ts),
                          gflops=rows[name]["flops"] / med / 1e9, loadavg=load)
    for name, row in rows.items():
        if row["map"] in MAPS:
            row["efficiency"] = _paired(times[f"GEMM {row['map']}"], times[name])
            row["extra_over_x"] = row["temp_bytes"] / row["x_bytes"] if row.get("temp_bytes") is not None else None
    tap_ratio = base["taps"] / base["active_taps"]
    rows["default fwd+bwd"].update(
        speedup=_paired(times[f"{LAX} fwd+bwd"], times["default fwd+bwd"]), tap_ratio=tap_ratio,
        speedup_target=RATIO_TARGET * tap_ratio,
    )
    return list(rows.values())


def _paired(reference: list[float], times: list[float]) -> float:
    """The median over rounds of ``reference / time``: both were timed in the same round,
    one after the other, so a load that comes and goes cancels out."""
    return statistics.median(r / t for r, t in zip(reference, times))


def _time(fns: dict, args: dict, timing: Preset) -> dict[str, list[float]]:
    """``time_interleaved`` with each function's own operands."""
    calls = {name: (lambda name=name: fns[name](*args[name])) for name in fns}
    return time_interleaved(calls, [()], timing)


# --------------------------------------------------------------------------- output


def table(rows: list[dict]) -> str:
    lines = [
        "Per map: median ms (p20-p80), GFLOP/s on active taps, efficiency = the same-FLOP GEMM's time / the "
        f"map's time (target {EFFICIENCY_TARGET}), peak extra memory (compiled temporaries) / size of x "
        "(target <= 1). `lax.conv(kernel*mask)` computes every tap, so its GFLOP/s count only the active ones.",
        "",
        "| shape | dtype | map | strategy | ms | p20-p80 | GFLOP/s | efficiency | extra MiB | extra / x | load |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["map"] not in MAPS:
            continue
        eff = "" if r["strategy"] == "GEMM" else f"{r['efficiency']:.2f}"
        extra = "" if r["strategy"] == "GEMM" or r.get("extra_over_x") is None else f"{r['extra_over_x']:.2f}"
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['map']} | {r['strategy']} | {1e3 * r['median_s']:.2f} "
            f"| {1e3 * r['p20_s']:.2f}-{1e3 * r['p80_s']:.2f} | {r['gflops']:.0f} | {eff} "
            f"| {mib(r.get('temp_bytes'))} | {extra} | {r['loadavg']} |"
        )
    lines += [
        "",
        "Forward+backward (`y, dx, dk`), `masked_conv` with its default config against `lax.conv(kernel*mask)`:",
        "",
        f"| shape | dtype | ours ms | lax ms | speed-up | tap ratio | target ({RATIO_TARGET} x tap ratio) | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r["shape"], r["dtype"], r["strategy"]): r for r in rows if r["map"] == "fwd+bwd"}
    for (shape, dtype, strategy), r in by_key.items():
        if strategy != "default":
            continue
        lax_ = by_key[(shape, dtype, LAX)]
        met = "met" if r["speedup"] >= r["speedup_target"] else "**not met**"
        lines.append(
            f"| {shape} | {dtype} | {1e3 * r['median_s']:.2f} | {1e3 * lax_['median_s']:.2f} | {r['speedup']:.2f}x "
            f"| {r['tap_ratio']:.2f} | {r['speedup_target']:.2f}x, {met} | {r['loadavg']} |"
        )
    return "\n".join(lines)


def is_rows(rows: list[dict]) -> bool:
    """Whether ``rows`` (a ``.jsonl`` read back) are this benchmark's."""
    return bool(rows) and all("map" in r and "strategy" in r for r in rows)


def write_outputs(rows: list[dict], out: Path | None, chart_too: bool = False) -> None:
    """Prints the tables; with ``out``, writes ``out.md`` too (the roofline draws no chart)."""
    publish(header(rows) + "\n\n" + table(rows) + "\n", rows, out, chart_too=False)


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in ROOFLINE_SHAPES], metavar="NAME",
                        help=f"of {[s.name for s in ROOFLINE_SHAPES]} (default: all)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--blocks", nargs="*", type=float, default=[], metavar="MIB",
                        help="also time the blocked strategies with these block sizes, in MiB")


def run(args) -> int:
    """Times every shape and dtype; rows to ``args.prefix``.jsonl as they come, then the tables."""
    shapes = [s for s in ROOFLINE_SHAPES if not args.shapes or s.name in args.shapes]
    meta = metadata("roofline", args.command)
    print(f"{len(shapes) * len(args.dtypes)} shapes x dtypes on {meta['device']}; writing {args.prefix}.jsonl",
          file=sys.stderr)
    rows = []
    with open(f"{args.prefix}.jsonl", "w") as jsonl:
        for shape in shapes:
            for dtype in args.dtypes:
                start = time.perf_counter()
                new = measure_shape(shape, dtype, args.blocks, meta)
                print(f"{shape.name} {dtype}: {time.perf_counter() - start:.0f} s, load {new[0]['loadavg']}",
                      file=sys.stderr, flush=True)
                rows += new
                jsonl.writelines(json.dumps(r) + "\n" for r in new)
                jsonl.flush()
    write_outputs(rows, args.prefix)
    return 0
