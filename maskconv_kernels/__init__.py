"""maskconv-kernels: exact and fast masked convolutions for JAX."""
from .api import IMPLEMENTATIONS, masked_conv
from .audit import CausalityError, CausalityReport, as_function, assert_causal, audit_causal
from .masks import (
    Mask,
    causal_mask,
    channel_grouped_mask,
    horizontal_stack_mask,
    pixelcnn_mask,
    vertical_stack_mask,
)
from .reference import leaky_masked_conv, masked_conv_reference
from .short_conv import causal_conv1d, causal_conv1d_update

__version__ = "0.1.0"

__all__ = [
    "masked_conv",
    "causal_conv1d",
    "causal_conv1d_update",
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
]
