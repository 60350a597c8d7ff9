"""``causal_conv1d``'s problem: its arguments checked once, in its own words, into a frozen :class:`Problem`.

Every implementation takes a :class:`Problem` and never re-validates. The checks shared
with :func:`~.update.causal_conv1d_update` take the caller's :class:`~..._core.errors.OpError`,
so a message names the function the user called. Layouts are
channels-last: ``x (B, L, D)``, ``weight (W, D)``, states ``(B, (W - 1) * dilation, D)``.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ..._core.args import as_operand, as_segment_ids, float_dtype, is_int, segment_ids_of_positions
from ..._core.errors import OpError
from ..._core.history import check_history

__all__ = ["ACTIVATIONS", "Problem", "make_problem", "problem_of", "check_activation", "check_operands", "check_state"]

# causal-conv1d's names: "swish" is SiLU's other name.
ACTIVATIONS = (None, "silu", "swish")


@dataclasses.dataclass(frozen=True)
class Problem:
    """Everything static about one ``causal_conv1d`` call (hashable)."""

    batch: int
    length: int
    dim: int
    width: int
    dilation: int
    silu: bool
    has_bias: bool
    segmented: bool
    has_state: bool
    x_dtype: np.dtype
    weight_dtype: np.dtype
    bias_dtype: np.dtype | None

    @property
    def state_len(self) -> int:
        """How far the first output reaches back: ``(W - 1) * dilation``."""
        return (self.width - 1) * self.dilation

    def back(self, t: int) -> int:
        """How far before an output its tap ``t`` reads: ``(W - 1 - t) * dilation``."""
        return (self.width - 1 - t) * self.dilation

    @property
    def dtypes(self) -> dict[str, np.dtype]:
        named = {"x": self.x_dtype, "weight": self.weight_dtype}
        if self.bias_dtype is not None:
            named["bias"] = self.bias_dtype
        return named


OP = OpError("causal_conv1d")


def check_activation(activation, err: OpError = OP) -> None:
    if activation not in ACTIVATIONS:
        raise err.value(f"activation must be None, 'silu' or 'swish' (the same), got {activation!r}")


def check_operands(x, weight, bias, dilation, err: OpError = OP) -> tuple[int, int, int]:
    """The shapes and dtypes shared by the full convolution and the decode step; returns ``(W, D, state length)``."""
    with err.words():
        for name, operand in (("x", x), ("weight", weight), ("bias", bias)):
            if operand is not None:
                float_dtype(f"{name} must have", operand.dtype)
    if x.ndim != 3:
        raise err.value(
            f"x must be (B, L, D), channels-last (batch, positions, channels), got shape {tuple(x.shape)}"
            + (": x needs a batch axis, x[None] gives one" if x.ndim == 2 else "")
        )
    d = x.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != d:
        hint = ""
        if weight.ndim == 2 and weight.shape[0] == d:
            hint = " (causal-conv1d's (D, W) weight: pass weight.T, or use maskconv_kernels.compat.causal_conv1d_fn)"
        elif weight.ndim == 2 and x.shape[1] == weight.shape[1]:
            hint = (" (x looks like causal-conv1d's (B, D, L): x is read channels-last (B, L, D); transpose it, or "
                    "use maskconv_kernels.compat.causal_conv1d_fn)")
        raise err.value(
            f"weight must be (W, D) = (width, {d}) to match x of shape {tuple(x.shape)} read as "
            f"(B, L, D), got {tuple(weight.shape)}{hint}"
        )
    if weight.shape[0] < 1:
        raise err.value(f"weight needs a width of at least 1, got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (d,):
        raise err.value(f"bias must be (D,) = ({d},), got {tuple(bias.shape)}")
    if not is_int(dilation) or dilation < 1:
        raise err.value(f"dilation must be a positive int, got {dilation!r}")
    width = int(weight.shape[0])
    return width, d, (width - 1) * int(dilation)


def check_state(name: str, state, batch: int, state_len: int, d: int, dtype, err: OpError = OP) -> None:
    check_history(err, name, state, (batch, state_len, d), "(B, (W - 1) * dilation, D)", dtype)


def make_problem(x, weight, bias=None, segment_ids=None, initial_state=None, *, activation=None, dilation=1,
                 positions=None, padding_id=None):
    """The arguments checked: ``(problem, x, weight, bias, segment_ids, initial_state)``, arrays as arrays.

    ``positions`` (packing by positions) comes back as segment ids
    (:func:`~maskconv_kernels._core.args.segment_ids_of_positions`), with the state of a row
    whose first token starts a document replaced by zeros (selected, so never read);
    segment ids equal to ``padding_id`` come back as ``-1`` (:func:`ids_of`).
    """
    check_activation(activation)
    with OP.words():
        x, weight = as_operand("x", x), as_operand("weight", weight)
        bias = None if bias is None else as_operand("bias", bias)
    _, d, state_len = check_operands(x, weight, bias, dilation)
    ids = ids_of(segment_ids, positions, x.shape[:-1], "x's shape without D, (B, L)", padding_id=padding_id)
    if initial_state is not None:
        initial_state = as_operand("initial_state", initial_state)
        check_state("initial_state", initial_state, x.shape[0], state_len, d, x.dtype)
        if positions is not None and x.shape[1]:
            initial_state = unread_before_a_start(initial_state, ids)
    problem = problem_of(x, weight, bias, ids, initial_state, activation=activation, dilation=dilation)
    return problem, x, weight, bias, ids, initial_state


def ids_of(segment_ids, positions, shape, what: str, err: OpError = OP, *, padding_id=None):
    """Segment ids from either packing convention (``None`` for neither); both is an error.

    ``padding_id``: the id that marks padding in ``segment_ids`` (MaxText's ``0``), or
    ``None`` (negative ids only). Ids equal to it come back as ``-1``, the library's own
    padding, so nothing after this reads the caller's convention; negative ids stay
    padding. Explicit, never guessed from the values: a row of ids ``0, 0, 1`` is two
    documents without it and padding then one document with ``padding_id=0``.
    """
    if padding_id is not None:
        check_padding_id(padding_id, segment_ids, positions, err)
    if positions is None:
        if segment_ids is None:
            return None
        with err.words():
            ids = as_segment_ids(segment_ids, shape, what)
        return ids if padding_id is None else jnp.where(ids == padding_id, jnp.asarray(-1, ids.dtype), ids)
    if segment_ids is not None:
        raise err.value(
            "pass segment_ids or positions, not both: they are two ways to say where documents start "
            "(segment_ids: a change of id; positions: a 0, as RecurrentGemma's segment_pos)"
        )
    with err.words():
        return segment_ids_of_positions(positions, shape, what)


def check_padding_id(padding_id, segment_ids, positions, err: OpError = OP) -> None:
    """``padding_id`` is an int, and comes with ``segment_ids`` (the ids it speaks of)."""
    if not is_int(padding_id):
        raise err.type(f"padding_id must be an int (the segment id that marks padding, MaxText's 0) or None, got "
                       f"{padding_id!r}")
    if positions is not None:
        raise err.value("padding_id says which segment id marks padding; with positions, padding is a negative "
                        "position: pass segment_ids with padding_id, or positions without it")
    if segment_ids is None:
        raise err.value("padding_id says which segment id marks padding, but no segment_ids were given: pass "
                        "segment_ids with it, or drop padding_id")


def unread_before_a_start(state, ids):
    """``state (B, F, ...)`` with zeros in the rows whose first token starts a document (id 1 from
    :func:`~maskconv_kernels._core.args.segment_ids_of_positions`): selected, so a NaN there
    reaches nothing and its gradient is exactly 0. A state belongs to its row's first
    token's document; with positions that is document 0, the one the row continues."""
    continues = ids[:, 0] == 0
    return jnp.where(continues.reshape((-1,) + (1,) * (state.ndim - 1)), state, jnp.zeros((), state.dtype))


def problem_of(x, weight, bias, ids, initial_state, *, activation, dilation) -> Problem:
    """The :class:`Problem` of arguments already checked (nothing is checked here): for a caller
    that validated its own, as :func:`~.update.causal_conv1d_update` does, so nothing is checked twice."""
    batch, length, d = x.shape
    state_len = (weight.shape[0] - 1) * int(dilation)
    return Problem(
        batch=int(batch), length=int(length), dim=int(d), width=int(weight.shape[0]), dilation=int(dilation),
        silu=activation is not None, has_bias=bias is not None, segmented=ids is not None,
        has_state=initial_state is not None and state_len > 0, x_dtype=np.dtype(x.dtype),
        weight_dtype=np.dtype(weight.dtype), bias_dtype=None if bias is None else np.dtype(bias.dtype),
    )
