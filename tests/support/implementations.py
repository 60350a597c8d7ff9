"""Each op's implementations as the shared suites call them, taken from the op's registry.

Each entry of ``BACKENDS`` has the signature of :func:`maskconv_kernels.masked_conv`
(without ``implementation``), one per backend of its registry that can run here; slow
ones (interpreters) are in ``SLOW_BACKENDS`` so that heavy cases can skip them with a reason.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import backends, xla
from maskconv_kernels.ops.masked_conv.spec import make_spec

__all__ = [
    "ON_GPU", "PLATFORM", "Backend", "suite_dtype", "BACKENDS", "SLOW_BACKENDS", "SLOW_TIER_BACKENDS", "backend_params",
    "Named",
]

ON_GPU = jax.default_backend() == "gpu"
PLATFORM = backends.lowering_platform()


@dataclasses.dataclass(frozen=True)
class Backend:
    """How the suite calls one backend: ``masked_conv``'s signature, without ``implementation``."""

    implementation: str
    interpret: bool = False
    config: object = None  # the backend's config, e.g. xla.Config("matmul")
    dtype: np.dtype = np.dtype("float32")  # what the shared suites run it in (suite_dtype)

    def unsupported(self, x, kernel, mask, **kw) -> str | None:
        spec = make_spec(x, kernel, mask, **kw)
        return backends.get(self.implementation).unsupported(spec, PLATFORM, self.interpret)

    def __call__(self, x, kernel, mask, **kw):
        if ON_GPU and kw.get("precision") is None:
            # Float32 dots on GPUs default to TF32 (10-bit mantissa), which the float32
            # TOLERANCE does not cover: the suite asks for IEEE products. TF32 is what
            # the benchmarks time.
            kw["precision"] = "highest"
        reason = self.unsupported(x, kernel, mask, **kw)
        if reason is not None:
            # Explicit implementation= raising NotImplementedError for these is tested in
            # the backend's own tests; here the shared cases would only repeat that.
            pytest.skip(f'implementation="{self.implementation}" does not support this case: {reason}')
        return mk.masked_conv(
            x, kernel, mask, implementation=self.implementation, interpret=self.interpret, config=self.config, **kw
        )


def suite_dtype(record, interpret: bool = not ON_GPU) -> np.dtype | None:
    """The dtype the shared suites run a backend in: float32 where it takes it, else
    bfloat16 (the Mosaic GPU kernels: wgmma's float32 mode is TF32 on K-major operands);
    ``None`` where it runs neither here. Tests draw their inputs in ``conv.dtype`` and
    bound errors by its TOLERANCE."""
    for dtype in (np.dtype("float32"), np.dtype(jnp.bfloat16)):
        probe = make_spec(np.zeros((1, 4, 4, 2), dtype), np.zeros((3, 3, 2, 2), dtype), np.ones((3, 3)))
        if record.unsupported(probe, PLATFORM, interpret) is None:
            return dtype
    return None


def _backends() -> dict[str, Backend]:
    """Every registered backend that can run here: kernel backends compiled on GPUs, in
    their interpreters elsewhere (what CI checks on CPU); one whose package is missing
    here (triton without the extra), or that needs a newer jax (pallas_mosaic_gpu on jax
    0.10), is left out, and its own tests say so."""
    found = {
        "xla": Backend("xla"),  # per map, what this platform runs (on CPU: fwd "conv", dx and dw "gemm")
        "xla_conv": Backend("xla", config=xla.Config("conv")),  # per-box convolutions and their transposes
        "xla_gemm": Backend("xla", config=xla.Config("gemm")),  # blocked im2col GEMMs, every map
        "xla_conv_blocks": Backend("xla", config=xla.Config("conv_blocks")),  # blocked convolutions per box
        "xla_matmul": Backend("xla", config=xla.Config("matmul")),  # what GPUs run, on CPU
    }
    for name, record in backends.BACKENDS.items():
        if "kernel_problem" not in record.traits:
            continue
        dtype = suite_dtype(record)
        if dtype is None:
            continue
        found[name if ON_GPU else f"{name}_interpret"] = Backend(name, interpret=not ON_GPU, dtype=dtype)
    return found


BACKENDS = _backends()
# Backends too slow for large or many cases (interpret mode).
SLOW_BACKENDS: set[str] = {name for name, b in BACKENDS.items() if b.interpret}
# The backends whose shared suites run in the slow tier (.ci/run runs it after the
# README's command): the interpreted kernels, and the xla strategies this platform's
# default does not run at the suites' sizes ("xla" on CPU runs "conv" below 128 x 128
# channels; "gemm" and "conv_blocks" are chosen by hand or for large channel counts;
# "matmul" is what GPUs run, so on a GPU the "xla" entry runs it in the fast tier).
# test_agreement.py's smoke test keeps one case of each in the README's command, and
# test_xla.py's block tests keep "gemm" and "conv_blocks" there.
SLOW_TIER_BACKENDS: set[str] = SLOW_BACKENDS | (
    {"xla_conv", "xla_conv_blocks", "xla_gemm", "xla_matmul"} & set(BACKENDS)
)


def backend_params() -> list:
    """Every backend's name, marked slow where :data:`SLOW_TIER_BACKENDS` says (and
    ``interpreted`` where it runs in an interpreter)."""

    def marks(name):
        return [pytest.mark.slow, *([pytest.mark.interpreted] if name in SLOW_BACKENDS else [])]

    return [pytest.param(n, marks=marks(n)) if n in SLOW_TIER_BACKENDS else n for n in sorted(BACKENDS)]


class Named:
    """The function under test, with its backend's name for skips and ids."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn
        self.slow = name in SLOW_BACKENDS
        self.dtype = fn.dtype

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)
