"""Block sizes of causal_conv1d's Mosaic TPU kernels, timed on the attached TPU.

    python -m benchmarks.causal_conv1d_tpu_blocks --out DIR

For causal-conv1d's published shape (B=4, L=16384, D=4128, W=4, bfloat16 activations,
float32 weights, bias and SiLU), the same with D=4096 (a whole number of 128-lane tiles:
the first ran at a lower rate per element than the other shapes) and a Mamba-2 layer at
2k tokens, times the forward and the forward+backward under each candidate ``Config``
(one process, samples interleaved) and gives each as a fraction of the HBM roofline
(:func:`maskconv_kernels.bench.sequence.ideal_bytes` over the chip's specified
bandwidth) and of the bfloat16 copy rate measured in the run (on a TPU:
:func:`maskconv_kernels.bench.sequence.copy_rates`; a v5e copies far below its
specification), with the compiled program's copy instructions and temporary bytes (a layout
copy of an operand around the kernels would show there). ``default_packed`` is the
default config on packed documents (four a row, as segment ids), which the sequence
benchmark does not time. Writes
``DIR/causal_conv1d_tpu_blocks.jsonl`` with the machine's metadata, and prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp

from maskconv_kernels.bench.machine import metadata
from maskconv_kernels.bench.sequence import SeqShape, _inputs, copy_rates, ideal_bytes, mode_fn, roofline_bandwidth
from maskconv_kernels.bench.timing import Preset, time_interleaved
from maskconv_kernels.ops.causal_conv1d import causal_conv1d
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import Config

SHAPES = (SeqShape("B4_L16384_D4128_W4", 4, 16384, 4128, 4), SeqShape("B4_L16384_D4096_W4", 4, 16384, 4096, 4),
          SeqShape("B4_L2048_D1536_W4", 4, 2048, 1536, 4))
CANDIDATES = {
    "default": Config(),
    "p512_c512": Config(block_positions=512, block_channels=512),
    "p2048_c512": Config(block_positions=2048, block_channels=512),
    "p1024_c1024": Config(block_positions=1024, block_channels=1024),
    "bwd_p256_c512": Config(backward_block_positions=256, backward_block_channels=512),
    "bwd_p1024_c512": Config(backward_block_positions=1024, backward_block_channels=512),
    "bwd_p512_c1024": Config(backward_block_positions=512, backward_block_channels=1024),
    "bwd_p512_c256": Config(backward_block_positions=512, backward_block_channels=256),
    "default_packed": Config(),
}
PACKED = ("default_packed",)  # run with segment ids: four documents of equal length a row
PRESET = Preset(True, ("bfloat16",), ("fwd", "fwd+bwd"), samples=7, min_sample_s=0.002, warmup=2, max_input_sets=2,
                peak_n=0)


def _conv(x, w, b, *, config: Config, packed: bool):
    """The kernels on ``x (B, L, D)``; ``packed``: four documents of equal length a row."""
    ids = None
    if packed:
        batch, length = x.shape[:2]
        ids = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) * 4 // length, (batch, length))
    return causal_conv1d(x, w, b, segment_ids=ids, activation="silu", implementation="pallas_mosaic_tpu",
                         config=config)


def _copies(compiled) -> int:
    """The copy instructions of a compiled program's HLO (layout changes, among others)."""
    return len(re.findall(r"= \S+ copy(?:-start)?\(", compiled.as_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--modes", nargs="+", default=list(PRESET.modes))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = metadata("tpu_blocks", "python -m benchmarks.causal_conv1d_tpu_blocks")
    bandwidth, measured = roofline_bandwidth(jax.default_backend(), PRESET)
    copy = copy_rates(jax.default_backend(), PRESET).get("bfloat16")
    rows = []
    with open(args.out / "causal_conv1d_tpu_blocks.jsonl", "w") as f:
        for shape in SHAPES:
            for mode in args.modes:
                argsets = _inputs(shape, jnp.bfloat16, PRESET.max_input_sets, mode)
                compiled = {}
                for name, config in CANDIDATES.items():
                    conv = functools.partial(_conv, config=config, packed=name in PACKED)
                    compiled[name] = jax.jit(mode_fn(conv, mode)).lower(*argsets[0]).compile()
                times = time_interleaved(compiled, argsets, PRESET)
                nbytes = ideal_bytes(shape, jnp.bfloat16, mode)
                roofline = nbytes / bandwidth
                for name, ts in times.items():
                    stats = compiled[name].memory_analysis()
                    row = dict(meta, shape=shape.name, mode=mode, config=name, segmented=name in PACKED,
                               blocks=dataclasses.asdict(CANDIDATES[name]), median_s=statistics.median(ts),
                               frac_roofline=roofline / statistics.median(ts), bandwidth_bytes_per_s=bandwidth,
                               copy_bytes_per_s=copy,
                               frac_copy=None if copy is None else nbytes / copy / statistics.median(ts),
                               measured_bandwidth_bytes_per_s=measured, hlo_copies=_copies(compiled[name]),
                               temp_bytes=None if stats is None else stats.temp_size_in_bytes)
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    of_copy = "" if copy is None else f" ({100 * row['frac_copy']:.0f}% of the copy rate)"
                    print(f"{shape.name} {mode:8s} {name:16s} {1e3 * row['median_s']:8.3f} ms "
                          f"{100 * row['frac_roofline']:5.1f}% of {bandwidth / 1e9:.0f} GB/s{of_copy}, "
                          f"{row['hlo_copies']} copies, {(row['temp_bytes'] or 0) / 2**20:.0f} MiB temporaries",
                          flush=True)


if __name__ == "__main__":
    main()
