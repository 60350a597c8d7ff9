"""Probe (ran on a TPU v5e: benchmarks/results/causal_conv1d_tpu_decode_tpu_v5e_jax0.10.jsonl): the one-launch decode kernel (``causal_conv1d_tpu_update``) against XLA's gather + conv + scatter.

    python -m benchmarks.probes.causal_conv1d_tpu_decode           # on a TPU
    python -m benchmarks.probes.causal_conv1d_tpu_decode --small   # anywhere, interpreted
    python -m benchmarks.probes.causal_conv1d_tpu_decode --fixed   # the step's fixed cost (add --small anywhere)

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
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from maskconv_kernels.bench.machine import metadata
from maskconv_kernels.ops.causal_conv1d import causal_conv1d_step
from maskconv_kernels.ops.causal_conv1d.checks import problem_of
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import decode as dk

SMALL = "--small" in sys.argv
FIXED = "--fixed" in sys.argv
UNROLL = "--unroll" in sys.argv  # the loop's steps written out: no loop iteration between them
INTERP = jax.default_backend() != "tpu"
SHAPES = [(16, 256)] if SMALL else [(64, 2048), (256, 2048), (64, 8192), (256, 8192)]
STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 2 if SMALL else 50
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
        return lax.fori_loop(0, STEPS, body, (jnp.zeros_like(x), pool), unroll=UNROLL)
    return jax.jit(run, donate_argnums=1)


def timed(f, *args):
    """Seconds a step of ``f`` (a ``looped`` step), the median of five calls after one."""
    times = []
    for _ in range(6 if not SMALL else 1):
        fresh = [jnp.array(a) for a in args]  # the pool is donated
        jax.block_until_ready(fresh)
        t0 = time.perf_counter()
        jax.block_until_ready(f(*fresh))
        times.append((time.perf_counter() - t0) / STEPS)
    return float(np.median(times[1:] if len(times) > 1 else times))


def _nothing(reads_ref, x_ref, pool_ref, y_ref, pool_out):
    y_ref[...] = x_ref[...]


def empty_step(x, pool, w, b, idx):
    """A ``pallas_call`` of one grid step that aliases the pool and copies the tokens: the
    launch alone."""
    del w, b
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    tile = pl.BlockSpec(x.shape, lambda i, *_: (0, 0))
    return pl.pallas_call(
        _nothing, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(1,), in_specs=[tile, hbm],
                                               out_specs=[tile, hbm]),
        input_output_aliases={2: 1}, interpret=INTERP, name="decode_probe_empty",
    )(idx, x, pool)


def loop_only(x, pool, w, b, idx):
    """The loop's own cost: one element of the pool updated in place."""
    return x, pool.at[idx[0], 0, 0].set(w[0, 0])


def api_step(x, pool, w, b, idx):
    """``causal_conv1d_step`` on decode rows (the serving benchmark's decode kind)."""
    qsl = jnp.arange(x.shape[0] + 1, dtype=jnp.int32)
    return causal_conv1d_step(x, pool, w, b, query_start_loc=qsl, state_indices=idx,
                              has_initial_state=jnp.ones(x.shape[0], bool), activation="silu")


def fixed_cost(meta):
    """Where a decode step's time goes below its bytes: rows swept at D = 2048 over one pool
    of 512 slots, for the kernel alone, ``causal_conv1d_step`` around it, a launch that does
    nothing, and the loop itself. Each row: us a step (prediction 35: about 30 us + bytes at
    560 GB/s)."""
    d, slots = (256, 32) if SMALL else (2048, 512)
    rows = (8, 16) if SMALL else (8, 32, 64, 128, 256)
    for r in rows:
        x, pool, w, b, idx = inputs(slots // 2, d)
        x, idx = x[:r], idx[:r]
        variants = {"loop_only": loop_only, "empty_kernel": empty_step, "kernel_r8": kernel_step(8, d),
                    "causal_conv1d_step": api_step}
        for name, step in variants.items():
            try:
                t = timed(looped(step), x, pool, w, b, idx)
                row = dict(R=r, D=d, slots=slots, variant=name, us=1e6 * t,
                           gbps=(r * d * 2 * 2 + r * S * d * 4 * 2) / t / 1e9)
            except Exception as e:  # a variant Mosaic refuses: say why, go on
                row = dict(R=r, D=d, variant=name, error=f"{type(e).__name__}: {str(e)[:400]}")
            print(json.dumps(dict(meta, **row)), flush=True)


def main():
    meta = metadata("decode_probe", "python -m benchmarks.probes.causal_conv1d_tpu_decode"
                    + (" --small" if SMALL else "") + (" --fixed" if FIXED else "") + (" --unroll" if UNROLL else "") + f" --steps {STEPS}")
    if FIXED:
        return fixed_cost(meta)
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
                t = timed(looped(step), x, pool, w, b, idx)
                row = dict(R=r, D=d, variant=name, us=1e6 * t, gbps=nbytes / t / 1e9, max_diff_vs_xla=diff,
                           nan_isolated=isolated)
            except Exception as e:  # a variant Mosaic refuses: say why, go on
                row = dict(R=r, D=d, variant=name, error=f"{type(e).__name__}: {str(e)[:400]}")
            print(json.dumps(dict(meta, **row)), flush=True)


if __name__ == "__main__":
    main()
