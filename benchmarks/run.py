"""Times every implementation of maskconv_kernels against the leaky baseline.

    python -m benchmarks.run --preset cpu --out benchmarks/results/cpu

For each shape of ``benchmarks/shapes.py``, dtype and mode (``fwd``, ``bwd``,
``fwd+bwd``), it compiles the baseline ``lax.conv_general_dilated(x, kernel * mask)``
(``maskconv_kernels.leaky_masked_conv``; cuDNN on GPUs) and every backend of
``maskconv_kernels.api.IMPLEMENTATIONS`` that supports the problem on this device, then:

* times them in one process, samples interleaved (baseline, ours, baseline, ...) so
  that a noisy machine slows all of them alike and the ratios stay meaningful;
  lowering and compilation are timed separately, outside the timed region;
* reports the median and p20/p80 over samples, achieved TFLOP/s counted on active taps
  only (``ConvSpec.flops``: the baseline gets credit only for useful work) and its
  fraction of the peak of a large matmul measured in the same run;
* reports peak memory from ``compiled.memory_analysis()``;
* measures exactness on the very executables it timed: the leaked gradient (max |dx|
  at inputs that the centre output reaches only through masked taps) and NaN isolation
  (NaN in "future" inputs; outputs that read them only through masked taps must stay
  bit-identical).

Writes ``OUT.jsonl`` (one row per measurement, each with the machine's metadata),
``OUT.md`` (the table) and ``OUT.png`` (speed-up chart); prints the table and a short
summary last.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import maskconv_kernels as mk
from maskconv_kernels import api, backends
from maskconv_kernels.spec import make_spec

from .shapes import SHAPES, BenchShape

BASELINE = "baseline"
MODES = ("fwd", "bwd", "fwd+bwd")
# FLOPs of a mode in units of the forward's: the backward computes dx and dkernel,
# each as many multiply-adds (on active entries) as the forward.
MODE_FLOPS = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Preset:
    """How hard to measure on one kind of device."""

    full_batch: bool  # SHAPES' device-filling batch, else their small_batch
    dtypes: tuple[str, ...]
    modes: tuple[str, ...]
    samples: int  # timed samples per implementation
    min_sample_s: float  # each sample repeats the call until it lasts this long
    warmup: int
    max_input_sets: int  # inputs rotated among this many copies when they fit in cache
    peak_n: int  # square matmul size for the measured peak
    shapes: tuple[str, ...] | None = None  # names; None: all


PRESETS = {
    # All shapes at their small batch; 5-10 minutes on 2 busy cores.
    "cpu": Preset(False, ("float32", "bfloat16"), MODES, samples=9, min_sample_s=0.05, warmup=1,
                  max_input_sets=2, peak_n=1024),
    # The full grid at device-filling batch sizes.
    "gpu": Preset(True, ("bfloat16", "float32", "float16"), MODES, samples=25, min_sample_s=0.002,
                  warmup=3, max_input_sets=8, peak_n=8192),
    # Smoke test: two shapes, one dtype, few samples.
    "quick": Preset(False, ("float32",), MODES, samples=3, min_sample_s=0.0, warmup=1, max_input_sets=1,
                    peak_n=256, shapes=("pixelcnn_7x7A_C1-64_28x28", "wavenet_k3masked_d8_C128-256_L16k")),
}


# --------------------------------------------------------------------------- metadata


def _git_commit() -> str:
    if os.environ.get("MASKCONV_COMMIT"):
        return os.environ["MASKCONV_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def metadata(preset_name: str) -> dict:
    import jaxlib

    device = jax.devices()[0]
    meta = {
        "device": device.device_kind if device.platform != "cpu" else f"CPU: {_cpu_model()}",
        "platform": device.platform,
        "device_count": jax.device_count(),
        "gpu_driver": _nvidia_smi("driver_version") if device.platform == "gpu" else None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "commit": _git_commit(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "preset": preset_name,
        "command": " ".join(["python -m benchmarks.run", *sys.argv[1:]]),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # not installed, or broken on this machine: only metadata
        meta["triton"] = None
    return meta


# --------------------------------------------------------------------------- problems


def _conv(impl: str, shape: BenchShape):
    if impl == BASELINE:
        return lambda x, k: mk.leaky_masked_conv(x, k, shape.mask, **shape.conv_args)
    return lambda x, k: mk.masked_conv(x, k, shape.mask, implementation=impl, **shape.conv_args)


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
    """Our backends that run ``spec`` here (compiled, not interpreted), and why the others do not."""
    ok, skipped = [], {}
    for name in api.IMPLEMENTATIONS:
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


def _n_input_sets(set_bytes: int, cache_bytes: int, max_sets: int) -> int:
    """Enough copies that the rotation spans twice the cache, so no call finds its inputs cached."""
    return max(1, min(max_sets, math.ceil(2 * cache_bytes / max(set_bytes, 1))))


def cache_bytes(platform_name: str) -> int:
    if platform_name == "gpu":
        return 60 << 20  # H100/H200 L2 (50-60 MB)
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) << 10 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return 32 << 20


# --------------------------------------------------------------------------- timing


def _block(out):
    jax.block_until_ready(out)


def time_interleaved(fns: dict, argsets, preset: Preset) -> dict[str, list[float]]:
    """Per-call seconds, ``preset.samples`` samples per function, interleaved.

    Each sample launches the call ``n`` times back to back (rotating input sets) and
    blocks once, so asynchronous dispatch keeps the device busy and the sample measures
    device time, not launch latency; ``n`` makes a sample last ``min_sample_s``.
    """
    n_inner = {}
    for name, fn in fns.items():
        for i in range(preset.warmup):
            _block(fn(*argsets[i % len(argsets)]))
        t = time.perf_counter()
        _block(fn(*argsets[0]))
        one = time.perf_counter() - t
        n_inner[name] = max(1, math.ceil(preset.min_sample_s / max(one, 1e-7)))
    times = {name: [] for name in fns}
    names = list(fns)
    for s in range(preset.samples):
        # Rotate who goes first, so no implementation always follows the same neighbour.
        for name in names[s % len(names):] + names[: s % len(names)]:
            fn, n = fns[name], n_inner[name]
            t = time.perf_counter()
            for i in range(n):
                out = fn(*argsets[i % len(argsets)])
            _block(out)
            times[name].append((time.perf_counter() - t) / n)
    return times


def quantile(values, q: float) -> float:
    return float(np.quantile(np.asarray(values), q))


def measure_peak(dtype_name: str, n: int, preset: Preset) -> float:
    """FLOP/s of an ``n x n x n`` matmul at default precision (what the convolutions use)."""
    dtype = DTYPES[dtype_name]
    ka, kb = jax.random.split(jax.random.PRNGKey(7))
    sets = [(jax.random.normal(ka, (n, n), jnp.float32).astype(dtype),
             jax.random.normal(kb, (n, n), jnp.float32).astype(dtype), None)]
    f = jax.jit(lambda a, b, _: a @ b).lower(*sets[0]).compile()
    times = time_interleaved({"mm": f}, sets, dataclasses.replace(preset, samples=max(5, preset.samples // 3)))
    return 2 * n**3 / statistics.median(times["mm"])


def memory(compiled) -> dict:
    try:
        m = compiled.memory_analysis()
    except Exception:  # some platforms do not implement it
        return {"peak_bytes": None, "temp_bytes": None}
    if m is None:
        return {"peak_bytes": None, "temp_bytes": None}
    peak = getattr(m, "peak_memory_in_bytes", 0) or (
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    )
    return {"peak_bytes": int(peak), "temp_bytes": int(m.temp_size_in_bytes)}


# --------------------------------------------------------------------------- exactness


def receptive_field(spec, out_index) -> np.ndarray:
    """Bool ``in_spatial``: inputs that output ``out_index`` reads through active taps."""
    field = np.zeros(spec.in_spatial, bool)
    for tap in spec.mask.active_taps:
        pos = tuple(o * s - lo + t * d for o, s, (lo, _), t, d in
                    zip(out_index, spec.strides, spec.padding, tap, spec.dilation))
        if all(0 <= p < n for p, n in zip(pos, spec.in_spatial)):
            field[pos] = True
    return field


def clean_outputs(spec, poisoned: np.ndarray) -> np.ndarray:
    """Bool ``out_spatial``: outputs that read no ``poisoned`` input through an active tap."""
    ind = poisoned.astype(np.float64)[None, ..., None]
    ones = np.ones((*spec.window, 1, 1))
    reach = mk.masked_conv_reference(ind, ones, spec.mask.tap_bits, strides=spec.strides,
                                     padding=spec.padding, dilation=spec.dilation)
    return reach[0, ..., 0] == 0


def _changed_per_position(y0, y1) -> np.ndarray:
    """Per output position, how many (batch, channel) values differ bit for bit (reduced on the device)."""
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(y0.dtype).itemsize]
    diff = jax.lax.bitcast_convert_type(y0, uint) != jax.lax.bitcast_convert_type(y1, uint)
    return np.asarray(jnp.sum(diff, axis=(0, diff.ndim - 1)))


def gradient_leak(bwd_out_dx, spec, centre) -> tuple[float, bool]:
    """Max |dx| outside the centre output's active field; and whether the field got gradient."""
    dx = np.asarray(jnp.max(jnp.abs(bwd_out_dx.astype(jnp.float32)), axis=(0, bwd_out_dx.ndim - 1)), np.float64)
    field = receptive_field(spec, centre)
    return float(dx[~field].max(initial=0.0)), bool((dx[field] > 0).any())


