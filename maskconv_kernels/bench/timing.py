"""How the benchmarks time: samples interleaved between the functions compared, in one process.

Each sample launches a compiled call ``n`` times back to back (rotating input sets) and
blocks once, so asynchronous dispatch keeps the device busy and the sample measures
device time, not launch latency; ``n`` makes a sample last at least ``min_sample_s``.
Samples of the functions compared are interleaved, rotating who goes first, so load from
other processes slows all of them alike: on a shared machine absolute times wander, their
ratios much less. Compilation happens before any timed call.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Preset", "DTYPES", "add_grid_arguments", "preset_name", "overridden", "within_budget", "time_interleaved",
           "median_times", "quantile", "measure_peak", "memory", "n_input_sets"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Preset:
    """How hard to measure on one kind of device."""

    full_batch: bool  # the shapes' device-filling batch, else their small_batch
    dtypes: tuple[str, ...]
    modes: tuple[str, ...]
    samples: int  # timed samples per function
    min_sample_s: float  # each sample repeats the call until it lasts this long
    warmup: int
    max_input_sets: int  # inputs rotated among this many copies when they fit in cache
    peak_n: int  # square matmul size for the measured peak (0: not measured)
    shapes: tuple[str, ...] | None = None  # names; None: all


def add_grid_arguments(parser, presets, preset_help: str, shapes_help: str, modes) -> None:
    """The options of a benchmark that sweeps shapes x dtypes x modes under a preset."""
    parser.add_argument("--preset", choices=["auto", *presets], default="auto",
                        help=f"{preset_help}; auto (default): the platform's preset (tpu on a TPU, gpu on a GPU), "
                        "cpu elsewhere")
    parser.add_argument("--quick", action="store_true", help="same as --preset quick")
    parser.add_argument("--shapes", help=shapes_help)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", choices=modes)
    parser.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="stop starting new cells after S seconds (the most important cells run first)")


def preset_name(args, platform_name: str, presets=()) -> str:
    """The preset ``args`` ask for: ``--quick``, ``--preset``, or by the platform (``auto``: the
    platform's own preset where ``presets`` has one, ``tpu`` say; else gpu on a GPU, cpu elsewhere)."""
    if getattr(args, "quick", False):
        return "quick"
    preset = getattr(args, "preset", None)
    if preset is None:
        return "full"
    if preset != "auto":
        return preset
    return platform_name if platform_name in presets else ("gpu" if platform_name == "gpu" else "cpu")


def overridden(preset: Preset, args) -> Preset:
    """``preset`` with the dtypes and modes of ``--dtypes`` and ``--modes``, where given."""
    if args.dtypes:
        preset = dataclasses.replace(preset, dtypes=tuple(args.dtypes))
    if args.modes:
        preset = dataclasses.replace(preset, modes=tuple(args.modes))
    return preset


def within_budget(grid, budget: float | None, start: float):
    """The cells of ``grid`` started before ``budget`` seconds have passed since ``start``
    (``time.perf_counter()``); says on stderr how many were skipped."""
    for i, cell in enumerate(grid):
        if budget is not None and time.perf_counter() - start > budget:
            print(f"\ntime budget of {budget:.0f} s spent: {len(grid) - i} cells skipped", file=sys.stderr)
            return
        yield cell


def select(args, presets: dict, platform_name: str) -> tuple[str, Preset, list]:
    """The preset ``args`` ask for (its name, with ``--dtypes`` and ``--modes`` applied) and
    its shapes whose names contain ``--shapes``; none: says so on stderr."""
    name = preset_name(args, platform_name, presets)
    preset, shapes = presets[name]
    shapes = [s for s in shapes if args.shapes is None or args.shapes in s.name]
    if not shapes:
        print(f"no shape of preset {name} matches --shapes {args.shapes!r}", file=sys.stderr)
    return name, overridden(preset, args), shapes


def run_grid(grid, run_cell, out: str, budget: float | None, where: str) -> list[dict]:
    """``run_cell(i, *cell)`` for each cell of ``grid`` started within ``budget`` seconds, its
    rows appended to ``out``.jsonl as they come (a run cut short keeps what it measured);
    progress on stderr: each cell before it runs, then its seconds."""
    print(f"{len(grid)} cells on {where}; writing {out}.jsonl", file=sys.stderr)
    start, rows = time.perf_counter(), []
    with open(f"{out}.jsonl", "w") as f:
        for i, cell in enumerate(within_budget(grid, budget, start)):
            t = time.perf_counter()
            print("  " + " ".join(str(getattr(v, "name", v)) for v in cell), end="", file=sys.stderr, flush=True)
            for row in run_cell(i, *cell):
                rows.append(row)
                f.write(json.dumps(row) + "\n")
            f.flush()
            print(f": {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return rows


def time_interleaved(fns: dict, argsets, preset: Preset) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns`` (compiled), ``preset.samples`` samples each, interleaved.

    ``argsets`` is a list of argument tuples, rotated within a sample so that no call
    finds its inputs in cache because the previous call left them there; or a dict
    giving each function its own list (functions of different arguments timed together).
    With ``preset.min_sample_s`` 0 a sample is one call, and no call is made to size it.
    """
    sets = argsets if isinstance(argsets, dict) else {name: argsets for name in fns}
    n_inner = {}
    for name, fn in fns.items():
        for i in range(preset.warmup):
            jax.block_until_ready(fn(*sets[name][i % len(sets[name])]))
        if preset.min_sample_s <= 0:
            n_inner[name] = 1
            continue
        t = time.perf_counter()
        jax.block_until_ready(fn(*sets[name][0]))
        one = time.perf_counter() - t
        n_inner[name] = max(1, math.ceil(preset.min_sample_s / max(one, 1e-7)))
    times = {name: [] for name in fns}
    names = list(fns)
    for s in range(preset.samples):
        # Rotate who goes first, so no function always follows the same neighbour.
        for name in names[s % len(names):] + names[: s % len(names)]:
            fn, n, own = fns[name], n_inner[name], sets[name]
            t = time.perf_counter()
            for i in range(n):
                out = fn(*own[i % len(own)])
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t) / n)
    return times


def median_times(fns: dict, argsets, samples: int, min_sample_s: float = 0.0, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, samples interleaved: :func:`time_interleaved`
    for the tools that time a few functions without a grid's :class:`Preset` (the report, the
    tuner, the decode benchmark)."""
    preset = Preset(False, (), (), samples=samples, min_sample_s=min_sample_s, warmup=warmup, max_input_sets=1,
                    peak_n=0)
    return {name: statistics.median(ts) for name, ts in time_interleaved(fns, argsets, preset).items()}


def quantile(values, q: float) -> float:
    return float(np.quantile(np.asarray(values), q))


def measure_peak(dtype_name: str, n: int, preset: Preset) -> float:
    """FLOP/s of an ``n x n x n`` matmul at default precision (what the convolutions use), timed here."""
    dtype = DTYPES[dtype_name]
    ka, kb = jax.random.split(jax.random.PRNGKey(7))
    sets = [(jax.random.normal(ka, (n, n), jnp.float32).astype(dtype),
             jax.random.normal(kb, (n, n), jnp.float32).astype(dtype), None)]
    f = jax.jit(lambda a, b, _: a @ b).lower(*sets[0]).compile()
    times = time_interleaved({"mm": f}, sets, dataclasses.replace(preset, samples=max(5, preset.samples // 3)))
    return 2 * n**3 / statistics.median(times["mm"])


def memory(compiled) -> dict:
    """``peak_bytes``, ``temp_bytes`` and ``output_bytes`` of a compiled executable (``None`` where the
    platform reports none).

    The peak is ``memory_analysis()``'s, or arguments + outputs + temporaries - aliases
    where the platform gives no peak.
    """
    none = {"peak_bytes": None, "temp_bytes": None, "output_bytes": None}
    try:
        m = compiled.memory_analysis()
    except Exception:  # some platforms do not implement it
        return none
    if m is None:
        return none
    peak = getattr(m, "peak_memory_in_bytes", 0) or (
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    )
    return {"peak_bytes": int(peak), "temp_bytes": int(m.temp_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes)}


def n_input_sets(set_bytes: int, cache_bytes: int, max_sets: int) -> int:
    """Enough copies of the inputs that their rotation spans twice the cache."""
    return max(1, min(max_sets, math.ceil(2 * cache_bytes / max(set_bytes, 1))))
