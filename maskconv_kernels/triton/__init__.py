"""The Triton backend: ``triton.jit`` kernels launched through ``jax_triton.triton_call``.

From jax 0.11 the Pallas Triton lowering is deprecated and names official Triton with
jax-triton as the way to keep using Triton; this backend is that path. Same structure
and contract as the Pallas backend: implicit GEMMs whose tap loop runs over active taps
only, float32 accumulation, a deterministic weight gradient, all behind one custom VJP.

Modules: :mod:`.kernels` (the ``triton.jit`` kernels), :mod:`.config` (block sizes,
heuristic, autotune list), :mod:`.ops` (jax-triton launches, autotune, custom VJP).
Importing this package imports neither ``triton`` nor ``jax_triton``: they are needed
(``pip install maskconv-kernels[triton]``) only to run or compile the kernels.
Selected explicitly with ``implementation="triton"``; with ``interpret=True`` the same
kernels run in Triton's interpreter on any host (:mod:`.interpret`), which is how CI
checks them without a GPU.
"""
from __future__ import annotations

import importlib.util

import jax
import numpy as np

from ..spec import ConvSpec

__all__ = ["masked_conv", "unsupported"]


def _missing_dependency(interpret: bool) -> str | None:
    needed = (("triton", "triton"),) if interpret else (("triton", "triton"), ("jax_triton", "jax-triton"))
    for module, package in needed:
        if importlib.util.find_spec(module) is None:
            return (
                f"the {package} package is not installed: pip install 'maskconv-kernels[triton]' "
                "(triton>=3.6 and jax-triton; Linux with an NVIDIA GPU)"
            )
    return None


def unsupported(spec: ConvSpec, platform: str, interpret: bool = False) -> str | None:
    """Why the Triton kernels cannot run ``spec`` on ``platform`` (``None`` when they can)."""
    if spec.ndim not in (1, 2):
        return f"{spec.ndim}-D convolutions (the Triton kernels cover 1-D and 2-D; use implementation='xla')"
    if spec.groups != 1:
        return f"feature_group_count={spec.groups} (the Triton kernels are ungrouped; use implementation='xla')"
    if spec.mask.partial_taps:
        return (
            f"channel-partial taps {spec.mask.partial_taps[:3]}{'...' if len(spec.mask.partial_taps) > 3 else ''} "
            "(a full-shaped mask whose taps are active for only some channel pairs; a GEMM tile cannot skip "
            "single products, so use implementation='xla', which splits them into exact dense pieces)"
        )
    if np.dtype(spec.acc_dtype) != np.float32:
        return f"{spec.acc_dtype} accumulation (float64 inputs); the Triton kernels take float32, bfloat16 or float16"
    if not interpret and platform not in ("gpu", "cuda"):
        return (
            f"platform {platform!r} (the Triton kernels run on NVIDIA GPUs only; interpret=True runs them "
            "in Triton's interpreter on any host, slowly)"
        )
    return _missing_dependency(interpret)


def masked_conv(x: jax.Array, kernel: jax.Array, spec: ConvSpec, *, interpret: bool = False) -> jax.Array:
    """Exact masked convolution through the Triton kernels.

    Args:
      x: ``[N, *spatial, C_in]``, 1 or 2 spatial dims; float32, bfloat16 or float16.
      kernel: ``[*window, C_in, C_out]``, same dtype as ``x``.
      spec: the validated problem; :func:`unsupported` must have accepted it.
      interpret: run the same kernels in Triton's interpreter on the host (any platform,
        slow; needs ``triton`` but not jax-triton): what CI tests on CPU.

    Returns:
      ``[N, *out_spatial, C_out]`` in ``spec.out_dtype``, accumulated in float32;
      differentiable in ``x`` and ``kernel`` through the Triton gradient kernels.
    """
    from . import ops  # imports triton; jax_triton is imported at the first compiled launch

    return ops.conv(x, kernel, spec, interpret)
