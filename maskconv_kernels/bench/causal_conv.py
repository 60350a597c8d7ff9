"""Causal convolutions along time: ``causal_conv`` against the padding and the cache users write by hand.

    python -m maskconv_kernels.bench causal_conv --preset cpu --out DIR

At layers of video VAEs and audio codecs (:data:`.shapes.CAUSAL_SHAPES`) it times, in one
process with samples interleaved (:mod:`.timing`):

* ``fwd`` and ``fwd+bwd`` (``y``; ``y`` and the gradients of x, kernel and bias): the
  full pass, ``causal_conv`` against the code written today, ``jnp.pad`` along time
  (zeros, or ``mode="edge"`` for ``"replicate"``) then ``lax.conv_general_dilated`` with
  ``VALID`` on time (``"SAME"`` on the other axes);
* ``stream``: one chunk of a stream (``chunk`` frames, jitted for that shape, after a
  first chunk), ``causal_conv_stream`` against a concatenating cache (the previous
  ``k_T - 1`` frames concatenated with the chunk, ``VALID`` on time, the tail kept), each
  set against its share of its own full pass (``chunk / T`` of the full pass's time,
  timed in the same interleaved samples).

Both sides accumulate in float32, add the bias there and round once, so they compute the
same values (``max_abs_diff`` in each row of ours: measured on the timed executables).
Beside each time: ``temp_bytes + output_bytes`` of the compiled executable
(``compiled.memory_analysis()``), ours next to the baseline's: ``jnp.pad`` makes a padded
copy of x, ``causal_conv`` pads inside the convolution. Writes ``PREFIX.jsonl`` (rows with
the machine's metadata) as it goes, then ``PREFIX.md`` and ``PREFIX.png``; prints the
tables and the targets last: full pass at least as fast as the baseline (``>= 1.0x``)
with no more memory; a streamed chunk within ``1.25x`` of its share of the full pass.
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..ops.causal_conv import causal_conv, causal_conv_stream
from .chart import publish
from .exactness import differences, measure
from .machine import cache_bytes, header, metadata
from .shapes import CAUSAL_SHAPES, CausalShape
from .table import leak_cell, mib, ms, nan_cell
from .timing import DTYPES, Preset, add_grid_arguments, memory, n_input_sets, quantile, run_grid, select, time_interleaved

MODES = ("fwd", "fwd+bwd", "stream")
OURS, BASELINE = "causal_conv", "jnp.pad + lax.conv"
STREAM_OURS, STREAM_BASELINE = "causal_conv_stream", "concat cache + lax.conv"
SPEED_TARGET, STREAM_TARGET = 1.0, 1.25  # ours / baseline speed at least; chunk time / its share at most


def _tiny(name, frames, spatial, c_in, c_out, window, stride, padding_mode, chunk):
    return CausalShape(name, "video" if spatial else "audio", frames, spatial, c_in, c_out, window, stride, padding_mode,
                       chunk, batch=1, small_batch=1, cpu=False)


PRESETS = {
    # The cheaper layers of each family at batch 1, float32 (the CPU's dtype).
    "cpu": (Preset(False, ("float32",), MODES, samples=7, min_sample_s=0.05, warmup=1, max_input_sets=1, peak_n=0),
            tuple(s for s in CAUSAL_SHAPES if s.cpu)),
    # Every layer at the real sizes, bfloat16 then float32.
    "gpu": (Preset(True, ("bfloat16", "float32"), MODES, samples=15, min_sample_s=0.002, warmup=2, max_input_sets=4,
                   peak_n=0),
            CAUSAL_SHAPES),
    # A TPU: every layer at the real sizes, as the GPU's.
    "tpu": (Preset(True, ("bfloat16", "float32"), MODES, samples=15, min_sample_s=0.002, warmup=2, max_input_sets=4,
                   peak_n=0),
            CAUSAL_SHAPES),
    # A smoke test (CI, tests): two tiny layers, both padding modes, both strides.
    "quick": (Preset(False, ("float32",), MODES, samples=2, min_sample_s=0.0, warmup=1, max_input_sets=1, peak_n=0),
              (_tiny("tiny_video_3x3x3_C8_T5_6x6_replicate", 5, (6, 6), 8, 8, (3, 3, 3), 1, "replicate", 2),
               _tiny("tiny_audio_k4_s2_C8-16_L64", 64, (), 8, 16, (4,), 2, "zeros", 8))),
}


# --------------------------------------------------------------------------- the formulations


def _layer(shape: CausalShape) -> dict:
    """``causal_conv``'s keyword arguments for the layer."""
    return {"strides": shape.strides, "padding_mode": shape.padding_mode}


