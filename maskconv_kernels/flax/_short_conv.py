"""What the linen and nnx ``ShortConv`` modules share: PyTorch's initialisers, the state's shape, the full pass.

Mamba's, Mamba-2's and gated DeltaNet's short convolutions are ``torch.nn.Conv1d(D, D,
kernel_size=W, groups=D)`` (flash-linear-attention's ``ShortConvolution`` subclasses
it) left at PyTorch's default initialisation: ``kaiming_uniform_(a=sqrt(5))`` for the
weight and ``uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for the bias, with ``fan_in =
(D / groups) * W = W`` for a depthwise convolution. Both bounds are then ``1/sqrt(W)``
(the gain ``sqrt(2 / (1 + a^2)) = sqrt(1/3)`` times ``sqrt(3 / fan_in)``). A PyTorch
weight ``(D, 1, W)`` loads as ``weight = w[:, 0, :].T``, ``(W, D)``.

Flax models write the same convolution as ``nn.Conv(features=D, kernel_size=(W,),
feature_group_count=D, padding="CAUSAL")`` (or ``((W - 1) * dilation, 0)``), whose kernel
is ``(W, 1, D)``: :func:`from_conv_params` converts its parameters.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from maskconv_kernels.ops.causal_conv1d import causal_conv1d, causal_conv1d_update

__all__ = [
    "torch_conv1d_uniform", "weight_init", "bias_init_for", "state_shape", "full_pass", "decode_step",
    "refuse_state_arguments", "from_conv_params",
]


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


def full_pass(module, x, weight, bias, segment_ids=None, positions=None) -> jax.Array:
    """A ``ShortConv``'s full pass ``(N, L, D)``: :func:`causal_conv1d` with the module's
    ``activation``, ``dilation`` and ``implementation``, over its ``context_parallel``
    split where it has one (:meth:`~maskconv_kernels.parallel.ContextParallel.causal_conv1d`)."""
    kw = dict(segment_ids=segment_ids, positions=positions, activation=module.activation, dilation=module.dilation,
              implementation=module.implementation)
    if module.context_parallel is None:
        return causal_conv1d(x, weight, bias, **kw)
    return module.context_parallel.causal_conv1d(x, weight, bias, **kw)


def decode_step(
    module, x, state, weight, bias, segment_ids=None, positions=None, *, state_indices=None, has_initial_state=None,
) -> tuple[jax.Array, jax.Array]:
    """A ``ShortConv``'s decode step: ``(y, new state)`` from :func:`causal_conv1d_update` with
    the module's ``activation``, ``dilation`` and ``implementation``.

    ``x``: ``(N, T, D)`` (or ``(B, T, D)`` with ``state_indices``); ``state``: ``(N,
    (W - 1) * dilation, D)``; ``y`` is shaped like ``x``. ``segment_ids`` are refused: a
    step continues each row's sequence (``positions`` start documents inside a chunk).
    """
    if segment_ids is not None:
        raise ValueError("segment_ids is for full sequences: a decode step continues one sequence per row")
    return causal_conv1d_update(
        x, state, weight, bias, activation=module.activation, dilation=module.dilation, state_indices=state_indices,
        has_initial_state=has_initial_state, implementation=module.implementation, positions=positions,
    )


def refuse_state_arguments(state_indices, has_initial_state, allocation: str) -> None:
    """Raises ``ValueError`` for decode-only arguments in a full pass; ``allocation`` names how the module allocates its state."""
    if state_indices is not None or has_initial_state is not None:
        raise ValueError(
            f"state_indices and has_initial_state are for decode steps (decode=True, after {allocation}); a full "
            "forward pass starts every row from zeros"
        )


def from_conv_params(params: Mapping) -> dict:
    """A depthwise ``nn.Conv``'s parameters as ``ShortConv``'s: ``kernel (W, 1, D)`` -> ``weight (W, D)``.

    ``params``: ``{"kernel": (W, 1, D), "bias": (D,)}`` (``bias`` optional), or variables
    holding them under ``"params"``, as ``nn.Conv(features=D, kernel_size=(W,),
    feature_group_count=D).init`` returns them; the result has the same nesting. The
    kernel's values are kept (``kernel[:, 0, :]``), so a ``ShortConv`` with these
    parameters computes the causal convolution that conv computes with ``padding="CAUSAL"``
    or ``((W - 1) * dilation, 0)``, up to rounding. Checkpoints of a model that used the
    ``nn.Conv`` load through it::

        >>> import flax.linen as nn, jax, jax.numpy as jnp
        >>> from maskconv_kernels.flax import ShortConv, from_conv_params
        >>> x = jnp.ones((2, 16, 8))
        >>> conv = nn.Conv(8, (4,), feature_group_count=8, padding="CAUSAL")
        >>> conv_variables = conv.init(jax.random.key(0), x)
        >>> variables = from_conv_params(conv_variables)
        >>> jax.tree_util.tree_map(jnp.shape, variables)
        {'params': {'bias': (8,), 'weight': (4, 8)}}
        >>> bool(jnp.allclose(ShortConv(4).apply(variables, x), conv.apply(conv_variables, x)))
        True
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"from_conv_params takes nn.Conv's parameters, a mapping with 'kernel', got {type(params).__name__}")
    if "params" in params and "kernel" not in params:
        return {**params, "params": from_conv_params(params["params"])}
    if "kernel" not in params or set(params) - {"kernel", "bias"}:
        raise ValueError(
            f"from_conv_params takes a depthwise nn.Conv's parameters {{'kernel', 'bias'}} (or variables holding them "
            f"under 'params'), got keys {sorted(params)}"
        )
    kernel = params["kernel"]
    shape = tuple(jnp.shape(kernel))
    if len(shape) != 3 or shape[1] != 1:
        raise ValueError(
            f"from_conv_params: kernel must be a depthwise 1-D convolution's (W, 1, D) (nn.Conv with "
            f"kernel_size=(W,) and feature_group_count = features = D), got shape {shape}"
        )
    converted = {"weight": kernel[:, 0, :]}
    if "bias" in params:
        if tuple(jnp.shape(params["bias"])) != (shape[2],):
            raise ValueError(f"from_conv_params: bias must be (D,) = ({shape[2]},), got {tuple(jnp.shape(params['bias']))}")
        converted["bias"] = params["bias"]
    return converted
