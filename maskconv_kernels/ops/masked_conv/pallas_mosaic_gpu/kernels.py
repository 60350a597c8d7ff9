"""The Mosaic GPU kernels: a tap GEMM (forward and input gradient) and a tap weight gradient.

Both are ``plgpu.kernel`` bodies, written as jax's own Hopper ops are
(``jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py``): program indices from
``lax.axis_index`` (or ``plgpu.nd_loop`` over a persistent grid), ``plgpu.emit_pipeline``
(or its warp-specialized form) streaming TMA boxes into swizzled shared memory, ``wgmma``
into a float32 register accumulator, an epilogue through shared memory with a TMA store.
Only active taps have a box: a masked tap is never read.

Operands are the grid layouts of :mod:`.grid`; every box starts on a multiple of 8 rows,
as TMA into tiled shared memory requires.
"""
from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from ...._core.hardware import sm_count
from .config import Config, stages
from .grid import CHUNK, Grid

__all__ = ["tap_gemm", "tap_weight_grad", "weight_grad_chunk"]

_M_WGMMA = 64  # rows of one wgmma instruction (per warpgroup)


def _transforms(minor: int, dtype) -> tuple:
    """Tiling and swizzle of a shared-memory tile whose minor dimension holds ``minor`` elements
    (or, for a wgmma's two operands, the smaller of their minor dimensions: they must share
    one swizzle)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _select(index, values: tuple[int, ...]):
    """``values[index]`` for a traced scalar ``index`` and static ``values`` (a select chain: no table in memory)."""
    out = jnp.int32(values[0])
    for i, v in enumerate(values[1:], 1):
        if v != values[0]:
            out = jnp.where(index == i, jnp.int32(v), out)
    return out


def _interpret(interpret: bool):
    return plgpu.InterpretGPUParams() if interpret else None


def _params():
    # Lane semantics: the transforms written here are the layouts used (no inference).
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def tap_gemm(a, w, g: Grid, tiles: Config, batch: int, out_dtype, *, interpret: bool, name: str):
    """``out[r] = sum_t a[d(t), r + shift(t)] @ w[t]``, per image, over the grid's output rows.

    Persistent: one program per SM walks the (pixel tile, channel tile) grid, channel
    tiles innermost so that programs running together read the same operand boxes (L2).
    Warp-specialized (``tiles.warp_specialized``, jax's Hopper matmul's structure): a
    producer warpgroup issues the TMA boxes, two consumer warpgroups each run ``wgmma`` on
    half of a ``2 * tile_pixels``-row tile; else one warpgroup does both, the pipeline
    keeping ``max_concurrent_steps`` boxes in flight.

    Args:
      a: ``[D, rows, K]`` (:func:`.grid.copies`), 16-bit, ``K`` a multiple of ``tiles.block_k``.
      w: ``[T * K, N]``, the dtype of ``a``: tap ``t``'s ``[K, N]`` block, ``N`` a multiple of
        ``tiles.tile_n``.
      g: the grid; ``batch``: images.

    Returns:
      ``[batch * per_image, N]`` of ``out_dtype``, ``per_image``: an image's ``H_o * Wp`` grid
      rows rounded up to whole tiles (:func:`.grid.crop` takes the valid ones).
    """
    tm, tn, bk = tiles.tile_pixels, tiles.tile_n, tiles.block_k
    groups = 2 if tiles.warp_specialized else 1  # consumer warpgroups, tm rows each
    cta_m = groups * tm
    k_blocks = a.shape[2] // bk
    steps = len(g.rows) * k_blocks
    tiles_per_image = -(-g.out_hw[0] * g.width // cta_m)
    m_tiles, n_tiles = batch * tiles_per_image, w.shape[1] // tn
    shifts, copy_of = g.shifts(), g.copy_index
    operands = _transforms(min(bk, tn), a.dtype)
    n_stages = stages(tiles, (cta_m + tn) * bk * a.dtype.itemsize, cta_m * tn * jnp.dtype(out_dtype).itemsize)

    def in_specs(m, n):
        base = (m // tiles_per_image) * g.image_rows + (m % tiles_per_image) * cta_m

        def a_block(k):
            t = k // k_blocks
            return _select(t, copy_of), pl.multiple_of(base + _select(t, shifts), 8), k % k_blocks

        return [
            plgpu.BlockSpec((None, pl.Element(cta_m), bk), a_block, transforms=operands, delay_release=1),
            plgpu.BlockSpec((bk, tn), lambda k: (k, n), transforms=operands, delay_release=1),
        ]

    def mma(acc, a_smem, w_smem, group):
        plgpu.wgmma(acc, a_smem.at[pl.ds(group * tm, tm)] if groups > 1 else a_smem, w_smem)
        plgpu.wgmma_wait(1)  # the previous step's boxes are free once its wgmma is done
        return acc

    def store(acc, out_smem, out_ref, m, n, group):
        out_smem[...] = acc[...].astype(out_smem.dtype)
        plgpu.commit_smem()
        rows = pl.ds(pl.multiple_of(m * cta_m + group * tm, tm), tm)
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[rows, pl.ds(pl.multiple_of(n * tn, tn), tn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out_smem is free for the next tile

    def plain(a_ref, w_ref, out_ref, out_smem):
        @plgpu.nd_loop((m_tiles, n_tiles), collective_axes="sm")
        def _tile(info):
            m, n = info.index

            def scope(acc):
                plgpu.emit_pipeline(
                    lambda _, a_smem, w_smem, acc: mma(acc, a_smem, w_smem, 0),
                    grid=(steps,), in_specs=in_specs(m, n), max_concurrent_steps=n_stages, init_carry=acc,
                )(a_ref, w_ref)
                plgpu.wgmma_wait(0)
                store(acc, out_smem, out_ref, m, n, 0)

            pl.run_scoped(scope, plgpu.ACC((tm, tn), jnp.float32))

        plgpu.wait_smem_to_gmem(0)

    def pipeline(m, n, body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), in_specs=in_specs(m, n), memory_registers=40, wg_axis="wg",
            num_compute_wgs=groups, max_concurrent_steps=n_stages, compute_context=context,
        )

    def specialized(a_ref, w_ref, out_ref):
        zero, ignore = jnp.int32(0), lambda *_, **__: None

        # The pipeline's buffers are allocated once, outside the tile loop: no
        # synchronisation between tiles beyond the pipeline's own barriers.
        @functools.partial(
            pl.run_scoped,
            allocations=pipeline(zero, zero, ignore, ignore).get_allocations(a_ref, w_ref),
            out_smem=plgpu.SMEM((groups, tm, tn), out_dtype, transforms=_transforms(tn, out_dtype)),
            collective_axes="wg",
        )
        def _scope(allocations, out_smem):
            group = lax.axis_index("wg")

            @plgpu.nd_loop((m_tiles, n_tiles), collective_axes="sm")
            def _tile(info):
                m, n = info.index

                def context(run):
                    def scope(acc):
                        run(acc)
                        store(acc, out_smem.at[group], out_ref, m, n, group)

                    pl.run_scoped(scope, plgpu.ACC((tm, tn), jnp.float32))

                body = lambda _, a_smem, w_smem, acc: mma(acc, a_smem, w_smem, group)
                pipeline(m, n, body, context)(a_ref, w_ref, allocations=allocations)

        plgpu.wait_smem_to_gmem(0)

    launch = dict(
        out_type=jax.ShapeDtypeStruct((m_tiles * cta_m, w.shape[1]), out_dtype),
        grid=(min(sm_count(), m_tiles * n_tiles),),
        grid_names=("sm",),
        compiler_params=_params(),
        interpret=_interpret(interpret),
        kernel_name=name,
    )
    if groups > 1:
        return plgpu.kernel(specialized, num_threads=groups + 1, thread_name="wg", **launch)(a, w)
    scratch = [plgpu.SMEM((tm, tn), out_dtype, transforms=_transforms(tn, out_dtype))]
    return plgpu.kernel(plain, scratch_types=scratch, **launch)(a, w)


def weight_grad_chunk(g: Grid, tiles: Config) -> int:
    """Pixels per weight-gradient step: the grid's chunk; 64 with 128-channel tiles, so
    that three stages of both operands still fit shared memory."""
    return g.chunk if tiles.weight_grad_c_in == _M_WGMMA else CHUNK


def tap_weight_grad(x, dy, g: Grid, tiles: Config, batch: int, splits: int, *, interpret: bool):
    """``parts[s, t] = sum over split s of x[d(t), r + shift(t)]^T @ dy[r]``, float32.

    Args:
      x: ``[D, rows, C_in]`` (:func:`.grid.copies` of the forward grid), 16-bit, ``C_in`` a
        multiple of ``tiles.weight_grad_c_in``.
      dy: ``[batch * H_o * Wp, C_out]`` (:func:`.grid.rows_of`), the dtype of ``x``,
        ``C_out`` a multiple of ``tiles.tile_n``.
      g: :func:`.grid.weight_grad_grid` (whole chunks tile each image's valid rows).
      splits: ranges of the pixel reduction, a divisor of the chunk count (:func:`.config.weight_grad_splits`).

    Returns:
      ``[splits, T, C_in, C_out]`` float32 partial sums (added in order by the core).
    """
    _, _, ci_pad = x.shape
    co_pad = dy.shape[1]
    tn, bci, chunk = tiles.tile_n, tiles.weight_grad_c_in, weight_grad_chunk(g, tiles)
    taps = len(g.rows)
    ci_tiles, co_tiles = ci_pad // bci, co_pad // tn
    per_image = g.out_hw[0] * g.width // chunk  # chunks of an image's valid rows
    chunks = batch * per_image
    assert chunks % splits == 0, (chunks, splits)
    steps = chunks // splits
    shifts, copy_of = g.shifts(), g.copy_index
    operands = _transforms(min(bci, tn), x.dtype)

    def body(x_ref, dy_ref, out_ref, out_smem):
        tc, co, s = lax.axis_index("tap_ci"), lax.axis_index("co"), lax.axis_index("split")
        t, ci = tc // ci_tiles, tc % ci_tiles

        def x_block(k):
            q = s * steps + k
            row = (q // per_image) * g.image_rows + (q % per_image) * chunk + _select(t, shifts)
            return _select(t, copy_of), pl.multiple_of(row, 8), ci

        def step(_, x_smem, dy_smem, acc):
            plgpu.wgmma(acc, x_smem.transpose((1, 0)), dy_smem)
            plgpu.wgmma_wait(1)
            return acc

        def scope(acc):
            plgpu.emit_pipeline(
                step,
                grid=(steps,),
                in_specs=[
                    plgpu.BlockSpec((None, pl.Element(chunk), bci), x_block, transforms=operands, delay_release=1),
                    plgpu.BlockSpec((chunk, tn), lambda k: (s * steps + k, co), transforms=operands, delay_release=1),
                ],
                max_concurrent_steps=stages(tiles, chunk * (bci + tn) * x.dtype.itemsize, bci * tn * 4),
                init_carry=acc,
            )(x_ref, dy_ref)
            plgpu.wgmma_wait(0)
            out_smem[...] = acc[...]
            plgpu.commit_smem()
            rows = pl.ds(pl.multiple_of(((s * taps + t) * ci_tiles + ci) * bci, bci), bci)
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[rows, pl.ds(pl.multiple_of(co * tn, tn), tn)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scope, plgpu.ACC((bci, tn), jnp.float32))

    parts = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits * taps * ci_pad, co_pad), jnp.float32),
        scratch_types=[plgpu.SMEM((bci, tn), jnp.float32, transforms=_transforms(tn, jnp.float32))],
        grid=(taps * ci_tiles, co_tiles, splits),
        grid_names=("tap_ci", "co", "split"),
        compiler_params=_params(),
        interpret=_interpret(interpret),
        kernel_name="maskconv_mgpu_weight_grad",
    )(x, dy)
    return parts.reshape(splits, taps, ci_pad, co_pad)
