"""Probe: where causal_conv1d's TPU kernels spend their time, by taking them apart.

    python -m benchmarks.probes.causal_conv1d_tpu_variants                      # on a TPU
    python -m benchmarks.probes.causal_conv1d_tpu_variants --small --interpret  # anywhere

Kept as it ran on a TPU v5e on 2026-12-06 (output:
``benchmarks/results/causal_conv1d_tpu_variants_tpu_v5e_jax0.10.jsonl``). At
``[4, 8192, 4096]`` bfloat16, width 4, float32 weights, it times stripped-down forward
kernels with the library's block layout (an ``[n, c]`` block and the 16 rows before it
as a second BlockSpec), one JSON line each, as bytes moved (x read, y written) per second:

* ``copy``: the block copied; ``frame``: through a float32 VMEM frame;
* ``unaligned_taps{1,2,4}``: 1, 2 or 4 taps, each a load from the frame at an offset
  that is not a multiple of 8 rows (the library's way); ``unaligned_silu``: 4 taps and
  SiLU; ``unaligned_slices_silu``: the same in 256-row slices;
* ``roll``, ``roll_silu``, ``roll_slices_silu``: the taps as sublane rolls
  (``pltpu.roll``) of the aligned block, the first tile redone from a small frame;

at four block shapes, then the library's own forward and backward kernels (bias and SiLU,
and neither) at two backward blocks, and ``implementation="xla"``'s forward. The
variants' first block reads its own first rows as "the rows before" (no state): ``err``
compares every output but the sequence's first 16 rows with a float32 reference, so
only a wrong shift shows there (one bfloat16 rounding is 0.0156 at these magnitudes).
"""
import functools
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maskconv_kernels.ops.causal_conv1d import causal_conv1d
from maskconv_kernels.ops.causal_conv1d.checks import make_problem
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import _laid_out, Config
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import kernels as K

SMALL = "--small" in sys.argv
INTERPRET = "--interpret" in sys.argv
B, L, D, W = (1, 1024, 512, 4) if SMALL else (4, 8192, 4096, 4)
H = 16
SQ = pl.Squeezed()
PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3, vmem_limit_bytes=48 << 20)


def timeit(f, *args, n=10):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def specs(n, c):
    ratio = n // H
    block = pl.BlockSpec((SQ, n, c), lambda b, j, i: (b, i, j))
    before = pl.BlockSpec((SQ, H, c), lambda b, j, i: (b, jnp.maximum(i * ratio - 1, 0), j))
    wspec = pl.BlockSpec((W, c), lambda b, j, i: (0, j))
    return block, before, wspec


def call(kernel, x, w, n, c, scratch=(), name="ablate"):
    block, before, wspec = specs(n, c)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0], x.shape[2] // c, x.shape[1] // n),
        in_specs=[block, before, wspec], out_specs=block, scratch_shapes=list(scratch), compiler_params=PARAMS,
        interpret=INTERPRET, name=name)(x, x, w)


# ---- forward variants (no bias, no silu unless said; W=4, dilation 1; first block's halo = rows before clamp)

def k_copy(x_ref, b_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...]


def k_frame(x_ref, b_ref, w_ref, o_ref, f_ref, *, n):
    f_ref[:H] = b_ref[...].astype(jnp.float32)
    f_ref[H:] = x_ref[...].astype(jnp.float32)
    o_ref[...] = f_ref[H:].astype(o_ref.dtype)


def _silu(v):
    return v * jax.nn.sigmoid(v)


def k_unaligned(x_ref, b_ref, w_ref, o_ref, f_ref, *, n, taps, silu):
    f_ref[:H] = b_ref[...].astype(jnp.float32)
    f_ref[H:] = x_ref[...].astype(jnp.float32)
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for t in range(W - taps, W):
        k = H - (W - 1 - t)
        acc = acc + w_ref[t:t + 1, :].astype(jnp.float32) * f_ref[k:k + n]
    if silu:
        acc = _silu(acc)
    o_ref[...] = acc.astype(o_ref.dtype)


