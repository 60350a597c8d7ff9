"""The masked convolution benchmark: ``masked_conv`` against ``lax.conv_general_dilated(x, kernel * mask)``.

    python -m maskconv_kernels.bench conv --preset cpu --out DIR

For each shape of :mod:`.shapes` (layers of PixelCNN, PixelCNN++, gated PixelCNN and
WaveNet), dtype and mode (``fwd``, ``bwd``, ``fwd+bwd``), it compiles the baseline
``lax.conv_general_dilated(x, kernel * mask)`` (:func:`maskconv_kernels.leaky_masked_conv`,
what ``flax.linen.Conv(mask=...)`` runs; cuDNN on GPUs) and every implementation of
``masked_conv`` that runs the problem compiled on this device, then:

* times them in one process, samples interleaved (:mod:`.timing`), lowering and
  compilation timed apart, outside the timed region;
* reports the median and p20/p80 over samples, TFLOP/s counted on active taps only
  (``ConvSpec.flops``: the baseline gets credit only for useful work) and its fraction of
  a large matmul's rate measured in the same run;
* reports peak memory from ``compiled.memory_analysis()``;
* measures exactness on the very executables it timed (:mod:`maskconv_kernels.leaks`):
  the gradient at inputs the centre output reaches only through masked taps, and NaN
  isolation (NaN in the inputs at or after the centre in raster order; the outputs that
  read none of them through an active tap must stay bit-identical).

Writes ``PREFIX.jsonl`` (one row per measurement, each with the machine's metadata) as
it goes, then ``PREFIX.md`` (the tables) and ``PREFIX.png`` (the speed-up chart, with
matplotlib); prints the tables and a summary last.
"""
from __future__ import annotations

import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .. import leaks
from ..ops.masked_conv import backends, masked_conv, xla
from ..ops.masked_conv.reference import leaky_masked_conv
from ..ops.masked_conv.spec import make_spec
from .chart import chart, draw
from .exactness import differences
from .machine import cache_bytes, header, metadata
from .shapes import SHAPES, BenchShape
from .table import leak_cell, mib, ms, nan_cell
from .timing import (DTYPES, Preset, add_grid_arguments, measure_peak, memory, n_input_sets, overridden, preset_name,
                     quantile, time_interleaved, within_budget)

BASELINE = "baseline"
MODES = ("fwd", "bwd", "fwd+bwd")
# FLOPs of a mode in units of the forward's: the backward computes dx and dkernel,
# each as many multiply-adds (on active entries) as the forward.
MODE_FLOPS = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}


PRESETS = {
    # Every shape at its small batch, float32 and bfloat16 (its time: ESTIMATES in __main__).
    "cpu": Preset(False, ("float32", "bfloat16"), MODES, samples=9, min_sample_s=0.05, warmup=1,
                  max_input_sets=2, peak_n=1024),
    # The full grid at device-filling batch sizes.
    "gpu": Preset(True, ("bfloat16", "float32", "float16"), MODES, samples=25, min_sample_s=0.002,
                  warmup=3, max_input_sets=8, peak_n=8192),
    # A TPU: device-filling batches, bfloat16 and float32 (the MXU's dtypes; float16 is
    # computed in float32 there).
    "tpu": Preset(True, ("bfloat16", "float32"), MODES, samples=15, min_sample_s=0.002, warmup=3,
                  max_input_sets=8, peak_n=8192),
    # Smoke test: two shapes, one dtype, few samples.
    "quick": Preset(False, ("float32",), MODES, samples=3, min_sample_s=0.0, warmup=1, max_input_sets=1,
                    peak_n=256, shapes=("pixelcnn_7x7A_C1-64_28x28", "wavenet_k3masked_d8_C128-256_L16k")),
}


# --------------------------------------------------------------------------- problems


def _conv(impl: str, shape: BenchShape):
    if impl == BASELINE:
        return lambda x, k: leaky_masked_conv(x, k, shape.mask, **shape.conv_args)
    name, config = implementation_config(impl)
    return lambda x, k: masked_conv(x, k, shape.mask, implementation=name, config=config, **shape.conv_args)


