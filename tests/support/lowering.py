"""Lowering for an NVIDIA GPU on a host without one, and compiling what the runtime compiles."""
from __future__ import annotations

import contextlib
import warnings

from maskconv_kernels._core.hardware import gpu_target
from maskconv_kernels._core.primitives import PALLAS_TRITON_DEPRECATION

__all__ = ["cuda_lowering", "with_ttir_passes"]


@contextlib.contextmanager
def cuda_lowering():
    """Lowering for an NVIDIA GPU on a machine without one (:func:`maskconv_kernels._core.hardware.gpu_target`).

    The Pallas Triton backend's deprecation warning (jax >= 0.11) is the package's to
    filter, while it lowers; here it is an error, so none escapes.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=PALLAS_TRITON_DEPRECATION, category=DeprecationWarning)
        with gpu_target():
            yield


def with_ttir_passes(backend=None, stages=None, options=None, language=None, capability=None):
    """A stages hook: the TTGIR stage first runs the TTIR stage's passes (a .ttir file skips them).

    Called without arguments, Triton asks for the hook's part of the cache key.
    """
    if backend is None:
        return "-ttir-passes-first", "ttir-passes-first"
    to_ttgir = stages["ttgir"]
    stages["ttgir"] = lambda src, metadata: to_ttgir(backend.make_ttir(src, metadata, options, capability), metadata)
