"""Predicted cost of the ``pallas_mosaic_gpu`` kernels on the headline shapes (no GPU needed).

    python -m benchmarks.predict_mgpu                 # the tables in benchmarks/NOTES.md
    python -m benchmarks.predict_mgpu --ws-loop-efficiency 0.7 --ws-overhead-us 2

PREDICTIONS, NOT MEASUREMENTS. Work, bytes, programs and rounds come from the backend's
own code (``grid.forward_grid`` / ``input_grad_grid`` / ``weight_grad_grid``,
``Config.get_default``, ``config.stages``, ``config.weight_grad_splits``, the shapes of
``grid.copies`` / ``grid.rows_of`` through ``jax.eval_shape``), so they are what the
kernels launch. It prints the default ``Config`` tiles (warp-specialized) and the same tiles
with ``warp_specialized=False``. Times rest on assumptions, each a flag (``Assumptions``):

* peak 720 TFLOP/s (bf16 8192^3 matmul, first H200 run) shared evenly by 132 SMs;
* ``ws_loop_efficiency`` / ``loop_efficiency``: the fraction of that peak an SM's
  steady-state loop reaches, warp-specialized (a TMA producer and two wgmma consumer
  warpgroups) / one warpgroup (``emit_pipeline``, ``wgmma_wait(1)``, the weight gradient too);
* ``ws_overhead_us`` / ``overhead_us``: per output tile, the pipeline fill and epilogue
  that the loop does not overlap. Warp-specialized, the producer fetches the next tile's
  first boxes while the consumers store (it waits only for the last boxes to be consumed),
  so about one of the two shows; one warpgroup runs fill, drain and epilogue in sequence.
  The forward / input gradient are persistent (``min(132, tiles)`` programs, one per SM:
  shared memory and, warp-specialized, registers allow no second), so an SM pays this
  once per tile it walks; the weight gradient is one program per tile;
* ``copy_tbs``: the XLA ops around each kernel (per-column-offset copies, crop, padding,
  split sum) run alone at this rate, read + write bytes counted (NOTES.md's 4.3 TB/s);
* ``cudnn_efficiency``: cuDNN's fraction of the peak on its dense window (all taps).

A kernel's time is ``max(compute of its busiest SM, its own HBM bytes / copy_tbs)``, plus
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

from maskconv_kernels._core.hardware import SM_COUNT
from maskconv_kernels.bench.shapes import HEADLINE_SHAPES
from maskconv_kernels.ops.masked_conv.pallas_mosaic_gpu import Config, grid
from maskconv_kernels.ops.masked_conv.pallas_mosaic_gpu.config import stages, weight_grad_splits
from maskconv_kernels.ops.masked_conv.pallas_mosaic_gpu.kernels import weight_grad_chunk
from maskconv_kernels.ops.masked_conv.kernel_problem import kernel_problem
from maskconv_kernels.ops.masked_conv.spec import make_spec

PEAK = 720e12  # bf16 FLOP/s, 8192^3 matmul on the H200 (NOTES.md)
SMEM_PER_SM = 228 * 1024  # an SM's shared memory; each block also reserves 1 KiB
BF16 = 2


@dataclasses.dataclass(frozen=True)
class Assumptions:
    loop_efficiency: float = 0.75
    overhead_us: float = 2.0
    copy_tbs: float = 4.3
    cudnn_efficiency: float = 0.6
    ws_loop_efficiency: float = 0.85
    ws_overhead_us: float = 1.0


def _nbytes(fn, shape) -> int:
    out = jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    return math.prod(out.shape) * np.dtype(out.dtype).itemsize


def _schedule(tiles, slots, steps, step_flops, efficiency, overhead_us) -> dict:
    """Compute time of the busiest SM: ``tiles`` output tiles of ``steps`` wgmma steps each,
    ``slots`` programs at a time (132 x programs per SM). An SM's co-resident programs
    share its tensor cores and hide each other's overheads."""
    per_sm = slots // SM_COUNT
    rounds = -(-tiles // slots)
    step_s = step_flops / (PEAK / SM_COUNT) / efficiency
    if per_sm == 1:  # nothing overlaps a tile's fill and epilogue
        t = rounds * (steps * step_s + overhead_us * 1e-6)
    else:
        t = -(-tiles // SM_COUNT) * steps * step_s + overhead_us * 1e-6
    return dict(tiles=tiles, per_sm=per_sm, rounds=rounds, last=tiles - (rounds - 1) * slots, slots=slots,
                steps=steps, t_compute=t)


def tap_gemm(g, t: Config, batch, c_a, c_out, a: Assumptions) -> dict:
    """The forward (operand x) or the input gradient (operand dy), as ``conv._tap_conv`` and
    ``kernels.tap_gemm`` launch it: persistent, ``min(132, tiles)`` programs walking
    (pixel tile, channel tile), channel tiles innermost."""
    tm, tn, bk, ws = t.tile_pixels, t.tile_n, t.block_k, t.warp_specialized
    cta_m = (2 if ws else 1) * tm  # warp-specialized: two consumer warpgroups of tm rows
    k_pad, n_pad = grid.round_up(c_a, bk), grid.round_up(c_out, tn)
    tiles_per_image = -(-g.out_hw[0] * g.width // cta_m)
    m_tiles, n_tiles = batch * tiles_per_image, n_pad // tn
    taps = len(g.rows)
    steps = taps * (k_pad // bk)
    n_stages = stages(t, (cta_m + tn) * bk * BF16, cta_m * tn * BF16)
    smem = n_stages * (cta_m + tn) * bk * BF16 + cta_m * tn * BF16
    # Persistent: one program per SM at most (the grid is min(132, tiles)), whatever fits.
    s = _schedule(m_tiles * n_tiles, min(SM_COUNT, m_tiles * n_tiles), steps, 2 * cta_m * tn * bk,
                  a.ws_loop_efficiency if ws else a.loop_efficiency, a.ws_overhead_us if ws else a.overhead_us)
    a_shape, valid = (batch, *g.in_hw, c_a), batch * math.prod(g.out_hw) * c_out * BF16
    copies = _nbytes(lambda x: grid.copies(x, g, k_pad, 2 * tm), a_shape)
    out = m_tiles * cta_m * n_pad * BF16  # the kernel's output, rounding rows included
    weights = taps * k_pad * n_pad * BF16
    s.update(
        programs=min(SM_COUNT, s["tiles"]), threads=384 if ws else 128, smem_kib=smem / 1024,
        executed=2 * s["tiles"] * cta_m * tn * bk * steps, copies_mb=copies / 1e6,
        # XLA around the kernel: reads the operand and writes its copies; stacks the
        # weights; the crop reads the valid outputs and writes them.
        extra_bytes=math.prod(a_shape) * BF16 + copies + 2 * weights + 2 * valid,
        # The kernel: channel tiles innermost, so a pixel tile's channel tiles run in the
        # same round and the copies (far larger than the 60 MB L2) stream from HBM once;
        # neighbouring pixel tiles share rows through L2. Weights stay in L2.
        kernel_hbm=copies + weights + out,
        l2=s["tiles"] * steps * (cta_m + tn) * bk * BF16 + out,
        desc=f"{'WS ' if ws else ''}{cta_m}x{tn}, bk {bk}, {n_stages} stages",
    )
    return s


def tap_weight_grad(p, g, t: Config, batch, a: Assumptions) -> dict:
    """The weight gradient, as ``conv.weight_grad`` launches it (one program per tile, one warpgroup)."""
    tn, bci, chunk = t.tile_n, t.weight_grad_c_in, weight_grad_chunk(g, t)
    ci_pad, co_pad = grid.round_up(p.c_in, bci), grid.round_up(p.c_out, tn)
    taps = len(g.rows)
    chunks = batch * g.out_hw[0] * g.width // chunk
    base = taps * (ci_pad // bci) * (co_pad // tn)
    splits = weight_grad_splits(t, base, chunks)
    steps = chunks // splits
    n_stages = stages(t, chunk * (bci + tn) * BF16, bci * tn * 4)
    smem = n_stages * chunk * (bci + tn) * BF16 + bci * tn * 4
    per_sm = max(1, SMEM_PER_SM // (smem + 1024))
    s = _schedule(base * splits, SM_COUNT * per_sm, steps, 2 * bci * tn * chunk, a.loop_efficiency, a.overhead_us)
    x_shape = (batch, *g.in_hw, p.c_in)
    copies = _nbytes(lambda x: grid.copies(x, g, ci_pad, 0), x_shape)
    rows = _nbytes(lambda d: grid.rows_of(d, g, co_pad), (batch, *g.out_hw, p.c_out))
    parts = splits * taps * ci_pad * co_pad * 4
    dense = math.prod(p.window) * p.c_in * p.c_out * BF16
    s.update(
        programs=s["tiles"], threads=128, smem_kib=smem / 1024,
        executed=2 * s["tiles"] * bci * tn * chunk * steps, copies_mb=copies / 1e6,
        # XLA: reads x and writes its copies; reads dy and writes it on the grid's rows;
        # the split sum reads the float32 parts; the scatter writes the dense gradient.
        extra_bytes=math.prod(x_shape) * BF16 + copies + batch * math.prod(g.out_hw) * p.c_out * BF16 + rows
        + parts + dense,
        # The kernel: tap_ci is the fastest grid axis, so each output-channel tile streams
        # the copies from HBM once; dy's rows are read once; the parts written.
        kernel_hbm=(co_pad // tn) * copies + rows + parts,
        l2=s["tiles"] * steps * chunk * (bci + tn) * BF16 + parts,
        desc=f"{bci}x{tn}, chunk {chunk}, {n_stages} stages, {splits} splits",
    )
    return s


def predict(shape, kinds=("fwd", "dx", "dw"), tiles: Config | None = None, a: Assumptions = Assumptions()) -> list[dict]:
    """One row per kernel of ``shape`` (bf16, its full batch) with ``tiles`` (default: the heuristic's)."""
    x = jax.ShapeDtypeStruct(shape.x_shape(shape.batch), jnp.bfloat16)
    k = jax.ShapeDtypeStruct(shape.kernel_shape, jnp.bfloat16)
    spec = make_spec(x, k, shape.mask, **shape.conv_args)
    p = kernel_problem(spec)
    t = tiles or Config.get_default(spec, jnp.bfloat16)
    dense = 2 * shape.batch * math.prod(spec.out_spatial) * math.prod(shape.window) * shape.c_in * shape.c_out
    make = {
        "fwd": lambda: (grid.forward_grid(p), lambda g: tap_gemm(g, t, shape.batch, p.c_in, p.c_out, a)),
        "dx": lambda: (grid.input_grad_grid(p), lambda g: tap_gemm(g, t, shape.batch, p.c_out, p.c_in, a)),
        "dw": lambda: (grid.weight_grad_grid(p), lambda g: tap_weight_grad(p, g, t, shape.batch, a)),
    }
    rows, bw = [], a.copy_tbs * 1e12
    for kind in kinds:
        g, cost = make[kind]()
        r = dict(shape=shape.name, kernel=kind, grid=g, useful=spec.flops(shape.batch), **cost(g))
        r.update(hbm_s=r["kernel_hbm"] / bw, copies_s=r["extra_bytes"] / bw,
                 cudnn_s=dense / (PEAK * a.cudnn_efficiency))
        r["kernel_s"] = max(r["t_compute"], r["hbm_s"])
        r["total_s"] = r["kernel_s"] + r["copies_s"]
        rows.append(r)
    return rows


def tables(rows) -> str:
    out = ["| shape | kernel | CTA tile | grid rows x Wp, copies | tiles | programs (per SM, smem, threads) "
           "| tiles per SM (last round) | steps | executed GFLOP (waste) | copies MB | XLA copies r+w MB "
           "| kernel HBM MB | L2->SM GB (TB/s needed) |",
           "|---|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = r["grid"]
        out.append(
            f"| {r['shape']} | {r['kernel']} | {r['desc']} | {g.height} x {g.width}, {len(g.distinct_copies)} "
            f"| {r['tiles']} | {r['programs']} ({r['per_sm']}, {r['smem_kib']:.0f} KiB, {r['threads']}) "
            f"| {r['rounds'] * r['per_sm']} ({r['last']}/{r['slots']}) | {r['steps']} "
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
                        help="fraction of 720 TFLOP/s one warpgroup's main loop reaches (warp_specialized=False, "
                             "and the weight gradient; assumed)")
    parser.add_argument("--overhead-us", type=float, default=d.overhead_us,
                        help="per tile, fill + epilogue not overlapped, one warpgroup, microseconds (assumed)")
    parser.add_argument("--copy-tbs", type=float, default=d.copy_tbs, help="HBM copy rate, read+write, TB/s")
    parser.add_argument("--cudnn-efficiency", type=float, default=d.cudnn_efficiency,
                        help="cuDNN's fraction of 720 TFLOP/s on all window taps (assumed, as in NOTES.md)")
    parser.add_argument("--ws-loop-efficiency", type=float, default=d.ws_loop_efficiency,
                        help="fraction of 720 TFLOP/s the warp-specialized main loop reaches (assumed)")
    parser.add_argument("--ws-overhead-us", type=float, default=d.ws_overhead_us,
                        help="per tile, fill / epilogue not overlapped, warp-specialized, microseconds (assumed)")
    args = parser.parse_args(argv)
    a = Assumptions(args.loop_efficiency, args.overhead_us, args.copy_tbs, args.cudnn_efficiency,
                    args.ws_loop_efficiency, args.ws_overhead_us)
    print(f"PREDICTIONS, not measurements: bf16, headline shapes; loop efficiency {a.ws_loop_efficiency} "
          f"warp-specialized / {a.loop_efficiency} one warpgroup, {a.ws_overhead_us} / {a.overhead_us} us per "
          f"tile; copies at {a.copy_tbs} TB/s; cuDNN at {a.cudnn_efficiency:.0%} of 720 TFLOP/s")
    for title, ws in (("default Config (warp_specialized=True)", True), ("warp_specialized=False", False)):
        rows = []
        for s in HEADLINE_SHAPES:
            x = jax.ShapeDtypeStruct(s.x_shape(s.batch), jnp.bfloat16)
            k = jax.ShapeDtypeStruct(s.kernel_shape, jnp.bfloat16)
            t = Config.get_default(make_spec(x, k, s.mask, **s.conv_args), jnp.bfloat16)
            rows += predict(s, tiles=dataclasses.replace(t, warp_specialized=ws), a=a)
        print(f"\n## {title}\n\n{tables(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
