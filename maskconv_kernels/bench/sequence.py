"""Short causal convolutions of sequence models: ``causal_conv1d`` against what JAX users write.

    python -m maskconv_kernels.bench sequence --preset cpu --out DIR

Shapes are Mamba-2 / gated-DeltaNet layers (``x: (B, L, D)``, a depthwise causal kernel
of width ``W``, float32 weights and bias, SiLU, as their short convolutions run). For
each shape, dtype and mode (``fwd``, ``bwd``, ``fwd+bwd``, ``decode``) it times, in one
process with samples interleaved (:mod:`.timing`):

* ``causal_conv1d``: this library, ``implementation=None`` (what the platform gets);
* the platform's kernels by name: ``pallas_triton`` (``causal_conv1d(implementation=
  "pallas_triton")``, fused Pallas kernels) on GPUs, interpreted in the quick preset to
  test the benchmark itself; ``pallas_mosaic_tpu`` (its Mosaic TPU kernels) on TPUs;
* ``lax.conv``: ``lax.conv_general_dilated(..., feature_group_count=D)``, the usual JAX
  depthwise convolution (cuDNN on GPUs), in x's dtype with float32 accumulation;
* ``shift-and-add``: a hand-written ``jnp`` sum over taps of shifted inputs times
  weights, in float32, which XLA fuses: the simplest exact formulation.

In ``decode`` they are ``causal_conv1d_update`` over a pool of ``B`` slots (not donated
here: each timed call reuses its inputs), a ``(B, W, D)`` window convolved by
``lax.conv`` with ``VALID`` padding, and the window's weighted sum by hand; each returns
the output and the new state. All compute ``silu(conv(x) + bias)`` rounded once to x's
dtype; the first cell's outputs are compared with the shift-and-add's. Beside each time:
the memory roofline, the bytes a fused kernel must move (``fwd``: read x, write y;
``bwd``: read x and dy, write dx; the weights once; ``decode``: read the state and the
token, write the output and the state) over the memory bandwidth: the HBM's specification
(4.8 TB/s on an H200; on a TPU, jax's own table, 819 GB/s on a v5e, with the rate a large
array add reaches in the same run beside it) or, on a CPU, that measured rate. On a TPU each
row also gives the fraction of its dtype's copy rate (``x * 2`` over 512 MiB, measured in the
run): what the chip lets one stream in and one out reach. Writes ``PREFIX.jsonl``
(rows with the machine's metadata) as it goes, then ``PREFIX.md`` and ``PREFIX.png``;
prints the tables and the goals last.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from .chart import publish, roofline_bars
from .exactness import differences, measure
from .machine import header, metadata
from .table import leak_cell, ms, nan_cell
from .timing import DTYPES, Preset, add_grid_arguments, memory, quantile, run_grid, select, time_interleaved

MODES = ("fwd", "bwd", "fwd+bwd", "decode")
OURS, FUSED, LAX, SHIFT = "causal_conv1d", "pallas_triton", "lax.conv", "shift-and-add"
# The kernels timed by name beside implementation=None, per platform.
KERNELS = {"gpu": FUSED, "tpu": "pallas_mosaic_tpu"}
H200_HBM_BYTES_PER_S = 4.8e12


@dataclasses.dataclass(frozen=True)
class SeqShape:
    """``x: (batch, length, dim)``, ``weight: (width, dim)``."""

    name: str
    batch: int
    length: int
    dim: int
    width: int


def _mamba(batch, length, dim, width):
    return SeqShape(f"B{batch}_L{length}_D{dim}_W{width}", batch, length, dim, width)


PRESETS = {
    # A Mamba-2 layer (D = 1536 at 2k tokens) in every width, both dtypes.
    "cpu": (Preset(False, ("float32", "bfloat16"), MODES, samples=7, min_sample_s=0.05, warmup=1,
                   max_input_sets=1, peak_n=0),
            tuple(_mamba(4, 2048, 1536, w) for w in (4, 2, 3, 8))),
    # Mamba-2 130M's conv channels at 2k, causal-conv1d's published shape (D = 4128 at 16k),
    # a GDN layer at 4k, D = 4096 at 8k; the other widths.
    "gpu": (Preset(True, ("bfloat16", "float32"), MODES, samples=15, min_sample_s=0.002, warmup=2,
                   max_input_sets=4, peak_n=0),
            (_mamba(4, 2048, 1536, 4), _mamba(4, 16384, 4128, 4), _mamba(8, 4096, 2048, 4), _mamba(4, 8192, 4096, 4),
             _mamba(4, 2048, 1536, 2), _mamba(4, 2048, 1536, 3), _mamba(4, 2048, 1536, 8))),
    # The GPU preset's shapes on a TPU v5e, bfloat16 first.
    "tpu": (Preset(True, ("bfloat16", "float32"), MODES, samples=10, min_sample_s=0.002, warmup=2,
                   max_input_sets=3, peak_n=0),
            (_mamba(4, 2048, 1536, 4), _mamba(4, 16384, 4128, 4), _mamba(8, 4096, 2048, 4), _mamba(4, 8192, 4096, 4),
             _mamba(4, 2048, 1536, 2), _mamba(4, 2048, 1536, 3), _mamba(4, 2048, 1536, 8))),
    # A smoke test (CI, tests): one small shape, the fused kernels interpreted off a GPU.
    "quick": (Preset(False, ("float32",), MODES, samples=2, min_sample_s=0.0, warmup=1, max_input_sets=1,
                     peak_n=0),
              (_mamba(1, 40, 24, 4),)),
}


# --------------------------------------------------------------------------- the formulations


def _lax_conv(x, w, b):
    d, width = x.shape[-1], w.shape[0]
    y = lax.conv_general_dilated(
        x, w[:, None, :].astype(x.dtype), (1,), [(width - 1, 0)], dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=d, preferred_element_type=jnp.float32,
    )
    return jax.nn.silu(y + b.astype(jnp.float32)).astype(x.dtype)


def _shift_and_add(x, w, b):
    width, length = w.shape[0], x.shape[1]
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (width - 1, 0), (0, 0)))
    y = sum(xp[:, t : t + length] * w[t].astype(jnp.float32) for t in range(width))
    return jax.nn.silu(y + b.astype(jnp.float32)).astype(x.dtype)


def _lax_conv_step(x, w, b, state):
    """One token: ``x (B, D)``, ``state (B, W - 1, D)``; the window convolved with VALID padding."""
    window = jnp.concatenate([state, x[:, None]], axis=1)
    y = lax.conv_general_dilated(
        window, w[:, None, :].astype(x.dtype), (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=x.shape[-1], preferred_element_type=jnp.float32,
    )[:, 0]
    return jax.nn.silu(y + b.astype(jnp.float32)).astype(x.dtype), window[:, 1:]


def _shift_and_add_step(x, w, b, state):
    window = jnp.concatenate([state, x[:, None]], axis=1)
    y = sum(window[:, t].astype(jnp.float32) * w[t].astype(jnp.float32) for t in range(w.shape[0]))
    return jax.nn.silu(y + b.astype(jnp.float32)).astype(x.dtype), window[:, 1:]


def _ours_step(x, w, b, state):
    return causal_conv1d_update(x, state, w, b, activation="silu")


STEPS = {OURS: _ours_step, LAX: _lax_conv_step, SHIFT: _shift_and_add_step}


def formulations(platform_name: str, preset_name: str) -> dict:
    """Name -> ``f(x, w, b)``. The platform's kernels (:data:`KERNELS`) run compiled there; the
    fused Triton kernels run interpreted only in the quick preset (anywhere else they would
    take hours)."""
    found = {OURS: lambda x, w, b: causal_conv1d(x, w, b, activation="silu")}
    kernel = KERNELS.get(platform_name, FUSED if preset_name == "quick" else None)
    if kernel is not None:
        interpret = platform_name not in KERNELS
        found[kernel] = lambda x, w, b: causal_conv1d(x, w, b, activation="silu", implementation=kernel,
                                                      interpret=interpret)
    return {**found, LAX: _lax_conv, SHIFT: _shift_and_add}


def mode_fn(conv, mode: str):
    """``f(x, w, b, dy)`` for one mode; ``fwd`` ignores ``dy``; ``bwd`` gives dx, dw and db. In
    ``decode``, ``conv`` is a step ``(x, w, b, state) -> (y, state)`` and the fourth argument the state."""
    if mode == "decode":
        return conv
    if mode == "fwd":
        return lambda x, w, b, dy: conv(x, w, b)
    if mode == "bwd":
        return lambda x, w, b, dy: jax.vjp(conv, x, w, b)[1](dy)

    def fwd_bwd(x, w, b, dy):
        y, pull = jax.vjp(conv, x, w, b)
        return y, pull(dy)

    return fwd_bwd


def ideal_bytes(shape: SeqShape, dtype, mode: str) -> int:
    """What a fused kernel must move: activations once per read or write, the weights once."""
    act = shape.batch * shape.length * shape.dim * np.dtype(dtype).itemsize
    weights = (shape.width + 1) * shape.dim * 4
    fwd, bwd = 2 * act + weights, 3 * act + 2 * weights  # bwd: read x and dy, write dx; dw, db
    token = shape.batch * shape.dim * np.dtype(dtype).itemsize
    decode = 2 * shape.width * token + weights  # read the state and the token, write both back
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd, "decode": decode}[mode]


def _bytes_per_s(fn, args: tuple, nbytes: int, preset: Preset) -> float:
    """``nbytes`` over the median time of ``fn(*args)`` compiled (five interleaved samples)."""
    compiled = jax.jit(fn).lower(*args).compile()
    times = time_interleaved({"fn": compiled}, [args], dataclasses.replace(preset, samples=5))
    return nbytes / statistics.median(times["fn"])


def measure_bandwidth(preset: Preset, mib: int = 64) -> float:
    """Bytes per second of a large elementwise add (two reads, one write) of ``mib`` MiB of
    float32 per operand, in this process."""
    n = mib << 20 >> 2
    a, b = jnp.ones((n,), jnp.float32), jnp.full((n,), 2.0, jnp.float32)
    return _bytes_per_s(lambda a, b: a + b, (a, b), 3 * 4 * n, preset)


def measure_copy_rate(preset: Preset, dtype, mib: int = 512) -> float:
    """Bytes per second of ``x * 2`` (one read, one write) over a ``mib`` MiB array of
    ``dtype``, in this process: what a one-stream-in, one-stream-out kernel can hope for.
    On a TPU v5e it is well below the specification, and lower in bfloat16 than in
    float32 (``benchmarks/tpu_bandwidth.py`` finds a single DMA and a Pallas copy no
    faster)."""
    dtype = np.dtype(dtype)
    x = jnp.ones(((mib << 20) // dtype.itemsize,), dtype)
    return _bytes_per_s(lambda x: x * 2, (x,), 2 * x.nbytes, preset)


def specified_bandwidth() -> float:
    """The attached TPU's specified HBM bytes per second, all its cores (jax's table)."""
    from .._core.hardware import tpu_info

    info = tpu_info()
    return float(info.mem_bw_bytes_per_second * info.num_cores)


def copy_rates(platform_name: str, preset: Preset) -> dict[str, float]:
    """On a TPU, :func:`measure_copy_rate` of each of the preset's dtypes, by name (said on
    stderr); elsewhere none: the roofline is already a measured rate (or a GPU's HBM)."""
    if platform_name != "tpu":
        return {}
    rates = {name: measure_copy_rate(preset, DTYPES[name]) for name in preset.dtypes}
    print("copy rate (x * 2, 512 MiB): " + ", ".join(f"{n} {r / 1e9:.1f} GB/s" for n, r in rates.items()),
          file=sys.stderr)
    return rates


def roofline_bandwidth(platform_name: str, preset: Preset) -> tuple[float, float | None]:
    """``(bytes per second for the rooflines, the copy rate measured here or None)``: the
    H200's HBM on a GPU; the chip's specified HBM bandwidth on a TPU (jax's table), beside
    an add of 512 MiB operands (a 64 MiB one reached half the v5e's); measured elsewhere.
    Said on stderr."""
    if platform_name == "gpu":
        bandwidth, measured, what = H200_HBM_BYTES_PER_S, None, "H200 HBM"
    elif platform_name == "tpu":
        bandwidth = specified_bandwidth()
        measured = measure_bandwidth(preset, mib=512)
        what = f"the chip's specified HBM bandwidth; a 512 MiB add moved {measured / 1e9:.1f} GB/s here"
    else:
        bandwidth = measured = measure_bandwidth(preset)
        what = "measured"
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s ({what})", file=sys.stderr)
    return bandwidth, measured


def _inputs(shape: SeqShape, dtype, n_sets: int, mode: str = "fwd"):
    """``(x, w, b, dy)``; in ``decode``, ``(x (B, D), w, b, state (B, W - 1, D))``."""
    if mode == "decode":
        return [(x[:, -1], w, b, x[:, : shape.width - 1]) for x, w, b, _ in _inputs(shape, dtype, n_sets)]
    sets = []
    for i in range(n_sets):
        kx, kw, kb, kd = jax.random.split(jax.random.PRNGKey(100 + i), 4)
        x = jax.random.normal(kx, (shape.batch, shape.length, shape.dim), jnp.float32).astype(dtype)
        w = jax.random.normal(kw, (shape.width, shape.dim), jnp.float32) / np.sqrt(shape.width)
        b = 0.1 * jax.random.normal(kb, (shape.dim,), jnp.float32)
        dy = jax.random.normal(kd, x.shape, jnp.float32).astype(dtype)
        sets.append((x, w, b, dy))
    return jax.block_until_ready(sets)


def cells(shapes, preset: Preset):
    """The most informative first (a time budget cuts the rest): the first shape in every dtype and
    mode, then every other shape's fwd+bwd, then their single passes."""
    grid = [(s, d, m) for s in shapes for d in preset.dtypes for m in preset.modes]
    return sorted(grid, key=lambda c: (c[0] != shapes[0], c[2] != "fwd+bwd", preset.dtypes.index(c[1])))


def run_cell(shape: SeqShape, dtype_name: str, mode: str, preset: Preset, meta: dict, bandwidth: float,
             found: dict, compare: bool = False, rates: dict | None = None) -> list[dict]:
    dtype = DTYPES[dtype_name]
    argsets = _inputs(shape, dtype, preset.max_input_sets, mode)
    if mode == "decode":
        found = {name: step for name, step in STEPS.items() if name in found}
    base = {"shape": shape.name, **dataclasses.asdict(shape), "dtype": dtype_name, "weight_dtype": "float32",
            "mode": mode, "ideal_bytes": ideal_bytes(shape, dtype, mode), "bandwidth_bytes_per_s": bandwidth,
            "copy_bytes_per_s": (rates or {}).get(dtype_name), **meta}
    rows, compiled = {}, {}
    for name, conv in found.items():
        row = dict(base, implementation=name)
        try:
            t = time.perf_counter()
            compiled[name] = jax.jit(mode_fn(conv, mode)).lower(*argsets[0]).compile()
            row["compile_s"] = time.perf_counter() - t
            row.update(memory(compiled[name]))
        except Exception as e:  # report it and carry on with the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        rows[name] = row
    times = time_interleaved(compiled, argsets, preset)
    roofline = base["ideal_bytes"] / bandwidth
    for name, ts in times.items():
        rows[name].update(median_s=statistics.median(ts), p20_s=quantile(ts, 0.2), p80_s=quantile(ts, 0.8),
                          roofline_s=roofline, frac_roofline=roofline / statistics.median(ts))
        if base["copy_bytes_per_s"]:
            rows[name]["frac_copy"] = base["ideal_bytes"] / base["copy_bytes_per_s"] / statistics.median(ts)
    for name in times:
        for ref in (LAX, SHIFT):
            if ref in times and name != ref:
                rows[name][f"vs_{ref}"] = rows[ref]["median_s"] / rows[name]["median_s"]
    if mode != "decode":
        for name in times:
            measure(compiled[name], mode, argsets[0], rows[name])
    if compare and SHIFT in compiled:
        reference = compiled[SHIFT](*argsets[0])
        for name in compiled:
            rows[name]["max_abs_diff_vs_shift"] = differences(compiled[name](*argsets[0]), reference)["max_abs_diff"]
    return list(rows.values())


# --------------------------------------------------------------------------- output


def markdown(rows: list[dict]) -> str:
    lines = [
        "Median ms (p20-p80); roofline = ideal bytes / bandwidth (the fraction of it achieved in brackets); of "
        "the copy rate: the same bytes at the rate x * 2 of the row's dtype reached in the run (TPUs only); "
        f"speed-ups are {LAX}'s and {SHIFT}'s time over this row's; measured on the timed executables, leak = "
        "max |dx| at positions after the one output given a cotangent, NaN-isolated = outputs before NaN inputs "
        "stay bit-identical.",
        "",
        "| shape | dtype | mode | implementation | median ms | p20-p80 ms | roofline ms (achieved) | of the copy rate "
        f"| vs {LAX} | vs {SHIFT} | peak MiB | leak | NaN-isolated |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['dtype']} | {r['mode']} | {r['implementation']} | error: "
                         f"{r['error'][:80]} |||||||||")
            continue
        if "median_s" not in r:
            continue
        vs = [f"{r[k]:.2f}x" if k in r else "—" for k in (f"vs_{LAX}", f"vs_{SHIFT}")]
        peak = "—" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.0f}"
        copy = f"{100 * r['frac_copy']:.0f}%" if "frac_copy" in r else "—"
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['mode']} | {r['implementation']} | {ms(r['median_s'])} "
            f"| {ms(r['p20_s'])}-{ms(r['p80_s'])} | {ms(r['roofline_s'])} ({100 * r['frac_roofline']:.0f}%) "
            f"| {copy} | {vs[0]} | {vs[1]} | {peak} | {leak_cell(r)} | {nan_cell(r)} |"
        )
    return "\n".join(lines)