def implementation_config(impl: str):
    """``(implementation, config)`` of a timed entry: ``"xla[conv]"`` is ``"xla"`` under
    ``Config("conv")`` (``--xla-strategies``); a plain name its default config."""
    if not impl.endswith("]"):
        return impl, None
    name, strategy = impl[:-1].split("[")
    return name, backends.get(name).config_class()(strategy)


def mode_fn(impl: str, shape: BenchShape, mode: str):
    """``f(x, kernel, dy)`` for one mode; ``fwd`` ignores ``dy``."""
    conv = _conv(impl, shape)
    if mode == "fwd":
        return lambda x, k, dy: conv(x, k)
    if mode == "bwd":
        # The primal output is unused, so XLA drops the forward: this times dx and dkernel.
        return lambda x, k, dy: jax.vjp(conv, x, k)[1](dy)

    def fwd_bwd(x, k, dy):
        y, pull = jax.vjp(conv, x, k)
        return y, pull(dy)

    return fwd_bwd


_TOLD: set[tuple[str, str]] = set()  # (backend, reason) pairs run_cell has printed


def implementations(spec, platform_name: str) -> tuple[list[str], dict[str, str]]:
    """``masked_conv``'s implementations that run ``spec`` here (compiled, not interpreted), and why the others
    do not."""
    ok, skipped = [], {}
    for name in backends.IMPLEMENTATIONS:
        try:
            reason = backends.get(name).unsupported(spec, backends.lowering_platform(platform_name), interpret=False)
        except Exception as e:  # a backend that cannot even be imported here
            reason = f"{type(e).__name__}: {e}"
        if reason is None:
            ok.append(name)
        else:
            skipped[name] = reason
    return ok, skipped


