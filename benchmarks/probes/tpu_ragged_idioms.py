"""Probe: which ragged idioms Mosaic compiles, and at what cost, before the mixed step's kernel is written.

    python -m benchmarks.probes.tpu_ragged_idioms              # on a TPU
    python -m benchmarks.probes.tpu_ragged_idioms --interpret  # anywhere (checks the values, not Mosaic)

A scheduler step's tokens are ragged: request ``r`` owns rows ``[start_r, end_r)`` of the
flat ``[T, D]`` batch, and its first ``W - 1`` tokens read its slot. A kernel over blocks of
``T`` must therefore touch rows at run-time offsets. Each variant below is one idiom, a
small kernel whose result is checked against NumPy, compiled (or refused: the error is the
finding) and timed on ``[T, D] = [2048, 2048]`` float32 with 256 run-time offsets:

* ``patch_aligned``: per offset ``o`` (SMEM), load the 16 rows at ``floor(o / 8) * 8`` of a
  VMEM block (``pl.ds(pl.multiple_of(., 8), 16)``), select rows ``o .. o + 2`` (an iota
  compare) to constants, store back: the per-request patch of the first ``W - 1`` rows,
  in a ``lax.fori_loop`` with run-time bounds;
* ``roll_dynamic``: ``pltpu.roll`` of each ``[16, D]`` tile along sublanes by a run-time shift;
* ``dma_unaligned``: a DMA from HBM ``x[T, D]`` of the 16 rows at an unaligned run-time
  offset into VMEM (a request's chunk), one per offset, then written out;
* ``token_leading``: the same DMA with tokens as a leading axis, ``x[T, D / 128, 128]``.

Prints one JSON line per variant: compiled or the error, values equal or not, the
compiled program's copy instructions (``token_leading`` reshapes a jit's argument: on a TPU
that may be a relayout), seconds.
"""
import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maskconv_kernels.bench.timing import median_times

INTERPRET = "--interpret" in sys.argv or jax.default_backend() != "tpu"
T, D, N = (128, 256, 16) if INTERPRET else (2048, 2048, 256)
ROWS = 16  # a patch window: two float32 sublane tiles


def offsets(seed=0):
    """``N`` sorted offsets in ``[8, T - ROWS - 8)``, at least 3 apart (requests of 3 or more tokens)."""
    rng = np.random.default_rng(seed)
    picks = np.sort(rng.choice(np.arange(8, T - ROWS - 8, 3), N, replace=False))
    return jnp.asarray(picks, jnp.int32)


def _patch_kernel(offsets_ref, count_ref, x_ref, y_ref):
    y_ref[...] = x_ref[...]

    def body(i, carry):
        o = offsets_ref[i]
        base = pl.multiple_of(lax.div(o, 8) * 8, 8)
        window = y_ref[pl.ds(base, ROWS), :]
        row = lax.broadcasted_iota(jnp.int32, window.shape, 0) + base
        for j in range(3):  # the request's first W - 1 = 3 rows get their "slot" values
            window = jnp.where(row == o + j, jnp.float32(-(j + 1)), window)
        y_ref[pl.ds(base, ROWS), :] = window
        return carry

    lax.fori_loop(0, count_ref[0], body, 0)


def patch_aligned(x, offs):
    return pl.pallas_call(
        _patch_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec(x.shape, lambda: (0, 0))],
        out_specs=pl.BlockSpec(x.shape, lambda: (0, 0)), interpret=INTERPRET, name="probe_patch_aligned",
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 << 20),
    )(offs, jnp.asarray([offs.shape[0]], jnp.int32), x)


def patch_reference(x, offs):
    y = np.asarray(x).copy()
    for o in np.asarray(offs):
        for j in range(3):
            y[o + j] = -(j + 1)
    return y


def _roll_kernel(shifts_ref, x_ref, y_ref):
    for i in range(y_ref.shape[0]):
        y_ref[i] = pltpu.roll(x_ref[i], shifts_ref[i], 0)


def roll_dynamic(x, offs):
    tiles = x.reshape(T // ROWS, ROWS, D)
    shifts = offs[: T // ROWS] % ROWS
    return pl.pallas_call(
        _roll_kernel, out_shape=jax.ShapeDtypeStruct(tiles.shape, tiles.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(tiles.shape, lambda: (0, 0, 0))],
        out_specs=pl.BlockSpec(tiles.shape, lambda: (0, 0, 0)), interpret=INTERPRET, name="probe_roll_dynamic",
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 << 20),
    )(shifts, tiles)


def roll_reference(x, offs):
    tiles = np.asarray(x).reshape(T // ROWS, ROWS, D)
    return np.stack([np.roll(t, int(s), axis=0) for t, s in zip(tiles, np.asarray(offs)[: T // ROWS] % ROWS)])


def _dma_kernel(offsets_ref, x_hbm, y_ref, buf, sem):
    copies = []
    for i in range(y_ref.shape[0]):
        copies.append(pltpu.make_async_copy(x_hbm.at[pl.ds(offsets_ref[i], ROWS)], buf.at[i], sem))
        copies[-1].start()
    for c in copies:
        c.wait()
    y_ref[...] = buf[...]


def dma_unaligned(x, offs, leading: bool = False):
    src = x.reshape(T, D // 128, 128) if leading else x
    shape = (N, ROWS, *src.shape[1:])
    zeros = (0,) * len(shape)
    return pl.pallas_call(
        _dma_kernel, out_shape=jax.ShapeDtypeStruct(shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(shape, lambda: zeros), interpret=INTERPRET, name="probe_dma_unaligned",
        scratch_shapes=[pltpu.VMEM(shape, x.dtype), pltpu.SemaphoreType.DMA(())],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 << 20),
    )(offs, src)


def dma_reference(x, offs, leading: bool = False):
    rows = np.stack([np.asarray(x)[o:o + ROWS] for o in np.asarray(offs)])
    return rows.reshape(N, ROWS, D // 128, 128) if leading else rows


VARIANTS = {
    "patch_aligned": (patch_aligned, patch_reference),
    "roll_dynamic": (roll_dynamic, roll_reference),
    "dma_unaligned": (dma_unaligned, dma_reference),
    "token_leading": (functools.partial(dma_unaligned, leading=True), functools.partial(dma_reference, leading=True)),
}


def main():
    offs = offsets()
    for dtype in (jnp.float32, jnp.bfloat16):
        x = (jnp.arange(T * D, dtype=jnp.float32).reshape(T, D) % 251).astype(dtype)
        for name, (fn, reference) in VARIANTS.items():
            if name in ("patch_aligned", "roll_dynamic") and dtype != jnp.float32:
                continue  # 32-bit tiles only: what the kernels' float32 frames hold
            row = dict(variant=name, dtype=jnp.dtype(dtype).name, T=T, D=D, offsets=N, interpret=INTERPRET)
            try:
                compiled = jax.jit(fn).lower(x, offs).compile()
                got = np.asarray(compiled(x, offs), np.float32)
                copies = len(re.findall(r"= \S+ copy(?:-start)?\(", compiled.as_text()))
                row.update(compiled=True, equal=bool(np.array_equal(got, np.asarray(reference(x, offs), np.float32))),
                           hlo_copies=copies, median_s=median_times({name: compiled}, [(x, offs)], 10)[name])
            except Exception as e:  # noqa: BLE001 - a refused idiom is the finding
                row.update(compiled=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
