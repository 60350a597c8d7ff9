"""Other libraries' faces on this one's ops, so that code written for them ports by its import line.

* :mod:`.causal_conv1d`: Dao-AILab's ``causal_conv1d`` package (``causal_conv1d_fn``,
  ``causal_conv1d_update``), channels-first, on :func:`maskconv_kernels.causal_conv1d`.
* :mod:`.vllm`: vLLM's ``causal_conv1d_fn`` and ``causal_conv1d_update``
  (``vllm/model_executor/layers/mamba/ops/causal_conv1d.py``): its pool ``(N, dim, S)``,
  pad slots, prefix caching and speculative decoding, on
  :func:`maskconv_kernels.causal_conv1d_step`. Its functions share the Dao-AILab names, so
  import them from the module: ``from maskconv_kernels.compat.vllm import causal_conv1d_fn``.
"""
from .causal_conv1d import causal_conv1d_fn, causal_conv1d_update

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
