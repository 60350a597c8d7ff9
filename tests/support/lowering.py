"""Lowering for an NVIDIA GPU on a host without one, and compiling what the runtime compiles.

Pallas' Triton kernels: :func:`capture_triton_modules` keeps the Triton IR jax's lowering
hands to XLA, :func:`compile_triton_modules` compiles it for sm_90 with the ``triton``
package as at run time (Triton's TTIR passes first: a ``.ttir`` file skips them).
"""
from __future__ import annotations

import contextlib
import warnings

import jax
import numpy as np
import pytest

from maskconv_kernels._core.hardware import COMPUTE_CAPABILITY, gpu_target
from maskconv_kernels._core.primitives import PALLAS_TRITON_DEPRECATION
from maskconv_kernels.ops.masked_conv import maps
from maskconv_kernels.ops.masked_conv.kernel_problem import kernel_problem

__all__ = ["cuda_lowering", "capture_triton_modules", "compile_triton_modules", "kernel_jaxprs", "count"]


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


def _with_ttir_passes(backend=None, stages=None, options=None, language=None, capability=None):
    """A stages hook: the TTGIR stage first runs the TTIR stage's passes (a .ttir file skips them).

    Called without arguments, Triton asks for the hook's part of the cache key.
    """
    if backend is None:
        return "-ttir-passes-first", "ttir-passes-first"
    to_ttgir = stages["ttgir"]
    stages["ttgir"] = lambda src, metadata: to_ttgir(backend.make_ttir(src, metadata, options, capability), metadata)


def capture_triton_modules(monkeypatch) -> list[str]:
    """The Triton IR (text) of every kernel Pallas' Triton lowering builds from now on in the test."""
    from jax._src.pallas.triton import lowering  # the one place jax exposes the Triton module it lowers to

    modules = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    return modules


def _run_ttir_passes_first(triton, monkeypatch) -> None:
    """Triton starts a ``.ttir`` file after its TTIR stage: make the TTGIR stage run that stage's passes first."""
    if hasattr(triton.knobs.runtime, "add_stages_inspection_hook"):
        monkeypatch.setattr(triton.knobs.runtime, "add_stages_inspection_hook", _with_ttir_passes)
        return
    # An older triton: wrap the backend's stages, and compile afresh (its cache key does not see this).
    from triton.backends.nvidia.compiler import CUDABackend

    add_stages = CUDABackend.add_stages

    def with_passes(self, stages, options, *rest):
        add_stages(self, stages, options, *rest)
        _with_ttir_passes(self, stages, options, None, self._parse_arch(options.arch))

    monkeypatch.setattr(CUDABackend, "add_stages", with_passes)
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")


def compile_triton_modules(modules: dict[str, str], options: dict[str, dict], tmp_path, monkeypatch) -> dict[str, str]:
    """Each Triton IR module of ``modules`` (by name) compiled for sm_90 with ``options[name]``
    (``num_warps``, ``num_stages``), as XLA compiles Pallas kernels: TTIR passes, TTGIR, LLVM
    IR, PTX. Returns each one's PTX, also written to ``tmp_path / <name>.ptx``."""
    triton = pytest.importorskip("triton", reason="compiling the Pallas kernels' Triton IR needs triton")
    from triton.backends.compiler import GPUTarget

    _run_ttir_passes_first(triton, monkeypatch)
    ptx = {}
    for name, module in modules.items():
        path = tmp_path / f"{name}.ttir"
        path.write_text(module)
        # Fusion as XLA compiles Pallas kernels (on), stated: triton 3.9 warns when unset.
        compiled = triton.compile(str(path), target=GPUTarget("cuda", COMPUTE_CAPABILITY, 32),
                                  options=dict(options[name], enable_fp_fusion=True))
        ptx[name] = compiled.asm["ptx"]
        (tmp_path / f"{name}.ptx").write_text(ptx[name])
    return ptx


def kernel_jaxprs(backend, spec, dtype, platform: str, interpret: bool = False) -> dict:
    """``{pallas_call name: kernel jaxpr}`` of a kernel backend's three kernels (its module:
    ``forward``, ``input_grad``, ``weight_grad``) as masked_conv's maps run them lowered for
    ``platform``, at a batch of 2."""
    job = maps.Job(spec, kernel_problem(spec), None, interpret, platform, np.dtype(dtype))
    p, n = job.problem, 2
    x = jax.ShapeDtypeStruct(p.x_shape(n), dtype)
    y = jax.ShapeDtypeStruct(p.y_shape(n), spec.out_dtype)
    k = jax.ShapeDtypeStruct(p.kernel_shape(), dtype)
    found = {}
    for fn, args in ((backend.forward, (x, k)), (backend.input_grad, (y, k)), (backend.weight_grad, (x, y))):
        found.update(_pallas_calls(jax.make_jaxpr(lambda a, b: fn(a, b, job, np.dtype(dtype)))(*args).jaxpr))
    return found


def _pallas_calls(jaxpr) -> dict:
    """``{pallas_call name: kernel jaxpr}`` of every ``pallas_call`` in ``jaxpr``, however nested."""
    found = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found[eqn.params["name"]] = eqn.params["jaxpr"]
        for sub in _sub_jaxprs(eqn):
            found.update(_pallas_calls(sub))
    return found


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr


def count(jaxpr, primitive: str) -> int:
    """How many ``primitive`` equations ``jaxpr`` holds, however nested."""
    return sum((eqn.primitive.name == primitive) + sum(count(s, primitive) for s in _sub_jaxprs(eqn))
               for eqn in jaxpr.eqns)
