"""Probe (ran on a TPU v5e: benchmarks/results/causal_conv1d_tpu_decode_tpu_v5e_jax0.10.jsonl): the one-launch decode kernel (``causal_conv1d_tpu_update``) against XLA's gather + conv + scatter.

    python -m benchmarks.probes.causal_conv1d_tpu_decode           # on a TPU
    python -m benchmarks.probes.causal_conv1d_tpu_decode --small   # anywhere, interpreted

R rows of one bfloat16 token each, D channels, width 4, SiLU, a pool of 2R float32 slots of
3 inputs (the serving benchmark's decode step). Each variant runs ``STEPS`` decode steps in
one ``lax.fori_loop`` carrying the pool (so the pool is updated in place, as a donated
serving loop does), timed per step; bytes per step: the rows' slots read and written, the
tokens read and the outputs written. Checks each variant's outputs and pool against
XLA's, and that NaN in every unread slot reaches nothing.
"""
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
from jax import lax
from maskconv_kernels.bench.machine import metadata
from maskconv_kernels.ops.causal_conv1d.checks import problem_of
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import decode as dk

SMALL = "--small" in sys.argv
INTERP = jax.default_backend() != "tpu"
SHAPES = [(16, 256)] if SMALL else [(64, 2048), (256, 2048), (64, 8192), (256, 8192)]
STEPS = 2 if SMALL else 50
W, S = 4, 3


def inputs(r, d, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((r, d)), jnp.bfloat16)
    pool = jnp.asarray(rng.standard_normal((2 * r, S, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((W, d)) / 2, jnp.float32)
    b = jnp.asarray(0.1 * rng.standard_normal(d), jnp.float32)
    idx = jnp.asarray(rng.permutation(2 * r)[:r], jnp.int32)
    return x, pool, w, b, idx


def xla_step(x, pool, w, b, idx):
    rows = pool[idx]  # (R, S, D)
    ext = jnp.concatenate([rows, x[:, None].astype(jnp.float32)], axis=1)  # (R, S + 1, D)
    pre = b + jnp.einsum("rkd,kd->rd", ext[:, S + 1 - W:], w)
    y = (pre * jax.nn.sigmoid(pre)).astype(x.dtype)
    return y, pool.at[idx].set(ext[:, 1:])


def kernel_step(rows, channels):
    def f(x, pool, w, b, idx):
        problem = problem_of(x[:, None], w, b, None, None, activation="silu", dilation=1)
        s = dk.DecodeStatic(problem=problem, state_len=S, rows=rows, channels=channels)
        y, pool = dk.update(x[:, None], pool, w, b[None], idx, idx, s=s, interpret=INTERP)
        return y[:, 0], pool
    return f


def looped(step):
    def run(x, pool, w, b, idx):
        def body(i, carry):
            y, pool = carry
            return step(x, pool, w, b, idx)
        return lax.fori_loop(0, STEPS, body, (jnp.zeros_like(x), pool))
    return jax.jit(run, donate_argnums=1)


def main():
    meta = metadata("decode_probe", "python -m benchmarks.probes.causal_conv1d_tpu_decode" + (" --small" if SMALL else ""))
    for r, d in SHAPES:
        x, pool, w, b, idx = inputs(r, d)
        ref_y, ref_pool = jax.jit(xla_step)(x, pool, w, b, idx)
        variants = {"xla": xla_step}
        for rows in (8, 16) if not SMALL else (8,):
            for channels in sorted({min(d, 4096), d}):
                variants[f"kernel_r{rows}_c{channels}"] = kernel_step(rows, channels)
        read = jnp.zeros(2 * r, bool).at[idx].set(True)
        nan_pool = jnp.where(read[:, None, None], pool, jnp.nan)
        nbytes = r * d * 2 * 2 + r * S * d * 4 * 2
        for name, step in variants.items():
            try:
                y1, p1 = jax.jit(step)(x, pool, w, b, idx)
                y2, p2 = jax.jit(step)(x, nan_pool, w, b, idx)
                diff = max(float(jnp.max(jnp.abs(y1.astype(jnp.float32) - ref_y.astype(jnp.float32)))),
                           float(jnp.max(jnp.abs(p1[idx] - ref_pool[idx]))))
                isolated = bool(jnp.array_equal(y1, y2)) and bool(jnp.array_equal(p1[idx], p2[idx]))
                f = looped(step)
                times = []
                for _ in range(6 if not SMALL else 1):
                    pl_ = jnp.array(pool)
                    jax.block_until_ready(pl_)
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(x, pl_, w, b, idx))
                    times.append((time.perf_counter() - t0) / STEPS)
                t = float(np.median(times[1:] if len(times) > 1 else times))
                row = dict(R=r, D=d, variant=name, us=1e6 * t, gbps=nbytes / t / 1e9, max_diff_vs_xla=diff,
                           nan_isolated=isolated)
            except Exception as e:  # a variant Mosaic refuses: say why, go on
                row = dict(R=r, D=d, variant=name, error=f"{type(e).__name__}: {str(e)[:400]}")
            print(json.dumps(dict(meta, **row)), flush=True)


if __name__ == "__main__":
    main()