def _inputs(shape: BenchShape, batch: int, dtype, spec, n_sets: int):
    sets = []
    for i in range(n_sets):
        kx, kk, kd = jax.random.split(jax.random.PRNGKey(1000 + i), 3)
        fan_in = shape.active_taps * shape.c_in
        x = jax.random.normal(kx, shape.x_shape(batch), jnp.float32).astype(dtype)
        k = (jax.random.normal(kk, shape.kernel_shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)
        dy = jax.random.normal(kd, (batch, *spec.out_spatial, shape.c_out), jnp.float32).astype(dtype)
        sets.append((x, k, dy))
    return jax.block_until_ready(sets)


# --------------------------------------------------------------------------- exactness


def exactness(compiled, mode: str, x, k, spec) -> dict:
    """Exactness measured on the executable that was timed, around the centre output.

    * ``bwd``, ``fwd+bwd``: the cotangent is nonzero only at the centre output (every
      batch element and channel, random values); ``leak_max_abs`` is
      :func:`~maskconv_kernels.leaks.forbidden_gradient` of ``dx`` outside the centre's
      :func:`~maskconv_kernels.leaks.active_field` (exact: ``0.0``), and
      ``leak_field_reached`` says the field itself did get gradient.
    * ``fwd``, ``fwd+bwd``: every input at or after the centre in raster order becomes
      NaN; ``nan_changed`` counts the elements of the outputs that read none of them
      through an active tap (:func:`~maskconv_kernels.leaks.clean_outputs`) that changed
      bit for bit (exact: 0).
    """
    result = {}
    centre = tuple(o // 2 for o in spec.out_spatial)
    if mode in ("bwd", "fwd+bwd"):
        rng = np.random.default_rng(0)
        dy = np.zeros((x.shape[0], *spec.out_spatial, spec.c_out), np.float32)
        dy[(slice(None), *centre)] = rng.standard_normal((x.shape[0], spec.c_out))
        out = compiled(x, k, jnp.asarray(dy, x.dtype))
        dx = out[0] if mode == "bwd" else out[1][0]
        # Per input position, the largest |dx| over the batch and the channels.
        dx = np.asarray(jnp.max(jnp.abs(dx.astype(jnp.float32)), axis=(0, dx.ndim - 1)), np.float64)
        field = leaks.active_field(spec, centre)
        result["leak_max_abs"] = leaks.forbidden_gradient(dx, ~field)
        result["leak_field_reached"] = bool((dx[field] > 0).any())
    if mode in ("fwd", "fwd+bwd"):
        future = leaks.raster_future(spec.in_spatial, tuple(n // 2 for n in spec.in_spatial))
        clean = leaks.clean_outputs(spec, future)
        dummy = jnp.zeros((x.shape[0], *spec.out_spatial, spec.c_out), x.dtype)
        xp = jnp.where(jnp.asarray(future)[None, ..., None], jnp.asarray(np.nan, x.dtype), x)
        y0, y1 = compiled(x, k, dummy), compiled(xp, k, dummy)
        if mode == "fwd+bwd":
            y0, y1 = y0[0], y1[0]
        changed = np.asarray(leaks.changed_elements(y0, y1, axis=(0, y0.ndim - 1)))[clean]
        result["nan_clean_outputs"] = int(clean.sum()) * x.shape[0] * spec.c_out
        result["nan_changed"] = int(changed.sum())
        result["nan_isolated"] = bool(clean.any()) and not changed.any()
    return result


# --------------------------------------------------------------------------- the grid


def cells(preset: Preset, shape_filter: str | None):
    """(shape, dtype, mode) in priority order, so a time budget cuts the least important."""
    shapes = [s for s in SHAPES if (preset.shapes is None or s.name in preset.shapes)
              and (shape_filter is None or re.search(shape_filter, s.name))]

    def priority(cell):
        shape, dtype, mode = cell
        # The headline shapes in the first dtype (every mode: the split shows which pass is
        # slow), then their training steps in the other dtypes, then every training step,
        # then forward and backward alone.
        first = dtype == preset.dtypes[0]
        tier = 0 if shape.headline and first else 1 if shape.headline and mode == "fwd+bwd" else 2
        return (tier, mode != "fwd+bwd", preset.dtypes.index(dtype))

    grid = [(s, d, m) for s in shapes for d in preset.dtypes for m in preset.modes]
    return sorted(grid, key=priority)


def run_cell(shape: BenchShape, dtype_name: str, mode: str, preset: Preset, meta: dict, peaks: dict,
             platform_name: str, only: list[str] | None, strategies=()) -> list[dict]:
    """One cell (shape, dtype, mode): a row per implementation, the baseline's first.

    ``peaks`` maps dtype names to the matmul FLOP/s measured in this run; ``only``
    narrows ``masked_conv``'s implementations (the baseline always runs); ``strategies``
    adds ``xla`` under each of those strategies (``"xla[conv]"``, ...).
    """
    dtype = DTYPES[dtype_name]
    batch = shape.batch if preset.full_batch else shape.small_batch
    x_struct = jax.ShapeDtypeStruct(shape.x_shape(batch), dtype)
    k_struct = jax.ShapeDtypeStruct(shape.kernel_shape, dtype)
    spec = make_spec(x_struct, k_struct, shape.mask, **shape.conv_args)
    ours, skipped = implementations(spec, platform_name)
    for name, why in skipped.items():  # said once per backend and reason, as the grid goes
        if (name, why) not in _TOLD:
            _TOLD.add((name, why))
            print(f"\n  {name} not run ({shape.name} {dtype_name} and any alike): {why}", file=sys.stderr, flush=True)
    impls = [BASELINE] + [i for i in ours if only is None or i in only]
    if "xla" in ours:
        impls += [f"xla[{s}]" for s in strategies]
    set_bytes = sum(math.prod(s) * np.dtype(dtype).itemsize
                    for s in (x_struct.shape, k_struct.shape, (batch, *spec.out_spatial, shape.c_out)))
    argsets = _inputs(shape, batch, dtype, spec,
                      n_input_sets(set_bytes, cache_bytes(platform_name), preset.max_input_sets))
    flops = MODE_FLOPS[mode] * spec.flops(batch)
    base = {
        "shape": shape.name, "family": shape.family, "dtype": dtype_name, "mode": mode, "batch": batch,
        "x_shape": list(shape.x_shape(batch)), "kernel_shape": list(shape.kernel_shape),
        "active_taps": shape.active_taps, "taps": int(np.prod(shape.window)),
        "conv_args": {k: v for k, v in shape.conv_args.items()}, "flops": flops,
        "input_sets": len(argsets), "skipped_implementations": skipped, **meta,
    }
    rows, compiled = {}, {}
    for impl in impls:
        row = dict(base, implementation=impl)
        try:
            fn = jax.jit(mode_fn(impl, shape, mode))
            t = time.perf_counter()
            lowered = fn.lower(*argsets[0])
            row["lower_s"] = time.perf_counter() - t
            t = time.perf_counter()
            compiled[impl] = lowered.compile()
            row["compile_s"] = time.perf_counter() - t
            row.update(memory(compiled[impl]))
            # On stderr as it happens: a cell cut short by a time limit still shows where the time went.
            print(f"\n  {shape.name} {dtype_name} {mode} {impl}: lowered in {row['lower_s']:.1f} s, "
                  f"compiled in {row['compile_s']:.1f} s", file=sys.stderr, flush=True)
        except Exception as e:  # report and carry on: one broken backend must not hide the rest
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            compiled.pop(impl, None)
        rows[impl] = row
    try:
        times = time_interleaved(compiled, argsets, preset) if compiled else {}
    except Exception as e:
        times = {}
        for impl in compiled:
            rows[impl]["error"] = f"timing failed: {type(e).__name__}: {e}"[:300]
    for impl, ts in times.items():
        med = statistics.median(ts)
        rows[impl].update(
            median_s=med, p20_s=quantile(ts, 0.2), p80_s=quantile(ts, 0.8), samples=len(ts),
            tflops=flops / med / 1e12, peak_tflops=peaks[dtype_name] / 1e12,
            frac_peak=flops / med / peaks[dtype_name],
        )
        try:
            rows[impl].update(exactness(compiled[impl], mode, *argsets[0][:2], spec))
        except Exception as e:
            rows[impl]["exactness_error"] = f"{type(e).__name__}: {e}"[:300]
    # The values, next to the baseline's on the same inputs: on finite inputs masked_conv and
    # lax.conv(kernel * mask) are one function up to rounding, so a kernel that computes the wrong
    # thing shows here while its exactness columns stay clean.
    if BASELINE in times and len(times) > 1:
        reference = compiled[BASELINE](*argsets[0])
        for impl in times:
            if impl != BASELINE:
                try:
                    rows[impl].update(differences(compiled[impl](*argsets[0]), reference))
                except Exception as e:
                    rows[impl]["agreement_error"] = f"{type(e).__name__}: {e}"[:300]
    base_t = rows[BASELINE].get("median_s")
    for row in rows.values():
        if base_t and row.get("median_s"):
            row["speedup"] = base_t / row["median_s"]
    return list(rows.values())


# --------------------------------------------------------------------------- output


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    lines = [
        "Times in ms (median, p20-p80 over samples); speed-up = baseline median / median; TFLOP/s on active "
        "taps only; peak = a large matmul measured in the same run; leak = max |dx| at inputs reachable only "
        "through masked taps; NaN-isolated = outputs not reading NaN inputs through active taps stay "
        "bit-identical; vs baseline = the largest difference from the baseline's outputs on the same inputs, "
        "over its largest value (rounding only, where the values are right).",
        "",
        "| shape | N | dtype | mode | implementation | median ms | p20-p80 ms | speed-up | TFLOP/s | % peak "
        "| peak MiB | compile s | leak | NaN-isolated | vs baseline |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    key = {s.name: i for i, s in enumerate(SHAPES)}
    order = sorted(rows, key=lambda r: (key.get(r["shape"], 99), r["dtype"], MODES.index(r["mode"]),
                                        r["implementation"] != BASELINE, r["implementation"]))
    for r in order:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['dtype']} | {r['mode']} | {r['implementation']} "
                         f"| error: {r['error'][:80]} ||||||||||")
            continue
        if "median_s" not in r:
            continue
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['dtype']} | {r['mode']} | {r['implementation']} "
            f"| {ms(r['median_s'])} | {ms(r['p20_s'])}-{ms(r['p80_s'])} | {r.get('speedup', 0):.2f}x "
            f"| {r['tflops']:.3g} | {100 * r['frac_peak']:.1f} "
            f"| {mib(r.get('peak_bytes'))} "
            f"| {r['compile_s']:.2f} | {leak_cell(r)} | {nan_cell(r)} "
            f"| {format(r['max_rel_diff'], '.1e') if 'max_rel_diff' in r else '—'} |"
        )
    skipped = {}
    for r in rows:
        for name, why in r.get("skipped_implementations", {}).items():
            skipped.setdefault(name, why)
    if skipped:
        lines += ["", "Not run here: " + "; ".join(f"`{n}`: {w}" for n, w in sorted(skipped.items())) + "."]
    return "\n".join(lines)


def pivot(rows: list[dict], mode: str = "fwd+bwd") -> str:
    """One line per shape and dtype for one mode: each implementation's median and speed-up side by side."""
    rs = [r for r in rows if r["mode"] == mode and "median_s" in r]
    impls = sorted({r["implementation"] for r in rs} - {BASELINE})
    head = ["shape", "N", "dtype", "baseline ms"] + [f"{i} ms (speed-up)" for i in impls] + \
        ["leak: baseline / " + " / ".join(impls), "NaN-isolated: baseline / " + " / ".join(impls)]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|" + "---:|" * (1 + len(impls)) + "---|---|"]
    key = {s.name: i for i, s in enumerate(SHAPES)}
    cells: dict[tuple, dict] = {}
    for r in rs:
        cells.setdefault((key.get(r["shape"], 99), r["shape"], r["dtype"]), {})[r["implementation"]] = r
    for (_, shape, dtype), by in sorted(cells.items()):
        if BASELINE not in by:
            continue
        b = by[BASELINE]
        cols = [shape, str(b["batch"]), dtype, ms(b["median_s"])]
        cols += [f"{ms(by[i]['median_s'])} ({by[i]['speedup']:.2f}x)" if i in by else "—" for i in impls]
        cols.append(" / ".join(leak_cell(by[i]) if i in by else "—" for i in [BASELINE, *impls]))
        cols.append(" / ".join(nan_cell(by[i]).split(" (")[0] if i in by else "—" for i in [BASELINE, *impls]))
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Geometric-mean speed-up per implementation, dtype and mode; exactness in one word; the largest
    relative difference from the baseline's values."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["implementation"] != BASELINE and "speedup" in r:
            groups.setdefault((r["implementation"], r["dtype"], r["mode"]), []).append(r)
    base = [r for r in rows if r["implementation"] == BASELINE and "median_s" in r]
    lines = [
        "| implementation | dtype | mode | shapes | geomean speed-up | min | max | max leak | NaN-isolated "
        "| max vs baseline |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]

    def exact(rs):
        grads = [r["leak_max_abs"] for r in rs if "leak_max_abs" in r]
        nans = [r["nan_isolated"] for r in rs if "nan_isolated" in r]
        leak = "—" if not grads else ("0" if max(grads) == 0 else f"{max(grads):.1e}")
        nan = "—" if not nans else f"{sum(nans)}/{len(nans)}"
        return leak, nan

    for name in sorted({r["dtype"] for r in base}):
        for mode in MODES:
            rs = [r for r in base if r["dtype"] == name and r["mode"] == mode]
            if rs:
                leak, nan = exact(rs)
                lines.append(f"| {BASELINE} (lax.conv, kernel*mask) | {name} | {mode} | {len(rs)} | 1.00x | | "
                             f"| {leak} | {nan} | — |")
    for (impl, dtype, mode), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], MODES.index(kv[0][2]))):
        sp = [r["speedup"] for r in rs]
        leak, nan = exact(rs)
        rel = [r["max_rel_diff"] for r in rs if "max_rel_diff" in r]
        lines.append(f"| {impl} | {dtype} | {mode} | {len(rs)} | {math.exp(np.mean(np.log(sp))):.2f}x "
                     f"| {min(sp):.2f}x | {max(sp):.2f}x | {leak} | {nan} | {f'{max(rel):.1e}' if rel else '—'} |")
    headline = [r for r in rows if r["shape"] in {s.name for s in SHAPES if s.headline} and r["mode"] == "fwd+bwd"
                and r["implementation"] != BASELINE and "speedup" in r]
    if headline:
        lines += ["", "The two headline layers (32x32, 256 channels: where a PixelCNN's training time goes), "
                  "forward+backward, baseline time / this implementation's, at this run's batch (N=64 in the "
                  "gpu preset):", ""]
        lines += [f"- {r['shape']} N={r['batch']} {r['dtype']} {r['implementation']}: {r['speedup']:.2f}x"
                  for r in sorted(headline, key=lambda r: (r["shape"], r["dtype"], r["implementation"]))]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    add_grid_arguments(parser, PRESETS, "cpu: every shape at a small batch, float32 and bfloat16; gpu: "
                       "device-filling batches, bfloat16, float32 and float16; quick: two shapes, seconds",
                       "a regular expression on shape names (see --list-shapes)", MODES)
    parser.add_argument("--list-shapes", action="store_true", help="print the shapes and exit")
    parser.add_argument("--implementations", nargs="+", metavar="NAME", choices=list(backends.IMPLEMENTATIONS),
                        help=f"masked_conv implementations to time, of {list(backends.IMPLEMENTATIONS)} (default: "
                        "every one that runs compiled here; the baseline always runs)")
    parser.add_argument("--xla-strategies", nargs="+", metavar="STRATEGY", default=(),
                        choices=[s for s in xla.STRATEGIES if s != "auto"],
                        help="also time the xla implementation under each of these strategies, as "
                        "xla[STRATEGY] (xla.Config(STRATEGY)): what each map would cost were it the default")


