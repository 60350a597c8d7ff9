"""The ``pallas_triton`` backend: what it supports and its three kernels.

Everything around the kernels (the 1-D lift, the transposes and JVPs that make the
forward, input gradient and weight gradient differentiable to any order, batching,
the per-platform choice at lowering time, batch partitioning, the weight gradient's
split sum and scatter) is :mod:`..maps`, shared by every backend.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..spec import ConvSpec
from . import kernels
from .config import Config
from .kernels import Geometry

__all__ = ["unsupported", "forward", "input_grad", "weight_grad"]

_INT32_LIMIT = 2**31


def unsupported(spec: ConvSpec, platform: str | None, interpret: bool = False) -> str | None:
    """Why the Pallas kernels cannot run ``spec`` (``None`` when they can); the record says they
    lower for cuda (or anywhere interpreted)."""
    if spec.ndim == 3:
        return "3-D convolutions (the Pallas kernels are 1-D and 2-D; implementation=None uses xla)"
    if spec.groups > 1:
        return f"feature_group_count={spec.groups} (grouped convolutions; implementation=None uses xla)"
    if np.dtype(spec.acc_dtype) != np.float32:
        return f"{spec.acc_dtype} inputs (the kernels take float32, bfloat16 and float16)"
    return None


def _blocks(job, kernel: str) -> Config:
    return job.config if job.config is not None else Config.get_default(job.spec, job.dtype, kernel)


def _geometry(job, batch: int, kernel: str) -> Geometry:
    p = job.problem
    pixels = max(p.in_hw[0] * p.in_hw[1], p.out_hw[0] * p.out_hw[1])
    if batch * pixels >= _INT32_LIMIT:
        raise NotImplementedError(
            f'implementation="pallas_triton" does not support this problem: N * pixels = {batch} * {pixels} '
            "does not fit the kernels' int32 pixel index; split the batch"
        )
    return Geometry(p, _blocks(job, kernel))


def _padded_kernel(k, g: Geometry):
    """``[KH, KW, C_in_pad, C_out_pad]``: channels zero-padded to whole tiles (the kernel is small)."""
    p = g.problem
    return jnp.pad(k, ((0, 0), (0, 0), (0, g.c_in_pad - p.c_in), (0, g.c_out_pad - p.c_out)))


def _common(a, b):
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


# The three kernels the maps (maskconv_kernels.ops.masked_conv.maps) lower, on the 2-D problem.


def forward(x, k, job, out_dtype):
    """``y: [N, OH, OW, C_out]`` from ``x: [N, H, W, C_in]``, ``k: [KH, KW, C_in, C_out]``."""
    g = _geometry(job, x.shape[0], "forward")
    x, k = _common(x, k)
    return kernels.forward(x, _padded_kernel(k, g), g, out_dtype, job.interpret)


def input_grad(dy, k, job, out_dtype):
    """``dx: [N, H, W, C_in]`` from ``dy: [N, OH, OW, C_out]``: the transpose of :func:`forward` in ``x``."""
    g = _geometry(job, dy.shape[0], "input_grad")
    dy, k = _common(dy, k)
    return kernels.input_grad(dy, _padded_kernel(k, g), g, out_dtype, job.interpret)


def weight_grad(x, dy, job, out_dtype):
    """``[splits, T, C_in, C_out]``: partial weight gradients of the active taps only."""
    g = _geometry(job, x.shape[0], "weight_grad")
    x, dy = _common(x, dy)
    return kernels.weight_grad(x, dy, g, out_dtype, job.interpret)
