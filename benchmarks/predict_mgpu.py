"""Predicted cost of the ``pallas_mosaic_gpu`` kernels on the acceptance shapes (no GPU needed).

    python -m benchmarks.predict_mgpu                 # the table in benchmarks/NOTES.md
    python -m benchmarks.predict_mgpu --loop-efficiency 0.6 --overhead-us 3
    python -m benchmarks.predict_mgpu --narrow-grid   # what if Wp were round_up(W_o, 8)

PREDICTIONS, NOT MEASUREMENTS. Work, bytes, programs and waves come from the backend's
own code (``mosaic_gpu.grid``, ``Tiles.get_default``, ``config.stages``,
``config.weight_grad_splits``, the shapes of ``grid.copies`` / ``grid.rows_of`` through
``jax.eval_shape``), so they are what the kernels launch. Times rest on assumptions,
each a flag (``Assumptions``):

* peak 720 TFLOP/s (bf16 8192^3 matmul, first H200 run) shared evenly by 132 SMs;
* ``loop_efficiency``: the fraction of that peak one program's steady-state loop reaches
  (one warpgroup, ``emit_pipeline`` without warp specialisation, ``wgmma_wait(1)``);
* ``overhead_us``: per program, launch + pipeline fill + epilogue; with one program per
  SM (shared memory allows no second at the default tiles) and a non-persistent grid,
  nothing hides it;
* ``copy_tbs``: the XLA ops around each kernel (per-column-offset copies, crop, padding,
  split sum) run alone at this rate, read + write bytes counted (NOTES.md's 4.3 TB/s);
* ``cudnn_efficiency``: cuDNN's fraction of the peak on its dense window (all taps).

A kernel's time is ``max(compute over its waves, its own HBM bytes / copy_tbs)``, plus
the XLA copies around it. L2->SM traffic is printed with the rate it would need, not
folded in: the H200's L2 bandwidth has not been measured here.
"""
from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from maskconv_kernels.hardware import SM_COUNT
from maskconv_kernels.mosaic_gpu import Tiles, grid
from maskconv_kernels.mosaic_gpu.config import stages, weight_grad_splits
from maskconv_kernels.problem import kernel_problem
from maskconv_kernels.spec import make_spec

from .shapes import BAR_SHAPES

PEAK = 720e12  # bf16 FLOP/s, 8192^3 matmul on the H200 (NOTES.md)
SMEM_PER_SM = 228 * 1024  # an SM's shared memory; each block also reserves 1 KiB
BF16 = 2


@dataclasses.dataclass(frozen=True)
class Assumptions:
    loop_efficiency: float = 0.75
    overhead_us: float = 2.0
    copy_tbs: float = 4.3
    cudnn_efficiency: float = 0.6
    narrow_grid: bool = False  # what-if: grid width round_up(W_o, align) instead of W_o + max column offset