def targets(rows: list[dict]) -> str:
    """The library's goals, per shape and dtype: forward+backward within 1.25x of the shift-and-add (the
    simplest exact formulation) and at least 8x faster than lax.conv's depthwise convolution."""
    lines = [f"| shape | dtype | implementation | time / {SHIFT}'s (<= 1.25) | {LAX}'s time / this (>= 8) |",
             "|---|---|---|---:|---:|"]
    for r in rows:
        timed = f"vs_{SHIFT}" in r and f"vs_{LAX}" in r
        if r["implementation"] not in (LAX, SHIFT) and r["mode"] == "fwd+bwd" and timed:
            over_shift, over_lax = 1 / r[f"vs_{SHIFT}"], r[f"vs_{LAX}"]
            mark = lambda ok: "" if ok else " **missed**"  # noqa: E731
            lines.append(f"| {r['shape']} | {r['dtype']} | {r['implementation']} | {over_shift:.2f}x"
                         f"{mark(over_shift <= 1.25)} | {over_lax:.1f}x{mark(over_lax >= 8)} |")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    roofline_bars([r for r in rows if r["mode"] == "fwd+bwd"], path, "dtype", "fraction of the memory roofline (fwd+bwd)",
                  "causal conv1d, forward + backward", sort=True)


def is_rows(rows: list[dict]) -> bool:
    """Whether ``rows`` (a ``.jsonl`` read back) are this benchmark's."""
    return bool(rows) and all("ideal_bytes" in r and "implementation" in r and "mode" in r for r in rows)