def exactness(compiled, mode: str, x, k, spec) -> dict:
    """Measured on the executable that was timed."""
    result = {}
    centre = tuple(o // 2 for o in spec.out_spatial)
    if mode in ("bwd", "fwd+bwd"):
        # Cotangent only at the centre output (every batch element and channel), as in the seed report.
        rng = np.random.default_rng(0)
        dy = np.zeros((x.shape[0], *spec.out_spatial, spec.c_out), np.float32)
        dy[(slice(None), *centre)] = rng.standard_normal((x.shape[0], spec.c_out))
        out = compiled(x, k, jnp.asarray(dy, x.dtype))
        dx = out[0] if mode == "bwd" else out[1][0]
        leak, reached = gradient_leak(dx, spec, centre)
        result["leak_max_abs"] = leak
        result["leak_field_reached"] = reached
    if mode in ("fwd", "fwd+bwd"):
        # Poison every input at or after the centre in raster order ("the future").
        order = np.arange(int(np.prod(spec.in_spatial))).reshape(spec.in_spatial)
        future = order >= order[tuple(n // 2 for n in spec.in_spatial)]
        clean = clean_outputs(spec, future)
        dummy = jnp.zeros((x.shape[0], *spec.out_spatial, spec.c_out), x.dtype)
        xp = jnp.where(jnp.asarray(future)[None, ..., None], jnp.asarray(np.nan, x.dtype), x)
        y0, y1 = compiled(x, k, dummy), compiled(xp, k, dummy)
        if mode == "fwd+bwd":
            y0, y1 = y0[0], y1[0]
        changed = _changed_per_position(y0, y1)[clean]
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
        # The acceptance shapes in the first dtype (every mode: the split shows which pass is
        # slow), then their training steps in the other dtypes, then every training step,
        # then forward and backward alone.
        first = dtype == preset.dtypes[0]
        tier = 0 if shape.bar and first else 1 if shape.bar and mode == "fwd+bwd" else 2
        return (tier, mode != "fwd+bwd", preset.dtypes.index(dtype))

    grid = [(s, d, m) for s in shapes for d in preset.dtypes for m in preset.modes]
    return sorted(grid, key=priority)


def run_cell(shape: BenchShape, dtype_name: str, mode: str, preset: Preset, meta: dict, peaks: dict,
             platform_name: str, only: list[str] | None):
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
    set_bytes = sum(math.prod(s) * np.dtype(dtype).itemsize
                    for s in (x_struct.shape, k_struct.shape, (batch, *spec.out_spatial, shape.c_out)))
    argsets = _inputs(shape, batch, dtype, spec,
                      _n_input_sets(set_bytes, cache_bytes(platform_name), preset.max_input_sets))
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
    base_t = rows[BASELINE].get("median_s")
    for row in rows.values():
        if base_t and row.get("median_s"):
            row["speedup"] = base_t / row["median_s"]
    return list(rows.values())


# --------------------------------------------------------------------------- output


def _ms(s):
    return "—" if s is None else f"{1e3 * s:.3g}"


def _mib(b):
    return "—" if b is None else f"{b / 2**20:.1f}"


def _leak(row):
    if "leak_max_abs" not in row:
        return "—"
    v = row["leak_max_abs"]
    return "0" if v == 0.0 else f"**{v:.1e}**"


def _nan(row):
    if "nan_isolated" not in row:
        return "—"
    return "yes" if row["nan_isolated"] else f"**no** ({row['nan_changed']} changed)"


def _short(commit: str) -> str:
    return commit[:12] + ("-dirty" if commit.endswith("-dirty") else "")


def header(rows: list[dict]) -> str:
    """The machine, versions, commit and command of a run."""
    meta = rows[0]
    return "\n".join([
        f"Device: {meta['device']} ({meta['platform']}, {meta['cpu_count']} CPU cores"
        + (f", driver {meta['gpu_driver']}" if meta.get("gpu_driver") else "") + "); "
        f"jax {meta['jax']}, jaxlib {meta['jaxlib']}, Python {meta['python']}; commit {_short(meta['commit'])}; "
        f"{meta['time_utc']}; load average at start {meta['loadavg_at_start']}.",
        "",
        f"Command: `{meta['command']}`",
    ])


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    lines = [
        "Times in ms (median, p20-p80 over samples); speed-up = baseline median / median; TFLOP/s on active "
        "taps only; peak = a large matmul measured in the same run; leak = max |dx| at inputs reachable only "
        "through masked taps; NaN-isolated = outputs not reading NaN inputs through active taps stay "
        "bit-identical.",
        "",
        "| shape | N | dtype | mode | implementation | median ms | p20-p80 ms | speed-up | TFLOP/s | % peak "
        "| peak MiB | compile s | leak | NaN-isolated |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    key = {s.name: i for i, s in enumerate(SHAPES)}
    order = sorted(rows, key=lambda r: (key.get(r["shape"], 99), r["dtype"], MODES.index(r["mode"]),
                                        r["implementation"] != BASELINE, r["implementation"]))
    for r in order:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['dtype']} | {r['mode']} | {r['implementation']} "
                         f"| error: {r['error'][:80]} |||||||||")
            continue
        if "median_s" not in r:
            continue
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['dtype']} | {r['mode']} | {r['implementation']} "
            f"| {_ms(r['median_s'])} | {_ms(r['p20_s'])}-{_ms(r['p80_s'])} | {r.get('speedup', 0):.2f}x "
            f"| {r['tflops']:.3g} | {100 * r['frac_peak']:.1f} "
            f"| {_mib(r.get('peak_bytes'))} "
            f"| {r['compile_s']:.2f} | {_leak(r)} | {_nan(r)} |"
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
        cols = [shape, str(b["batch"]), dtype, _ms(b["median_s"])]
        cols += [f"{_ms(by[i]['median_s'])} ({by[i]['speedup']:.2f}x)" if i in by else "—" for i in impls]
        cols.append(" / ".join(_leak(by[i]) if i in by else "—" for i in [BASELINE, *impls]))
        cols.append(" / ".join(_nan(by[i]).split(" (")[0] if i in by else "—" for i in [BASELINE, *impls]))
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Geometric-mean speed-up per implementation, dtype and mode; exactness in one word."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["implementation"] != BASELINE and "speedup" in r:
            groups.setdefault((r["implementation"], r["dtype"], r["mode"]), []).append(r)
    base = [r for r in rows if r["implementation"] == BASELINE and "median_s" in r]
    lines = [
        "| implementation | dtype | mode | shapes | geomean speed-up | min | max | max leak | NaN-isolated |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]

    def exact(rs):
        leaks = [r["leak_max_abs"] for r in rs if "leak_max_abs" in r]
        nans = [r["nan_isolated"] for r in rs if "nan_isolated" in r]
        leak = "—" if not leaks else ("0" if max(leaks) == 0 else f"{max(leaks):.1e}")
        nan = "—" if not nans else f"{sum(nans)}/{len(nans)}"
        return leak, nan

    for name in sorted({r["dtype"] for r in base}):
        for mode in MODES:
            rs = [r for r in base if r["dtype"] == name and r["mode"] == mode]
            if rs:
                leak, nan = exact(rs)
                lines.append(f"| {BASELINE} (lax.conv, kernel*mask) | {name} | {mode} | {len(rs)} | 1.00x | | "
                             f"| {leak} | {nan} |")
    for (impl, dtype, mode), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], MODES.index(kv[0][2]))):
        sp = [r["speedup"] for r in rs]
        leak, nan = exact(rs)
        lines.append(f"| {impl} | {dtype} | {mode} | {len(rs)} | {math.exp(np.mean(np.log(sp))):.2f}x "
                     f"| {min(sp):.2f}x | {max(sp):.2f}x | {leak} | {nan} |")
    bar = [r for r in rows if r["shape"] in {s.name for s in SHAPES if s.bar} and r["mode"] == "fwd+bwd"
           and r["implementation"] != BASELINE and "speedup" in r]
    if bar:
        lines += ["", "The issue's acceptance shapes (fwd+bwd, baseline time / ours; the bar itself is for an H200 at N=64):", ""]
        lines += [f"- {r['shape']} N={r['batch']} {r['dtype']} {r['implementation']}: {r['speedup']:.2f}x"
                  for r in sorted(bar, key=lambda r: (r["shape"], r["dtype"], r["implementation"]))]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["auto", *PRESETS], default="auto",
                        help="auto: gpu on GPUs, cpu elsewhere")
    parser.add_argument("--quick", action="store_true", help="same as --preset quick")
    parser.add_argument("--shapes", help="regex on shape names")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", choices=MODES)
    parser.add_argument("--implementations", nargs="+", help="subset of our backends (baseline always runs)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; stop starting new cells after this (the most important run first)")
    parser.add_argument("--out", default=None, help="path prefix for .jsonl/.md/.png (default "
                        "benchmarks/results/<platform>)")
    parser.add_argument("--no-chart", action="store_true")
    parser.add_argument("--render", metavar="JSONL",
                        help="only redraw the table, summary and chart of an earlier (or interrupted) run")
    args = parser.parse_args(argv)
    if args.render:
        return render(Path(args.render), chart_too=not args.no_chart)

    platform_name = jax.default_backend()
    name = "quick" if args.quick else (
        args.preset if args.preset != "auto" else ("gpu" if platform_name == "gpu" else "cpu"))
    preset = PRESETS[name]
    if args.dtypes:
        preset = dataclasses.replace(preset, dtypes=tuple(args.dtypes))
    if args.modes:
        preset = dataclasses.replace(preset, modes=tuple(args.modes))
    out = Path(args.out or Path(__file__).parent / "results" / platform_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = metadata(name)
    grid = cells(preset, args.shapes)
    print(f"{len(grid)} cells on {meta['device']} (preset {name}); writing {out}.jsonl", file=sys.stderr)

    start = time.perf_counter()
    peaks = {d: measure_peak(d, preset.peak_n, preset) for d in preset.dtypes}
    print("measured peak TFLOP/s: " + ", ".join(f"{d} {p / 1e12:.3g}" for d, p in peaks.items()),
          file=sys.stderr)
    rows: list[dict] = []
    jsonl = Path(f"{out}.jsonl")
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is optional for a bare run
        def tqdm(it, **kw):
            return it
    with open(jsonl, "w") as f:
        bar = tqdm(grid, unit="cell", file=sys.stderr)
        for shape, dtype, mode in bar:
            if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
                print(f"\ntime budget of {args.time_budget:.0f} s spent: skipping the remaining cells",
                      file=sys.stderr)
                break
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(f"{shape.name} {dtype} {mode}")
            for row in run_cell(shape, dtype, mode, preset, meta, peaks, platform_name, args.implementations):
                rows.append(row)
                f.write(json.dumps(row) + "\n")
            f.flush()
    write_outputs(rows, out, chart_too=not args.no_chart)
    return 0


def write_outputs(rows: list[dict], out: Path, chart_too: bool = True) -> None:
    """``out.md`` (table + summary) and ``out.png``; prints the table, then the summary last."""
    table = markdown(rows)
    summ = summary(rows)
    overview = pivot(rows, "fwd+bwd")
    head = header(rows) if rows else ""
    Path(f"{out}.md").write_text(head + "\n\n## Forward + backward, side by side\n\n" + overview
                                 + "\n\n## All rows\n\n" + table + "\n\n## Summary\n\n" + summ + "\n")
    if chart_too:
        try:
            from .chart import chart

            chart(rows, Path(f"{out}.png"))
        except ImportError as e:
            print(f"no chart ({e}); install the bench extra: pip install '.[bench]'", file=sys.stderr)
    print(head + "\n")
    print(table)
    print("\n## Summary\n")
    print(summ)


def render(jsonl: Path, chart_too: bool = True) -> int:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    write_outputs(rows, Path(str(jsonl).removesuffix(".jsonl")), chart_too)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
