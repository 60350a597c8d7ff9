"""Other libraries' faces on this one's ops, so that code written for them ports by its import line.

* :mod:`.causal_conv1d`: Dao-AILab's ``causal_conv1d`` package (``causal_conv1d_fn``,
  ``causal_conv1d_update``), channels-first, on :func:`maskconv_kernels.causal_conv1d`.
"""
from .causal_conv1d import causal_conv1d_fn, causal_conv1d_update

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
