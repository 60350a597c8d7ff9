"""``causal_conv1d``'s ``pallas_mosaic_gpu`` implementation: Pallas kernels lowered through Mosaic GPU.

* :mod:`.config`: :class:`Config`, the tiles and their heuristic;
* :mod:`.kernels`: the forward, pre-activation-cotangent and backward kernels
  (``plgpu.kernel`` bodies, one warpgroup a tile).

Runs on sm_90 GPUs (the kernels need no wgmma or TMA, but Mosaic GPU targets Hopper and
later), or anywhere in Mosaic GPU's interpreter (``interpret=True``); jax >= 0.11. Every
feature of the op: segment ids, an initial state, any width and dilation, bias, SiLU,
float32, bfloat16 and float16 inputs and weights (float32 arithmetic). The op's
primitives (:class:`~maskconv_kernels._core.fused.FusedOp`) lower :func:`forward` and
:func:`backward`, and give them derivatives of every order: this package is a forward
and a backward, nothing more.

Importing it imports no Mosaic GPU module: :mod:`.kernels` is imported when the kernels
are lowered, so choosing a backend costs nothing where they do not run (and jax 0.10's
Mosaic GPU package, which needs absl-py, is never imported).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...._core.hardware import attached_compute_capability, jax_version
from ..checks import Problem
from .config import KERNELS, Config

__all__ = ["Config", "KERNELS", "DTYPES", "unsupported", "forward", "backward"]

DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
_MIN_JAX = (0, 11)
_HOPPER = (9, 0)
_INT32_LIMIT = 2**31


def unsupported(problem: Problem, platform: str | None, interpret: bool = False) -> str | None:
    """Why the Mosaic GPU kernels cannot run ``problem`` lowered for ``platform`` (``None`` when they can).

    ``platform``: the lowering platform (the record says they lower for cuda, or anywhere
    interpreted), or ``None`` to ask about the problem alone; lowered, the GPU must be a Hopper.
    """
    if jax_version() < _MIN_JAX:
        return (
            f"jax {jax.__version__}: the Mosaic GPU kernels need jax >= 0.11 (plgpu.kernel and, off a GPU, "
            "its interpreter; implementation='xla' takes it)"
        )
    for name, dtype in problem.dtypes.items():
        if np.dtype(dtype) not in DTYPES:
            return f"{name} in {dtype}: its kernels take float32, bfloat16 and float16 (implementation='xla' takes it)"
    extended = problem.batch * (problem.length + 2 * (problem.state_len + 128)) * max(problem.dim, 128)
    if extended >= _INT32_LIMIT:
        return f"{problem.batch} x {problem.length} x {problem.dim} elements do not fit an int32 index; split the batch"
    if interpret or platform is None:
        return None
    capability = attached_compute_capability()
    if capability is not None and capability < _HOPPER:
        return f"compute capability {capability[0]}.{capability[1]}: Mosaic GPU targets Hopper (sm_90) and later"
    return None


def forward(operands: dict, *, problem: Problem, config: Config | None = None, interpret: bool = False):
    """``y (B, L, D)`` in x's dtype from the forward kernel (float32 accumulation, bias and SiLU
    in float32, rounded once); ``operands`` as :func:`~..xla.forward`'s."""
    x = operands["x"]
    if x.size == 0:  # a kernel grid cannot be empty
        return jnp.zeros(x.shape, x.dtype)
    from . import kernels  # jax's Mosaic GPU: imported when the kernels are lowered

    return kernels.forward(operands, problem=problem, config=_config(problem, config), interpret=interpret)


def backward(operands: dict, dy, *, problem: Problem, config: Config | None = None, interpret: bool = False):
    """The cotangents of x, the weight, the bias and the state (those given, in the operands'
    order) from the backward kernels."""
    if operands["x"].size == 0:
        return [jnp.zeros(a.shape, a.dtype) for name, a in operands.items() if name != "ids"]
    from . import kernels

    return kernels.backward(operands, dy, problem=problem, config=_config(problem, config), interpret=interpret)


def _config(problem: Problem, config: Config | None) -> Config:
    return config if config is not None else Config.get_default(problem.length, problem.dim)
