"""Block sizes of masked_conv's Mosaic TPU kernels, each kernel timed alone on the attached TPU.

    python -m benchmarks.masked_conv_tpu_blocks --out DIR

The ``pallas_mosaic_tpu`` config's first defaults (``block_pixels=512, block_channels=256``,
every tap per weight-gradient step) were chosen from the MXU's shape; this sweep's first run
(TPU v5e, 2026-12-07, where ``default`` is that config) set today's 2,048 pixels. For the issue's three PixelCNN layers (N=64, 32x32, C=256, bfloat16: 7x7 type A,
5x5 type B, 3x3 type B) this times each of the three kernels alone under each candidate
``Config``: the forward (``masked_conv``), the input gradient (its ``jax.linear_transpose``
in x) and the weight gradient (in the kernel), one process, samples interleaved per
kernel. Each row gives the kernel's TFLOP/s counting active taps only and its fraction of
a large bfloat16 matmul's rate measured in the same run (the issue's target: 75% for each
kernel at C=256). A candidate Mosaic refuses (VMEM) is a row with its error.

``--pad-in-kernel`` times the default (the kernels pad their image in VMEM, no padded copy
in HBM) against the same blocks with ``pad_in_kernel=False`` (they read XLA's padded copy).
``--quick`` times two candidates of one layer at N=2 interpreted on the CPU: it checks the
script, not the kernels. Writes ``DIR/masked_conv_tpu_blocks.jsonl`` with the machine's
metadata and prints a table.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import maskconv_kernels as mk
from maskconv_kernels.bench.machine import metadata
from maskconv_kernels.bench.shapes import by_name
from maskconv_kernels.bench.timing import Preset, measure_peak, time_interleaved
from maskconv_kernels.ops.masked_conv.pallas_mosaic_tpu import Config
from maskconv_kernels.ops.masked_conv.spec import make_spec

LAYERS = ("pixelcnn_7x7A_C256_32x32", "pixelcnn_5x5B_C256_32x32", "pixelcnn_3x3B_C256_32x32")
KINDS = ("forward", "input_grad", "weight_grad")
# (block_pixels, block_channels, block_taps); None: the heuristic's default for the kernel.
GEMM_CANDIDATES = (None, (256, 256, 64), (512, 256, 64), (1024, 256, 64), (4096, 256, 64), (512, 128, 64),
                   (1024, 128, 64), (2048, 128, 64))
WEIGHT_GRAD_CANDIDATES = (None, (1024, 256, 64), (512, 256, 64), (256, 256, 64), (512, 128, 64), (1024, 128, 64),
                          (512, 256, 8), (1024, 256, 8), (2048, 256, 8))
# The default blocks (the kernels pad their image themselves) against the same reading a
# padded copy (Config.pad_in_kernel=False).
PAD_CANDIDATES = (None, (2048, 256, 64, False))
PRESET = Preset(True, ("bfloat16",), (), samples=9, min_sample_s=0.003, warmup=2, max_input_sets=2, peak_n=8192)


def kernel_fn(kind: str, spec_args: dict, config, x, k, interpret: bool = False):
    """One kernel alone, as a function of the arrays it reads: the forward of ``(x, k)``, the
    input gradient of ``(dy, k)`` and the weight gradient of ``(x, dy)``."""
    conv = functools.partial(mk.masked_conv, implementation="pallas_mosaic_tpu", config=config,
                             interpret=interpret, **spec_args)
    if kind == "forward":
        return lambda x, k: conv(x, k)
    if kind == "input_grad":
        return lambda dy, k: jax.linear_transpose(lambda x: conv(x, k), x)(dy)[0]
    return lambda x, dy: jax.linear_transpose(lambda k: conv(x, k), k)(dy)[0]


def _operands(shape, batch: int, dtype, sets: int):
    """``sets`` argument sets ``{kind: (a, b)}`` of one layer, and the spec's arguments."""
    spec_args = dict(mask=shape.mask, **shape.conv_args)
    out = []
    for s in range(sets):
        kx, kk, kd = jax.random.split(jax.random.PRNGKey(s), 3)
        x = jax.random.normal(kx, shape.x_shape(batch), jnp.float32).astype(dtype)
        k = (jax.random.normal(kk, shape.kernel_shape, jnp.float32) / np.sqrt(shape.active_taps * shape.c_in)).astype(dtype)
        spec = make_spec(x, k, shape.mask, **shape.conv_args)
        dy = jax.random.normal(kd, (batch, *spec.out_spatial, shape.c_out), jnp.float32).astype(dtype)
        out.append({"forward": (x, k), "input_grad": (dy, k), "weight_grad": (x, dy)})
    return out, spec_args, spec


