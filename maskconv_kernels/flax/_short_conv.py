"""What the linen and nnx ``ShortConv`` modules share: PyTorch's initialisers, the state's shape.

Mamba's, Mamba-2's and gated DeltaNet's short convolutions are ``torch.nn.Conv1d(D, D,
kernel_size=W, groups=D)`` (flash-linear-attention's ``ShortConvolution`` subclasses
it) left at PyTorch's default initialisation: ``kaiming_uniform_(a=sqrt(5))`` for the
weight and ``uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for the bias, with ``fan_in =
(D / groups) * W = W`` for a depthwise convolution. Both bounds are then ``1/sqrt(W)``
(the gain ``sqrt(2 / (1 + a^2)) = sqrt(1/3)`` times ``sqrt(3 / fan_in)``). A PyTorch
weight ``(D, 1, W)`` loads as ``weight = w[:, 0, :].T``, ``(W, D)``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["torch_conv1d_uniform", "weight_init", "bias_init_for", "state_shape"]


def torch_conv1d_uniform(width: int):
    """``uniform(-1/sqrt(width), 1/sqrt(width))``: PyTorch's depthwise ``Conv1d`` weight and bias initialiser."""
    bound = 1.0 / math.sqrt(width)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def weight_init(key, shape, dtype=jnp.float32):
    """PyTorch's ``Conv1d`` default for a depthwise weight ``(W, D)``: ``uniform(±1/sqrt(W))``."""
    return torch_conv1d_uniform(shape[0])(key, shape, dtype)


def bias_init_for(width: int, bias_init):
    """``bias_init``, or PyTorch's default (``uniform(±1/sqrt(width))``) when it is ``None``."""
    return torch_conv1d_uniform(width) if bias_init is None else bias_init


def state_shape(input_shape, width: int, dilation: int, features: int) -> tuple[int, int, int]:
    """``(N, (W - 1) * dilation, D)``: the decode state for full-size inputs of ``input_shape`` ``(N, L, D)``."""
    if len(input_shape) != 3 or input_shape[-1] != features:
        raise ValueError(
            f"ShortConv decodes inputs (N, L, D) with D = {features}: give the full-size input shape (N, L, "
            f"{features}) to allocate the state, got {tuple(input_shape)}"
        )
    return (input_shape[0], (width - 1) * dilation, features)
