"""``causal_conv1d``'s ``pallas_triton`` implementation: fused Pallas kernels, lowered through Triton.

* :mod:`.config`: :class:`Config` (``BlockSizes`` before), the tiles and their heuristic;
* :mod:`.kernels`: the forward, backward and state-gradient kernels;
* :mod:`.fused`: the kernels as primitives, differentiable to any order.

Runs on NVIDIA GPUs, or on any platform with ``interpret=True`` (the Pallas interpreter).
"""
from __future__ import annotations

import numpy as np

from ..checks import Problem
from .config import BlockSizes, Config
from .kernels import DTYPES, KERNELS

__all__ = ["Config", "BlockSizes", "KERNELS", "unsupported", "forward"]


def unsupported(problem: Problem, platform: str | None, interpret: bool = False) -> str | None:
    """Why the fused kernels cannot run ``problem`` lowered for ``platform`` (``None`` when they can)."""
    for name, dtype in problem.dtypes.items():
        if np.dtype(dtype) not in DTYPES:
            return f"{name} in {dtype}: its kernels take float32, bfloat16 and float16 (implementation='xla' takes it)"
    if interpret or platform is None:
        return None
    if platform == "rocm":
        return "ROCm GPUs: its kernels are tuned and tested for NVIDIA GPUs only (use implementation='xla')"
    if platform not in ("cuda", "gpu"):
        return (
            "its kernels lower through Triton for NVIDIA GPUs (pass interpret=True to run them in the Pallas "
            "interpreter, or use implementation='xla')"
        )
    return None


def forward(x, weight, bias, segment_ids, initial_state, *, problem: Problem, config=None, interpret: bool = False):
    """``y (B, L, D)`` from the fused kernels (:func:`.fused.forward`)."""
    from .fused import forward as fused_forward  # Pallas: imported when this implementation runs

    return fused_forward(x, weight, bias, segment_ids, initial_state, problem=problem, config=config,
                         interpret=interpret)