def _round_up(n, m):
    return -(-n // m) * m


def _nbytes(fn, shape) -> int:
    out = jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    return math.prod(out.shape) * np.dtype(out.dtype).itemsize


def _grid(g: grid.Grid, a: Assumptions) -> grid.Grid:
    # The copies are already shifted by their column offset, so the columns past W_o are
    # never read for a valid output: width W_o (aligned) computes the same values.
    return dataclasses.replace(g, width=_round_up(g.out_hw[1], g.align)) if a.narrow_grid else g


def _schedule(programs, steps, step_flops, smem, a: Assumptions) -> dict:
    """Waves and compute time of ``programs`` programs of ``steps`` wgmma steps each."""
    per_sm = max(1, SMEM_PER_SM // (smem + 1024))
    waves = -(-programs // (SM_COUNT * per_sm))
    step_s = step_flops / (PEAK / SM_COUNT) / a.loop_efficiency
    if per_sm == 1:  # nothing overlaps one program's fill and epilogue
        t = waves * (steps * step_s + a.overhead_us * 1e-6)
    else:  # co-resident programs share the tensor cores and hide each other's overheads
        t = waves * per_sm * steps * step_s + a.overhead_us * 1e-6
    return dict(programs=programs, per_sm=per_sm, waves=waves, steps=steps, smem_kib=smem / 1024, t_compute=t)


def tap_gemm(g, t: Tiles, batch, c_a, c_out, a: Assumptions) -> dict:
    """The forward (operand x) or the input gradient (operand dy), as ``conv._tap_conv`` launches it."""
    tm, tn, bk = t.tile_pixels, t.tile_n, t.block_k
    k_pad, n_pad = _round_up(c_a, bk), _round_up(c_out, tn)
    tiles_per_image = -(-g.out_hw[0] * g.width // tm)
    taps = len(g.rows)
    programs, steps = batch * tiles_per_image * (n_pad // tn), taps * (k_pad // bk)
    n_stages = stages(t, (tm + tn) * bk * BF16, tm * tn * BF16)
    s = _schedule(programs, steps, 2 * tm * tn * bk, n_stages * (tm + tn) * bk * BF16 + tm * tn * BF16, a)
    a_shape, valid = (batch, *g.in_hw, c_a), batch * math.prod(g.out_hw) * c_out * BF16
    copies = _nbytes(lambda x: grid.copies(x, g, k_pad, tm), a_shape)
    out = batch * tiles_per_image * tm * n_pad * BF16  # the kernel's output, extra columns included
    weights = taps * k_pad * n_pad * BF16
    s.update(
        executed=2 * programs * tm * tn * bk * steps, copies_mb=copies / 1e6,
        # XLA around the kernel: reads the operand and writes its copies; stacks the
        # weights; the crop reads the valid outputs and writes them.
        extra_bytes=math.prod(a_shape) * BF16 + copies + 2 * weights + 2 * valid,
        # The kernel: m is the fastest grid axis (CUDA x), so each of the n_pad/tn passes
        # streams the copies (far larger than the 60 MB L2) from HBM once; neighbours in a
        # wave share rows through L2. Weights stay in L2.
        kernel_hbm=(n_pad // tn) * copies + weights + out,
        l2=programs * steps * (tm + tn) * bk * BF16 + out,
        tiles=f"{tm}x{tn}, bk {bk}, {n_stages} stages",
    )
    return s


def tap_weight_grad(p, g, t: Tiles, batch, a: Assumptions) -> dict:
    """The weight gradient, as ``conv.weight_grad`` launches it."""
    tn, bci, chunk = t.tile_n, 64, g.chunk
    ci_pad, co_pad = _round_up(p.c_in, bci), _round_up(p.c_out, tn)
    taps = len(g.rows)
    chunks = batch * g.out_hw[0] * g.width // chunk
    base = taps * (ci_pad // bci) * (co_pad // tn)
    splits = weight_grad_splits(t, base, chunks)
    steps = chunks // splits
    n_stages = stages(t, chunk * (bci + tn) * BF16, bci * tn * 4)
    s = _schedule(base * splits, steps, 2 * bci * tn * chunk, n_stages * chunk * (bci + tn) * BF16 + bci * tn * 4, a)
    x_shape = (batch, *g.in_hw, p.c_in)
    copies = _nbytes(lambda x: grid.copies(x, g, ci_pad, 0), x_shape)
    rows = _nbytes(lambda d: grid.rows_of(d, g, co_pad), (batch, *g.out_hw, p.c_out))
    parts = splits * taps * ci_pad * co_pad * 4
    dense = math.prod(p.window) * p.c_in * p.c_out * BF16
    s.update(
        executed=2 * s["programs"] * bci * tn * chunk * steps, copies_mb=copies / 1e6,
        # XLA: reads x and writes its copies; reads dy and writes it on the grid's rows;
        # the split sum reads the float32 parts; the scatter writes the dense gradient.
        extra_bytes=math.prod(x_shape) * BF16 + copies + batch * math.prod(g.out_hw) * p.c_out * BF16 + rows
        + parts + dense,
        # The kernel: tap_ci is the fastest grid axis, so each output-channel tile streams
        # the copies from HBM once; dy's rows are read once; the parts written.
        kernel_hbm=(co_pad // tn) * copies + rows + parts,
        l2=s["programs"] * steps * chunk * (bci + tn) * BF16 + parts,
        tiles=f"{bci}x{tn}, chunk {chunk}, {n_stages} stages, {splits} splits",
    )
    return s


def predict(shape, kinds=("fwd", "dx", "dw"), tiles: Tiles | None = None, a: Assumptions = Assumptions()) -> list[dict]:
    """One row per kernel of ``shape`` (bf16, its full batch) with ``tiles`` (default: the heuristic's)."""
    x = jax.ShapeDtypeStruct(shape.x_shape(shape.batch), jnp.bfloat16)
    k = jax.ShapeDtypeStruct(shape.kernel_shape, jnp.bfloat16)
    spec = make_spec(x, k, shape.mask, **shape.conv_args)
    p = kernel_problem(spec)
    t = tiles or Tiles.get_default(spec, jnp.bfloat16)
    dense = 2 * shape.batch * math.prod(spec.out_spatial) * math.prod(shape.window) * shape.c_in * shape.c_out
    make = {
        "fwd": lambda: (grid.forward_grid(p), lambda g: tap_gemm(g, t, shape.batch, p.c_in, p.c_out, a)),
        "dx": lambda: (grid.input_grad_grid(p), lambda g: tap_gemm(g, t, shape.batch, p.c_out, p.c_in, a)),
        "dw": lambda: (grid.weight_grad_grid(p), lambda g: tap_weight_grad(p, g, t, shape.batch, a)),
    }
    rows, bw = [], a.copy_tbs * 1e12
    for kind in kinds:
        g, cost = make[kind]()
        g = _grid(g, a)
        r = dict(shape=shape.name, kernel=kind, grid=g, useful=spec.flops(shape.batch), **cost(g))
        r.update(hbm_s=r["kernel_hbm"] / bw, copies_s=r["extra_bytes"] / bw,
                 cudnn_s=dense / (PEAK * a.cudnn_efficiency))
        r["kernel_s"] = max(r["t_compute"], r["hbm_s"])
        r["total_s"] = r["kernel_s"] + r["copies_s"]
        rows.append(r)
    return rows


def tables(rows) -> str:
    out = ["| shape | kernel | tiles | grid rows x Wp, copies | programs (per SM, smem) | waves (last) | steps "
           "| executed GFLOP (waste) | copies MB | XLA copies r+w MB | kernel HBM MB | L2->SM GB (TB/s needed) |",
           "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g, slots = r["grid"], SM_COUNT * r["per_sm"]
        out.append(
            f"| {r['shape']} | {r['kernel']} | {r['tiles']} | {g.height} x {g.width}, {len(g.distinct_cols)} "
            f"| {r['programs']} ({r['per_sm']}, {r['smem_kib']:.0f} KiB) "
            f"| {r['waves']} ({r['programs'] - (r['waves'] - 1) * slots}/{slots}) | {r['steps']} "
            f"| {r['executed'] / 1e9:.1f} (+{100 * (r['executed'] / r['useful'] - 1):.0f}%) "
            f"| {r['copies_mb']:.0f} | {r['extra_bytes'] / 1e6:.0f} | {r['kernel_hbm'] / 1e6:.0f} "
            f"| {r['l2'] / 1e9:.1f} ({r['l2'] / r['kernel_s'] / 1e12:.1f}) |")
    out += ["", "| shape | kernel | compute ms | kernel HBM ms | kernel ms | XLA copies ms | predicted ms "
            "| cuDNN ms (assumed) | cuDNN / ours |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    ms = lambda s: f"{1e3 * s:.3f}"
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sub = [r for r in rows if r["shape"] == shape]
        for r in sub:
            out.append(f"| {shape} | {r['kernel']} | {ms(r['t_compute'])} | {ms(r['hbm_s'])} | {ms(r['kernel_s'])} "
                       f"| {ms(r['copies_s'])} | {ms(r['total_s'])} | {ms(r['cudnn_s'])} "
                       f"| {r['cudnn_s'] / r['total_s']:.2f}x |")
        total = lambda key: sum(r[key] for r in sub)
        out.append(f"| {shape} | **step** | | | {ms(total('kernel_s'))} | {ms(total('copies_s'))} "
                   f"| **{ms(total('total_s'))}** | {ms(total('cudnn_s'))} "
                   f"| **{total('cudnn_s') / total('total_s'):.2f}x** |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.predict_mgpu", description=__doc__.splitlines()[0])
    d = Assumptions()
    parser.add_argument("--loop-efficiency", type=float, default=d.loop_efficiency,
                        help="fraction of 720 TFLOP/s one program's main loop reaches (assumed)")
    parser.add_argument("--overhead-us", type=float, default=d.overhead_us,
                        help="per-program launch + pipeline fill + epilogue, microseconds (assumed)")
    parser.add_argument("--copy-tbs", type=float, default=d.copy_tbs, help="HBM copy rate, read+write, TB/s")
    parser.add_argument("--cudnn-efficiency", type=float, default=d.cudnn_efficiency,
                        help="cuDNN's fraction of 720 TFLOP/s on all window taps (assumed, as in NOTES.md)")
    parser.add_argument("--narrow-grid", action="store_true",
                        help="what-if, not the implementation: grid width round_up(W_o, 8)")
    args = parser.parse_args(argv)
    a = Assumptions(args.loop_efficiency, args.overhead_us, args.copy_tbs, args.cudnn_efficiency, args.narrow_grid)
    print(f"PREDICTIONS, not measurements: bf16, acceptance shapes, default Tiles; loop efficiency "
          f"{a.loop_efficiency}, {a.overhead_us} us per program, copies at {a.copy_tbs} TB/s, cuDNN at "
          f"{a.cudnn_efficiency:.0%} of 720 TFLOP/s" + ("; WHAT-IF narrow grid" if a.narrow_grid else "") + "\n")
    print(tables([r for s in BAR_SHAPES for r in predict(s, a=a)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
