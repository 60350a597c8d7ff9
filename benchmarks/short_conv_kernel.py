"""Times ``causal_conv1d``'s fused Pallas kernels beside the XLA shift-and-add and cuDNN's depthwise convolution.

    python -m benchmarks.short_conv_kernel --out benchmarks/results/short_conv   # on a GPU
    python -m benchmarks.short_conv_kernel --quick       # anywhere: tiny shapes, kernels interpreted (tests the script)

At Mamba-2 / gated DeltaNet shapes (``B, L, D``, width 4) in bfloat16 and float32, each
of ``y = silu(conv(x) + bias)`` computed three ways:

* ``pallas_triton``: ``causal_conv1d(implementation="pallas_triton")``, the fused
  kernels of :mod:`maskconv_kernels.short_conv_kernels`;
* ``xla``: ``causal_conv1d(implementation="xla")``, the shift-and-add (a sum over taps
  of shifted inputs times weights) that XLA fuses with the bias and SiLU;
* ``lax_conv``: ``lax.conv_general_dilated(..., feature_group_count=D)``, cuDNN's
  depthwise convolution on NVIDIA GPUs, then the bias and SiLU;

in modes ``fwd`` (``y``), ``bwd`` (``dx, dweight, dbias`` given ``dy``; the unused
forward is dead code) and ``fwd+bwd``. Beside each time, the HBM roofline: the bytes a
pass must move (every ``(B, L, D)`` array read or written once: ``x`` and ``y`` forward,
``x``, ``dy`` and ``dx`` backward, the forward's and the backward's together for
``fwd+bwd``, as a training step runs them) over 4.8 TB/s, the H200's bandwidth, and the
fraction of it reached. The first cell's outputs of the three are compared (max
difference from ``xla``). Timing and metadata are :mod:`benchmarks.run`'s: samples
interleaved in one process, median and p20/p80, the machine, versions and commit on
every row.

Writes ``OUT.jsonl`` (a row per implementation, shape, dtype and mode) as it goes and
prints the table last; ``--render OUT.jsonl`` prints the table of an earlier run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maskconv_kernels.short_conv import causal_conv1d

from .run import DTYPES, MODES, Preset, metadata, quantile, time_interleaved

HBM_BYTES_PER_S = 4.8e12  # H200 (HBM3e)
IMPLEMENTATIONS = ("pallas_triton", "xla", "lax_conv")
# Arrays of shape (B, L, D) each mode moves once (reads and writes), the roofline's unit.
MODE_ARRAYS = {"fwd": 2, "bwd": 3, "fwd+bwd": 5}


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    length: int
    dim: int
    width: int = 4

    def bytes(self, mode: str, dtype) -> int:
        """Bytes a mode must move through HBM: its ``(B, L, D)`` arrays once, the weights and bias once."""
        arrays = MODE_ARRAYS[mode] * self.batch * self.length * self.dim * np.dtype(dtype).itemsize
        return arrays + (self.width + 1) * self.dim * 4 * (2 if mode == "fwd+bwd" else 1)


# Mamba-2 130M's conv channels (d_inner 1536) at 2k, a 2.7B-class GDN layer at 4k, and D=4096 at 8k.
SHAPES = (
    Shape("mamba2_B4_L2048_D1536", 4, 2048, 1536),
    Shape("gdn_B8_L4096_D2048", 8, 4096, 2048),
    Shape("B4_L8192_D4096", 4, 8192, 4096),
)
QUICK_SHAPES = (Shape("quick_B1_L40_D24", 1, 40, 24),)

PRESETS = {
    "gpu": Preset(True, ("bfloat16", "float32"), MODES, samples=15, min_sample_s=0.002, warmup=2,
                  max_input_sets=4, peak_n=0),
    # Interpreted kernels: one sample each, to test the script.
    "quick": Preset(False, ("float32",), MODES, samples=1, min_sample_s=0.0, warmup=0, max_input_sets=1, peak_n=0),
}


def layer(impl: str, shape: Shape, interpret: bool):
    """``y = silu(conv(x, w) + b)``, ``x: (B, L, D)``, ``w: (W, D)``, ``b: (D,)``, as ``impl`` computes it."""
    if impl == "lax_conv":
        def conv(x, w, b):
            # (B, L, D) with a (W, 1, D) kernel: depthwise, causal by W - 1 zeros in front.
            y = lax.conv_general_dilated(
                x, w[:, None, :].astype(x.dtype), (1,), [(shape.width - 1, 0)],
                dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=shape.dim,
                preferred_element_type=jnp.float32,
            )
            return jax.nn.silu(y + b).astype(x.dtype)

        return conv
    return lambda x, w, b: causal_conv1d(x, w, b, activation="silu", implementation=impl,
                                         interpret=interpret and impl == "pallas_triton")


def mode_fn(impl: str, shape: Shape, mode: str, interpret: bool):
    """``f(x, w, b, dy)`` for one mode; ``fwd`` ignores ``dy``."""
    conv = layer(impl, shape, interpret)
    if mode == "fwd":
        return lambda x, w, b, dy: conv(x, w, b)
    if mode == "bwd":
        return lambda x, w, b, dy: jax.vjp(conv, x, w, b)[1](dy)

    def fwd_bwd(x, w, b, dy):
        y, pull = jax.vjp(conv, x, w, b)
        return y, pull(dy)

    return fwd_bwd


def _inputs(shape: Shape, dtype, n_sets: int):
    sets = []
    for i in range(n_sets):
        rng = np.random.default_rng(100 + i)
        x = jnp.asarray(rng.standard_normal((shape.batch, shape.length, shape.dim), np.float32), dtype)
        w = jnp.asarray(rng.standard_normal((shape.width, shape.dim), np.float32) / 2)  # float32, as Mamba keeps them
        b = jnp.asarray(rng.standard_normal((shape.dim,), np.float32) / 2)
        dy = jnp.asarray(rng.standard_normal((shape.batch, shape.length, shape.dim), np.float32), dtype)
        sets.append((x, w, b, dy))
    return jax.block_until_ready(sets)


def cells(shapes, preset: Preset):
    """The most informative first: the first shape in every dtype and mode, then every fwd+bwd, then the rest."""
    grid = [(s, d, m) for s in shapes for d in preset.dtypes for m in preset.modes]
    first = lambda c: (c[0] != shapes[0], c[2] != "fwd+bwd", c[1] != preset.dtypes[0])  # noqa: E731
    return sorted(grid, key=first)


def run_cell(shape: Shape, dtype_name: str, mode: str, preset: Preset, meta: dict, interpret: bool,
             compare: bool) -> list[dict]:
    dtype = DTYPES[dtype_name]
    set_bytes = shape.bytes("fwd+bwd", dtype)
    n_sets = max(1, min(preset.max_input_sets, -(-2 * (60 << 20) // set_bytes)))  # rotate past a 60 MB L2
    argsets = _inputs(shape, dtype, n_sets)
    moved = shape.bytes(mode, dtype)
    base = {"shape": shape.name, "batch": shape.batch, "length": shape.length, "dim": shape.dim,
            "width": shape.width, "dtype": dtype_name, "weight_dtype": "float32", "activation": "silu",
            "mode": mode, "bytes": moved, "roofline_s": moved / HBM_BYTES_PER_S, "input_sets": n_sets, **meta}
    rows, compiled = {}, {}
    for impl in IMPLEMENTATIONS:
        row = dict(base, implementation=impl)
        try:
            fn = jax.jit(mode_fn(impl, shape, mode, interpret))
            t = time.perf_counter()
            lowered = fn.lower(*argsets[0])
            row["lower_s"] = time.perf_counter() - t
            t = time.perf_counter()
            compiled[impl] = lowered.compile()
            row["compile_s"] = time.perf_counter() - t
        except Exception as e:  # report and carry on: one broken implementation must not hide the rest
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        rows[impl] = row
    times = time_interleaved(compiled, argsets, preset) if compiled else {}
    for impl, ts in times.items():
        med = statistics.median(ts)
        rows[impl].update(median_s=med, p20_s=quantile(ts, 0.2), p80_s=quantile(ts, 0.8), samples=len(ts),
                          roofline_fraction=base["roofline_s"] / med)
    if compare and "xla" in compiled:
        reference = jax.tree_util.tree_leaves(compiled["xla"](*argsets[0]))
        for impl in compiled:
            got = jax.tree_util.tree_leaves(compiled[impl](*argsets[0]))
            rows[impl]["max_abs_diff_vs_xla"] = max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32)))) for a, r in zip(got, reference))
    return list(rows.values())


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def table(rows: list[dict]) -> str:
    """Markdown: per shape, dtype and mode, each implementation's median microseconds and fraction of the roofline."""
    if not rows:
        return "no rows"
    r0 = rows[0]
    head = (f"{r0['device']} | jax {r0['jax']} | commit {r0['commit'][:12]} | {r0['time_utc']} | "
            f"load {r0['loadavg_at_start']}\n\nmicroseconds (median; fraction of the HBM roofline at "
            f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s in brackets)\n\n")
    lines = ["| shape | dtype | mode | roofline | " + " | ".join(IMPLEMENTATIONS)
             + " | speed-up vs xla | speed-up vs lax_conv |",
             "|---|---|---|---:|" + "---:|" * (len(IMPLEMENTATIONS) + 2)]
    keyed: dict[tuple, dict] = {}
    for row in rows:
        keyed.setdefault((row["shape"], row["dtype"], row["mode"]), {})[row["implementation"]] = row
    for (shape, dtype, mode), by_impl in keyed.items():
        cells = []
        for impl in IMPLEMENTATIONS:
            row = by_impl.get(impl, {})
            cells.append(f"{_us(row['median_s'])} ({row['roofline_fraction']:.0%})" if "median_s" in row
                         else ("error" if "error" in row else "-"))
        ours = by_impl.get("pallas_triton", {}).get("median_s")
        ratio = lambda other: f"{by_impl[other]['median_s'] / ours:.2f}x" if ours and "median_s" in by_impl.get(other, {}) else "-"  # noqa: E731
        roof = _us(next(iter(by_impl.values()))["roofline_s"])
        lines.append(f"| {shape} | {dtype} | {mode} | {roof} | " + " | ".join(cells)
                     + f" | {ratio('xla')} | {ratio('lax_conv')} |")
    errors = [f"error: {r['implementation']} {r['shape']} {r['dtype']} {r['mode']}: {r['error']}" for r in rows if "error" in r]
    diffs = [f"{r['implementation']} {r['shape']} {r['dtype']} {r['mode']}: {r['max_abs_diff_vs_xla']:.3g}"
             for r in rows if "max_abs_diff_vs_xla" in r]
    extra = ("\n\nmax |difference| from xla: " + "; ".join(diffs)) if diffs else ""
    return head + "\n".join(lines) + extra + ("\n\n" + "\n".join(errors) if errors else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.short_conv_kernel", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, kernels interpreted off a GPU (tests the script)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", choices=MODES)
    parser.add_argument("--budget", type=float, default=None, help="seconds; stop starting new cells after this")
    parser.add_argument("--out", default=None, help="path prefix of the .jsonl (default benchmarks/results/short_conv_<platform>)")
    parser.add_argument("--render", metavar="JSONL", help="only print the table of an earlier (or interrupted) run")
    args = parser.parse_args(argv)
    if args.render:
        rows = [json.loads(line) for line in Path(args.render).read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0 if rows else 1

    on_gpu = jax.default_backend() == "gpu"
    name = "quick" if args.quick or not on_gpu else "gpu"
    preset = PRESETS[name]
    if args.dtypes:
        preset = dataclasses.replace(preset, dtypes=tuple(args.dtypes))
    if args.modes:
        preset = dataclasses.replace(preset, modes=tuple(args.modes))
    shapes = QUICK_SHAPES if name == "quick" else SHAPES
    meta = dict(metadata(name), command=" ".join(["python -m benchmarks.short_conv_kernel", *sys.argv[1:]]))
    out = Path(args.out or Path(__file__).parent / "results" / f"short_conv_{jax.default_backend()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    grid = cells(shapes, preset)
    print(f"{len(grid)} cells on {meta['device']} (preset {name}); writing {out}.jsonl", file=sys.stderr)
    start, rows = time.perf_counter(), []
    with open(f"{out}.jsonl", "w") as f:
        for i, (shape, dtype, mode) in enumerate(grid):
            if args.budget is not None and time.perf_counter() - start > args.budget:
                print(f"time budget of {args.budget:.0f} s spent: {len(grid) - i} cells skipped", file=sys.stderr)
                break
            print(f"  {shape.name} {dtype} {mode}", file=sys.stderr, flush=True)
            for row in run_cell(shape, dtype, mode, preset, meta, interpret=not on_gpu, compare=i == 0):
                rows.append(row)
                f.write(json.dumps(row) + "\n")
            f.flush()
    print(table(rows))
    return 0 if rows and not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
