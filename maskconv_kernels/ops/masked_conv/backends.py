"""``masked_conv``'s implementations table: one record per backend, read by the API, the maps and the tests.

A record says what a backend is, not how it computes (:class:`~maskconv_kernels._core.registry.Implementation`):
its name (which says the lowering), its module (a module or folder of this package named
as the implementation), how it meets SPMD and how its interpreter runs. Its traits:

* ``"kernel_problem"``: its kernels read the 2-D :class:`~.kernel_problem.KernelProblem` (1-D
  lifted, active taps only) and return the weight gradient of the active taps as
  partial sums ``[splits, T, C_in, C_out]``; without it they take the N-D ``ConvSpec``;
* ``"segments"``: its kernels take ``segment_ids`` (a keyword argument of all three);
* ``"mixed_dtypes"``: its kernels take x and a kernel of different dtypes.

A backend module supplies ``Config``, ``unsupported(spec, platform, interpret)`` and the
three kernels ``forward(x, k, job, out_dtype)``, ``input_grad(dy, k, job, out_dtype)`` and
``weight_grad(x, dy, job, out_dtype)`` (:class:`~.maps.Job`); :mod:`.maps` does the rest.
"""
from __future__ import annotations

from ..._core.primitives import PALLAS_TRITON_DEPRECATION
from ..._core.registry import BATCH, NATIVE, Implementation, Registry, lowering_platform
from .spec import ConvSpec

__all__ = [
    "REGISTRY", "BACKENDS", "IMPLEMENTATIONS", "PREFERENCE", "get", "choose", "lowering_platform", "BATCH",
    "NATIVE",
]

_PACKAGE = __name__.rpartition(".")[0]
_KERNELS = frozenset({"kernel_problem"})
_CUDA = ("cuda",)


def _requirements(backend: Implementation, spec: ConvSpec) -> str | None:
    if spec.segmented and "segments" not in backend.traits:
        return "segment_ids (its kernels have no segment selects; implementation='xla' has)"
    if spec.mixed and "mixed_dtypes" not in backend.traits:
        return (
            f"x in {spec.x_dtype} with a {spec.kernel_dtype} kernel (its kernels take one dtype; "
            "implementation='xla' takes both)"
        )
    return None


REGISTRY = Registry(
    "masked_conv",
    (
        Implementation("xla", f"{_PACKAGE}.xla", spmd=NATIVE, traits=frozenset({"segments", "mixed_dtypes"})),
        # Pallas kernels lowered through Triton (jax.experimental.pallas.triton); since jax
        # 0.11 that lowering warns it is deprecated (the "triton" backend is the way on).
        Implementation(
            "pallas_triton", f"{_PACKAGE}.pallas_triton", platforms=_CUDA, lowering_warnings=(PALLAS_TRITON_DEPRECATION,),
            traits=_KERNELS,
        ),
        # triton.jit kernels launched through jax-triton; interpreted in a worker process.
        Implementation("triton", f"{_PACKAGE}.triton", platforms=_CUDA, interpreter="callback", traits=_KERNELS),
        # Pallas kernels lowered through Mosaic GPU (plgpu.kernel, TMA, wgmma), for Hopper.
        Implementation(
            "pallas_mosaic_gpu", f"{_PACKAGE}.pallas_mosaic_gpu", platforms=_CUDA, interpreter="effects", traits=_KERNELS,
        ),
        # Pallas kernels lowered through Mosaic for TPUs; interpreted by Pallas' interpret=True
        # mode, traced inline (no host callbacks).
        Implementation("pallas_mosaic_tpu", f"{_PACKAGE}.pallas_mosaic_tpu", platforms=("tpu",), traits=_KERNELS),
    ),
    # Tried in order by implementation=None, per lowering platform; "xla" runs everything.
    # pallas_triton first on NVIDIA GPUs: on an H200 its kernels (per-kernel default
    # tiles) beat pallas_mosaic_gpu's at both headline shapes, and Mosaic GPU takes a
    # subset of its problems (docs/performance.md#h200). pallas_mosaic_tpu first on TPUs,
    # for the 2-D problems it takes whose boxes are small (its not_preferred): on a TPU v5e
    # it beat lax.conv and xla's per-box convolutions at 3x3 and 5x5 type B, and lost to
    # the latter at 7x7 type A (docs/performance.md, TPU v5e).
    # ROCm: no kernel is tested there.
    {"cpu": ("xla",), "cuda": ("pallas_triton", "pallas_mosaic_gpu", "xla"), "rocm": ("xla",),
     "tpu": ("pallas_mosaic_tpu", "xla")},
    _requirements,
)
BACKENDS = REGISTRY.by_name
IMPLEMENTATIONS = REGISTRY.names
PREFERENCE = REGISTRY.preference
get = REGISTRY.get
choose = REGISTRY.choose
