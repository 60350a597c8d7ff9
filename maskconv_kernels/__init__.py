"""maskconv-kernels: exact and fast masked convolutions for JAX.

The ops are packages of :mod:`maskconv_kernels.ops`, each with its implementations;
:mod:`.masks` builds masks, :mod:`.parallel` splits a spatial or sequence axis over
devices, :mod:`.audit` checks a whole model for causality, :mod:`.flax` and
:mod:`.equinox` hold the modules, :mod:`.compat` other libraries' faces on the ops
(Dao-AILab causal-conv1d's), and ``python -m maskconv_kernels`` prints the leak report.
"""
from . import _moved
from ._core.hardware import gpu_target
from .audit import CausalityError, CausalityReport, as_function, assert_causal, audit_causal
from .masks import (
    Mask,
    causal_mask,
    channel_grouped_mask,
    horizontal_stack_mask,
    pixelcnn_mask,
    vertical_stack_mask,
)
from .ops.causal_conv import causal_conv, causal_conv_stream, causal_conv_transpose, causal_conv_transpose_stream
from .ops.causal_conv1d import causal_conv1d, causal_conv1d_step, causal_conv1d_update
from .ops.masked_conv import IMPLEMENTATIONS, masked_conv
from .ops.masked_conv.reference import leaky_masked_conv, masked_conv_reference

_moved.install()
__getattr__ = _moved.module_attribute  # mk.api, mk.spatial, ...: the moved modules by their old attribute

__version__ = "0.1.0"

__all__ = [
    "masked_conv",
    "causal_conv1d",
    "causal_conv1d_update",
    "causal_conv1d_step",
    "causal_conv",
    "causal_conv_stream",
    "causal_conv_transpose",
    "causal_conv_transpose_stream",
    "IMPLEMENTATIONS",
    "Mask",
    "pixelcnn_mask",
    "causal_mask",
    "vertical_stack_mask",
    "horizontal_stack_mask",
    "channel_grouped_mask",
    "masked_conv_reference",
    "leaky_masked_conv",
    "audit_causal",
    "assert_causal",
    "as_function",
    "CausalityReport",
    "CausalityError",
    "gpu_target",
]
