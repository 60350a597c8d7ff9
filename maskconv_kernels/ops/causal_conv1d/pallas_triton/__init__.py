"""``causal_conv1d``'s ``pallas_triton`` implementation: fused Pallas kernels, lowered through Triton.

* :mod:`.config`: :class:`Config`, the tiles and their heuristic;
* :mod:`.kernels`: the forward, backward and state-gradient kernels.

Runs on NVIDIA GPUs, or on any platform with ``interpret=True`` (the Pallas interpreter).
The op's primitives (:class:`~maskconv_kernels._core.fused.FusedOp`) lower :func:`forward`
and :func:`backward`, and give them derivatives of every order.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...._moved import renamed_attributes
from ..checks import Problem
from .config import Config
from .kernels import DTYPES, KERNELS

__all__ = ["Config", "KERNELS", "unsupported", "forward", "backward"]

# The config's name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"BlockSizes": "Config"})


def unsupported(problem: Problem, platform: str | None, interpret: bool = False) -> str | None:
    """Why the fused kernels cannot run ``problem`` (``None`` when they can); the record says they
    lower for cuda (or anywhere interpreted)."""
    for name, dtype in problem.dtypes.items():
        if np.dtype(dtype) not in DTYPES:
            return f"{name} in {dtype}: its kernels take float32, bfloat16 and float16 (implementation='xla' takes it)"
    return None


def forward(operands: dict, *, problem: Problem, config: Config | None = None, interpret: bool = False):
    """``y (B, L, D)`` in x's dtype from the forward kernel (float32 accumulation, bias and SiLU
    in float32, rounded once); ``operands`` as :func:`~..xla.forward`'s."""
    from . import kernels  # Pallas: imported when this implementation lowers

    (y,) = kernels.forward(*_operands(operands), s=_static(problem, config, interpret))
    return y


def backward(operands: dict, dy, *, problem: Problem, config: Config | None = None, interpret: bool = False):
    """The cotangents of x, the weight, the bias and the state (those given) from the backward
    kernels."""
    from . import kernels

    return kernels.backward(*_operands(operands), dy, s=_static(problem, config, interpret))


def _operands(operands: dict) -> tuple:
    """In :meth:`~.kernels.Static.operand_names`' order, the ids as int32."""
    if "ids" in operands:
        operands = {**operands, "ids": operands["ids"].astype(jnp.int32)}
    return tuple(operands[n] for n in ("x", "w", "bias", "ids", "state") if n in operands)


def _static(problem: Problem, config: Config | None, interpret: bool):
    from .kernels import Static

    return Static(
        width=problem.width, dilation=problem.dilation, silu=problem.silu, has_bias=problem.has_bias,
        has_ids=problem.segmented, has_state=problem.has_state,
        blocks=config or Config.get_default(problem.length, problem.dim), interpret=bool(interpret),
    )