def _config(candidate) -> Config | None:
    return None if candidate is None else Config(*candidate)


def _compile(kind, spec_args, candidate, x, k, args, interpret: bool):
    try:
        return jax.jit(kernel_fn(kind, spec_args, _config(candidate), x, k, interpret)).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a config Mosaic refuses is a result, not a crash
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _name(candidate) -> str:
    if candidate is None:
        return "default"
    return "p{}_c{}_t{}".format(*candidate[:3]) + ("_padcopy" if candidate[3:] == (False,) else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--layers", nargs="+", default=list(LAYERS))
    parser.add_argument("--quick", action="store_true", help="two candidates of the first layer, N=2, on the CPU")
    parser.add_argument("--pad-in-kernel", action="store_true",
                        help="the default against the same blocks with pad_in_kernel=False")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    preset = PRESET
    gemm, wgrad, layers, batch = GEMM_CANDIDATES, WEIGHT_GRAD_CANDIDATES, args.layers, None
    if args.pad_in_kernel:
        gemm = wgrad = PAD_CANDIDATES
    if args.quick:
        preset = dataclasses.replace(preset, samples=1, min_sample_s=0.0, warmup=0, max_input_sets=1, peak_n=256)
        gemm, wgrad, layers, batch = gemm[:2], wgrad[:2], layers[:1], 2
    meta = metadata("tpu_blocks", "python -m benchmarks.masked_conv_tpu_blocks")
    peak = measure_peak("bfloat16", preset.peak_n, preset)
    print(f"bfloat16 {preset.peak_n}^3 matmul: {peak / 1e12:.1f} TFLOP/s", flush=True)
    with open(args.out / "masked_conv_tpu_blocks.jsonl", "w") as f:
        for layer in layers:
            shape = by_name(layer)
            n = batch or shape.batch
            argsets, spec_args, spec = _operands(shape, n, jnp.bfloat16, preset.max_input_sets)
            flops = spec.flops(n)  # one GEMM on active taps: each kernel's multiply-adds, x2
            for kind in KINDS:
                candidates = wgrad if kind == "weight_grad" else gemm
                t = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    compiled = dict(zip(candidates, pool.map(
                        lambda c: _compile(kind, spec_args, c, *argsets[0]["forward"], argsets[0][kind], args.quick),
                        candidates)))
                print(f"{layer} {kind}: compiled {len(candidates)} in {time.perf_counter() - t:.1f} s", flush=True)
                ok = {c: fn for c, fn in compiled.items() if not isinstance(fn, str)}
                times = time_interleaved(ok, [a[kind] for a in argsets], preset) if ok else {}
                default = Config.get_default(spec, jnp.bfloat16, kind)
                for c in candidates:
                    row = dict(meta, shape=layer, kind=kind, config=_name(c), batch=n,
                               blocks=dataclasses.asdict(_config(c) or default), peak_flops_per_s=peak)
                    if c in times:
                        median = statistics.median(times[c])
                        row.update(median_s=median, tflops=flops / median / 1e12, frac_peak=flops / median / peak)
                        shown = f"{1e3 * median:8.3f} ms {row['tflops']:6.1f} TFLOP/s ({100 * row['frac_peak']:.0f}%)"
                    else:
                        row["error"] = compiled[c]
                        shown = f"error: {compiled[c][:120]}"
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(f"{layer} {kind:11s} {_name(c):16s} {row['blocks']} {shown}", flush=True)


if __name__ == "__main__":
    main()
