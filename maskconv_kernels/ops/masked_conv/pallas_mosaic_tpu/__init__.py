"""The ``pallas_mosaic_tpu`` backend: Pallas kernels lowered through Mosaic for TPUs, that never read a masked tap.

* :mod:`.config`: :class:`Config`, the block sizes, their heuristic and the VMEM budget
  (``masked_conv(..., implementation="pallas_mosaic_tpu", config=Config(...))``);
* :mod:`.geometry`: the shifted GEMMs of the active taps and the blocks (with halos)
  the kernels run over;
* :mod:`.kernels`: the tap GEMM (forward, input gradient) and the tap weight gradient,
  MXU matmuls accumulated in float32 VMEM scratch;
* :mod:`.conv`: :func:`unsupported` and the three kernels as the core calls them.

Lowers for TPUs, or runs anywhere in Pallas' interpreter (``interpret=True``, traced
inline: jax 0.10 and 0.12 alike). Supports 1-D and 2-D, stride-1, ungrouped
convolutions with any padding, dilation, window or channel-partial mask, in float32
and bfloat16 (float32 accumulation); the rest is reported by :func:`unsupported` and
``implementation=None`` uses ``"xla"``. Named only: ``implementation=None`` does not try
it. CI has no TPU: its tests lower the kernels for one and interpret them; on
2026-12-06 tests/masked_conv/test_pallas_mosaic_tpu.py also passed compiled on one TPU
v5e (jax 0.10.2). Not timed on a TPU: the default blocks are not tuned.
"""
from .config import Config
from .conv import forward, input_grad, unsupported, weight_grad

__all__ = ["Config", "unsupported", "forward", "input_grad", "weight_grad"]