def _dimension_numbers(shape: CausalShape):
    return {0: ("NWC", "WIO", "NWC"), 1: ("NHWC", "HWIO", "NHWC"), 2: ("NDHWC", "DHWIO", "NDHWC")}[len(shape.spatial)]


def _lax_conv_valid_time(xp, kernel, bias, shape: CausalShape, x_dtype):
    """``lax.conv`` of an input already padded along time: ``VALID`` there, ``"SAME"`` (stride 1) on the others."""
    pads = [(0, 0)] + [((k - 1) // 2, k - 1 - (k - 1) // 2) for k in shape.window[1:]]
    y = lax.conv_general_dilated(xp, kernel, shape.strides, pads, dimension_numbers=_dimension_numbers(shape),
                                 preferred_element_type=jnp.float32)
    return (y + bias.astype(jnp.float32)).astype(x_dtype)


def baseline(shape: CausalShape):
    """``f(x, kernel, bias)``: ``jnp.pad`` along time, then ``lax.conv`` ``VALID`` on time."""
    context = shape.window[0] - 1

    def f(x, kernel, bias):
        widths = [(0, 0), (context, 0)] + [(0, 0)] * (x.ndim - 2)
        xp = jnp.pad(x, widths, mode="edge" if shape.padding_mode == "replicate" else "constant")
        return _lax_conv_valid_time(xp, kernel, bias, shape, x.dtype)

    return f


def ours(shape: CausalShape):
    """``f(x, kernel, bias)``: :func:`~maskconv_kernels.causal_conv`."""
    layer = _layer(shape)
    return lambda x, kernel, bias: causal_conv(x, kernel, bias, **layer)


def baseline_step(shape: CausalShape):
    """``step(chunk, cache, kernel, bias) -> (y, cache)``: the previous ``k_T - 1`` frames concatenated with
    the chunk, ``VALID`` on time, the last ``k_T - 1`` frames kept (a chunk a multiple of the stride)."""
    context = shape.window[0] - 1

    def step(chunk, cache, kernel, bias):
        xe = jnp.concatenate([cache, chunk], axis=1)
        return _lax_conv_valid_time(xe, kernel, bias, shape, chunk.dtype), xe[:, xe.shape[1] - context:]

    return step


def ours_step(shape: CausalShape):
    """``step(chunk, state, kernel, bias) -> (y, state)``: :func:`~maskconv_kernels.causal_conv_stream`."""
    layer = _layer(shape)
    return lambda chunk, state, kernel, bias: causal_conv_stream(chunk, state, kernel, bias, **layer)


def mode_fn(conv, mode: str):
    """``f(x, kernel, bias, dy)``; ``fwd`` ignores ``dy``; ``fwd+bwd`` gives ``y`` and the three gradients."""
    if mode == "fwd":
        return lambda x, k, b, dy: conv(x, k, b)

    def fwd_bwd(x, k, b, dy):
        y, pull = jax.vjp(conv, x, k, b)
        return y, pull(dy)

    return fwd_bwd


def _inputs(shape: CausalShape, batch: int, dtype, n_sets: int):
    """``(x, kernel, bias, dy)`` per set: unit-variance inputs and outputs (drawn by NumPy: nothing to compile)."""
    sets = []
    fan_in = int(np.prod(shape.window)) * shape.c_in
    out_shape = (batch, shape.out_frames, *shape.spatial, shape.c_out)
    for i in range(n_sets):
        rng = np.random.default_rng(200 + i)
        draw = lambda shape_, scale=1.0: jnp.asarray(  # noqa: E731
            (rng.standard_normal(shape_, np.float32) * np.float32(scale)).astype(dtype))
        sets.append((draw(shape.x_shape(batch)), draw(shape.kernel_shape, 1 / np.sqrt(fan_in)),
                     draw((shape.c_out,), 0.1), draw(out_shape)))
    return jax.block_until_ready(sets)


def stream_inputs(shape: CausalShape, full_sets) -> dict:
    """Each side's arguments for the second chunk of a stream, after a first chunk of ``chunk`` frames:
    ``{OURS_STEP: [(chunk, state, k, b)], BASELINE_STEP: [(chunk, cache, k, b)]}``."""
    n, context = shape.chunk, shape.window[0] - 1
    first_step = jax.jit(ours_step(shape))
    found = {STREAM_OURS: [], STREAM_BASELINE: []}
    for x, k, b, _ in full_sets:
        _, state = first_step(x[:, :n], None, k, b)
        found[STREAM_OURS].append((x[:, n:2 * n], state, k, b))
        found[STREAM_BASELINE].append((x[:, n:2 * n], x[:, n - context:n], k, b))
    return jax.block_until_ready(found)


# --------------------------------------------------------------------------- a cell


def _compile(fn, args, row: dict):
    """``fn`` lowered and compiled for ``args``; times and memory into ``row``."""
    t = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    row["lower_s"] = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    row["compile_s"] = time.perf_counter() - t
    row.update(memory(compiled))
    if row.get("temp_bytes") is not None:
        row["mem_bytes"] = row["temp_bytes"] + row["output_bytes"]
    return compiled


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def run_cell(shape: CausalShape, dtype_name: str, mode: str, preset: Preset, meta: dict,
             platform_name: str = "cpu") -> list[dict]:
    """One cell (shape, dtype, mode): a row for ours, one for the baseline."""
    dtype = DTYPES[dtype_name]
    batch = shape.batch if preset.full_batch else shape.small_batch
    itemsize = np.dtype(dtype).itemsize
    set_bytes = itemsize * (math.prod(shape.x_shape(batch)) + math.prod(shape.kernel_shape)
                            + batch * shape.out_frames * math.prod(shape.spatial) * shape.c_out)
    full_sets = _inputs(shape, batch, dtype, n_input_sets(set_bytes, cache_bytes(platform_name),
                                                          preset.max_input_sets))
    base = {"shape": shape.name, "family": shape.family, "dtype": dtype_name, "mode": mode, "batch": batch,
            "frames": shape.frames, "spatial": list(shape.spatial), "c_in": shape.c_in, "c_out": shape.c_out,
            "window": list(shape.window), "time_stride": shape.stride, "padding_mode": shape.padding_mode,
            "chunk": shape.chunk, "x_shape": list(shape.x_shape(batch)), "flops_fwd": shape.flops(batch),
            "input_sets": len(full_sets), **meta}
    if mode == "stream":
        pairs = {STREAM_OURS: (ours_step(shape), OURS, ours(shape)),
                 STREAM_BASELINE: (baseline_step(shape), BASELINE, baseline(shape))}
        argsets = {**stream_inputs(shape, full_sets)}
        full_args = [s[:3] for s in full_sets]
        fns = {name: step for name, (step, _, _) in pairs.items()}
        fns.update({full: f for _, full, f in pairs.values()})
        argsets.update({full: full_args for _, full, _ in pairs.values()})
    else:
        fns = {OURS: mode_fn(ours(shape), mode), BASELINE: mode_fn(baseline(shape), mode)}
        argsets = {name: full_sets for name in fns}
    rows, compiled = {}, {}
    for name, fn in fns.items():
        row = dict(base, implementation=name)
        try:
            compiled[name] = _compile(fn, argsets[name][0], row)
        except Exception as e:  # report it and carry on with the other
            row["error"] = _error(e)
        rows[name] = row
    try:
        times = time_interleaved(compiled, {name: argsets[name] for name in compiled}, preset)
    except Exception as e:
        times = {}
        for name in compiled:
            rows[name]["error"] = f"timing failed: {_error(e)}"
    for name, ts in times.items():
        rows[name].update(median_s=statistics.median(ts), p20_s=quantile(ts, 0.2), p80_s=quantile(ts, 0.8),
                          samples=len(ts))
    if mode != "stream":
        for name in times:
            measure(compiled[name], mode, argsets[name][0], rows[name], shape.stride)
    if mode == "stream":
        for step_name, (_, full, _) in pairs.items():
            row = rows[step_name]
            if "median_s" in row and "median_s" in rows.get(full, {}):
                row["full_pass_s"] = rows[full]["median_s"]
                row["share_s"] = shape.chunk / shape.frames * row["full_pass_s"]
                row["vs_share"] = row["median_s"] / row["share_s"]
        first, second = STREAM_OURS, STREAM_BASELINE
        out = [rows[STREAM_OURS], rows[STREAM_BASELINE]]
    else:
        first, second = OURS, BASELINE
        out = [rows[OURS], rows[BASELINE]]
    if "median_s" in rows[first] and "median_s" in rows[second]:
        rows[first]["speedup"] = rows[second]["median_s"] / rows[first]["median_s"]
        rows[second]["speedup"] = 1.0
    if first in compiled and second in compiled:
        try:  # like with like: the timed executables' outputs (and, streaming, new states' frames)
            a, b = compiled[first](*argsets[first][0]), compiled[second](*argsets[second][0])
            if mode == "stream":
                a = (a[0], a[1].frames)
            rows[first]["max_abs_diff"] = differences(a, b)["max_abs_diff"]
        except Exception as e:
            rows[first]["max_abs_diff_error"] = _error(e)
    return out


def cells(shapes, preset: Preset):
    """The first dtype before the others (a time budget cuts the rest); in it, shape by shape, every mode."""
    return [(s, d, m) for d in preset.dtypes for s in shapes for m in preset.modes]


# --------------------------------------------------------------------------- output


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _pairs(rows: list[dict]):
    """``(ours, baseline)`` row pairs per shape, dtype and mode, in the rows' order."""
    found: dict[tuple, dict] = {}
    for r in rows:
        found.setdefault((r["shape"], r["dtype"], r["mode"]), {})[r["implementation"]] = r
    for key, by in found.items():
        mine = by.get(STREAM_OURS if key[2] == "stream" else OURS)
        theirs = by.get(STREAM_BASELINE if key[2] == "stream" else BASELINE)
        if mine is not None and theirs is not None:
            yield mine, theirs


def markdown(rows: list[dict]) -> str:
    lines = [
        "Median ms (p20-p80 over samples); memory = temp + output bytes of the compiled executable "
        "(`memory_analysis()`); speed-up = the baseline's median / this row's. `stream`: one chunk of "
        "`chunk` frames after a first chunk; its share = chunk / T of the same side's full pass (timed in the "
        "same samples); measured on the timed executables, leak = max |dx| at frames after the one output "
        "frame given a cotangent, NaN-isolated = output frames before NaN input frames stay bit-identical.",
        "",
        "| shape | N | dtype | mode | implementation | median ms | p20-p80 ms | speed-up | memory MiB "
        "| full pass ms | chunk / share | compile s | max abs diff | leak | NaN-isolated |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['dtype']} | {r['mode']} | {r['implementation']} "
                         f"| error: {r['error'][:80]} ||||||||||")
            continue
        if "median_s" not in r:
            continue
        share = f"{r['vs_share']:.2f}x" if "vs_share" in r else "—"
        diff = f"{r['max_abs_diff']:.2g}" if "max_abs_diff" in r else "—"
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "—"
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['dtype']} | {r['mode']} | {r['implementation']} "
            f"| {ms(r['median_s'])} | {ms(r['p20_s'])}-{ms(r['p80_s'])} | {speed} "
            f"| {mib(r.get('mem_bytes'), '.3g')} "
            f"| {ms(r.get('full_pass_s'))} | {share} | {r['compile_s']:.2f} | {diff} | {leak_cell(r)} "
            f"| {nan_cell(r)} |"
        )
    return "\n".join(lines)


