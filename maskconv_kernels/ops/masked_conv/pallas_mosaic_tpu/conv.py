"""The ``pallas_mosaic_tpu`` backend: what it supports and its three kernels as the core calls them.

Everything around the kernels (the 1-D lift, transposes and JVPs, batching, the choice
at lowering time, batch partitioning, the weight gradient's split sum and scatter) is
:mod:`..maps`, shared by every backend. Here: the zero padding of the operand (once,
outside the kernels), the active taps' weight matrices, and the crop of the results.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..kernel_problem import KernelProblem, kernel_problem
from ..spec import ConvSpec
from . import kernels
from .config import KERNELS, VMEM_BUDGET_BYTES, VMEM_LIMIT_BYTES, Config, MiB, geometry, vmem_bytes
from .geometry import Geometry, Runs

__all__ = ["LARGE_BOX_TAPS", "unsupported", "not_preferred", "forward", "input_grad", "weight_grad"]

_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


# Where XLA's per-box convolutions overtake the kernels: between the largest boxes of 5x5
# type B (10 taps; the kernels 1.09x faster) and 7x7 type A (21; XLA 1.07-1.13x faster),
# measured on a TPU v5e at C=256 (docs/performance.md, TPU v5e); 16 lies between.
LARGE_BOX_TAPS = 16


def unsupported(spec: ConvSpec, platform: str | None, interpret: bool = False) -> str | None:
    """Why the Mosaic TPU kernels cannot run ``spec`` (``None`` when they can); the record says
    they lower for TPUs (or anywhere interpreted)."""
    return _problem_reason(spec)


def not_preferred(spec: ConvSpec, platform: str) -> str | None:
    """Why ``implementation=None`` passes the kernels over for ``spec`` (``None``: it takes them).

    Measured on a TPU v5e (bfloat16, N=64, 32x32, C=256, forward+backward against
    ``lax.conv(kernel * mask)``): 1.79x at 3x3 type B, 1.72x at 5x5 type B, where the
    ``xla`` path's per-box convolutions gave 0.65x and 1.58x (boxes of 3 and 2 taps, of
    10 and 3); at 7x7 type A (a box of 21 taps and one of 3) they beat the kernels, 1.75x
    against 1.55x, and 1.77x against 1.64x with the kernels' tuned blocks. So a mask
    with a box of :data:`LARGE_BOX_TAPS` taps or more (a dense window of them included:
    one box, lax's own convolution) goes to ``xla``. 2-D layers only were timed: 1-D
    problems (WaveNet's) keep ``xla`` until they are.
    """
    if spec.ndim != 2:
        return f"{spec.ndim}-D problems: the kernels were timed on 2-D layers only; implementation=None uses xla"
    largest = max((len(term.box.taps()) for term in spec.mask.terms), default=0)
    if largest >= LARGE_BOX_TAPS:
        return (f"a mask with a box of {largest} taps: XLA's convolution of a box that large beat the kernels on a "
                "TPU v5e; implementation=None uses xla")
    return None


@functools.lru_cache(maxsize=256)
def _problem_reason(spec: ConvSpec) -> str | None:
    if spec.ndim == 3:
        return "3-D convolutions (the Mosaic TPU kernels are 1-D and 2-D; implementation=None uses xla)"
    if spec.groups > 1:
        return f"feature_group_count={spec.groups} (grouped convolutions; implementation=None uses xla)"
    if any(s != 1 for s in spec.strides):
        return f"strides={spec.strides} (the kernels' shifted GEMMs are stride 1; implementation=None uses xla)"
    if np.dtype(spec.dtype) not in _DTYPES:
        return f"{spec.dtype} inputs (the kernels take float32 and bfloat16; implementation=None uses xla)"
    problem = kernel_problem(spec)
    if _empty(problem, 1):
        return None  # no kernel runs
    for kernel in KERNELS:
        dtype = spec.dtype if kernel == "forward" else _grad_dtype(spec)
        config = Config.get_default(spec, dtype, kernel)
        need = vmem_bytes(problem, kernel, dtype.itemsize, config)
        if need > VMEM_BUDGET_BYTES:
            return (
                f"{problem.in_hw[0]}x{problem.in_hw[1]} pixels of {problem.c_in} channels: the {kernel} kernel's "
                f"smallest blocks ({config}) need {need / MiB:.1f} MiB of VMEM, over its {VMEM_BUDGET_BYTES // MiB} "
                "MiB budget (a block holds whole image rows and every reduction channel); implementation=None uses xla"
            )
    return None


def _empty(p: KernelProblem, batch: int) -> bool:
    """Every sum is empty (no example, or no input or output pixel): the maps are exact zeros, no kernel runs."""
    return batch == 0 or 0 in p.in_hw or 0 in p.out_hw


def _grad_dtype(spec: ConvSpec) -> np.dtype:
    """The operands' dtype in the backward kernels: the cotangent has the output's dtype."""
    return np.dtype(jnp.promote_types(spec.dtype, spec.out_dtype))


def _common(a, b):
    """Both operands in their common dtype: a float32 cotangent of bfloat16 inputs widens the kernel (exactly)."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


def _precision(problem: KernelProblem, dtype):
    """The dots' precision: float32 products when the problem asks for ``HIGH`` or ``HIGHEST``.

    Mosaic's default for float32 operands is bfloat16 passes, as XLA's default for
    ``lax.conv`` on TPU; ``HIGH`` is given ``HIGHEST`` (at least the precision asked for,
    and the one both jax 0.10 and 0.12 lower). 16-bit operands are exact products either way.
    """
    if np.dtype(dtype) == np.float32 and (problem.highest or problem.high):
        return lax.Precision.HIGHEST
    return None


def _geometry(job, kernel: str, dtype) -> tuple[Geometry, Config]:
    p, itemsize = job.problem, np.dtype(dtype).itemsize
    config = job.config if job.config is not None else Config.get_default(job.spec, dtype, kernel)
    need = vmem_bytes(p, kernel, itemsize, config)
    if need > (VMEM_LIMIT_BYTES if job.config is not None else VMEM_BUDGET_BYTES):
        given = "the config given" if job.config is not None else "the smallest blocks"
        raise NotImplementedError(
            f'implementation="pallas_mosaic_tpu" does not support this problem in {np.dtype(dtype)}: the {kernel} '
            f"kernel with {given} ({config}) needs {need / MiB:.1f} MiB of VMEM; pass a config with smaller blocks "
            "or use implementation=None"
        )
    return geometry(p, kernel, itemsize, config), config


def _pad_image(a, g: Geometry):
    """``[N, *g.image, C]``: ``a`` with the taps' zero padding, cropped to what they read, then zero-extended
    (``a`` itself where the kernel pads, ``g.inside``).

    First exactly the convolution's padding (``lax.pad``; negative padding crops), up to
    the last row and column an active tap of a real result reads; then zeros to the
    blocks' extent. Padding in one step would keep real rows that a crop removes.
    """
    if g.inside is not None:
        return a  # the kernel pads it in VMEM
    t = g.taps
    (lo_h, lo_w), (h, w), (oh, ow), (reach_h, reach_w) = t.pad_lo, t.in_hw, t.out_hw, t.reach
    a = lax.pad(a, jnp.zeros((), a.dtype), [
        (0, 0, 0), (lo_h, oh + reach_h - h - lo_h, 0), (lo_w, ow + reach_w - w - lo_w, 0), (0, 0, 0),
    ])
    extra = (g.image[0] - (oh + reach_h), g.image[1] - (ow + reach_w))
    return jnp.pad(a, ((0, 0), (0, extra[0]), (0, extra[1]), (0, 0))) if any(extra) else a


def _channels(runs: Runs | None, n: int) -> np.ndarray:
    """Bools ``[n]``: the channels of ``runs`` (``None``: all)."""
    keep = np.zeros(n, bool) if runs is not None else np.ones(n, bool)
    for start, stop in runs or ():
        keep[start:stop] = True
    return keep


def _weights(k, p: KernelProblem, g: Geometry, transpose: bool):
    """``[pieces, C_read, C_result_pad]``: each piece's tap matrix (``k[tap]`` or its transpose).

    Only the active taps are read (static indices). A channel-partial piece's entries
    outside its (read x write) runs are selected to zero: a masked kernel entry, even
    NaN, is never an operand. The transpose is one ``swapaxes`` of the stacked matrices:
    jax 0.12's XLA:CPU fails to compile (an LLVM instruction-selection error on a bfloat16
    broadcast) a stack of per-tap bfloat16 transposes, which the interpreter runs on CPU.
    """
    w = jnp.stack([k[p.taps[piece.tap]] for piece in g.taps.pieces])  # [pieces, C_in, C_out]
    w = jnp.swapaxes(w, 1, 2) if transpose else w
    if g.taps.has_partial:
        keep = np.stack([np.outer(_channels(piece.reads, g.c_read), _channels(piece.writes, g.c_result))
                         for piece in g.taps.pieces])
        w = jnp.where(keep, w, jnp.zeros((), w.dtype))
    return jnp.pad(w, ((0, 0), (0, 0), (0, g.c_result_pad - g.c_result))) if g.c_result_pad > g.c_result else w


def _crop(out, g: Geometry):
    """The real results of ``[N, *out_pad, C_pad]``."""
    (oh, ow), c = g.taps.out_hw, g.c_result
    return out if out.shape[1:] == (oh, ow, c) else out[:, :oh, :ow, :c]


def _tap_conv(a, k, job, out_dtype, kernel: str, name: str):
    p = job.problem
    if _empty(p, a.shape[0]):
        result = (p.out_hw, p.c_out) if kernel == "forward" else (p.in_hw, p.c_in)
        return jnp.zeros((a.shape[0], *result[0], result[1]), out_dtype)
    a, k = _common(a, k)
    g, _ = _geometry(job, kernel, a.dtype)
    w = _weights(k, job.problem, g, transpose=kernel == "input_grad")
    out = kernels.tap_gemm(
        _pad_image(a, g), w, g, out_dtype, precision=_precision(job.problem, a.dtype), interpret=job.interpret,
        name=name,
    )
    return _crop(out, g)


# The three kernels ..maps lowers, on the 2-D problem (1-D lifted to height 1).


def forward(x, k, job, out_dtype):
    """``y: [N, OH, OW, C_out]`` from ``x: [N, H, W, C_in]``, ``k: [KH, KW, C_in, C_out]``."""
    return _tap_conv(x, k, job, out_dtype, "forward", "maskconv_tpu_fwd")


def input_grad(dy, k, job, out_dtype):
    """``dx: [N, H, W, C_in]`` from ``dy: [N, OH, OW, C_out]``: the forward kernel on the transposed problem
    (flipped taps, transposed tap matrices, the complementary padding)."""
    return _tap_conv(dy, k, job, out_dtype, "input_grad", "maskconv_tpu_bwd_input")


def weight_grad(x, dy, job, out_dtype):
    """``[1, T, C_in, C_out]``: the weight gradient of the active taps ``job.problem.taps`` (one split)."""
    p = job.problem
    if _empty(p, x.shape[0]):
        return jnp.zeros((1, len(p.taps), p.c_in, p.c_out), out_dtype)
    x, dy = _common(x, dy)
    g, config = _geometry(job, "weight_grad", x.dtype)
    (oh, ow), (hp, wp) = g.taps.out_hw, g.out_pad
    dy = jnp.pad(dy, ((0, 0), (0, hp - oh), (0, wp - ow), (0, g.c_result_pad - g.c_result)))
    block_taps = min(config.block_taps, len(p.taps))
    dk = kernels.tap_weight_grad(
        _pad_image(x, g), dy, g, block_taps, out_dtype, precision=_precision(p, x.dtype), interpret=job.interpret,
        name="maskconv_tpu_bwd_weight",
    )
    dk = dk[:, : len(p.taps), :, : p.c_out]
    if p.has_partial_taps:
        # Entries of channel-partial taps outside every piece: exact zeros (selected).
        allowed = np.zeros((len(p.taps), p.c_in, p.c_out), bool)
        index = {tap: i for i, tap in enumerate(p.taps)}
        for piece in p.pieces:
            allowed[index[piece.tap]] |= np.outer(_channels(piece.in_runs, p.c_in), _channels(piece.out_runs, p.c_out))
        dk = jnp.where(allowed[None], dk, jnp.zeros((), dk.dtype))
    return dk
