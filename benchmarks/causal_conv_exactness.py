"""Where a ``causal_conv`` stream equals its full pass bit for bit, per implementation, dtype and layer.

    python -m benchmarks.causal_conv_exactness                 # this platform's implementations
    python -m benchmarks.causal_conv_exactness --interpret     # CPU: the kernel backends interpreted (small layers)

For each layer (video VAE, spectrogram and audio codec layers, strides 1 to 8), dtype and
chunk schedule (Wan's 1 + 4k frames, one stride at a time, the longest divisible chunk),
it runs the stream with one jitted step per chunk shape and the full pass jitted, and
prints whether the concatenated chunks are the full pass's bits, else the largest
difference in units of the output dtype's ulp at the output's scale and the bound the
suites hold them to (``TOLERANCE[dtype] * sqrt(reduction) * max|x| * max|k|``, for each
of the two against float64). The table is what docs/causal_conv.md and docs/design/causal_conv.md report; on a GPU it
answers the same question for the compiled kernels (``benchmarks/gpu_check.sh`` may run it).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import maskconv_kernels as mk
from maskconv_kernels.bench.machine import header, metadata
from maskconv_kernels.ops.causal_conv import IMPLEMENTATIONS, backends
from maskconv_kernels.ops.causal_conv.checks import make_problem
from maskconv_kernels.ops.masked_conv.backends import lowering_platform

TOLERANCE = {np.dtype("float32"): 2.0**-20, np.dtype(jnp.bfloat16): 2.0**-7}  # tests/support/numerics.py's


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    x_shape: tuple
    window: tuple
    c_out: int
    kw: tuple = ()
    small: bool = False

    @property
    def stride(self) -> int:
        s = dict(self.kw).get("strides", 1)
        return s if isinstance(s, int) else s[0]


LAYERS = [
    Layer("video 3x3x3 C64", (1, 17, 16, 16, 64), (3, 3, 3), 64),
    Layer("video 3x3x3 C64 s2 replicate", (1, 17, 16, 16, 64), (3, 3, 3), 64,
          (("strides", (2, 1, 1)), ("padding_mode", "replicate"))),
    Layer("video time 3x1x1 C128 s2", (1, 17, 8, 8, 128), (3, 1, 1), 128, (("strides", (2, 1, 1)),)),
    Layer("spectrogram 3x3 C32", (1, 65, 32, 32), (3, 3), 32),
    Layer("audio k7 C64", (1, 961, 64), (7,), 64),
    Layer("audio k4 C64 s2", (1, 961, 64), (4,), 128, (("strides", 2),)),
    Layer("audio k10 C128 s5", (1, 961, 128), (10,), 256, (("strides", 5),)),
    Layer("audio k16 C256 s8", (1, 961, 256), (16,), 512, (("strides", 8),)),
    Layer("audio k3 d3 C32", (1, 961, 32), (3,), 32, (("dilation", 3),)),
    Layer("small audio k4 C8 s2", (2, 33, 8), (4,), 8, (("strides", 2),), small=True),
    Layer("small spectrogram 3x3 C8", (1, 17, 6, 8), (3, 3), 8, small=True),
]


def schedules(frames: int, s: int) -> dict[str, list[int]]:
    out = {
        "1+4s+..": [1] + [4 * s] * ((frames - 1) // (4 * s)),
        "1+s+..": [1] + [s] * ((frames - 1) // s),
        "longest": [frames - s * ((frames - 1) // s), s * ((frames - 1) // s)],
    }
    return {k: [c for c in v if c] for k, v in out.items()}


def compare(layer: Layer, dtype, implementation: str, interpret: bool) -> dict[str, str]:
    kw = dict(layer.kw, implementation=implementation, interpret=interpret)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(layer.x_shape).astype(np.float32).astype(dtype))
    fan_in = int(np.prod(layer.window)) * layer.x_shape[-1]
    k = jnp.asarray((rng.standard_normal((*layer.window, layer.x_shape[-1], layer.c_out)) / np.sqrt(fan_in))
                    .astype(np.float32).astype(dtype))
    full_fn = jax.jit(lambda x, k, n: mk.causal_conv(x[:, :n], k, **kw), static_argnums=2)
    step = jax.jit(lambda c, st, k: mk.causal_conv_stream(c, st, k, **kw))
    scale = float(jnp.abs(x.astype(jnp.float32)).max() * jnp.abs(k.astype(jnp.float32)).max())
    bound = TOLERANCE[np.dtype(dtype)] * np.sqrt(fan_in) * scale
    out = {}
    for name, chunks in schedules(layer.x_shape[1], layer.stride).items():
        if implementation != "xla" and interpret and len(chunks) > 12:
            chunks = chunks[:12]  # an interpreter's budget
        total = sum(chunks)
        full = np.asarray(full_fn(x, k, total)).astype(np.float64)
        ys, state, start = [], None, 0
        for length in chunks:
            y, state = step(x[:, start : start + length], state, k)
            ys.append(y)
            start += length
        streamed = np.asarray(jnp.concatenate(ys, axis=1)).astype(np.float64)
        diff = np.abs(streamed - full)
        if not diff.any():
            out[name] = "bit-exact"
            continue
        ulp = float(np.finfo(np.float32).eps if np.dtype(dtype) == np.float32 else 2.0**-7) * float(np.abs(full).max())
        out[name] = f"{diff.max() / ulp:.2g} ulp ({(diff > 0).mean():.1%} differ; bound {bound / ulp:.0f} ulp)"
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="run the kernel backends in their interpreters")
    args = parser.parse_args(argv)
    platform = lowering_platform()
    rows = []
    for implementation in IMPLEMENTATIONS:
        for layer in LAYERS:
            if implementation != "xla" and platform == "cpu" and not (args.interpret and layer.small):
                continue
            for dtype in (np.dtype("float32"), np.dtype(jnp.bfloat16)):
                x = jax.ShapeDtypeStruct(layer.x_shape, dtype)
                kern = jax.ShapeDtypeStruct((*layer.window, layer.x_shape[-1], layer.c_out), dtype)
                spec = make_problem("causal_conv", x, kern, **dict(layer.kw))[0].spec
                reason = backends.REGISTRY.get(implementation).unsupported(spec, platform, args.interpret)
                if reason is not None:
                    continue
                result = compare(layer, dtype, implementation, args.interpret and implementation != "xla")
                rows.append((implementation, layer.name, str(dtype), result))
                print(f"| {implementation} | {layer.name} | {dtype} | " + " | ".join(result.values()) + " |", flush=True)
    print()
    command = " ".join(["python -m benchmarks.causal_conv_exactness", *(argv if argv is not None else sys.argv[1:])])
    print(header([metadata("causal_conv_exactness", command)]))
    print()
    print("| implementation | layer | dtype | " + " | ".join(schedules(17, 1)) + " |")
    print("|---|---|---|---|---|---|")
    for implementation, name, dtype, result in rows:
        print(f"| {implementation} | {name} | {dtype} | " + " | ".join(result.values()) + " |")


if __name__ == "__main__":
    main()