def targets(rows: list[dict]) -> str:
    """The targets, per shape and dtype: the full pass (``fwd``, ``fwd+bwd``) at least as fast as the baseline
    with no more memory; a streamed chunk within 1.25x of its share of the full pass."""
    full = [f"| shape | dtype | mode | {BASELINE} ms | {OURS} ms | speed-up (>= {SPEED_TARGET:.1f}x) "
            f"| {BASELINE} MiB | {OURS} MiB | no more memory |",
            "|---|---|---|---:|---:|---:|---:|---:|---|"]
    stream = [f"| shape | dtype | chunk | {STREAM_OURS} ms | its share ms | chunk / share (<= {STREAM_TARGET}x) "
              f"| {STREAM_BASELINE} ms | its chunk / share | {STREAM_OURS} MiB | {STREAM_BASELINE} MiB |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mine, theirs in _pairs(rows):
        if "median_s" not in mine or "median_s" not in theirs:
            continue
        if mine["mode"] == "stream":
            if "vs_share" not in mine:
                continue
            ratio = mine["vs_share"]
            ok = "" if ratio <= STREAM_TARGET else " **missed**"
            other = f"{theirs['vs_share']:.2f}x" if "vs_share" in theirs else "—"
            stream.append(f"| {mine['shape']} | {mine['dtype']} | {mine['chunk']} | {ms(mine['median_s'])} "
                          f"| {ms(mine['share_s'])} | {ratio:.2f}x{ok} | {ms(theirs['median_s'])} | {other} "
                          f"| {mib(mine.get('mem_bytes'), '.3g')} | {mib(theirs.get('mem_bytes'), '.3g')} |")
        else:
            speed = mine["speedup"]
            ok = "" if speed >= SPEED_TARGET else " **missed**"
            m, t = mine.get("mem_bytes"), theirs.get("mem_bytes")
            mem_ok = "—" if m is None or t is None else _mark(m <= t)
            full.append(f"| {mine['shape']} | {mine['dtype']} | {mine['mode']} | {ms(theirs['median_s'])} "
                        f"| {ms(mine['median_s'])} | {speed:.2f}x{ok} | {mib(t, '.3g')} | {mib(m, '.3g')} | {mem_ok} |")
    return ("Full pass: the baseline's time / ours, and memory (temp + output):\n\n" + "\n".join(full)
            + "\n\nStreaming: one chunk's time / its share of the same side's full pass (chunk / T of it):\n\n"
            + "\n".join(stream))


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [(m, t) for m, t in _pairs(rows) if "median_s" in m and "median_s" in t]
    labels = list(dict.fromkeys(f"{m['shape']}\n{m['dtype']}" for m, _ in pairs))
    if not labels:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(labels) + 1.8), sharey=True)
    ys = {label: i for i, label in enumerate(labels)}
    height = 0.8 / 3
    for j, mode in enumerate(("fwd", "fwd+bwd")):
        got = [(ys[f"{m['shape']}\n{m['dtype']}"], m["speedup"]) for m, _ in pairs if m["mode"] == mode]
        left.barh([y + (j - 0.5) * height for y, _ in got], [v for _, v in got], height, label=mode)
    left.axvline(SPEED_TARGET, color="black", linewidth=0.8)
    left.set_xlabel(f"{BASELINE} time / {OURS} time (full pass; >= 1: ours as fast or faster)")
    for j, (side, name) in enumerate(((0, STREAM_OURS), (1, STREAM_BASELINE))):
        got = [(ys[f"{m['shape']}\n{m['dtype']}"], (m, t)[side]["vs_share"]) for m, t in pairs
               if m["mode"] == "stream" and "vs_share" in (m, t)[side]]
        right.barh([y + (j - 0.5) * height for y, _ in got], [v for _, v in got], height, label=name)
    right.axvline(STREAM_TARGET, color="black", linewidth=0.8)
    right.set_xlabel(f"one chunk's time / its share of the full pass (<= {STREAM_TARGET})")
    left.set_yticks(range(len(labels)), labels, fontsize=7)
    left.invert_yaxis()
    for ax in (left, right):
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"causal_conv: {rows[0]['device']}, jax {rows[0]['jax']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def is_rows(rows: list[dict]) -> bool:
    """Whether ``rows`` (a ``.jsonl`` read back) are this benchmark's."""
    return bool(rows) and all("padding_mode" in r and "chunk" in r and "implementation" in r for r in rows)


