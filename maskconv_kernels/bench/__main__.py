"""``python -m maskconv_kernels.bench [MODE] [options]``: the benchmarks' command line.

The mode comes first (``conv`` when none is given); each mode module supplies
``add_arguments(parser)``, ``run(args)``, ``is_rows(rows)`` and ``write_outputs(rows,
prefix, chart_too)``. Here: the output folder, the file names and the ``render`` mode.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import shlex
import sys
from pathlib import Path

from .timing import preset_name

# mode -> (module, what it measures)
MODES = {
    "conv": ("conv", "masked_conv against lax.conv_general_dilated(x, kernel * mask) at layers of PixelCNN, "
             "PixelCNN++, gated PixelCNN and WaveNet: forward, backward, forward+backward, with the leaked "
             "gradient and NaN isolation measured on the timed executables"),
    "sequence": ("sequence", "causal_conv1d against lax.conv's depthwise convolution and a shift-and-add at "
                 "Mamba-2 and gated-DeltaNet shapes (forward, backward, both, one decode step), with the "
                 "memory roofline"),
    "causal_conv": ("causal_conv", "causal_conv against jnp.pad + lax.conv (VALID on time) at video VAE and audio "
                    "codec layers (forward, forward+backward), and causal_conv_stream against a concatenating cache "
                    "(one chunk, against its share of the full pass), with each executable's memory"),
    "serving": ("serving", "a serving scheduler's step (causal_conv1d_step: decode rows, prefill chunks mixed with "
                "them, prefix caching on) over a pool of float32 states against the bytes it must move and against "
                "gather + lax.conv + scatter, with NaN isolation of the slots it does not read"),
    "roofline": ("roofline", "each linear map of the xla backend (forward, input gradient, weight gradient) "
                 "against a GEMM of the same FLOPs, and its extra memory"),
    "decode": ("decode", "generation with decode caches against naive generation, on the repository's example "
               "models (a gated PixelCNN, a WaveNet-style stack; needs flax and a clone of the repository)"),
}

# Each mode's presets' wall time, compilation included, on a 2-core x86 VM (docs/performance.md
# gives the measurements; a loaded machine takes longer).
ESTIMATES = {
    ("conv", "cpu"): "3-5 min on a 2-core x86 VM",
    ("conv", "quick"): "15-20 s on a 2-core x86 VM",
    ("causal_conv", "cpu"): "3-5 min on a 2-core x86 VM",
    ("causal_conv", "quick"): "10-15 s on a 2-core x86 VM",
}

EPILOG = """\
Estimates (measured, compilation included): conv --preset cpu {conv_cpu}; --preset quick {conv_quick};
causal_conv --preset cpu {causal_cpu}.
On a GPU, --preset gpu times device-filling batches in three dtypes: give it a --time-budget.

Every run writes PREFIX.jsonl (a row per measurement: figures, device, CPU, load average,
jax/jaxlib/Python/package versions, git commit when run from a checkout, UTC time, the
command) as it goes, then PREFIX.md (the tables) and PREFIX.png (a chart, with matplotlib),
where PREFIX is DIR/NAME: --out DIR (default: a new folder maskconv-bench-MODE-<time> under
the current directory) and --name NAME (default MODE_<platform>). Tables go to stdout,
progress to stderr.

Examples:
  python -m maskconv_kernels.bench --preset cpu --out results
  python -m maskconv_kernels.bench conv --shapes 3x3B --dtypes bfloat16 --modes fwd+bwd
  python -m maskconv_kernels.bench sequence --quick
  python -m maskconv_kernels.bench causal_conv --preset cpu --out results
  python -m maskconv_kernels.bench render results/conv_cpu.jsonl