def run(args) -> int:
    """Times the grid; rows to ``args.prefix``.jsonl as they come, then the tables and the chart."""
    if args.list_shapes:
        for s in SHAPES:
            print(f"{s.name}: x (N, {', '.join(map(str, s.spatial))}, {s.c_in}), kernel {s.kernel_shape}, "
                  f"{s.active_taps} of {int(np.prod(s.window))} taps active, N={s.batch} (gpu) / {s.small_batch} (cpu)")
        return 0
    platform_name = jax.default_backend()
    name = preset_name(args, platform_name, PRESETS)
    preset = overridden(PRESETS[name], args)
    out = args.prefix
    meta = metadata(name, args.command)
    grid = cells(preset, args.shapes)
    if not grid:
        print(f"no shape matches --shapes {args.shapes!r}; --list-shapes lists them", file=sys.stderr)
        return 2
    print(f"{len(grid)} cells on {meta['device']} (preset {name}); writing {out}.jsonl", file=sys.stderr)

    start = time.perf_counter()
    peaks = {d: measure_peak(d, preset.peak_n, preset) for d in preset.dtypes}
    print("measured peak TFLOP/s: " + ", ".join(f"{d} {p / 1e12:.3g}" for d, p in peaks.items()),
          file=sys.stderr)
    rows: list[dict] = []
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is optional
        def tqdm(it, **kw):
            return it
    with open(f"{out}.jsonl", "w") as f:
        bar = tqdm(grid, unit="cell", file=sys.stderr)
        for shape, dtype, mode in within_budget(bar, args.time_budget, start):
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(f"{shape.name} {dtype} {mode}")
            for row in run_cell(shape, dtype, mode, preset, meta, peaks, platform_name, args.implementations,
                                args.xla_strategies):
                rows.append(row)
                f.write(json.dumps(row) + "\n")
            f.flush()
    write_outputs(rows, out, chart_too=not args.no_chart)
    return 0


def is_rows(rows: list[dict]) -> bool:
    """Whether ``rows`` (a ``.jsonl`` read back) are this benchmark's."""
    return bool(rows) and all("implementation" in r and "kernel_shape" in r and "mode" in r for r in rows)


def write_outputs(rows: list[dict], out: Path | None, chart_too: bool = True) -> None:
    """Prints the table, then the summary last; with ``out``, writes ``out.md`` and ``out.png`` too."""
    table = markdown(rows)
    summ = summary(rows)
    overview = pivot(rows, "fwd+bwd")
    head = header(rows) if rows else ""
    if out is not None:
        Path(f"{out}.md").write_text(head + "\n\n## Forward + backward, side by side\n\n" + overview
                                     + "\n\n## All rows\n\n" + table + "\n\n## Summary\n\n" + summ + "\n")
        if chart_too:
            draw(chart, rows, Path(f"{out}.png"))
    print(head + "\n")
    print(table)
    print("\n## Summary\n")
    print(summ)
