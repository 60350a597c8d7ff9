"""The ``pallas_mosaic_gpu`` backend: what it supports and its three kernels.

Everything around the kernels (the 1-D lift, transposes and JVPs, batching, the choice
at lowering time, batch partitioning, the weight gradient's split sum and scatter) is
:mod:`..maps`, shared by every backend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...._core.hardware import attached_compute_capability, jax_version
from ...._core.tiling import round_up
from ..spec import ConvSpec
from . import grid as _grid
from .config import Config, weight_grad_splits

__all__ = ["unsupported", "forward", "input_grad", "weight_grad"]

_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16))
_INT32_LIMIT = 2**31
_MIN_JAX = (0, 11)
_HOPPER = (9, 0)


def unsupported(spec: ConvSpec, platform: str | None, interpret: bool = False) -> str | None:
    """Why the Mosaic GPU kernels cannot run ``spec`` lowered for ``platform`` (``None`` when they can).

    ``platform``: the lowering platform (the record says they lower for cuda, or anywhere
    interpreted), or ``None`` to ask about the problem alone; lowered, the GPU must be a Hopper.
    """
    if jax_version() < _MIN_JAX:
        return (
            f"jax {jax.__version__}: the Mosaic GPU kernels need jax >= 0.11 (plgpu.kernel's pipelines and, "
            "off a GPU, its interpreter)"
        )
    if spec.ndim == 3:
        return "3-D convolutions (the Mosaic GPU kernels are 1-D and 2-D; implementation=None uses another backend)"
    if spec.groups > 1:
        return f"feature_group_count={spec.groups} (grouped convolutions)"
    if np.dtype(spec.dtype) not in _DTYPES:
        return (
            f"{spec.dtype} inputs: the kernels take bfloat16 and float16 (wgmma's float32 mode is TF32 with "
            "K-major operands only, which the pixel-major weight gradient is not; float32 goes to pallas_triton "
            "or xla, which honour precision)"
        )
    if any(s != 1 for s in spec.strides):
        return f"strides={spec.strides} (the kernels' shifted GEMMs are stride 1)"
    if interpret or platform is None:
        return None
    capability = attached_compute_capability()
    if capability is not None and capability != _HOPPER:
        return f"compute capability {capability[0]}.{capability[1]}: the kernels use Hopper's wgmma (sm_90a)"
    return None


def _tiles(job) -> Config:
    return job.config if job.config is not None else Config.get_default(job.spec, job.dtype)


def _check_size(rows: int):
    if rows >= _INT32_LIMIT:
        raise NotImplementedError(
            f'implementation="pallas_mosaic_gpu" does not support this problem: {rows} grid rows do not fit '
            "an int32 index; split the batch"
        )


def _classes(pieces, channels: int, transpose: bool):
    """The result channels grouped by the pieces that write them: ``[(pieces, channels)]``.

    A window mask has one class, every piece writing every channel. A channel-partial
    mask (PixelCNN's R, G, B groups) has one per group: each is its own tap GEMM over the
    pieces that reach it, so no product joins channels the mask keeps apart.
    """
    writes = np.stack([_grid.channel_mask(piece.in_runs if transpose else piece.out_runs, channels) for piece in pieces])
    owners: dict[tuple, list[int]] = {}
    for c in range(channels):
        owners.setdefault(tuple(np.flatnonzero(writes[:, c]).tolist()), []).append(c)
    return [(tuple(pieces[i] for i in members), tuple(cs)) for members, cs in owners.items()]


def _tap_weights(k, pieces, reads, results, transpose: bool, k_pad: int, n_pad: int):
    """``[T * k_pad, n_pad]``: per piece, ``k[tap]`` as ``[read channels, result channels]``.

    Rows a piece does not read are zero by a select (a masked kernel entry, even NaN, is
    never read); columns are the class's result channels; zero-padded.
    """
    blocks = []
    for piece, runs in zip(pieces, reads):
        w = k[piece.tap]  # [C_in, C_out]
        w = jnp.swapaxes(w, 0, 1) if transpose else w
        w = jnp.where(_grid.channel_mask(runs, w.shape[0])[:, None], w, jnp.zeros((), w.dtype))
        w = w[:, np.asarray(results)] if len(results) != w.shape[1] else w
        blocks.append(jnp.pad(w, ((0, k_pad - w.shape[0]), (0, n_pad - w.shape[1]))))
    return jnp.concatenate(blocks)


def _tap_conv(a, k, job, out_dtype, transpose: bool, name: str):
    """The forward (``transpose=False``) or the input gradient, one tap GEMM per channel class."""
    t, p = _tiles(job), job.problem
    batch, c_a = a.shape[0], a.shape[-1]
    c_result = p.c_in if transpose else p.c_out
    # A float32 cotangent (preferred_element_type=float32) is rounded to the inputs'
    # 16-bit dtype, as cuDNN's 16-bit backward passes take it: wgmma's float32 mode (TF32)
    # takes K-major operands only.
    a, k = a.astype(job.dtype), k.astype(job.dtype)
    make_grid = _grid.input_grad_grid if transpose else _grid.forward_grid
    from . import kernels  # jax's Mosaic GPU: imported when the kernels run, not when a backend is chosen

    parts, order = [], []
    for pieces, results in _classes(p.pieces, c_result, transpose):
        order += results
        if not pieces:  # channels no active entry writes: exact zeros
            parts.append(jnp.zeros((batch, *(p.in_hw if transpose else p.out_hw), len(results)), out_dtype))
            continue
        reads = tuple(piece.out_runs if transpose else piece.in_runs for piece in pieces)
        g = make_grid(p, taps=tuple(piece.tap for piece in pieces), reads=reads)
        _check_size(batch * g.image_rows)
        k_pad, n_pad = round_up(c_a, t.block_k), round_up(len(results), t.tile_n)
        copies = _grid.copies(a, g, k_pad, tail=2 * t.tile_pixels)  # the last tile's boxes read past the end
        w = _tap_weights(k, pieces, reads, results, transpose, k_pad, n_pad)
        out = kernels.tap_gemm(copies, w, g, t, batch, out_dtype, interpret=job.interpret, name=name)
        parts.append(_grid.crop(out, g, batch, out.shape[0] // batch, len(results)))
    y = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return y if order == sorted(order) else y[..., np.argsort(order)]


def _allowed(p) -> np.ndarray | None:
    """Bool ``[T, C_in, C_out]``: the channel pairs each active tap joins; ``None`` when all are."""
    if not p.has_partial_taps:
        return None
    allowed = np.zeros((len(p.taps), p.c_in, p.c_out), bool)
    index = {tap: i for i, tap in enumerate(p.taps)}
    for piece in p.pieces:
        allowed[index[piece.tap]] |= np.outer(_grid.channel_mask(piece.in_runs, p.c_in), _grid.channel_mask(piece.out_runs, p.c_out))
    return allowed


# The three kernels ..maps lowers, on the 2-D problem. Interpreted, they are traced inline:
# Mosaic GPU's interpreter carries an ordered effect, which the primitives declare
# (the backend record's interpreter="effects").


def forward(x, k, job, out_dtype):
    """``y: [N, OH, OW, C_out]`` from ``x: [N, H, W, C_in]``, ``k: [KH, KW, C_in, C_out]``."""
    return _tap_conv(x, k, job, out_dtype, False, "maskconv_mgpu_forward")


def input_grad(dy, k, job, out_dtype):
    """``dx: [N, H, W, C_in]`` from ``dy: [N, OH, OW, C_out]``: the transpose of :func:`forward` in ``x``."""
    return _tap_conv(dy, k, job, out_dtype, True, "maskconv_mgpu_input_grad")


def weight_grad(x, dy, job, out_dtype):
    """``[splits, T, C_in, C_out]`` float32: partial weight gradients of the active taps only."""
    del out_dtype  # the core casts the ordered sum
    from . import kernels  # jax's Mosaic GPU: imported when the kernels run, not when a backend is chosen

    t, p = _tiles(job), job.problem
    batch = x.shape[0]
    g = _grid.weight_grad_grid(p)
    _check_size(batch * g.image_rows)
    ci_pad, co_pad = round_up(p.c_in, t.weight_grad_c_in), round_up(p.c_out, t.tile_n)
    x, dy = x.astype(job.dtype), dy.astype(job.dtype)  # as in _tap_conv
    copies = _grid.copies(x, g, ci_pad, tail=0)
    rows = _grid.rows_of(dy, g, co_pad)
    chunks = batch * g.out_hw[0] * g.width // kernels.weight_grad_chunk(g, t)
    splits = weight_grad_splits(t, len(p.taps) * (ci_pad // t.weight_grad_c_in) * (co_pad // t.tile_n), chunks)
    parts = kernels.tap_weight_grad(copies, rows, g, t, batch, splits, interpret=job.interpret)[:, :, : p.c_in, : p.c_out]
    # Each entry of a tap's GEMM joins one input and one output channel; the pairs a
    # channel-partial tap keeps apart are selected away (a NaN there is not multiplied in).
    allowed = _allowed(p)
    return parts if allowed is None else jnp.where(allowed, parts, jnp.zeros((), parts.dtype))
