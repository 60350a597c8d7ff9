"""Generation time, naive vs decode caches: gated PixelCNNs and a WaveNet-style 1-D stack.

    python -m maskconv_kernels.bench decode --out DIR      # from a clone of the repository

The models are the repository's examples (``examples/pixelcnn``, ``examples/wavenet``,
Flax), which an installed package does not include: run it from a clone, or point
``--examples`` at that folder. Naive generation runs the whole network over the whole
image (or sequence) once per generated pixel (``examples/pixelcnn/sampling.py:sample_naive``, a jitted
``lax.fori_loop``); cached generation runs each layer once per position from its decode
cache (``sample_cached``: ``MaskedConv(decode=True)``, one ``lax.scan``). Both draw from
the same key, so their samples must be identical; every row says how that was checked:

* ``full``: the naive sampler ran to the end, and its samples equal the cached ones;
* ``replay``: the naive sampler ran its first ``naive_steps`` positions (equal to the
  cached samples there), and one full forward pass over the cached samples redraws every
  pixel as naive sampling would (``resample_from_logits``: exact masking makes each
  position's logits independent of later pixels, bit for bit). Its time is the measured
  time per step times the number of positions: every naive step is the same full pass.

Times are medians over ``--reps`` runs (more for cheap cases) after one compiling call,
naive and cached runs interleaved in one process; the first (compiling) call is
reported separately.
Writes ``PREFIX.jsonl`` (one row per case, with the machine, versions and commit),
``PREFIX.md`` (the table) and ``PREFIX.png`` (time against image size, with matplotlib).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .chart import publish
from .machine import header, metadata, short_commit
from .timing import median_times


@dataclasses.dataclass(frozen=True)
class Case:
    """One generation problem: a gated PixelCNN image (``size x size``) or a WaveNet sequence."""

    name: str
    kind: str  # "pixelcnn" or "wavenet"
    size: int  # image side, or sequence length
    batch: int
    features: int
    layers: int
    naive_steps: int | None  # None: the naive sampler runs every position

    @property
    def positions(self) -> int:
        return self.size * self.size if self.kind == "pixelcnn" else self.size


CASES = (
    Case("digits_8x8", "pixelcnn", 8, 16, 32, 5, None),  # the example's model
    Case("gated_8x8", "pixelcnn", 8, 16, 64, 8, None),
    Case("gated_16x16", "pixelcnn", 16, 16, 64, 8, 32),
    Case("gated_28x28", "pixelcnn", 28, 16, 64, 8, 16),
    Case("gated_32x32", "pixelcnn", 32, 16, 64, 8, 16),
    Case("wavenet_L1024", "wavenet", 1024, 4, 32, 10, 64),
    Case("wavenet_L4096", "wavenet", 4096, 4, 32, 10, 32),
)
QUICK = (
    Case("digits_8x8", "pixelcnn", 8, 4, 32, 5, None),
    Case("gated_12x12", "pixelcnn", 12, 2, 16, 3, 16),
    Case("wavenet_L256", "wavenet", 256, 2, 16, 10, 16),
)


def _median_times(fns: dict, reps: int, budget_s: float = 6.0, max_reps: int = 25) -> dict:
    """Median seconds per function, calls interleaved (:func:`.timing.median_times`); the first call of
    each compiles, and is timed apart.

    Cheap cases get more than ``reps`` calls (up to ``max_reps``, within about
    ``budget_s``): their medians are the noisiest on a shared machine.
    """
    first = {}
    for name, fn in fns.items():
        t = time.perf_counter()
        jax.block_until_ready(fn())
        first[name] = time.perf_counter() - t
    t = time.perf_counter()
    for fn in fns.values():
        jax.block_until_ready(fn())
    reps = max(reps, min(max_reps, int(budget_s / (time.perf_counter() - t))))
    return median_times(fns, [()], reps, warmup=0), first, reps


def load_examples(folder: str | None) -> types.SimpleNamespace:
    """The example models and samplers, from ``folder`` (the repository's ``examples/``).

    Without ``folder``: ``./examples``, then the ``examples/`` of the checkout this package
    runs from (an editable install). They need Flax.
    """
    from .machine import _SOURCE

    candidates = [Path(folder)] if folder else [Path.cwd() / "examples", _SOURCE / "examples"]
    found = next((c for c in candidates if (c / "pixelcnn" / "sampling.py").is_file()
                  and (c / "wavenet" / "generate.py").is_file()), None)
    if found is None:
        raise SystemExit(
            f"decode times the repository's example models, and no examples folder was found at "
            f"{', '.join(str(c) for c in candidates)} (it needs pixelcnn/sampling.py and wavenet/generate.py): "
            "run it from a clone of the repository, or pass --examples PATH/TO/examples")
    if importlib.util.find_spec("flax") is None:
        raise SystemExit("decode's example models are Flax modules: pip install 'maskconv-kernels[flax]'")
    for sub in ("pixelcnn", "wavenet"):  # the examples import their siblings by bare name
        if str(found / sub) not in sys.path:
            sys.path.insert(0, str(found / sub))
    model, sampling, generate = (importlib.import_module(m) for m in ("model", "sampling", "generate"))
    return types.SimpleNamespace(
        GatedPixelCNN=model.GatedPixelCNN, sample_naive=sampling.sample_naive, sample_cached=sampling.sample_cached,
        resample_from_logits=sampling.resample_from_logits, WaveNet=generate.WaveNet,
        generate_naive=generate.generate_naive, generate_cached=generate.generate_cached,
        regenerate_from_logits=generate.regenerate_from_logits)


def run_case(case: Case, reps: int, ex: types.SimpleNamespace, seed: int = 0) -> dict:
    """One case: naive and cached generation timed, interleaved, and their samples compared."""
    key = jax.random.key(seed + 1)
    if case.kind == "pixelcnn":
        model = ex.GatedPixelCNN(levels=4, features=case.features, layers=case.layers)
        variables = model.init(jax.random.key(seed), jnp.zeros((1, case.size, case.size, 1)))
        shape = (case.size, case.size)
        naive = lambda: ex.sample_naive(model, variables, key, case.batch, shape, steps=case.naive_steps)  # noqa: E731
        cached = lambda: ex.sample_cached(model, variables, key, case.batch, shape)  # noqa: E731
        replay = lambda s: ex.resample_from_logits(model, variables, key, s)  # noqa: E731
    else:
        model = ex.WaveNet(channels=case.features, dilations=tuple(2**i for i in range(case.layers)))
        variables = model.init(jax.random.key(seed), jnp.zeros((1, case.size, 1)))
        naive = lambda: ex.generate_naive(model, variables, key, case.batch, case.size, steps=case.naive_steps)  # noqa: E731
        cached = lambda: ex.generate_cached(model, variables, key, case.batch, case.size)  # noqa: E731
        replay = lambda s: ex.regenerate_from_logits(model, variables, key, s)  # noqa: E731
    median, first, reps = _median_times({"naive": naive, "cached": cached}, reps)
    naive_out = np.asarray(naive()).reshape(case.batch, -1)
    cached_samples = np.asarray(cached())
    cached_out = cached_samples.reshape(case.batch, -1)
    steps = case.naive_steps or case.positions
    naive_total = median["naive"] * case.positions / steps
    if case.naive_steps is None:
        check, identical = "full", bool((naive_out == cached_out).all())
    else:
        replayed = np.asarray(replay(jnp.asarray(cached_samples))).reshape(case.batch, -1)
        check = "replay"
        identical = bool((naive_out[:, :steps] == cached_out[:, :steps]).all() and (replayed == cached_out).all())
    params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(variables["params"]))
    return {
        **dataclasses.asdict(case),
        "positions": case.positions,
        "params": params,
        "naive_s": naive_total,
        "naive_measured_steps": steps,
        "naive_step_s": median["naive"] / steps,
        "cached_s": median["cached"],
        "speedup": naive_total / median["cached"],
        "naive_first_call_s": first["naive"],
        "cached_first_call_s": first["cached"],
        "identical": identical,
        "identical_check": check,
        "reps": reps,
    }


def _fmt(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def table(rows: list[dict]) -> str:
    lines = [
        "| case | batch | model | positions | naive | cached | speed-up | samples identical |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        model = (f"gated PixelCNN, {r['layers']} layers, {r['features']} ch" if r["kind"] == "pixelcnn"
                 else f"WaveNet, dilations 1..{2 ** (r['layers'] - 1)}, {r['features']} ch")
        naive = _fmt(r["naive_s"]) + ("" if r["identical_check"] == "full" else
                                      f" ({r['naive_measured_steps']} steps x {r['positions'] // r['naive_measured_steps']})")
        lines.append(
            f"| {r['name']} | {r['batch']} | {model} | {r['positions']} | {naive} | {_fmt(r['cached_s'])} | "
            f"**{r['speedup']:.0f}x** | {'yes' if r['identical'] else '**NO**'} ({r['identical_check']}) |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    meta = rows[0]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    gated = [r for r in rows if r["kind"] == "pixelcnn" and r["name"].startswith("gated")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    sizes = [r["size"] for r in gated]
    axes[0].plot(sizes, [r["naive_s"] for r in gated], "o-", label="naive (one full pass per pixel)")
    axes[0].plot(sizes, [r["cached_s"] for r in gated], "s-", label="decode caches")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("image side (pixels)")
    axes[0].set_ylabel("seconds to sample the batch")
    axes[0].set_xticks(sizes)
    axes[0].legend(fontsize=8)
    if gated:
        axes[0].set_title(f"gated PixelCNN, {gated[0]['layers']} layers, {gated[0]['features']} ch, "
                          f"batch {gated[0]['batch']}", fontsize=9)
    axes[1].plot(sizes, [r["speedup"] for r in gated], "o-", color="C2")
    for r in gated:
        axes[1].annotate(f"{r['speedup']:.0f}x", (r["size"], r["speedup"]), fontsize=8, textcoords="offset points",
                         xytext=(4, -10))
    axes[1].set_yscale("log")
    axes[1].set_xlabel("image side (pixels)")
    axes[1].set_ylabel("speed-up of cached sampling")
    axes[1].set_xticks(sizes)
    for ax in axes:
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle(f"{meta['device']}, jax {meta['jax']}, commit {short_commit(meta.get('commit'))}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def is_rows(rows: list[dict]) -> bool:
    """Whether ``rows`` (a ``.jsonl`` read back) are this benchmark's."""
    return bool(rows) and all("naive_s" in r and "cached_s" in r for r in rows)


def write_outputs(rows: list[dict], out: Path | None, chart_too: bool = True) -> None:
    """Prints the table; with ``out``, writes ``out.md`` and (``chart_too``) ``out.png`` too."""
    text = "# Generation time, naive vs decode caches\n\n" + header(rows) + "\n\n" + table(rows)
    publish(text, rows, out, chart_too, plot)


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="three small cases, seconds: a smoke test")
    parser.add_argument("--cases", nargs="+", metavar="NAME",
                        help=f"of {[c.name for c in CASES]} (or, with --quick, {[c.name for c in QUICK]})")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per case (more for cheap cases)")
    parser.add_argument("--examples", metavar="DIR", help="the repository's examples/ folder "
                        "(default: ./examples, then the source checkout's)")


def run(args) -> int:
    """Times every case; rows to ``args.prefix``.jsonl as they come, then the table and the chart."""
    ex = load_examples(args.examples)
    cases = QUICK if args.quick else CASES
    if args.cases:
        cases = tuple(c for c in cases if c.name in set(args.cases))
        if not cases:
            print(f"no case named {args.cases}", file=sys.stderr)
            return 2
    meta = metadata("quick" if args.quick else "full", args.command)
    print(f"{len(cases)} cases on {meta['device']}; writing {args.prefix}.jsonl", file=sys.stderr)
    rows = []
    with open(f"{args.prefix}.jsonl", "w") as f:
        for case in cases:
            row = {**run_case(case, args.reps, ex), **meta}
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"{case.name}: naive {_fmt(row['naive_s'])}, cached {_fmt(row['cached_s'])}, "
                  f"{row['speedup']:.0f}x, identical {row['identical']} ({row['identical_check']})",
                  file=sys.stderr, flush=True)
    write_outputs(rows, args.prefix, chart_too=not args.no_chart)
    if not all(r["identical"] for r in rows):
        print("cached and naive samples differ", file=sys.stderr)
        return 1
    return 0
