"""Probe: D4128's layout copies when causal_conv1d's input is made inside the program (as in a model).

    python -m benchmarks.probes.tpu_layout_in_model     # on a TPU

``benchmarks/probes/tpu_layout_copies.py`` found that a TPU gives a ``[4, 16384, 4128]``
bfloat16 parameter the layout ``{1,2,0}`` (positions minor: 4128 is not whole lane tiles,
16384 is), so a Pallas call, which takes ``{2,1,0}``, costs a copy in and one out. In a model
the short conv's input comes from a projection inside the same program, whose result XLA may
lay out as the kernel needs. This compiles an in-projection (``[B*L, 256] @ [256, D]``) then
the kernels (or XLA's shift-and-add) then a sum, for D = 4096 and 4128, and prints each
program's copy instructions and time. Kept as it ran.
"""
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp

from maskconv_kernels.ops.causal_conv1d import causal_conv1d


def program(impl):
    def f(h, w_in, w, b):
        x = (h @ w_in).astype(jnp.bfloat16).reshape(4, 16384, -1)
        y = causal_conv1d(x, w, b, activation="silu", implementation=impl)
        return y.astype(jnp.float32).sum(axis=(1, 2))
    return f


def main():
    for dim in (4096, 4128):
        h = jax.random.normal(jax.random.PRNGKey(0), (4 * 16384, 256), jnp.bfloat16)
        w_in = jax.random.normal(jax.random.PRNGKey(1), (256, dim), jnp.bfloat16) / 16
        w = jnp.full((4, dim), 0.25, jnp.float32)
        b = jnp.zeros((dim,), jnp.float32)
        for impl in ("pallas_mosaic_tpu", "xla"):
            compiled = jax.jit(program(impl)).lower(h, w_in, w, b).compile()
            text = compiled.as_text()
            copies = [line.strip()[:200] for line in text.splitlines() if re.search(r"= \S+ copy(?:-start)?\(", line)]
            jax.block_until_ready(compiled(h, w_in, w, b))
            ts = []
            for _ in range(10):
                t = time.perf_counter()
                jax.block_until_ready(compiled(h, w_in, w, b))
                ts.append(time.perf_counter() - t)
            print(json.dumps(dict(dim=dim, implementation=impl, copies=copies, median_s=statistics.median(ts))),
                  flush=True)


if __name__ == "__main__":
    main()
