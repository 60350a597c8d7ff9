"""Probe: what SiLU's sigmoid costs in causal_conv1d's TPU backward, by formula.

    python -m benchmarks.probes.causal_conv1d_tpu_sigmoid           # on a TPU
    python -m benchmarks.probes.causal_conv1d_tpu_sigmoid --small   # anywhere, interpreted

At ``[4, 8192, 4096]`` bfloat16, width 4, times the backward kernel
(``bench.sequence``'s ``bwd`` mode: only ``causal_conv1d_tpu_bwd`` runs) with
the sigmoid as ``jax.nn.sigmoid`` (``lax.logistic``: the kernels' until this probe ran), as
``0.5 tanh(x / 2) + 0.5`` (theirs since), as Pallas' exact reciprocal of ``1 + exp(-x)``, and as the identity
(no sigmoid at all: what the rest costs), beside the kernel without bias and SiLU; each
with its largest difference from ``jax.nn.sigmoid``'s gradients. The backward with SiLU ran at 73% of
the bfloat16 copy rate on a TPU v5e, without it at the copy rate
(``benchmarks/NOTES.md``): this says how much of the gap the sigmoid is.
"""
import json, statistics, sys
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from maskconv_kernels.bench.sequence import SeqShape, _inputs, ideal_bytes, mode_fn
from maskconv_kernels.bench.timing import Preset, time_interleaved
from maskconv_kernels.ops.causal_conv1d import causal_conv1d
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import kernels

SMALL = "--small" in sys.argv
INTERP = jax.default_backend() != "tpu"
seq = SeqShape("s", 1, 1024, 512, 4) if SMALL else SeqShape("s", 4, 8192, 4096, 4)
PRESET = Preset(True, ("bfloat16",), ("bwd",), samples=9, min_sample_s=0.005, warmup=2, max_input_sets=1, peak_n=0)
ORIG = kernels.sigmoid  # the kernels' (the tanh form since this probe ran)
FORMS = {
    "logistic": jax.nn.sigmoid,
    "tanh": lambda v: 0.5 * jnp.tanh(0.5 * v) + 0.5,
    "rcp": lambda v: pl.reciprocal(1.0 + jnp.exp(-v), approx=False),
    "identity": lambda v: v,
}

def conv(silu):
    return lambda x, w, b: causal_conv1d(x, w, b if silu else None, activation="silu" if silu else None,
                                         implementation="pallas_mosaic_tpu", interpret=INTERP)

def main():
    for mode in ("bwd",):
        args = _inputs(seq, jnp.bfloat16, 1, mode)
        fns = {}
        for name, form in FORMS.items():
            kernels.sigmoid = form
            try:
                fns[name] = jax.jit(mode_fn(conv(True), mode)).lower(*args[0]).compile()
            except Exception as e:
                print(json.dumps(dict(mode=mode, form=name, error=str(e)[:300])), flush=True)
            finally:
                kernels.sigmoid = ORIG
        fns["plain"] = jax.jit(mode_fn(conv(False), mode)).lower(*args[0]).compile()
        ref = fns["logistic"](*args[0])
        times = time_interleaved(fns, args, PRESET)
        for name, ts in times.items():
            out = fns[name](*args[0])
            d = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
            t = statistics.median(ts)
            print(json.dumps(dict(mode=mode, form=name, ms=1e3 * t, gbps=ideal_bytes(seq, jnp.bfloat16, mode) / t / 1e9,
                                  max_diff_vs_logistic=d)), flush=True)


if __name__ == "__main__":
    main()
