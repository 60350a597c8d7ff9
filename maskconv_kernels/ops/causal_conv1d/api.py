"""Short causal convolutions of sequence models, in the field's terms: :func:`causal_conv1d`.

Mamba / Mamba-2, gated DeltaNet, Hyena, LFM2 and RWKV-style token shifts run a
depthwise causal 1-D convolution of width 2 to 4 over ``(B, L, D)`` activations, trained
on packed documents (``segment_ids``) and served from a state of the last inputs. This
is Dao-AILab's ``causal_conv1d_fn`` (``seq_idx``, ``initial_states``,
``return_final_states``, bias and SiLU) channels-last in JAX (its own layout is
:mod:`maskconv_kernels.compat`'s), with the library's contract: a position never reads a
later one, nor (with ``segment_ids``) one of another document: selected, never
multiplied, so the gradient across documents is exactly 0.0 and a NaN in one document
changes no other's output.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..._core.errors import OpError
from ..._core.fused import FusedOp
from . import xla
from .backends import IMPLEMENTATIONS, PREFERENCE, REGISTRY
from .checks import OP, make_problem
from .state import final_state

__all__ = ["causal_conv1d", "IMPLEMENTATIONS", "PREFERENCE"]


def _local(problem, operands: dict):
    """The problem of one device's slice of the rows and channels (``operands``: its arrays)."""
    x = operands["x"]
    return dataclasses.replace(problem, batch=x.shape[0], dim=x.shape[-1])


# The op's primitives: causal_conv1d_fwd, _tangent and _bwd, each lowered by the
# implementation chosen for the platform; derivatives above the first are xla's. Depthwise:
# on several devices the kernels split along the rows and along the channels (tensor
# parallelism) where XLA split them.
PRIMITIVES = FusedOp("causal_conv1d", REGISTRY, xla.reference, data=("ids",), shared=("w", "bias"),
                     channels={"x": -1, "w": -1, "bias": -1, "state": -1, "y": -1}, local=_local)


def causal_conv1d(
    x: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    segment_ids: jax.typing.ArrayLike | None = None,
    padding_id: int | None = None,
    initial_state: jax.typing.ArrayLike | None = None,
    return_final_state: bool = False,
    activation: str | None = None,
    dilation: int = 1,
    implementation: str | None = None,
    interpret: bool = False,
    config=None,
    positions: jax.typing.ArrayLike | None = None,
):
    """Depthwise causal 1-D convolution: ``y[b, l, d] = act(bias[d] + sum_t weight[t, d] * x[b, l - (W-1-t) * dilation, d])``.

    Args:
      x: ``(B, L, D)``, channels-last; float32, bfloat16 or float16.
      weight: ``(W, D)``; its dtype may be wider than x's (Mamba keeps float32 weights
        for bfloat16 activations).
      bias: ``(D,)`` or ``None``.
      segment_ids: ``(B, L)`` integers or ``None``: packed documents. No tap crosses a
        document boundary; negative ids mark padding, whose outputs are zero and which
        receives no gradient (and, with ``padding_id``, ids equal to it).
      padding_id: ``None`` or the segment id that marks padding besides the negative
        ones: MaxText's convention, ``padding_id=0`` (documents ``1, 2, ...``, padding
        ``0``). Never guessed from the values: without it, id ``0`` is a document, and
        the final state of a right-padded row is its padding's inputs. Only with
        ``segment_ids``.
      positions: ``(B, L)`` integers or ``None``: packed documents described by position
        instead (RecurrentGemma's ``segment_pos``, MaxText's positions): ``0`` starts a
        document, anywhere; a negative position is padding. Exclusive with
        ``segment_ids``. The row's first token continues the document the state holds
        unless its position is 0 (then the state is not read: its gradient is 0). Read
        as the segment ids ``cumsum(positions == 0)`` (``-1`` where negative); from
        segment ids, positions are each token's distance from its document's start.
      initial_state: ``(B, (W - 1) * dilation, D)`` in x's dtype, the inputs before
        ``x[:, 0]`` (zeros when ``None``); differentiable. With ``segment_ids`` it belongs
        to each row's first document.
      return_final_state: also return the state after ``x``: its last ``(W - 1) *
        dilation`` inputs (the initial state's too, if ``x`` is shorter), in x's dtype;
        with ``segment_ids``, those of each row's last document, up to its last
        non-padding token (zeros before its start and in an all-padding row).
      activation: ``None`` or ``"silu"`` (``"swish"``).
      dilation: the taps' spacing.
      implementation: ``None`` or one of :data:`IMPLEMENTATIONS`: ``"xla"``
        (``masked_conv``'s depthwise maps, every platform), ``"pallas_triton"`` (fused
        kernels: bias, SiLU and selects in one pass; NVIDIA GPUs),
        ``"pallas_mosaic_gpu"`` (the same through Mosaic GPU; Hopper GPUs, jax >= 0.11) or
        ``"pallas_mosaic_tpu"`` (the same through Mosaic TPU; TPUs, float32 and bfloat16
        activations); the kernels run on any platform with ``interpret=True``. All are
        differentiable to any order, forward and reverse.
        ``None``: chosen per platform when lowered, the first of :data:`PREFERENCE` that
        runs the problem there (``"pallas_mosaic_tpu"`` on TPUs for sequences of 1,024
        positions or more, ``"xla"`` elsewhere: each was the faster where it was timed).
      interpret: run a kernel implementation in its interpreter (any platform, slowly).
      config: the named implementation's ``Config``, or ``None`` for its heuristic.

    Returns:
      ``y``: ``(B, L, D)`` in x's dtype, accumulated in float32 (bias and activation
      applied in float32, rounded once), or ``(y, final_state)``.

    Raises:
      ValueError, TypeError: bad arguments (the message names the argument).
      NotImplementedError: the named implementation does not take this problem, or cannot
        be lowered for the platform.
    """
    problem, x, weight, bias, ids, initial_state = make_problem(
        x, weight, bias, segment_ids, initial_state, activation=activation, dilation=dilation, positions=positions,
        padding_id=padding_id,
    )
    y = forward(OP, problem, x, weight, bias, ids, initial_state, implementation=implementation, interpret=interpret,
                config=config)
    if not return_final_state:
        return y
    return y, final_state(x, initial_state, ids, problem.state_len)


def forward(err: OpError, problem, x, weight, bias, ids, initial_state, *, implementation, interpret, config):
    """``y`` of a checked problem by the implementation asked for, with errors in ``err``'s words
    (:func:`~.update.causal_conv1d_update`, which checks its own arguments, calls it too)."""
    backend, interpret = REGISTRY.resolve(problem, implementation, interpret, config, op=err.op)
    if 0 in x.shape:
        return jnp.zeros(x.shape, x.dtype)  # every output an empty sum, or none
    given = (("bias", bias), ("ids", ids), ("state", initial_state if problem.has_state else None))
    operands = {"x": x, "w": weight, **{name: a for name, a in given if a is not None}}
    return PRIMITIVES(operands, problem=problem, backend=backend, interpret=interpret, config=config)
