"""Probe: where XLA copies the operands of a Pallas TPU call whose channels are not whole lane tiles.

    python -m benchmarks.probes.tpu_layout_copies              # on a TPU
    python -m benchmarks.probes.tpu_layout_copies --interpret  # anywhere (small arrays; no HLO copies to find)

On a TPU v5e on 2026-12-07, causal_conv1d's kernels at B4 L16384 **D4128** compiled with
2 copy instructions and 1,056 MiB of temporaries (forward; 4 and 1,585 MiB forward+backward)
and ran at 40% of the chip's copy rate, where at D4096 they compiled with none and ran at
100% (``benchmarks/results/causal_conv1d_tpu_blocks_tpu_v5e_jax0.10.jsonl``). This compiles,
for ``[4, 16384, D]`` bfloat16 with D = 4096 and 4128, Pallas copy kernels that differ in one
thing each, and prints each program's copy instructions (with their layouts), its
temporaries and its time:

* ``blocks``: ``(512, 512)`` blocks, the last channel block partial at D4128;
* ``whole_d``: ``(256, D)`` blocks, every channel in one block;
* ``twice``: ``blocks`` with x passed twice (as the kernels pass it: block and halo);
* ``kernel``: ``causal_conv1d``'s forward kernel (bias, SiLU).

Kept as it ran; its output is the evidence for the fix, not a benchmark.
"""
import functools
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from maskconv_kernels.ops.causal_conv1d import causal_conv1d

INTERPRET = "--interpret" in sys.argv
B, L = (1, 256) if INTERPRET else (4, 16384)
DIMS = (256, 288) if INTERPRET else (4096, 4128)
SQ = pl.Squeezed()


def _copy(*refs):
    refs[-1][...] = refs[0][...]


def pallas_copy(x, positions: int, channels: int, twice: bool = False):
    batch, length, dim = x.shape
    spec = pl.BlockSpec((SQ, positions, channels), lambda b, c, i: (b, i, c))
    return pl.pallas_call(
        _copy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(batch, pl.cdiv(dim, channels), pl.cdiv(length, positions)),
        in_specs=[spec, spec] if twice else [spec], out_specs=spec, interpret=INTERPRET, name="layout_copy",
    )(*([x, x] if twice else [x]))


def variants(dim: int) -> dict:
    w = jnp.full((4, dim), 0.25, jnp.float32)
    b = jnp.zeros((dim,), jnp.float32)
    return {
        "blocks": functools.partial(pallas_copy, positions=512, channels=512),
        "whole_d": functools.partial(pallas_copy, positions=256, channels=dim),
        "twice": functools.partial(pallas_copy, positions=512, channels=512, twice=True),
        "kernel": lambda x: causal_conv1d(x, w, b, activation="silu", implementation="pallas_mosaic_tpu",
                                          interpret=INTERPRET),
    }


def timeit(f, x, n=10):
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    for dim in DIMS:
        x = jax.random.normal(jax.random.PRNGKey(0), (B, L, dim), jnp.float32).astype(jnp.bfloat16)
        for name, fn in variants(dim).items():
            try:
                compiled = jax.jit(fn).lower(x).compile()
            except Exception as e:  # noqa: BLE001 - a refused variant is a finding
                print(json.dumps(dict(dim=dim, variant=name, error=str(e).splitlines()[0][:300])), flush=True)
                continue
            text = compiled.as_text()
            copies = [line.strip()[:240] for line in text.splitlines() if re.search(r"= \S+ copy(?:-start)?\(", line)]
            params = [line.strip()[:240] for line in text.splitlines() if " parameter(0)" in line][:2]
            calls = [line.strip()[:400] for line in text.splitlines() if "custom-call(" in line][:2]
            stats = compiled.memory_analysis()
            seconds = timeit(compiled, x)
            row = dict(dim=dim, variant=name, copies=copies, params=params, custom_calls=calls,
                       temp_mib=None if stats is None else stats.temp_size_in_bytes / 2**20, median_s=seconds,
                       read_write_gb_s=2 * x.size * x.dtype.itemsize / seconds / 1e9)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