def k_roll(x_ref, b_ref, w_ref, o_ref, f_ref, *, n, silu):
    """Taps as sublane rolls of the aligned block; the first tile redone from the small frame."""
    x = x_ref[...].astype(jnp.float32)
    acc = w_ref[W - 1:W, :].astype(jnp.float32) * x
    for t in range(W - 1):
        back = W - 1 - t
        acc = acc + w_ref[t:t + 1, :].astype(jnp.float32) * pltpu.roll(x, back, 0)
    if silu:
        acc = _silu(acc)
    o_ref[...] = acc.astype(o_ref.dtype)
    # first 16 rows from a 32-row frame
    f_ref[:H] = b_ref[...].astype(jnp.float32)
    f_ref[H:] = x[:H]
    head = jnp.zeros((H, x.shape[1]), jnp.float32)
    for t in range(W):
        k = H - (W - 1 - t)
        head = head + w_ref[t:t + 1, :].astype(jnp.float32) * f_ref[k:k + H]
    if silu:
        head = _silu(head)
    o_ref[:H] = head.astype(o_ref.dtype)


def k_roll_slices(x_ref, b_ref, w_ref, o_ref, f_ref, *, n, silu, rows=256):
    """As k_roll, in row slices of ``rows`` (fewer live vregs)."""
    f_ref[:H] = b_ref[...].astype(jnp.float32)
    f_ref[H:H + H] = x_ref[:H].astype(jnp.float32)
    ws = [w_ref[t:t + 1, :].astype(jnp.float32) for t in range(W)]
    for lo in range(0, n, rows):
        x = x_ref[lo:lo + rows].astype(jnp.float32)
        acc = ws[W - 1] * x
        for t in range(W - 1):
            acc = acc + ws[t] * pltpu.roll(x, W - 1 - t, 0)
        if silu:
            acc = _silu(acc)
        o_ref[lo:lo + rows] = acc.astype(o_ref.dtype)
        # rows lo..lo+15 need the 3 rows before lo
        if lo == 0:
            src = f_ref
            base = H
        else:
            src = None
        if lo == 0:
            head = jnp.zeros((H, x.shape[1]), jnp.float32)
            for t in range(W):
                k = base - (W - 1 - t)
                head = head + ws[t] * src[k:k + H]
        else:
            xx = x_ref[lo - H:lo + H].astype(jnp.float32)
            head = jnp.zeros((H, x.shape[1]), jnp.float32)
            for t in range(W):
                k = H - (W - 1 - t)
                head = head + ws[t] * xx[k:k + H]
        if silu:
            head = _silu(head)
        o_ref[lo:lo + H] = head.astype(o_ref.dtype)


def k_unaligned_slices(x_ref, b_ref, w_ref, o_ref, f_ref, *, n, silu, rows=256):
    f_ref[:H] = b_ref[...].astype(jnp.float32)
    f_ref[H:] = x_ref[...].astype(jnp.float32)
    ws = [w_ref[t:t + 1, :].astype(jnp.float32) for t in range(W)]
    for lo in range(0, n, rows):
        acc = jnp.zeros((rows, o_ref.shape[1]), jnp.float32)
        for t in range(W):
            k = H + lo - (W - 1 - t)
            acc = acc + ws[t] * f_ref[k:k + rows]
        if silu:
            acc = _silu(acc)
        o_ref[lo:lo + rows] = acc.astype(o_ref.dtype)


def reference(x, w, silu):
    xf = x.astype(jnp.float32)
    xp = jnp.pad(xf, ((0, 0), (W - 1, 0), (0, 0)))
    # first block's halo in the ablation kernels is the rows "before" block 0 = block 0's first H rows (clamped);
    # compare only rows >= H of the first block
    y = sum(w[t].astype(jnp.float32) * xp[:, t:t + x.shape[1]] for t in range(W))
    return (_silu(y) if silu else y).astype(x.dtype)