def write_outputs(rows: list[dict], out: Path | None, chart_too: bool) -> None:
    """Prints the tables, the targets last; with ``out``, also writes ``out.md`` and (``chart_too``) ``out.png``."""
    text = (header(rows) + "\n\n## All rows\n\n" + markdown(rows) + "\n\n## Targets (bold: missed)\n\n"
            + targets(rows) + "\n")
    publish(text, rows, out, chart_too, chart)


def add_arguments(parser) -> None:
    add_grid_arguments(parser, PRESETS, "cpu: the cheaper video and audio layers at batch 1, float32; gpu: every "
                       "layer at its real size, bfloat16 and float32; quick: two tiny layers, seconds",
                       "a substring of shape names (see --list-shapes)", MODES)
    parser.add_argument("--list-shapes", action="store_true", help="print the shapes and exit")


def run(args) -> int:
    """Times the grid; rows to ``args.prefix``.jsonl as they come, then the tables and the chart."""
    platform_name = jax.default_backend()
    if args.list_shapes:
        for s in CAUSAL_SHAPES:
            print(f"{s.name}: x (N, {', '.join(map(str, (s.frames, *s.spatial)))}, {s.c_in}), kernel "
                  f"{s.kernel_shape}, time stride {s.stride}, {s.padding_mode}, chunks of {s.chunk}, N={s.batch} "
                  f"(gpu) / {s.small_batch} (cpu){', in the cpu preset' if s.cpu else ''}")
        return 0
    name, preset, shapes = select(args, PRESETS, platform_name)
    if not shapes:
        return 2
    out = args.prefix
    meta = metadata(name, args.command)
    rows = run_grid(cells(shapes, preset), lambda _, *cell: run_cell(*cell, preset, meta, platform_name), out,
                    args.time_budget, f"{meta['device']} (preset {name})")
    if rows:
        write_outputs(rows, out, chart_too=not args.no_chart)
    return 0 if rows and not any("error" in r for r in rows) else 1
