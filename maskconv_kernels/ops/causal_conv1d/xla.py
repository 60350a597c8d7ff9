"""``causal_conv1d``'s ``xla`` implementation: ``masked_conv``'s depthwise maps.

The convolution is :func:`~maskconv_kernels.masked_conv` with ``feature_group_count=D``
and ``padding="CAUSAL"``, whose ``xla`` backend computes a depthwise problem as shifted
products (no im2col, no batched dot) and selects across segments; so it inherits the
contract and derivatives of every order. An initial state is the input before position
0; the outputs at its own positions are dropped. Bias and SiLU are applied in float32.

Its :func:`forward` is also the op's reference (:class:`~maskconv_kernels._core.fused.FusedOp`):
the derivatives above the first of every implementation are its derivatives.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..._core.fused import backward_by_vjp
from ..._core.history import History
from ..masked_conv import masked_conv
from ..masked_conv.xla import Config
from .checks import Problem

__all__ = ["Config", "unsupported", "forward", "backward", "reference"]


def unsupported(problem: Problem, platform: str | None, interpret: bool = False) -> str | None:
    """Every problem, on every platform."""
    return None


def forward(operands: dict, *, problem: Problem, config: Config | None = None, interpret: bool = False):
    """``y (B, L, D)`` in x's dtype: float32 accumulation, bias and activation in float32, rounded once.

    ``operands``: ``x``, ``w`` and, where given, ``bias``, ``ids`` (segment ids) and ``state``
    (the initial state).
    """
    del interpret  # nothing to interpret
    x, weight, bias, initial_state = operands["x"], operands["w"], operands.get("bias"), operands.get("state")
    ids = operands.get("ids")
    # The state is the input before position 0, of the row's first document (none: an empty history).
    past = History.of_first_document(x[:, :0] if initial_state is None else initial_state, ids)
    xe, ide = past.extend(x, ids)
    acc = jnp.promote_types(jnp.float32, jnp.promote_types(x.dtype, weight.dtype))
    y = past.outputs(masked_conv(
        xe, weight[:, None, :], np.ones(problem.width, bool), padding="CAUSAL", dilation=problem.dilation,
        feature_group_count=problem.dim, preferred_element_type=acc, implementation="xla", segment_ids=ide,
        config=config,
    ))
    if bias is not None:
        y = y + bias.astype(acc)
    if problem.silu:
        y = jax.nn.silu(y)
    if ids is not None:
        y = jnp.where((ids >= 0)[..., None], y, jnp.zeros((), y.dtype))  # bias and activation included
    return y.astype(x.dtype)


backward = backward_by_vjp(forward, data=("ids",))


def reference(operands: dict, problem: Problem):
    """The op's reference: :func:`forward`, differentiable to any order."""
    return forward(operands, problem=problem)
