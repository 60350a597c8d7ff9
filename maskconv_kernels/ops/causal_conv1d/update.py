"""Serving: :func:`causal_conv1d_update`, new tokens of each row from its slot of a state pool.

One or several new tokens per row from a pool of states ``(S, state_len, D)``
(``state_indices`` choose each row's slot for continuous batching, :data:`PAD_SLOT_ID`
rows touch nothing; linear or, with ``cache_seqlens``, circular states), in place under
``jax.jit`` with donation. Each step is :func:`~.api.causal_conv1d` on the slot's window,
or on a TPU one decode kernel (:mod:`.pallas_mosaic_tpu.decode`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .api import forward
from .backends import REGISTRY
from ..._core.args import as_operand
from ..._core.errors import OpError
from ..._core.history import History, Ring, check_dtype
from jax.extend.core import Primitive

from ..._core.primitives import (
    Kernels, batch_partitioned, bind, def_abstract_eval, def_batching, kernel_rule, register_lowering,
)
from .checks import check_activation, check_operands, ids_of, problem_of, unread_before_a_start
from . import pallas_mosaic_tpu as tpu
from .pallas_mosaic_tpu.config import NAN, PAD, ZEROS
from .state import final_state

__all__ = [
    "causal_conv1d_update", "PAD_SLOT_ID", "check_state_indices", "check_row_values", "read_slots", "write_slots",
    "zero_padding_rows", "one_launch", "tpu_kernel_taken", "decode_launch", "DECODE", "SERVING", "serving_rule",
    "serving_primitive",
]

# causal-conv1d's and vLLM's PAD_SLOT_ID: a row of the batch that holds no request.
PAD_SLOT_ID = -1

OP = OpError("causal_conv1d_update")  # its errors, and those of the checks it shares, in its name


def causal_conv1d_update(
    x: jax.typing.ArrayLike,
    conv_state: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    activation: str | None = None,
    dilation: int = 1,
    state_indices: jax.typing.ArrayLike | None = None,
    cache_seqlens: jax.typing.ArrayLike | None = None,
    has_initial_state: jax.typing.ArrayLike | None = None,
    implementation: str | None = None,
    interpret: bool = False,
    positions: jax.typing.ArrayLike | None = None,
):
    """New tokens of each row from its slot of a state pool: ``(y, new_conv_state)``.

    causal-conv1d's ``causal_conv1d_update`` (``cache_seqlens``, ``conv_state_indices``)
    channels-last, functional, with several tokens per call. Row ``b`` reads and rewrites
    slot ``state_indices[b]`` of the pool and no other; its outputs are those
    :func:`~.api.causal_conv1d` gives for its tokens after the inputs the slot holds, computed
    by :func:`~.api.causal_conv1d` itself (``initial_state``: the slot's last
    ``(W - 1) * dilation`` inputs), so that decoding a sequence step by step from an
    empty slot gives the full forward's outputs bit for bit wherever XLA compiles the
    two programs' arithmetic alike. (It need not: LLVM may contract a product and an add
    into one FMA, choosing per program, and vector and scalar code may evaluate SiLU
    differently; the docs' *where bit for bit stops* page says where this was seen.)

    Under ``jax.jit(..., donate_argnums=1)`` the pool is updated in place: one gather of
    the rows' slots, one scatter of them back, no copy of the pool. On a TPU, linear
    states without ``positions`` and up to 16 tokens a row run as one Mosaic kernel
    instead (``causal_conv1d_tpu_update``, :mod:`.pallas_mosaic_tpu.decode`): the pool stays
    in HBM, aliased to the new one, and only the rows' slots move, by DMA. It is the
    default there (``implementation=None``) and runs anywhere by name with
    ``implementation="pallas_mosaic_tpu", interpret=True``; its float32 arithmetic is the
    TPU forward kernel's, so its outputs are within rounding of XLA's, not bit for bit.
    It has no derivative of its own: differentiating it differentiates the composition.

    Args:
      x: ``(B, T, D)``, or ``(B, D)`` for one token; float32, bfloat16 or float16.
      conv_state: the pool, ``(S, state_len, D)`` in x's dtype, ``state_len >= (W - 1) *
        dilation``. Linear (``cache_seqlens=None``): a slot holds the last ``state_len``
        inputs of its sequence, oldest first (Mamba keeps ``state_len = W``). Circular
        (``cache_seqlens`` given): input ``p`` of a sequence lives at ``p % state_len``.
      weight, bias, activation, dilation, implementation, interpret: as in :func:`~.api.causal_conv1d`
        (``"pallas_mosaic_tpu"``: the decode kernel where it applies, above).
      state_indices: ``(B,)`` signed integers or ``None`` (row ``b`` uses slot ``b``; then
        ``S == B``). :data:`PAD_SLOT_ID` (-1) marks a row that holds no request: its
        outputs are zeros and it reads and writes nothing. Indices are checked (in ``[0,
        S)`` or -1, and no slot twice): concrete ones when called, traced ones under
        ``jax.experimental.checkify.checkify`` (the same message). Unchecked, a traced
        index outside ``[0, S)`` other than -1 writes nothing and reads NaN (its outputs
        are NaN, so the error shows, unless ``has_initial_state`` is false there), as
        jax's ``mode="fill"`` gathers and ``mode="drop"`` scatters do, and two rows naming
        one slot write it in an unspecified order.
      positions: ``(B, T)`` (or ``(B,)`` for one token) integers or ``None``: each
        token's position in its document (RecurrentGemma's ``segment_pos``), so that a
        document may start inside a chunk: a ``0`` starts one (the tokens from there on
        read nothing before it), a negative position is padding (zero output). The slot
        is read only if the row's first token continues its document (position not 0),
        and keeps the last document's inputs, zeros before its start
        (:func:`~.api.causal_conv1d`'s ``positions``). Linear states only.
      cache_seqlens: ``(B,)`` integers or ``None``: how many inputs each row's sequence
        had before ``x`` (circular mode). The window before ``x`` is read at positions
        ``(cache_seqlens - (W - 1) * dilation ... cache_seqlens - 1) % state_len``; the
        tokens are written at ``(cache_seqlens + t) % state_len`` (the last ``state_len``
        of them if ``T > state_len``). The caller advances it by ``T``.
      has_initial_state: ``(B,)`` bools or ``None`` (all true): where false, the row
        starts a new sequence: its slot's old content is never read (selected away, so
        a NaN in it cannot reach the outputs) and is replaced as if it had been zeros.

    Returns:
      ``y`` shaped like ``x`` in x's dtype (accumulated in float32, as
      :func:`~.api.causal_conv1d`), and the new pool (same shape and dtype as ``conv_state``).
    """
    check_activation(activation, OP)
    with OP.words():
        x, weight = as_operand("x", x), as_operand("weight", weight)
        conv_state = as_operand("conv_state", conv_state)
        bias = None if bias is None else as_operand("bias", bias)
    if x.ndim not in (2, 3):
        raise OP.value(f"x must be (B, T, D), or (B, D) for one token, got shape {tuple(x.shape)}")
    one_token = x.ndim == 2
    xt = x[:, None] if one_token else x
    _, d, window = check_operands(xt, weight, bias, dilation, OP)
    batch, tokens = xt.shape[:2]
    slots, state_len = _check_pool(conv_state, window, d, x.dtype, batch if state_indices is None else None)
    indices = None if state_indices is None else check_state_indices(state_indices, batch, slots)
    if cache_seqlens is not None:
        cache_seqlens = check_row_values("cache_seqlens", cache_seqlens, batch, "iu")
        if state_len == 0:
            raise OP.value("cache_seqlens (a circular state) needs conv_state with state_len >= 1, got 0")
    if has_initial_state is not None:
        has_initial_state = check_row_values("has_initial_state", has_initial_state, batch, "b")
    ids = None
    if positions is not None:
        if cache_seqlens is not None:
            raise OP.value("positions takes linear states only: a circular slot (cache_seqlens) has no place for a "
                           "document's start; pass one or the other")
        with OP.words():
            positions = jnp.asarray(positions)
        ids = ids_of(None, positions[:, None] if one_token else positions, xt.shape[:2],
                     "(B, T), or (B,) for one token", OP)

    # The arguments were checked above: the problem is built once, not checked again.
    problem = problem_of(xt, weight, bias, ids, conv_state, activation=activation, dilation=dilation)
    pieces = dict(problem=problem, implementation=implementation, interpret=interpret)
    if cache_seqlens is None and ids is None and one_launch(problem, implementation, interpret, state_len):
        y, new_state = _launched(xt, conv_state, weight, bias, indices, has_initial_state, **pieces)
    else:
        y, new_state = _composed(xt, conv_state, weight, bias, indices=indices, has_initial_state=has_initial_state,
                                 ids=ids, cache_seqlens=cache_seqlens, **pieces)
    return (y[:, 0] if one_token else y), new_state


def _composed(x, conv_state, weight, bias, *, indices, has_initial_state, ids, cache_seqlens, problem, implementation,
              interpret, writes=None):
    """``(y, new_state)`` composed of XLA ops around :func:`~.api.causal_conv1d`'s forward: a
    gather of the rows' slots, the forward on each row's window then tokens, a scatter.

    ``indices``: each row's slot (``None``: row ``b``'s is slot ``b``); ``writes``: the
    slots written, where they differ from those read (the serving step's ``write_indices``).
    """
    state_len, window = conv_state.shape[1], problem.state_len
    rows = conv_state if indices is None else read_slots(conv_state, indices)
    if has_initial_state is not None:
        rows = jnp.where(has_initial_state[:, None, None], rows, jnp.zeros((), rows.dtype))
    if ids is not None and x.shape[1]:
        rows = unread_before_a_start(rows, ids)
    if cache_seqlens is None:  # the slot is the sequence's last state_len inputs
        slot = History(rows)
        before = rows[:, state_len - window :]
        if ids is None:
            new_rows = slot.after(slot.extend(x)[0]).inputs
        else:  # the last document's inputs, zeros before its start
            new_rows = final_state(x, rows, ids, state_len)
    else:
        ring = Ring(state_len)
        before = ring.read(rows, cache_seqlens, window)
        new_rows = ring.write(rows, cache_seqlens, x)
    y = forward(OP, problem, x, weight, bias, ids, before, implementation=implementation, interpret=interpret,
                config=None)
    if indices is None:
        return y, new_rows
    return zero_padding_rows(y, indices), write_slots(conv_state, indices if writes is None else writes, new_rows)


def one_launch(problem, implementation: str | None, interpret: bool, state_len: int) -> bool:
    """Whether the decode step runs as the TPU's one-launch kernel: asked for by name
    (``"pallas_mosaic_tpu"``, checked as the forward would check it), or ``None`` without
    ``interpret`` (then on TPUs only, decided when lowered), for the problems it takes: up
    to :data:`~.pallas_mosaic_tpu.MAX_DECODE_TOKENS` tokens a row, slots of ``state_len
    >= 1`` inputs (a pool of empty slots, width 1, has nothing to move: the composition
    runs it)."""
    if not 0 < problem.length <= tpu.MAX_DECODE_TOKENS or state_len == 0:
        return False
    return tpu_kernel_taken(problem, implementation, interpret)


def tpu_kernel_taken(problem, implementation: str | None, interpret: bool) -> bool:
    """Whether a step takes a Mosaic TPU serving kernel (the decode step's, the mixed
    step's): asked for by name (``"pallas_mosaic_tpu"``, checked as the forward would check
    it), or ``None`` without ``interpret`` for a problem the kernels take (then on TPUs
    only, decided when lowered)."""
    if implementation == "pallas_mosaic_tpu":
        REGISTRY.resolve(problem, implementation, interpret, None, op=OP.op)
        return True
    return implementation is None and interpret is False and tpu.unsupported(problem, None) is None


def _launched(x, conv_state, weight, bias, indices, has_initial_state, *, problem, implementation, interpret):
    """``(y, new_state)`` from the decode kernel (on TPUs for ``implementation=None``, XLA's
    composition elsewhere), differentiable through the composition's derivatives."""
    indices = jnp.arange(x.shape[0], dtype=jnp.int32) if indices is None else indices
    return decode_launch(x, conv_state, weight, bias, indices, indices, has_initial_state, problem=problem,
                         implementation=implementation, interpret=interpret)


def decode_launch(x, pool, weight, bias, reads, writes, has_initial_state, *, problem, implementation, interpret):
    """``(y (B, T, D), pool)`` from the TPU's decode kernel: row ``b`` reads slot ``reads[b]``
    and writes slot ``writes[b]`` (``(B,)`` indices, :data:`PAD_SLOT_ID` for a pad row).

    One primitive (:data:`DECODE`), lowered per platform: for ``implementation=None`` the
    kernel where lowered for a TPU and XLA's composition (:func:`_composed`) elsewhere, so
    that no other platform traces the kernel; for ``"pallas_mosaic_tpu"`` the kernel
    everywhere. Its derivatives are the composition's (a ``custom_vjp``).
    :func:`causal_conv1d_update` and ``causal_conv1d_step``'s decode steps call it.
    """
    fresh = fresh_rows(has_initial_state, reads)
    params = dict(problem=problem, implementation=implementation, interpret=bool(interpret))

    # The slot indices are arguments, not closed over: a custom_vjp may not close over a tracer.
    @jax.custom_vjp
    def launch(x, pool, weight, bias, slots):
        operands = (x, pool, weight) + (() if bias is None else (bias,)) + slots
        return tuple(bind(SERVING.flavour(DECODE), *operands, **params))

    def launch_fwd(*args):
        return launch(*args), args

    def launch_bwd(args, cotangents):
        *operands, slots = args
        return (*jax.vjp(lambda *a: _decoded(*a, *slots, problem=problem), *operands)[1](cotangents), None)

    launch.defvjp(launch_fwd, launch_bwd)
    return launch(x, pool, weight, bias, (reads, writes, fresh))


def _decoded(x, pool, weight, bias, reads, writes, fresh, *, problem):
    """:func:`decode_launch`'s ``(y, pool)`` composed of XLA ops (:func:`_composed`)."""
    return _composed(x, pool, weight, bias, indices=reads, writes=writes, has_initial_state=jnp.logical_not(fresh),
                     ids=None, cache_seqlens=None, problem=problem, implementation="xla", interpret=False)


def _decode_kernel(x, pool, weight, bias, reads, writes, fresh, *, problem, interpret):
    """:func:`decode_launch`'s ``(y, pool)`` from the kernel: the rows' indices as its codes."""
    codes, targets = slot_codes(reads, writes, fresh, pool.shape[0])
    return tpu.update(x, pool, weight, bias, codes, targets, problem=problem, interpret=interpret)


def fresh_rows(has_initial_state, reads) -> jax.Array:
    """``(B,)`` bools: the rows that start fresh (``has_initial_state`` false; none where it
    is ``None``), beside ``reads (B,)``."""
    return jnp.zeros(reads.shape, bool) if has_initial_state is None else jnp.logical_not(has_initial_state)


def slot_codes(reads, writes, fresh, slots: int) -> tuple[jax.Array, jax.Array]:
    """The TPU kernels' ``(reads, writes)`` int32 codes (``.pallas_mosaic_tpu.decode``) of rows
    that read slot ``reads`` (:data:`PAD_SLOT_ID`: a pad row; ``fresh``: read zeros) and
    write slot ``writes``: an index outside the pool reads NaN and writes nothing."""
    indices, inside = _in_pool(reads, slots)
    codes = jnp.where(reads == PAD_SLOT_ID, PAD, jnp.where(~inside, NAN, jnp.where(fresh, ZEROS, indices)))
    targets, writable = _in_pool(writes, slots)
    return codes.astype(jnp.int32), jnp.where(writable, targets, -1).astype(jnp.int32)


def serving_rule(prim, fn, problem) -> Callable:
    """The lowering rule for ``prim`` of a serving kernel ``fn(x, pool, weight, bias, *metadata,
    problem) -> (y, pool)``, whose operands are ``x, pool, weight, [bias,] *metadata`` (the
    bias only where ``problem`` has one) and whose ``problem`` is that of the channels it is
    given. On several devices (``prim``'s partitioned flavour) it is split along the
    channels where XLA split them (tensor parallelism: a depthwise step, each channel of
    its outputs and slots reads only itself), the metadata replicated."""
    channeled = 3 + problem.has_bias  # x, pool, weight[, bias]: channels last

    def run(x, pool, weight, *rest):
        bias, rest = (rest[0], rest[1:]) if problem.has_bias else (None, rest)
        return list(fn(x, pool, weight, bias, *rest, problem=dataclasses.replace(problem, dim=x.shape[-1])))

    def split(*operands):
        n = len(operands)
        channels_in = [-1] * channeled + [None] * (n - channeled)
        return batch_partitioned(run, [False] * n, [False, False], True, channels_in, [-1, -1])(*operands)

    return kernel_rule(run, multiple_results=True, partitioned=split if prim is SERVING.flavours(prim)[0] else None)


def serving_primitive(name: str, rule_for: Callable) -> Primitive:
    """A serving kernel's primitive (its partitioned flavour; :data:`SERVING` gives the one to
    bind), lowered by ``rule_for(prim, platform, **params)``: results ``(y, pool)`` shaped
    like its first two operands, and a map over anything (the pool is read and written
    whole) maps it."""
    flavours = SERVING.primitives(name, multiple_results=True)
    for prim in flavours:
        def_abstract_eval(prim, lambda x, pool, *rest, **params: [(x.shape, x.dtype), (pool.shape, pool.dtype)])
        register_lowering(prim, functools.partial(rule_for, prim))
        def_batching(prim, lambda n, **params: [False] * n, foldable=False)
    return flavours[0]


def _decode_rule(prim, platform: str, *, problem, implementation, interpret):
    """:data:`DECODE`'s lowering for ``platform``: the kernel for a TPU (or by name), else the composition."""
    if implementation == "pallas_mosaic_tpu" or platform == "tpu":
        return serving_rule(prim, functools.partial(_decode_kernel, interpret=interpret), problem)
    return serving_rule(prim, _decoded, problem)


# The serving kernels' primitives, each in two flavours (the partitioned one bound but
# under an abstract mesh of abstract devices: _core.primitives.Kernels).
SERVING = Kernels(REGISTRY)
# causal_conv1d_update's decode step: operands (x, pool, weight, [bias,] reads, writes, fresh),
# results (y, pool); params problem, implementation (None or "pallas_mosaic_tpu"), interpret.
DECODE = serving_primitive("causal_conv1d_decode", _decode_rule)


# The pool's slots are read and written along its first axis only, so these serve any
# slot layout: this module's (state_len, D) and causal-conv1d's (D, state_len) alike.


def read_slots(conv_state: jax.Array, indices: jax.Array) -> jax.Array:
    """Row ``b``'s slot ``conv_state[indices[b]]``: zeros for a pad row (:data:`PAD_SLOT_ID`),
    NaN for any other index outside ``[0, S)``.

    ``conv_state: (S, *slot)``, ``indices: (B,)`` signed integers (checked by
    :func:`check_state_indices`); returns ``(B, *slot)``. NaN, not a clipped slot, so a
    traced index out of range shows in the outputs instead of reading another row's state;
    zeros for a pad row, whose outputs are zeroed, so that their zero cotangents times its
    inputs stay zero (NaN there made every gradient NaN).
    """
    slots = conv_state.shape[0]
    indices, inside = _in_pool(indices, slots)
    rows = jnp.take(conv_state, jnp.clip(indices, 0, slots - 1), axis=0)
    shape = inside.shape + (1,) * (rows.ndim - 1)
    fill = jnp.where(indices == PAD_SLOT_ID, 0.0, jnp.nan).astype(rows.dtype).reshape(shape)
    return jnp.where(inside.reshape(shape), rows, fill)


def write_slots(conv_state: jax.Array, indices: jax.Array, new_rows: jax.Array) -> jax.Array:
    """The pool with ``new_rows[b]`` in slot ``indices[b]``; rows without a slot (padding, out of range) write nowhere."""
    slots = conv_state.shape[0]
    indices, inside = _in_pool(indices, slots)
    return conv_state.at[jnp.where(inside, indices, slots)].set(new_rows, mode="drop")


def _in_pool(indices: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """``indices`` widened to hold ``slots`` (the index a scatter drops), and where they name a slot."""
    indices = indices.astype(jnp.promote_types(indices.dtype, jnp.int32))
    return indices, (indices >= 0) & (indices < slots)


def zero_padding_rows(y: jax.Array, indices: jax.Array) -> jax.Array:
    """``y (B, ...)`` with the rows of :data:`PAD_SLOT_ID` set to zeros, as causal-conv1d's kernel writes them."""
    pad = (indices == PAD_SLOT_ID).reshape((-1,) + (1,) * (y.ndim - 1))
    return jnp.where(pad, jnp.zeros((), y.dtype), y)


def _check_pool(conv_state, window: int, d: int, dtype, batch: int | None):
    """Checks the pool: ``(S, state_len >= window, D)`` in ``dtype``, ``S == batch`` unless ``None``.

    Returns ``(S, state_len)``.
    """
    shape = tuple(conv_state.shape)
    if len(shape) != 3 or shape[2] != d or shape[1] < window:
        raise OP.value(
            f"conv_state must be (S, state_len, D) with state_len >= (W - 1) * dilation = {window} and D = {d}, "
            f"got {shape}"
        )
    if batch is not None and shape[0] != batch:
        raise OP.value(
            f"conv_state has {shape[0]} slots but x has {batch} rows: without state_indices row b uses slot b, "
            "so they must be equal; pass state_indices (B,) to choose each row's slot in a larger pool"
        )
    check_dtype(OP, "conv_state", conv_state, dtype, hint=": it holds past inputs, so allocate it in the dtype of the inputs")
    return shape[0], shape[1]


def check_row_values(name: str, value, batch: int, kinds: str, err: OpError = OP):
    """One value per row: ``(B,)`` of a dtype kind in ``kinds`` (``"iu"`` integers, ``"b"`` bools)."""
    if not isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
        value = jnp.asarray(value)
    dtype = np.dtype(value.dtype)
    if dtype.kind not in kinds:
        what = "integers" if kinds == "iu" else "bools"
        raise err.type(f"{name} must hold {what}, one per row of x, got dtype {dtype}")
    if tuple(value.shape) != (batch,):
        raise err.value(f"{name} must have shape (B,) = ({batch},), one per row of x, got {tuple(value.shape)}")
    if kinds == "iu":
        err.check(value >= 0, f"{name} must be non-negative, got {{value}}", value=value)
    return value


def check_state_indices(state_indices, batch: int, slots: int, err: OpError = OP, name: str = "state_indices"):
    """``(B,)`` integers; concrete ones in ``[0, slots)`` or :data:`PAD_SLOT_ID`, no slot twice.

    ``err`` and ``name``: the public function and its argument, for the messages.
    """
    if not isinstance(state_indices, (jax.Array, jax.ShapeDtypeStruct)):
        state_indices = jnp.asarray(state_indices)
    dtype = np.dtype(state_indices.dtype)
    if dtype.kind != "i":
        raise err.type(
            f"{name} must hold signed integers (a slot of conv_state per row, {PAD_SLOT_ID} for none), "
            f"got dtype {dtype}"
        )
    if tuple(state_indices.shape) != (batch,):
        raise err.value(f"{name} must have shape (B,) = ({batch},), one per row of x, got {tuple(state_indices.shape)}")
    used = state_indices != PAD_SLOT_ID
    err.check(
        ~used | ((state_indices >= 0) & (state_indices < slots)),
        f"{name} must be slots of conv_state, in [0, {slots}), or {PAD_SLOT_ID} for a row without a request; "
        f"got {{indices}}", indices=state_indices,
    )
    # (B, B): another row with the same slot. B is a batch of rows, small.
    same = (state_indices[:, None] == state_indices[None, :]) & used[:, None] & ~jnp.eye(batch, dtype=bool)
    err.check(~same, f"{name} names a slot for several rows (each row needs its own slot): got {{indices}}",
              indices=state_indices)
    return state_indices
