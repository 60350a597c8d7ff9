"""``causal_conv1d``'s implementations table.

* ``"xla"``: :mod:`.xla`, ``masked_conv``'s depthwise maps (every platform, every order
  of derivative);
* ``"pallas_triton"``: :mod:`.pallas_triton`, fused Pallas kernels lowered through
  Triton (NVIDIA GPUs, or any platform with ``interpret=True``);
* ``"pallas_mosaic_gpu"``: :mod:`.pallas_mosaic_gpu`, Pallas kernels lowered through
  Mosaic GPU (Hopper GPUs, or any platform with ``interpret=True``; jax >= 0.11);
* ``"pallas_mosaic_tpu"``: :mod:`.pallas_mosaic_tpu`, Pallas kernels lowered through
  Mosaic for TPUs (or any platform with ``interpret=True``, traced inline).

``implementation=None`` takes, when lowered for a platform, the first of that platform's
:data:`PREFERENCE` that runs the problem there: ``"pallas_mosaic_tpu"`` on TPUs for
sequences of 1,024 positions or more (its ``not_preferred``), where its forward+backward
beat XLA's shift-and-add 2.5x to 4.3x on a TPU v5e at Mamba-2 shapes
(docs/performance.md, TPU v5e); ``"xla"`` elsewhere, because on an H200 XLA's
fusion of the shift-and-add beat the fused kernels by 1.3x to 2x
(docs/performance.md#h200). An
implementation module supplies ``Config``, ``unsupported(problem, platform, interpret)``,
``forward`` and ``backward`` (:mod:`maskconv_kernels._core.fused`), which the op's
primitives lower.
"""
from __future__ import annotations

from ..._core.primitives import PALLAS_TRITON_DEPRECATION
from ..._core.registry import BATCH, NATIVE, Implementation, Registry

__all__ = ["REGISTRY", "IMPLEMENTATIONS", "PREFERENCE"]

_PACKAGE = __name__.rpartition(".")[0]

REGISTRY = Registry(
    "causal_conv1d",
    (
        Implementation("xla", f"{_PACKAGE}.xla", spmd=NATIVE),
        Implementation("pallas_triton", f"{_PACKAGE}.pallas_triton", platforms=("cuda",), spmd=BATCH,
                       lowering_warnings=(PALLAS_TRITON_DEPRECATION,)),
        Implementation("pallas_mosaic_gpu", f"{_PACKAGE}.pallas_mosaic_gpu", platforms=("cuda",), spmd=BATCH,
                       interpreter="effects"),
        Implementation("pallas_mosaic_tpu", f"{_PACKAGE}.pallas_mosaic_tpu", platforms=("tpu",), spmd=BATCH),
    ),
    {"cpu": ("xla",), "cuda": ("xla",), "rocm": ("xla",), "tpu": ("pallas_mosaic_tpu", "xla")},
)
IMPLEMENTATIONS = REGISTRY.names
PREFERENCE = REGISTRY.preference
