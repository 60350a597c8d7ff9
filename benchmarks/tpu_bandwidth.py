"""The copy rate a TPU's HBM reaches, three ways, beside causal_conv1d's Mosaic TPU kernels.

    python -m benchmarks.tpu_bandwidth --out DIR          # on a TPU
    python -m benchmarks.tpu_bandwidth --small --out DIR  # anywhere: Pallas interpreted, to test the script

A memory-bound kernel is judged against the bytes it must move over a bandwidth; this
measures which bandwidth a kernel can reach on the chip at hand. For an array
``[4, 8192, 4096]`` in bfloat16 and in float32, and one of float32 with bfloat16's bytes
(``[4, 8192, 2048]``: whether a rate follows the dtype or the size; ``--small``: ``[1,
1024, 1024]`` and ``[1, 1024, 512]``), each a read of the array and a write of another:

* ``xla_scale``: ``x * 2``, XLA's fused elementwise loop;
* ``dma``: one HBM-to-HBM DMA of the whole array (``pltpu.make_async_copy``): the DMA
  engines alone, no core work;
* ``pallas_<n>x<c>``: a Pallas kernel copying ``[n, c]`` blocks through VMEM with the
  BlockSpec pipeline (double-buffered), as the causal_conv1d kernels stream theirs;

then ``causal_conv1d(implementation="pallas_mosaic_tpu")`` on the bfloat16 array (W=4,
float32 weights), forward and backward (``bench.sequence``'s modes), with bias and SiLU
and without, over the bytes :func:`maskconv_kernels.bench.sequence.ideal_bytes` says
they must move. Every row gives its rate, the fraction of the chip's specified bandwidth
(jax's ``TpuInfo``) and of the best copy of the same array (the kernels: of the
bfloat16 one). Writes
``DIR/tpu_bandwidth.jsonl`` with the machine's metadata and prints a table.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maskconv_kernels.bench.machine import metadata
from maskconv_kernels.bench.sequence import SeqShape, _inputs, ideal_bytes, mode_fn, specified_bandwidth
from maskconv_kernels.bench.timing import Preset, time_interleaved
from maskconv_kernels.ops.causal_conv1d import causal_conv1d

SHAPE, SMALL_SHAPE = (4, 8192, 4096), (1, 1024, 1024)
BLOCKS, SMALL_BLOCKS = ((1024, 512), (512, 4096), (4096, 512)), ((256, 512),)
PRESET = Preset(True, ("bfloat16", "float32"), ("fwd", "bwd"), samples=9, min_sample_s=0.005, warmup=2,
                max_input_sets=1, peak_n=0)
_SQUEEZED = pl.Squeezed()


def _copy_block(x_ref, y_ref):
    y_ref[...] = x_ref[...]


def pallas_copy(x, *, rows: int, cols: int, interpret: bool):
    """``x [B, L, D]`` copied in ``[rows, cols]`` blocks through VMEM."""
    batch, length, dim = x.shape
    spec = pl.BlockSpec((_SQUEEZED, rows, cols), lambda b, c, i: (b, i, c))
    return pl.pallas_call(
        _copy_block, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(batch, dim // cols, length // rows),
        in_specs=[spec], out_specs=spec, interpret=interpret, name="tpu_bandwidth_copy",
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3,
                                             vmem_limit_bytes=64 << 20))(x)  # 4096x512 float32: 32 MiB of buffers


def _copy_dma(x_hbm, y_hbm, sem):
    copy = pltpu.make_async_copy(x_hbm, y_hbm, sem.at[0])
    copy.start()
    copy.wait()


def dma_copy(x, *, interpret: bool):
    """``x`` copied HBM to HBM by one DMA."""
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _copy_dma, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[anywhere], out_specs=anywhere,
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))], interpret=interpret, name="tpu_bandwidth_dma")(x)


def copies(small: bool, interpret: bool, shape: tuple) -> dict:
    """The copies of a ``shape`` array by name, each ``f(x) -> a copy of x`` (``xla_scale``:
    ``2 x``); the block shapes that tile it (a block wider than the array would make an
    empty grid, and the copy would time nothing: it did once, at 3.6 TB/s)."""
    fns = {"xla_scale": lambda x: x * 2, "dma": functools.partial(dma_copy, interpret=interpret)}
    for rows, cols in SMALL_BLOCKS if small else BLOCKS:
        if shape[1] % rows or shape[2] % cols:
            continue
        fns[f"pallas_{rows}x{cols}"] = functools.partial(pallas_copy, rows=rows, cols=cols, interpret=interpret)
    return fns


def _kernels(silu: bool, interpret: bool):
    activation = "silu" if silu else None

    def conv(x, w, b):
        return causal_conv1d(x, w, b if silu else None, activation=activation, implementation="pallas_mosaic_tpu",
                             interpret=interpret)
    return conv


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--small", action="store_true", help="a small array, Pallas interpreted off a TPU")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    interpret = jax.default_backend() != "tpu"
    shape = SMALL_SHAPE if args.small else SHAPE
    meta = metadata("tpu_bandwidth", "python -m benchmarks.tpu_bandwidth" + (" --small" if args.small else ""))
    spec = specified_bandwidth() if jax.default_backend() == "tpu" else None
    rows = []

    def add(row: dict, ts: list[float], nbytes: int, dtype: str, shape: tuple) -> None:
        median = statistics.median(ts)
        row = dict(meta, **row, dtype=dtype, shape=list(shape), bytes=nbytes, median_s=median,
                   bytes_per_s=nbytes / median, spec_bytes_per_s=spec,
                   frac_spec=None if spec is None else nbytes / median / spec)
        rows.append(row)

    half = shape[:2] + (shape[2] // 2,)
    for dtype, size in (("bfloat16", shape), ("float32", shape), ("float32", half)):
        x = jax.random.normal(jax.random.key(0), size, jnp.dtype(dtype))
        fns = {name: jax.jit(f).lower(x).compile() for name, f in copies(args.small, interpret, size).items()}
        for name, fn in fns.items():
            expected = x * 2 if name == "xla_scale" else x
            if not bool(jnp.array_equal(fn(x), expected)):
                raise AssertionError(f"{name} did not copy {dtype}")
        times = time_interleaved(fns, [(x,)], PRESET)
        for name, ts in times.items():
            add({"copy": name}, ts, 2 * x.size * x.dtype.itemsize, dtype, size)
        del x

    seq = SeqShape("tpu_bandwidth", shape[0], shape[1], shape[2], 4)
    for mode in PRESET.modes:
        argsets = _inputs(seq, jnp.bfloat16, 1, mode)
        fns = {f"causal_conv1d_{'silu' if silu else 'plain'}": jax.jit(mode_fn(_kernels(silu, interpret), mode))
               .lower(*argsets[0]).compile() for silu in (True, False)}
        times = time_interleaved(fns, argsets, PRESET)
        for name, ts in times.items():
            add({"kernel": name, "mode": mode}, ts, ideal_bytes(seq, jnp.bfloat16, mode), "bfloat16", shape)

    best = {}  # each array's fastest copy
    for row in rows:
        if "copy" in row:
            array = row["dtype"], tuple(row["shape"])
            best[array] = max(best.get(array, 0.0), row["bytes_per_s"])
    for row in rows:
        row["frac_best_copy"] = row["bytes_per_s"] / best[row["dtype"], tuple(row["shape"])]
    with open(args.out / "tpu_bandwidth.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{meta['device']}; spec {'—' if spec is None else f'{spec / 1e9:.0f} GB/s'}")
    print("| what | array | ms | GB/s | of spec | of the array's best copy |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        what = r.get("copy") or f"{r['kernel']} {r['mode']}"
        of_spec = "—" if r["frac_spec"] is None else f"{100 * r['frac_spec']:.0f}%"
        print(f"| {what} | {r['dtype']} {r['shape']} | {1e3 * r['median_s']:.3f} | {r['bytes_per_s'] / 1e9:.1f} | {of_spec} "
              f"| {100 * r['frac_best_copy']:.0f}% |")
    return rows


if __name__ == "__main__":
    main()