"""


def _module(mode: str):
    return importlib.import_module(f"{__package__}.{MODES[mode][0]}")


def _output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", help="the folder to write into (created if missing; default: a new "
                        "folder maskconv-bench-MODE-<time> under the current directory)")
    parser.add_argument("--name", metavar="NAME", help="the files' name, without suffix (default MODE_<platform>)")
    parser.add_argument("--no-chart", action="store_true", help="write no chart")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m maskconv_kernels.bench",
        description="Benchmarks of maskconv-kernels on this machine's default device: is it exact, and is it "
        "faster than what JAX users write today? MODE defaults to conv.",
        epilog=EPILOG.format(conv_cpu=ESTIMATES[("conv", "cpu")], conv_quick=ESTIMATES[("conv", "quick")],
                             causal_cpu=ESTIMATES[("causal_conv", "cpu")]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    modes = parser.add_subparsers(dest="mode", metavar="MODE")
    for mode, (_, what) in MODES.items():
        sub = modes.add_parser(mode, help=what, description=f"Times {what}.")
        _module(mode).add_arguments(sub)
        _output_options(sub)
    render = modes.add_parser("render", help="print the tables of an earlier (or interrupted) run's .jsonl; with "
                              "--out, write its .md and chart there", description="Print the tables of an earlier "
                              "(or interrupted) run's rows; with --out, also write its .md and chart there.")
    render.add_argument("jsonl", type=Path, help="a .jsonl any mode wrote")
    render.add_argument("--out", metavar="DIR", help="also write NAME.md (and NAME.png) into DIR")
    render.add_argument("--name", metavar="NAME", help="the files' name (default: the .jsonl's)")
    render.add_argument("--no-chart", action="store_true", help="write no chart")
    return parser


def _new_folder(mode: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path.cwd() / f"maskconv-bench-{mode}-{stamp}"
    folder, i = base, 1
    while folder.exists():
        i += 1
        folder = base.with_name(f"{base.name}-{i}")
    return folder


def prefix(args, platform_name: str) -> Path:
    """``DIR/NAME``, the path every file of a run starts with; creates ``DIR``."""
    folder = Path(args.out) if args.out else _new_folder(args.mode)
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"--out {folder} is a file; pass a folder to write into")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (args.name or f"{args.mode}_{platform_name}")


def render(args) -> int:
    """Prints (and with ``--out``, writes) the tables of a ``.jsonl`` whichever mode wrote it."""
    try:
        rows = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise SystemExit(f"cannot read {args.jsonl}: {e.strerror}") from None
    if not rows:
        print(f"{args.jsonl} holds no rows", file=sys.stderr)
        return 1
    for mode in MODES:
        module = _module(mode)
        if module.is_rows(rows):
            out = None
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                out = Path(args.out) / (args.name or args.jsonl.name.removesuffix(".jsonl"))
            module.write_outputs(rows, out, chart_too=not args.no_chart)
            return 0
    print(f"{args.jsonl}: rows of no benchmark of {list(MODES)}", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in (*MODES, "render") and argv[0] not in ("-h", "--help")):
        argv = ["conv", *argv]
    args = build_parser().parse_args(argv)
    if args.mode == "render":
        return render(args)
    import jax

    args.command = "python -m maskconv_kernels.bench " + shlex.join(argv)
    if getattr(args, "list_shapes", False):
        return _module(args.mode).run(args)
    platform_name = jax.default_backend()
    args.prefix = prefix(args, platform_name)
    presets = getattr(_module(args.mode), "PRESETS", ())  # what auto picks from, as the mode's run() does
    estimate = ESTIMATES.get((args.mode, preset_name(args, platform_name, presets)), "not measured for this preset")
    print(f"maskconv-kernels benchmark {args.mode}: writing {args.prefix}.* (estimate: {estimate})",
          file=sys.stderr, flush=True)
    try:
        return _module(args.mode).run(args)
    finally:
        folder = args.prefix.parent
        if not args.out and not any(folder.iterdir()):  # a run that wrote nothing leaves no folder behind
            folder.rmdir()


if __name__ == "__main__":
    sys.exit(main())