def main():
    rows = []
    key = jax.random.key(0)
    x = jax.random.normal(key, (B, L, D), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (W, D), jnp.float32) * 0.5
    bias = jax.random.normal(jax.random.key(2), (D,), jnp.float32) * 0.1
    dy = jax.random.normal(jax.random.key(3), (B, L, D), jnp.bfloat16)
    fwd_bytes = 2 * B * L * D * 2
    bwd_bytes = 3 * B * L * D * 2
    ref = {s: reference(x, w, s) for s in (False, True)}

    def record(name, f, args, nbytes, check=None):
        try:
            t = timeit(jax.jit(f), *args)
            err = None
            if check is not None:
                out = jax.jit(f)(*args)
                silu = check
                d = jnp.abs(out[:, H:].astype(jnp.float32) - ref[silu][:, H:].astype(jnp.float32))
                err = float(jnp.max(d))
            row = dict(name=name, ms=t * 1e3, gbps=nbytes / t / 1e9, err=err)
        except Exception as e:  # noqa: BLE001
            row = dict(name=name, error=f"{type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        rows.append(row)

    f32 = pltpu.VMEM
    for n, c in ((1024, 512), (512, 1024), (2048, 512), (1024, 1024)):
        if SMALL and (n > L or c > D):
            continue
        tag = f"n{n}_c{c}"
        record(f"copy_{tag}", lambda x, w, n=n, c=c: call(k_copy, x, w, n, c), (x, w), fwd_bytes)
        record(f"frame_{tag}", lambda x, w, n=n, c=c: call(functools.partial(k_frame, n=n), x, w, n, c,
                                                           [f32((H + n, c), jnp.float32)]), (x, w), fwd_bytes)
        for taps in (1, 2, 4):
            record(f"unaligned_taps{taps}_{tag}", lambda x, w, n=n, c=c, taps=taps: call(
                functools.partial(k_unaligned, n=n, taps=taps, silu=False), x, w, n, c, [f32((H + n, c), jnp.float32)]),
                (x, w), fwd_bytes, check=False if taps == W else None)
        record(f"unaligned_silu_{tag}", lambda x, w, n=n, c=c: call(
            functools.partial(k_unaligned, n=n, taps=W, silu=True), x, w, n, c, [f32((H + n, c), jnp.float32)]),
            (x, w), fwd_bytes, check=True)
        record(f"unaligned_slices_silu_{tag}", lambda x, w, n=n, c=c: call(
            functools.partial(k_unaligned_slices, n=n, silu=True), x, w, n, c, [f32((H + n, c), jnp.float32)]),
            (x, w), fwd_bytes, check=True)
        record(f"roll_{tag}", lambda x, w, n=n, c=c: call(
            functools.partial(k_roll, n=n, silu=False), x, w, n, c, [f32((2 * H, c), jnp.float32)]),
            (x, w), fwd_bytes, check=False)
        record(f"roll_silu_{tag}", lambda x, w, n=n, c=c: call(
            functools.partial(k_roll, n=n, silu=True), x, w, n, c, [f32((2 * H, c), jnp.float32)]),
            (x, w), fwd_bytes, check=True)
        record(f"roll_slices_silu_{tag}", lambda x, w, n=n, c=c: call(
            functools.partial(k_roll_slices, n=n, silu=True), x, w, n, c, [f32((2 * H, c), jnp.float32)]),
            (x, w), fwd_bytes, check=True)
        if SMALL:
            break

    # the library's kernels, forward and backward alone, bias + silu
    for silu in (True, False):
        act = "silu" if silu else None
        problem, *_ = make_problem(x, w, bias, activation=act)
        ops = {"x": x, "w": w, "bias": bias}
        for bwd_cfg in (Config(), Config(backward_block_positions=1024, backward_block_channels=512)):
            s, args = _laid_out(ops, problem, bwd_cfg, backward=False)
            record(f"lib_fwd_silu{silu}", lambda x, s=s, args=args: K.forward(x, *args[1:], s=s, interpret=INTERPRET),
                   (x,), fwd_bytes)
            sb, argsb = _laid_out(ops, problem, bwd_cfg, backward=True)
            record(f"lib_bwd_silu{silu}_p{sb.positions}_c{sb.channels}",
                   lambda x, dy, s=sb, args=argsb: K.backward(x, *args[1:], dy, s=s, interpret=INTERPRET)[0],
                   (x, dy), bwd_bytes)
            if SMALL:
                break
    record("xla_fwd_silu", lambda x, w, b: causal_conv1d(x, w, b, activation="silu", implementation="xla"),
           (x, w, bias), fwd_bytes)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
