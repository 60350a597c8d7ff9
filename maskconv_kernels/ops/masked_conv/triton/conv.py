"""The ``triton`` backend: what it supports and its three kernels, as :mod:`..maps` calls them."""
from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

from ..spec import ConvSpec

__all__ = ["unsupported", "forward", "input_grad", "weight_grad"]


def _missing_dependency(interpret: bool) -> str | None:
    needed = (("triton", "triton"),) if interpret else (("triton", "triton"), ("jax_triton", "jax-triton"))
    for module, package in needed:
        if importlib.util.find_spec(module) is None:
            return (
                f"the {package} package is not installed: pip install 'maskconv-kernels[triton]' "
                "(triton>=3.6 and jax-triton; Linux with an NVIDIA GPU)"
            )
    return None


def unsupported(spec: ConvSpec, platform: str | None, interpret: bool = False) -> str | None:
    """Why the Triton kernels cannot run ``spec`` lowered for ``platform`` (``None`` when they can).

    ``platform``: the lowering platform (the record says they lower for cuda, or anywhere
    interpreted), or ``None`` to ask about the problem alone; lowered, jax-triton must import.
    """
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
    missing = _missing_dependency(interpret)
    if missing is None and not interpret and platform is not None:
        return _jax_triton_import_error()
    return missing


@functools.lru_cache(maxsize=None)
def _jax_triton_import_error() -> str | None:
    """Lowering for cuda imports jax-triton, which needs a jaxlib with CUDA support on the host doing the lowering."""
    saved = dict(os.environ)
    try:
        from jax_triton import triton_lib
    except ImportError as e:
        # A failed import can leave its settings behind (jax-triton 0.3.1 empties
        # TRITON_CACHE_DIR first, which then breaks triton.compile in this process).
        os.environ.clear()
        os.environ.update(saved)
        cause = str(e).split(". ")[0]
    else:
        if hasattr(getattr(triton_lib, "triton_kernel_call_lib", None), "TritonKernel"):
            return None
        cause = "jaxlib here has no GPU Triton support"
    return (
        f"jax-triton cannot lower on this host ({cause}): lower for cuda where jax has CUDA support, "
        "or use implementation='pallas_triton', which lowers for cuda on any host"
    )


# The three kernels, as ..maps calls them; ops imports triton.


def forward(x, w, job, out_dtype):
    from . import ops

    return ops.forward(x, w, job, out_dtype)


def input_grad(dy, w, job, out_dtype):
    from . import ops

    return ops.input_grad(dy, w, job, out_dtype)


def weight_grad(x, dy, job, out_dtype):
    from . import ops

    return ops.weight_grad(x, dy, job, out_dtype)
