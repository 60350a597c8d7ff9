"""The ``pallas_mosaic_tpu`` backend: Pallas kernels lowered through Mosaic for TPUs, that never read a masked tap.

* :mod:`.config`: :class:`Config`, the block sizes, their heuristic and the VMEM budget
  (``masked_conv(..., implementation="pallas_mosaic_tpu", config=Config(...))``);
* :mod:`.geometry`: the shifted GEMMs of the active taps and the blocks (with halos)
  the kernels run over;
* :mod:`.kernels`: the tap GEMM (forward, input gradient) and the tap weight gradient,
  MXU matmuls accumulated in float32 VMEM scratch;
* :mod:`.conv`: :func:`unsupported`, :func:`not_preferred` and the three kernels as the
  core calls them.

Lowers for TPUs, or runs anywhere in Pallas' interpreter (``interpret=True``, traced
inline: jax 0.10 and 0.12 alike). Supports 1-D and 2-D, stride-1, ungrouped
convolutions with any padding, dilation, window or channel-partial mask, in float32
and bfloat16 (float32 accumulation); the rest is reported by :func:`unsupported` and
``implementation=None`` uses ``"xla"``. ``implementation=None`` on a TPU takes it for the
2-D problems it runs whose mask has no box of 16 taps or more (:func:`not_preferred`). CI has no TPU: its tests lower the kernels
for one and interpret them; they also passed compiled on one TPU v5e (jax 0.10.2), where
it was timed (docs/performance.md, TPU v5e).
"""
from .config import Config
from .conv import forward, input_grad, not_preferred, unsupported, weight_grad

__all__ = ["Config", "unsupported", "not_preferred", "forward", "input_grad", "weight_grad"]
