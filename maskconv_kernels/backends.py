"""The registry of backends: one record per backend, read by the API, the core and the tests.

A record says what a backend is, not how it computes: its name (which says the
lowering), the module that supplies its kernels and support check, its config type and
how it behaves under SPMD. Backend modules are imported on first use, so optional
dependencies (triton, jax-triton) are needed only by those who use them.

A backend module supplies (see :mod:`maskconv_kernels.core`, which does everything else):

* ``unsupported(spec, platform, interpret) -> str | None``: why it cannot run ``spec``
  lowered for ``platform`` (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``; ``None`` asks
  about the problem alone), ``None`` when it can;
* ``forward(x, k, job, out_dtype)``, ``input_grad(dy, k, job, out_dtype)`` and
  ``weight_grad(x, dy, job, out_dtype)``: its three kernels (:class:`~maskconv_kernels.core.Job`),
  with a ``segment_ids`` keyword when the record says ``segments=True``.
  A kernel backend (``kernel_problem=True``) gets 2-D channels-last arrays of
  :class:`~maskconv_kernels.problem.KernelProblem` shapes and returns the weight
  gradient of the active taps as partial sums ``[splits, T, C_in, C_out]``.
"""
from __future__ import annotations

import dataclasses
import importlib

import jax

from .spec import ConvSpec

__all__ = [
    "Backend", "BACKENDS", "IMPLEMENTATIONS", "PREFERENCE", "get", "choose", "lowering_platform",
]

# How a backend meets XLA's SPMD partitioner.
NATIVE = "native"  # made of XLA ops: XLA partitions it itself, along any axis
BATCH = "batch"  # a custom call: wrapped in custom_partitioning that splits the batch (maskconv_kernels.sharding)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend.

    Attributes:
      name: the ``implementation=`` name; it says the lowering.
      module: the module supplying ``unsupported`` and the three kernels.
      config_type: ``"module:Class"`` of its frozen config (``masked_conv(config=...)``).
      spmd: ``"native"`` (XLA partitions it) or ``"batch"`` (batch-partitioned custom call).
      host_interpret: its interpret mode is a host callback (``jax.pure_callback``): host
        code gains nothing from partitioning, and a ``pure_callback`` inside
        ``custom_partitioning`` segfaults on several CPU devices (jax 0.10.2 and 0.12.0),
        so interpreted calls are left to XLA unpartitioned.
      kernel_problem: its kernels read the 2-D :class:`~maskconv_kernels.problem.KernelProblem`
        (1-D lifted, active taps only); else they take the N-D ``ConvSpec``.
      lowering_warnings: messages of warnings its lowering raises on purpose, filtered
        while (and only while) its kernels are lowered.
      segments: its kernels take ``segment_ids`` (a keyword argument of all three).
      mixed_dtypes: its kernels take x and a kernel of different dtypes.
    """

    name: str
    module: str
    config_type: str
    spmd: str = BATCH
    host_interpret: bool = False
    kernel_problem: bool = True
    lowering_warnings: tuple[str, ...] = ()
    segments: bool = False
    mixed_dtypes: bool = False

    def load(self):
        return importlib.import_module(self.module)

    def config_class(self) -> type:
        module, cls = self.config_type.split(":")
        return getattr(importlib.import_module(module), cls)

    def unsupported(self, spec: ConvSpec, platform: str | None, interpret: bool = False) -> str | None:
        if spec.segmented and not self.segments:
            return "segment_ids (its kernels have no segment selects; implementation='xla' has)"
        if spec.mixed and not self.mixed_dtypes:
            return (
                f"x in {spec.x_dtype} with a {spec.kernel_dtype} kernel (its kernels take one dtype; "
                "implementation='xla' takes both)"
            )
        return self.load().unsupported(spec, platform, interpret)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "xla", "maskconv_kernels.xla", "maskconv_kernels.xla:XlaConfig", spmd=NATIVE, kernel_problem=False,
            segments=True, mixed_dtypes=True,
        ),
        # Pallas kernels lowered through Triton (jax.experimental.pallas.triton); since jax
        # 0.11 that lowering warns it is deprecated (the "triton" backend is the way on).
        Backend(
            "pallas_triton", "maskconv_kernels.pallas", "maskconv_kernels.pallas.config:BlockSizes",
            lowering_warnings=("The Pallas Triton backend is deprecated",),
        ),
        # triton.jit kernels launched through jax-triton.
        Backend("triton", "maskconv_kernels.triton", "maskconv_kernels.triton.config:Configs", host_interpret=True),
        # Pallas kernels lowered through Mosaic GPU (plgpu.kernel, TMA, wgmma), for Hopper.
        Backend(
            "pallas_mosaic_gpu", "maskconv_kernels.mosaic_gpu", "maskconv_kernels.mosaic_gpu.config:Tiles",
            host_interpret=True,
        ),
    )
}
IMPLEMENTATIONS = tuple(BACKENDS)
# Tried in order by implementation=None, per lowering platform; "xla" runs everything.
# pallas_mosaic_gpu first: on sm_90 it takes 16-bit, stride-1 window masks; the rest
# falls through to pallas_triton, then xla.
PREFERENCE = ("pallas_mosaic_gpu", "pallas_triton", "xla")


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {name!r}") from None


def choose(spec: ConvSpec, platform: str, interpret: bool = False) -> Backend:
    """The backend ``implementation=None`` lowers ``spec`` with for ``platform``."""
    for name in PREFERENCE:
        if BACKENDS[name].unsupported(spec, platform, interpret) is None:
            return BACKENDS[name]
    raise AssertionError("the xla backend supports every problem")  # pragma: no cover


def lowering_platform(platform: str | None = None) -> str:
    """A platform as lowering names it: jax's ``"gpu"`` is ``"cuda"`` or ``"rocm"``; default: jax's."""
    platform = platform or jax.default_backend()
    if platform != "gpu":
        return platform
    try:
        version = jax.devices("gpu")[0].client.platform_version.lower()
    except Exception:  # pragma: no cover - no initialised GPU backend
        return "cuda"
    return "rocm" if "rocm" in version else "cuda"
