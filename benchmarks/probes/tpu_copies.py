"""Probe: the copy rate a Pallas TPU kernel, a DMA and XLA reach on the chip at hand.

    python -m benchmarks.probes.tpu_copies              # on a TPU
    python -m benchmarks.probes.tpu_copies --interpret  # anywhere (small array)

Kept as it ran on a TPU v5e on 2026-12-06 (output:
``benchmarks/results/tpu_copies_tpu_v5e_jax0.10.jsonl``): ``[4, 8192, 4096]`` in bfloat16
(256 MiB) and float32 (512 MiB), each read once and written once, as XLA's ``x * 2``, one
or four HBM-to-HBM DMAs, and Pallas BlockSpec copies at eight block shapes (one also
scaling, one asking for three buffers, one with every grid axis ``arbitrary``, one with
the grid's position and channel axes swapped). ``benchmarks/tpu_bandwidth.py`` is the
benchmark that grew from it.
"""
import functools, json, statistics, sys, time
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

INTERPRET = "--interpret" in sys.argv
B, L, D = (1, 1024, 1024) if INTERPRET else (4, 8192, 4096)
SQ = pl.Squeezed()

def timeit(f, *a, n=10):
    jax.block_until_ready(f(*a)); jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
    return statistics.median(ts)

def k_copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]

def k_scale(x_ref, o_ref):
    o_ref[...] = (x_ref[...].astype(jnp.float32) * 2).astype(o_ref.dtype)

def blockcopy(x, n, c, kernel=k_copy, buffers=None, sem=("parallel",) * 3, order="bji"):
    kw = {} if buffers is None else dict(pipeline_mode=pl.Buffered(buffers))
    if order == "bji":
        imap = lambda b, j, i: (b, i, j); grid = (x.shape[0], x.shape[2] // c, x.shape[1] // n)
    else:
        imap = lambda b, i, j: (b, i, j); grid = (x.shape[0], x.shape[1] // n, x.shape[2] // c)
    spec_in = pl.BlockSpec((SQ, n, c), imap, **kw)
    spec_out = pl.BlockSpec((SQ, n, c), imap)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid, in_specs=[spec_in],
                          out_specs=spec_out, interpret=INTERPRET, name="copy",
                          compiler_params=pltpu.CompilerParams(dimension_semantics=sem, vmem_limit_bytes=100 << 20))(x)

def dmacopy(x, pieces=1):
    def kernel(x_hbm, o_hbm, sems):
        step = x.shape[0] // pieces
        copies = [pltpu.make_async_copy(x_hbm.at[pl.ds(k * step, step)], o_hbm.at[pl.ds(k * step, step)], sems.at[k])
                  for k in range(pieces)]
        for cp in copies: cp.start()
        for cp in copies: cp.wait()
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_specs=pl.BlockSpec(memory_space=pl.ANY),
                          scratch_shapes=[pltpu.SemaphoreType.DMA((pieces,))], interpret=INTERPRET, name="dma")(x)

def main():
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jax.random.normal(jax.random.key(0), (B, L, D), dtype)
        nbytes = 2 * x.size * x.dtype.itemsize
        cases = {
            "xla_scale": lambda x: x * 2,
            "dma_1": functools.partial(dmacopy, pieces=1),
            "dma_4": functools.partial(dmacopy, pieces=4),
        }
        for n, c in ((1024, 512), (256, 4096), (512, 4096), (1024, 4096), (2048, 2048), (4096, 512), (2048, 1024), (8192, 512)):
            if n > L or c > D: continue
            cases[f"block_{n}x{c}"] = functools.partial(blockcopy, n=n, c=c)
        cases["block_1024x512_scale"] = functools.partial(blockcopy, n=1024, c=512, kernel=k_scale)
        cases["block_1024x512_buf3"] = functools.partial(blockcopy, n=1024, c=512, buffers=3)
        cases["block_1024x512_arbitrary"] = functools.partial(blockcopy, n=1024, c=512, sem=("arbitrary",) * 3)
        cases["block_1024x512_order_bij"] = functools.partial(blockcopy, n=1024, c=512, order="bij")
        for name, f in cases.items():
            try:
                f = jax.jit(f)
                ok = bool(jnp.array_equal(f(x), x * 2 if "scale" in name else x))
                t = timeit(f, x)
                row = dict(name=name, dtype=jnp.dtype(dtype).name, ms=t * 1e3, gbps=nbytes / t / 1e9, ok=ok)
            except Exception as e:
                row = dict(name=name, dtype=jnp.dtype(dtype).name, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)
    print("DONE")

if __name__ == "__main__":
    main()
