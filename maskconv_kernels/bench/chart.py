"""The benchmarks' files and the masked convolution chart.

:func:`publish` prints a benchmark's tables and writes them (and its chart) beside its
rows; :func:`chart` draws baseline time / implementation time per shape, one bar per
implementation, a panel per dtype and mode, on a log axis centred on 1x. Charts need
matplotlib (the ``bench`` extra); without it the benchmarks write no chart and say so.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from .machine import short_commit
from .shapes import SHAPES

MODES = ("fwd", "bwd", "fwd+bwd")


def chart_unavailable() -> str | None:
    """Why no chart can be drawn here (matplotlib missing), or ``None``."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed; pip install 'maskconv-kernels[bench]' adds it"
    return None


def publish(text: str, rows: list[dict], out, chart_too: bool, draw_fn=None) -> None:
    """Prints ``text``; with ``out`` (a path prefix), writes it to ``out.md`` and, if asked, the chart to ``out.png``."""
    if out is not None:
        Path(f"{out}.md").write_text(text)
        if chart_too and draw_fn is not None:
            draw(draw_fn, rows, Path(f"{out}.png"))
    print(text)


def draw(draw_fn, rows: list[dict], path) -> None:
    """``draw_fn(rows, path)`` (a matplotlib chart), or a line on stderr saying why there is none."""
    why = chart_unavailable()
    if why:
        print(f"no chart: {why}", file=sys.stderr)
    else:
        draw_fn(rows, path)


def roofline_bars(rows: list[dict], path, group: str, ylabel: str, title: str, sort: bool = False) -> None:
    """Bars of ``frac_roofline`` (the fraction of the memory roofline) per ``(shape, rows[group])``
    cell, one per implementation, to the image file ``path``; ``sort``: cells sorted, else as
    they come. The sequence and serving benchmarks' charts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in rows if "median_s" in r]
    cells = list(dict.fromkeys((r["shape"], r[group]) for r in rows))
    cells = sorted(cells) if sort else cells
    names = list(dict.fromkeys(r["implementation"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cells)), 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next((r["frac_roofline"] for r in rows if (r["shape"], r[group]) == c and r["implementation"] == name),
                       0.0) for c in cells]
        ax.bar(np.arange(len(cells)) + i * width, values, width, label=name)
    ax.set_xticks(np.arange(len(cells)) + (len(names) - 1) * width / 2, [f"{s}\n{g}" for s, g in cells], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}: {rows[0]['device']}" if rows else title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def chart(rows: list[dict], path) -> None:
    """Draws ``rows`` (the benchmark's, read back or fresh) to the image file ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in rows if r["implementation"] != "baseline" and "speedup" in r]
    if not rows:
        return
    dtypes = [d for d in ("bfloat16", "float32", "float16") if any(r["dtype"] == d for r in rows)]
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    impls = sorted({r["implementation"] for r in rows})
    order = [s.name for s in SHAPES]
    shapes = sorted({r["shape"] for r in rows}, key=lambda n: order.index(n) if n in order else len(order))
    batch = {r["shape"]: r["batch"] for r in rows}
    labels = [f"{n} (N={batch[n]})" for n in shapes]

    height = 0.8 / len(impls)
    speedups = [r["speedup"] for r in rows]
    lo, hi = min(min(speedups), 0.5), max(max(speedups), 2.0)
    fig, axes = plt.subplots(len(dtypes), len(modes), figsize=(5.5 * len(modes), 0.32 * len(shapes) * len(dtypes) + 1.6),
                             squeeze=False, sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, dtype in enumerate(dtypes):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for k, impl in enumerate(impls):
                got = {r["shape"]: r["speedup"] for r in rows
                       if r["dtype"] == dtype and r["mode"] == mode and r["implementation"] == impl}
                ys = [y for y, n in enumerate(shapes) if n in got]
                vals = [got[shapes[y]] for y in ys]
                pos = [y + (k - (len(impls) - 1) / 2) * height for y in ys]
                # Bars start at 1x, so slower-than-baseline bars point left on the log axis.
                ax.barh(pos, [v - 1.0 for v in vals], left=1.0, height=height,
                        color=colours[k % len(colours)], label=impl)
                for p, v in zip(pos, vals):
                    ax.text(v, p, f" {v:.2f}x " if v >= 1 else f" {v:.2f}x ", va="center",
                            ha="left" if v >= 1 else "right", fontsize=6)
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlim(lo / 1.6, hi * 1.6)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_title(f"{dtype}, {mode}", fontsize=10)
            ax.grid(axis="x", which="both", alpha=0.3)
            if i == len(dtypes) - 1:
                ax.set_xlabel("speed-up over lax.conv(kernel*mask)  (>1: ours faster)")
    axes[0][0].set_yticks(range(len(shapes)))
    axes[0][0].invert_yaxis()
    for row in axes:
        row[0].set_yticklabels(labels, fontsize=8)
    meta = rows[0]
    fig.suptitle(f"maskconv_kernels vs lax.conv_general_dilated(x, kernel*mask) on {meta['device']}\n"
                 f"jax {meta['jax']}, commit {short_commit(meta.get('commit'))}, {meta['time_utc']}", fontsize=10)
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