def write_outputs(rows: list[dict], out: Path | None, chart_too: bool) -> None:
    """Prints the tables; with ``out``, also writes ``out.md`` and (``chart_too``) ``out.png``."""
    text = header(rows) + "\n\n" + markdown(rows) + "\n\n## Goals (forward+backward; bold: missed)\n\n" \
        + targets(rows) + "\n"
    diffs = [f"{r['implementation']} {r['shape']} {r['dtype']} {r['mode']}: {r['max_abs_diff_vs_shift']:.3g}"
             for r in rows if "max_abs_diff_vs_shift" in r]
    if diffs:
        text += f"\nmax |difference| from {SHIFT}: " + "; ".join(diffs) + "\n"
    publish(text, rows, out, chart_too, chart)


def add_arguments(parser) -> None:
    add_grid_arguments(parser, PRESETS, "cpu: a Mamba-2 layer in widths 2, 3, 4 and 8, float32 and bfloat16; gpu, tpu: "
                       "Mamba-2 and gated-DeltaNet layers at 2k-8k tokens and causal-conv1d's B=4, L=16384, D=4128; "
                       "quick: one tiny shape, the fused kernels interpreted off a GPU",
                       "a substring of shape names (B<batch>_L<length>_D<dim>_W<width>)", MODES)


def run(args) -> int:
    """Times the grid; rows to ``args.prefix``.jsonl as they come, then the tables and the chart."""
    platform_name = jax.default_backend()
    name, preset, shapes = select(args, PRESETS, platform_name)
    if not shapes:
        return 2
    out = args.prefix
    meta = metadata(name, args.command)
    bandwidth, measured = roofline_bandwidth(platform_name, preset)
    meta = {**meta, "measured_bandwidth_bytes_per_s": measured}
    rates = copy_rates(platform_name, preset)
    found = formulations(platform_name, name)
    rows = run_grid(cells(shapes, preset),
                    lambda i, *cell: run_cell(*cell, preset, meta, bandwidth, found, compare=i == 0, rates=rates),
                    out, args.time_budget, f"{meta['device']} (preset {name})")
    write_outputs(rows, out, chart_too=not args.no_chart)
    return 0 if rows and not any("error" in r for r in rows) else 1
