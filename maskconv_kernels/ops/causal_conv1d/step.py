"""Serving: :func:`causal_conv1d_step`, a continuous-batching scheduler's whole step in one call.

A scheduler step of a hybrid model runs one flat batch of tokens that mixes prefill chunks
of new requests and decode tokens of running ones; each request's short-convolution state
lives in a slot of a pool. This module runs such a step as one :func:`~.api.causal_conv1d`
call on one extended sequence: each request's tokens follow its state (the last inputs its
slot holds, of its own document: the request's index as its segment id), so every output
is the one ``causal_conv1d`` gives on the request's whole sequence, and no value crosses
from one request, pad row or unused slot to another. The states after the step, and with
prefix caching after every block boundary the step crosses, are the last inputs of each
request's sequence: copies, exact in any dtype that holds x's values. A step that verifies
trees of drafts (``parents``) runs ``causal_conv1d`` once over each token's gathered window
instead: its parent chain, then its slot.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._core.args import as_operand, as_segment_ids
from ..._core.errors import OpError
from ..._core.history import check_dtype
from ..._core.primitives import bind
from .api import causal_conv1d
from .checks import check_activation, check_operands, problem_of
from . import pallas_mosaic_tpu as tpu
from .pallas_mosaic_tpu import config as tpu_config
from .pallas_mosaic_tpu.config import ZEROS
from .update import (
    PAD_SLOT_ID, SERVING, check_row_values, check_state_indices, decode_launch, fresh_rows, one_launch, read_slots,
    serving_primitive, serving_rule, slot_codes, tpu_kernel_taken, write_slots,
)

__all__ = ["causal_conv1d_step"]

OP = OpError("causal_conv1d_step")


def causal_conv1d_step(
    x: jax.typing.ArrayLike,
    pool: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    query_start_loc: jax.typing.ArrayLike,
    state_indices: jax.typing.ArrayLike,
    has_initial_state: jax.typing.ArrayLike | None = None,
    write_indices: jax.typing.ArrayLike | None = None,
    block_size: int | None = None,
    block_indices: jax.typing.ArrayLike | None = None,
    num_computed_tokens: jax.typing.ArrayLike | None = None,
    num_accepted_tokens: jax.typing.ArrayLike | None = None,
    parents: jax.typing.ArrayLike | None = None,
    accepted_path: jax.typing.ArrayLike | None = None,
    activation: str | None = None,
    dilation: int = 1,
    implementation: str | None = None,
    interpret: bool = False,
    positions: jax.typing.ArrayLike | None = None,
):
    """One scheduler step: the outputs of every request's tokens, and the pool after them.

    Request ``r`` owns tokens ``x[query_start_loc[r]:query_start_loc[r + 1]]`` (none is
    allowed): a prefill chunk of any length, 1 and fewer than ``W - 1`` included, or a
    decode step. It reads slot ``state_indices[r]`` of the pool (the last ``state_len``
    inputs of its sequence so far, oldest first, as :func:`~.update.causal_conv1d_update`
    keeps a linear slot), or starts fresh where ``has_initial_state[r]`` is false (the
    slot is never read: a NaN there cannot reach an output), and writes the last
    ``state_len`` inputs of its sequence after the step to slot ``write_indices[r]``
    (default: the slot it read). Its outputs are :func:`~.api.causal_conv1d`'s on its whole
    sequence, computed by ``causal_conv1d`` on the step's extended sequence: bit for bit
    wherever XLA compiles the two programs' arithmetic alike (docs: where bit for bit
    stops), within the dtype's rounding otherwise.

    Under ``jax.jit(..., donate_argnums=1)`` the pool is updated in place: one gather of
    the requests' slots, one scatter of the new states (and block states). On a TPU a
    step of as many tokens as requests, without prefix caching, speculative decoding or
    ``positions``, checks at run time whether each request has one token, and if so runs
    as :func:`~.update.causal_conv1d_update`'s decode kernel (the pool aliased in HBM, a DMA
    per slot; within rounding of the composition, not bit for bit); named with
    ``implementation="pallas_mosaic_tpu"`` it runs anywhere (``interpret=True``). On a TPU
    (or named), any other step without a tree of drafts (``parents``), nor accepted drafts
    with ``positions``, runs as the mixed step's kernel (:mod:`.pallas_mosaic_tpu.mixed`:
    one launch, the pool aliased, block states included, a slot's history after accepted
    drafts shifted in VMEM, inputs before a token's document selected to zero; within
    rounding of the composition). A step whose accepted tokens are not a
    chain in some row (a tree's branch), or, with prefix caching or ``write_indices``,
    whose slot writes could race with its reads (a slot written twice, or written by one
    request and read by another), with a pad row that has a slot to write or a request
    without tokens that copies a slot, runs as the composition, decided when it runs: the
    kernels read and write slots in token order, the composition reads them all first.

    Args:
      x: ``(T, D)``: the step's tokens, requests back to back, then padding up to ``T``
        (static, so one program serves every step of that size); float32, bfloat16 or
        float16.
      pool: ``(S, state_len, D)``, ``state_len >= (W - 1) * dilation``, in x's dtype or a
        wider float one that holds x's values exactly (float32 states for 16-bit x).
      weight, bias, activation, dilation, implementation, interpret: as in
        :func:`~.api.causal_conv1d`.
      query_start_loc: ``(R + 1,)`` integers, non-decreasing from 0; ``R`` is static
        (padded with requests of no token).
      state_indices: ``(R,)`` signed integers: each request's slot, or
        :data:`~.update.PAD_SLOT_ID` for a pad row (zero outputs, reads and writes nothing).
        Checked (in ``[0, S)`` or ``PAD_SLOT_ID``, no slot twice) when concrete, and
        under ``jax.experimental.checkify.checkify`` when traced, as every index and
        offset here.
      has_initial_state: ``(R,)`` bools or ``None`` (all true).
      write_indices: ``(R,)`` or ``None``: where each request's state after the step goes,
        when it is not the slot it read (a request that starts from a cached prefix's
        block slot writes its own).
      block_size: ``K`` for prefix caching, or ``None``: the state after every multiple of
        ``K`` tokens of a request (counted from its start, across steps) is written to the
        slot ``block_indices`` names for that block.
      block_indices: ``(R, M)`` integers with ``block_size``: slot ``block_indices[r, m]``
        receives request ``r``'s state after ``(m + 1) * K`` tokens if this step crosses
        that boundary (``PAD_SLOT_ID``: not cached; so for a boundary that unverified
        drafts cross, whose state could hold a rejected one). ``M`` is static.
      num_computed_tokens: ``(R,)`` integers with ``block_size``: how many tokens each
        request had before this step.
      num_accepted_tokens: ``(R,)`` integers or ``None``, for speculative decoding: a row
        whose previous step carried ``1 + k`` tokens (the last accepted one and ``k``
        drafts) accepted the first ``a`` of them, ``1 <= a <= k + 1``; its slot, of
        ``state_len = (W - 1) * dilation + k`` inputs, then holds valid inputs up to ``a``
        of that step's tokens, and the rejected drafts after them are never read: the
        window before this step's tokens ends at the last accepted one, and the state
        written after them holds no rejected input. ``k + 1`` (``state_len - (W - 1) *
        dilation + 1``) for a row whose every previous token was accepted (a prefill).
      parents: ``(T,)`` integers or ``None``, for a tree of drafts (EAGLE): each token's
        parent, as its index among its request's tokens, or ``-1`` for a token that
        follows the slot's inputs (the row's first token, the last accepted one). A
        parent comes before its children (``parents[t] < t - query_start_loc[r]``). Each
        token's window follows its parent chain, then the slot: a NaN in one branch
        reaches no token of another. A row of chained tokens has parents ``-1, 0, ...,
        n - 2``. The state written is the slot's inputs then every token, in the step's
        order, as for a chain; the next step says which of them were accepted with
        ``accepted_path``. Costs one convolution over ``T * ((W - 1) * dilation + 1)``
        gathered inputs (each token's window). Not with ``positions`` or ``block_size``.
      accepted_path: ``(R, k + 1)`` integers or ``None``, the step after a tree step: which
        of the slot's last ``k + 1`` inputs stay in each row's history, as increasing
        indices, then ``-1`` (at least one). After a step that carried ``1 + k`` tokens:
        its accepted tokens, root first (a chain of its tree). After a step of ``n < 1 +
        k`` tokens: ``0 .. k - n`` (the inputs before them), then ``k + 1 - n + j`` for
        its accepted tokens ``j``. ``arange(k + 1)``: the whole slot is history (after a
        prefill); ``arange(a)`` is ``num_accepted_tokens = a``. Not with
        ``num_accepted_tokens``.
      positions: ``(T,)`` non-negative integers or ``None``: each token's position in its
        document (RecurrentGemma's ``segment_pos``), so that a new document can start
        inside a request's tokens, a multi-token decode chunk included: from a ``0`` on,
        the request's tokens read nothing before it, and the state written holds the
        last document's inputs, zeros before its start. A request whose first token is
        at position 0 does not read its slot. Not with ``block_size`` (prefix caching
        counts a request's tokens as one document).

    Returns:
      ``y (T, D)`` in x's dtype (zeros at padding and pad rows), and the new pool (same
      shape and dtype).
    """
    with OP.words():
        x, weight, pool = as_operand("x", x), as_operand("weight", weight), as_operand("pool", pool)
        bias = None if bias is None else as_operand("bias", bias)
    check_activation(activation, OP)
    if x.ndim != 2:
        raise OP.value(f"x must be (T, D), the step's tokens back to back, got shape {tuple(x.shape)}")
    _, d, window = check_operands(x[None], weight, bias, dilation, OP)
    slots, state_len = _check_pool(pool, window, d, x.dtype)
    qsl = _check_query_start_loc(query_start_loc, x.shape[0])
    requests = qsl.shape[0] - 1
    read = check_state_indices(state_indices, requests, slots, OP)
    write = read if write_indices is None else check_state_indices(write_indices, requests, slots, OP, "write_indices")
    started = None if has_initial_state is None else check_row_values("has_initial_state", has_initial_state, requests,
                                                                    "b", OP)
    blocks = _check_blocks(block_size, block_indices, num_computed_tokens, requests, slots)
    path = _check_acceptance(num_accepted_tokens, accepted_path, requests, state_len, window)
    starts = None if positions is None else _check_positions(positions, x.shape[0], blocks)
    owner = _owners(qsl, x.shape[0])  # (T,): each token's request, R for padding
    within = jnp.arange(x.shape[0]) - jnp.take(qsl, owner)  # (T,): each token's index among its request's
    tree = None if parents is None else _check_parents(parents, owner, within, requests, blocks, starts)

    conv = dict(activation=activation, dilation=dilation, implementation=implementation, interpret=interpret)
    size = None if blocks is None else blocks[0]
    # The step's traced metadata, an argument of every branch: the kernels' derivatives (a
    # custom_vjp's) are the composition's, and a custom_vjp may not close over a tracer.
    meta = dict(qsl=qsl, read=read, write=write, started=started, owner=owner, within=within, path=path,
                starts=starts, tree=tree, blocks=None if blocks is None else blocks[1:])

    def composed(x, pool, weight, bias, meta):
        m = meta
        rows = read_slots(pool, m["read"])
        if m["path"] is not None:
            rows = _valid_history(rows, m["path"], window)
        if m["started"] is not None:
            rows = jnp.where(m["started"][:, None, None], rows, jnp.zeros((), rows.dtype))
        documents = None if m["starts"] is None else _documents(m["starts"], m["qsl"], m["owner"])
        before = rows[:, state_len - window:].astype(x.dtype)
        if m["tree"] is None:
            y = _outputs(x, before, weight, bias, m["qsl"], m["owner"], m["read"], window, documents, **conv)
        else:
            y = _tree_outputs(x, before, weight, bias, m["owner"], m["within"], m["read"], m["tree"], window, **conv)
        counts = m["qsl"][1:] - m["qsl"][:-1]
        state = _state_after(rows, x, m["qsl"], counts)
        if m["starts"] is not None:
            state = _from_last_start(state, m["starts"], m["qsl"], m["owner"], m["within"])
        new_pool = write_slots(pool, m["write"], state)
        if m["blocks"] is not None:
            new_pool = _write_blocks(new_pool, rows, x, m["qsl"], m["read"], size, *m["blocks"])
        return y, new_pool

    # Without a tree of drafts, on a TPU (or named): the decode kernel where each request
    # has one token (without prefix caching, accepted drafts or positions), the mixed step's
    # kernel otherwise (not with both accepted drafts and positions); checked at run time,
    # with the composition where the kernels' DMAs would not give its pool or a row's
    # accepted tokens are not a chain.
    mixed = decode = None
    if tree is None and (starts is None or path is None):
        # The kernels' slot codes (a request whose first token starts a document reads no
        # slot), and the slots of the block states this step crosses.
        fresh = fresh_rows(started, read)
        if starts is not None:
            fresh = fresh | (jnp.take(starts, jnp.minimum(qsl[:-1], x.shape[0] - 1)) & (qsl[1:] > qsl[:-1]))
        meta["codes"] = slot_codes(read, write, fresh, slots)
        crossed = None if blocks is None else _crossings(qsl, read, *blocks)[1]
        problem = problem_of(x[None], weight, bias, None, pool, activation=activation, dilation=dilation)
        if state_len > 0 and tpu_kernel_taken(problem, implementation, interpret):
            meta["shifts"] = None if path is None else _history_shifts(path, state_len, window)
            meta["cached"] = None if blocks is None else (crossed, blocks[2])
            meta["limits"] = None if starts is None else _limits(starts, within)
            mixed = _mixed_step(composed, size, problem, interpret)
        if blocks is None and path is None and starts is None and x.shape[0] == requests:
            problem = problem_of(x[:, None], weight, bias, None, pool, activation=activation, dilation=dilation)
            if one_launch(problem, implementation, interpret, state_len):
                decode = _decode(problem, implementation, interpret)
    if mixed is None and decode is None:
        return composed(x, pool, weight, bias, meta)
    refused = None
    if write_indices is not None or blocks is not None or path is not None:
        refused = _kernels_refuse(qsl, read, meta["codes"], crossed, slots, path, separate=write_indices is not None)
    step = _dispatch(refused, jnp.all(qsl[1:] - qsl[:-1] == 1), composed, mixed, decode)
    if implementation is None:
        return lax.platform_dependent(x, pool, weight, bias, meta, tpu=step, default=composed)
    return step(x, pool, weight, bias, meta)


def _dispatch(refused, one_each, composed, mixed, decode):
    """The step as ``mixed`` or ``decode`` (``None``: not taken; one at least), chosen when
    it runs: the decode kernel where each request has one token (``one_each``), else the
    mixed step's kernel (the composition without it), and the composition wherever
    ``refused`` (``None``: nowhere)."""
    branches, index = [mixed or composed], jnp.int32(0)
    if decode is not None:
        branches.append(decode)
        index = jnp.where(one_each, len(branches) - 1, index)
    if refused is not None:
        branches.append(composed)
        index = jnp.where(refused, len(branches) - 1, index)

    def step(*args):
        return branches[0](*args) if len(branches) == 1 else lax.switch(index, branches, *args)

    return step


def _kernels_refuse(qsl, read, codes, crossed, slots: int, path=None, separate: bool = True):
    """Whether a step with ``write_indices``, prefix caching or accepted drafts (``path``)
    must run as the composition: a row's accepted tokens that are not a chain (a tree's
    path: its history is not its slot shifted), or slot DMAs that would not give the
    composition's pool: a request without tokens that copies its slot (or NaN, for an
    index outside the pool) to another (it has no token row to send a state from), a pad
    row with a slot to write, a slot written twice, or one written by one request and read
    by another (the kernels read and write in token order; the composition reads every
    slot first). ``codes``: :func:`~.update.slot_codes`'s; ``crossed``: the block states'
    slots (:func:`_crossings`) or ``None``; ``separate``: ``write_indices`` given."""
    reads, writes = codes
    counts = qsl[1:] - qsl[:-1]
    copies = (counts == 0) & (reads != ZEROS) & (writes >= 0) & (writes != reads)  # a slot or NaN to copy
    refused = jnp.any(copies) | jnp.any((read == PAD_SLOT_ID) & (writes >= 0))
    if path is not None:
        refused |= jnp.any((path >= 0) & (path != jnp.arange(path.shape[1])))
    if crossed is None and not separate:
        return refused  # each request writes the slot it reads, and no other
    requests = read.shape[0]
    targets = [jnp.where((counts > 0) | (reads == ZEROS), writes, -1)]  # zeros for a fresh one without tokens
    owners = [jnp.arange(requests)]
    if crossed is not None:
        targets.append(crossed.reshape(-1))
        owners.append(jnp.repeat(jnp.arange(requests), crossed.shape[1]))
    target, owner = jnp.concatenate(targets), jnp.concatenate(owners)
    # Up to COMPARE_PAIRS pairs of slot targets ((R * (1 + M))^2), compared pairwise.
    races = _races_pairwise if target.shape[0] ** 2 <= tpu_config.COMPARE_PAIRS else _races_counted
    return refused | races(target, owner, reads, slots)


def _races_pairwise(target, owner, reads, slots: int):
    """Whether a slot is written twice (``target (n,)``, ``-1``: nothing written) or written
    by one request (``owner (n,)``) and read by another (``reads (R,)``, the slot codes: a
    slot where ``>= 0``), comparing every pair: ``n * (n + R)`` compares."""
    del slots  # the targets are compared with each other, not counted per slot
    n, requests = target.shape[0], reads.shape[0]
    valid = (target >= 0)[:, None]
    twice = valid & (target[:, None] == target[None, :]) & (jnp.arange(n)[:, None] < jnp.arange(n)[None, :])
    other = valid & (target[:, None] == reads[None, :]) & (owner[:, None] != jnp.arange(requests)[None, :])
    return jnp.any(twice) | jnp.any(other)


def _races_counted(target, owner, reads, slots: int):
    """:func:`_races_pairwise`'s answer by two scatters over the pool's ``slots`` (writes
    counted, each slot's reader) and a gather: ``n + R`` updates."""
    index = jnp.where(target >= 0, target, slots)
    written = jnp.zeros((slots + 1,), jnp.int32).at[index].add(1)
    reader = jnp.full((slots + 1,), -1, jnp.int32).at[jnp.where(reads >= 0, reads, slots)].set(
        jnp.arange(reads.shape[0]))
    other = (target >= 0) & (reader[index] >= 0) & (reader[index] != owner)
    return jnp.any(written[:slots] > 1) | jnp.any(other)


def _history_shifts(path, state_len: int, window: int):
    """``(R,)`` int32: how many rows before its slot's last a row's history ends, when its
    accepted tokens ``path`` are a chain (``0 .. a - 1``): ``state_len - (window - 1 + a)``."""
    return (state_len - (window - 1) - jnp.sum(path >= 0, axis=1)).astype(jnp.int32)


def _mixed_step(composed, size, problem, interpret):
    """The step as the mixed step's kernel (:func:`~.pallas_mosaic_tpu.step`), differentiated
    through ``composed``: both functions of ``(x, pool, weight, bias, meta)``, ``meta`` the
    step's traced metadata (:func:`causal_conv1d_step`'s), here with the rows' slot
    ``codes`` (:func:`~.update.slot_codes`), prefix caching's ``cached`` block states
    (crossed block states' slots ``(R, M)``, ``num_computed_tokens``) or ``None`` with
    ``size`` (``K``), the ``shifts`` of each slot's history's end before its last row
    (:func:`_history_shifts`) or ``None``, and the ``limits`` of how far back each token
    reads (:func:`_limits`) or ``None``."""

    @jax.custom_vjp
    def launch(x, pool, weight, bias, meta):
        owner, within = meta["owner"].astype(jnp.int32), meta["within"].astype(jnp.int32)
        optional = [*(meta["cached"] or ()), *(a for a in (meta["shifts"], meta["limits"]) if a is not None)]
        operands = (x, pool, weight, *(() if bias is None else (bias,)), meta["qsl"], *meta["codes"], owner, within,
                    *optional)
        return tuple(bind(SERVING.flavour(MIXED), *operands, problem=problem, interpret=bool(interpret),
                          size=None if meta["cached"] is None else size, shifted=meta["shifts"] is not None,
                          positioned=meta["limits"] is not None))

    def launch_fwd(*args):
        return launch(*args), args

    def launch_bwd(args, cotangents):
        *operands, meta = args
        return (*jax.vjp(lambda *a: composed(*a, meta), *operands)[1](cotangents), None)

    launch.defvjp(launch_fwd, launch_bwd)
    return launch


def _mixed_rule(prim, platform: str, *, problem, interpret: bool, size, shifted: bool, positioned: bool):
    """:data:`MIXED`'s lowering (every platform: the primitive is bound only where the
    kernel runs): the mixed step's kernel on the channels it is given (one device's, where
    they are split)."""
    del platform

    def fn(x, pool, weight, bias, qsl, reads, writes, owner, within, *rest, problem):
        rest = list(rest)
        blocks = (size, rest.pop(0), rest.pop(0)) if size is not None else None
        shifts = rest.pop(0) if shifted else None
        limits = rest.pop(0) if positioned else None
        return tpu.step(x, pool, weight, bias, qsl, reads, writes, owner, within, problem=problem,
                        interpret=interpret, blocks=blocks, shifts=shifts, limits=limits)

    return serving_rule(prim, fn, problem)


# The mixed step's kernel: operands (x, pool, weight, [bias,] qsl, reads, writes, owner,
# within, [crossed, computed,] [shifts,] [limits]), results (y, pool); params problem,
# interpret, size (K with prefix caching's block states, else None), shifted, positioned.
MIXED = serving_primitive("causal_conv1d_mixed_step", _mixed_rule)


def _decode(problem, implementation, interpret):
    """The step as the TPU's decode kernel (:func:`~.update.decode_launch`), for steps of
    one token a request (``T == R``)."""
    def kernel(x, pool, weight, bias, meta):
        y, pool = decode_launch(x[:, None], pool, weight, bias, meta["read"], meta["write"], meta["started"],
                                problem=problem, implementation=implementation, interpret=interpret)
        return y[:, 0], pool

    return kernel


# --------------------------------------------------------------------------- the step


def _owners(qsl: jax.Array, tokens: int) -> jax.Array:
    """``(T,)`` int32: the request owning each token, ``R`` for the padding after the last: how
    many requests end at or before it (every token against every end, up to
    ``COMPARE_PAIRS`` pairs; else a scatter and a cumulative sum; no search loop)."""
    if tokens * (qsl.shape[0] - 1) <= tpu_config.COMPARE_PAIRS:
        return jnp.sum(qsl[None, 1:] <= jnp.arange(tokens)[:, None], axis=1, dtype=jnp.int32)
    ends = jnp.zeros((tokens + 1,), jnp.int32).at[jnp.minimum(qsl[1:], tokens)].add(1)
    return jnp.cumsum(ends)[:tokens]


def _documents(starts, qsl, owner) -> jax.Array:
    """``(T,)`` int32: each token's document within its request, 0 for the one its slot
    holds, counting the document starts (``starts``, position 0) from the request's first token."""
    counted = jnp.cumsum(starts.astype(jnp.int32))
    before = jnp.concatenate([jnp.zeros((1,), jnp.int32), counted])[qsl[:-1]]  # (R,): starts before each request
    return counted - jnp.take(before, jnp.minimum(owner, qsl.shape[0] - 2))


def _limits(starts, within) -> jax.Array:
    """``(T,)`` int32: how far back each token may read, with ``positions``: to its request's
    last document start at or before it (``t`` minus that start's token), or ``2^30`` where
    its request has none up to it (it reads its slot's inputs, the request's first document)."""
    t = jnp.arange(starts.shape[0], dtype=jnp.int32)
    last = lax.cummax(jnp.where(starts, t, -1), axis=0)  # the last start at or before each token, in any request
    return jnp.where(last >= t - within, t - last, 1 << 30).astype(jnp.int32)


def _from_last_start(state, starts, qsl, owner, within):
    """``state (R, state_len, D)`` (the last inputs of each request's slot ++ tokens) with zeros
    before the request's last document start among its tokens (none: unchanged)."""
    requests, state_len = state.shape[:2]
    last = jnp.full((requests,), -1, jnp.int32).at[owner].max(jnp.where(starts, within, -1), mode="drop")
    counts = qsl[1:] - qsl[:-1]
    # In the state's coordinates: entry j holds (slot ++ tokens)[counts + j]; the start is at state_len + last.
    q = counts[:, None] + jnp.arange(state_len)
    keep = (last[:, None] < 0) | (q >= state_len + last[:, None])
    return jnp.where(keep[..., None], state, jnp.zeros((), state.dtype))


def _outputs(x, before, weight, bias, qsl, owner, read, window: int, documents=None, **conv):
    """``y (T, D)``: ``causal_conv1d`` on the extended sequence, request ``r``'s ``window``
    state inputs before its tokens, its index as their segment id (``-1`` for pad rows and
    padding: zero outputs, read by nobody). With ``documents`` (each token's document
    within its request, 0 the slot's), request ``r``'s document ``k`` gets id
    ``r * (T + 1) + k``, its state ``r * (T + 1)``."""
    tokens, requests = x.shape[0], before.shape[0]
    extended = tokens + requests * window
    stride = 1 if documents is None else tokens + 1
    # Token t of request r sits after the r + 1 states before it; padding tokens go nowhere.
    at = jnp.where(owner < requests, jnp.arange(tokens) + (owner + 1) * window, extended)
    ids = jnp.where(owner < requests, owner * stride + (0 if documents is None else documents), -1)
    ids = jnp.where(jnp.take(read, jnp.minimum(owner, requests - 1)) == PAD_SLOT_ID, -1, ids)
    state_at = (qsl[:-1] + jnp.arange(requests) * window)[:, None] + jnp.arange(window)  # (R, window)
    state_ids = jnp.where(read == PAD_SLOT_ID, -1, jnp.arange(requests) * stride)
    state_ids = jnp.broadcast_to(state_ids[:, None], state_at.shape)
    xe = jnp.zeros((extended, x.shape[1]), x.dtype).at[state_at.reshape(-1)].set(before.reshape(-1, x.shape[1]))
    xe = xe.at[at].set(x, mode="drop")
    ide = jnp.full((extended,), -1, jnp.int32).at[state_at.reshape(-1)].set(state_ids.reshape(-1))
    ide = ide.at[at].set(ids.astype(jnp.int32), mode="drop")
    ye = causal_conv1d(xe[None], weight, bias, segment_ids=ide[None], **conv)[0]
    y = jnp.take(ye, jnp.minimum(at, extended - 1), axis=0)
    return jnp.where((ids >= 0)[:, None], y, jnp.zeros((), y.dtype))


def _tree_outputs(x, before, weight, bias, owner, within, read, parents, window: int, **conv):
    """``y (T, D)`` for tokens whose predecessors are named by ``parents`` (a draft tree):
    each token's window (its ``window`` nearest ancestors, then the slot's last inputs,
    zeros before them) gathered into a row of ``window + 1`` inputs, one ``causal_conv1d``
    over those rows, each row's last output. Padding tokens and pad rows give zeros."""
    tokens, requests = x.shape[0], before.shape[0]
    held = requests * window  # the slots' inputs first, then the tokens, then one zero and one NaN
    zero, nan = held + tokens, held + tokens + 1
    d = x.shape[1]
    inputs = jnp.concatenate([before.reshape(held, d), x, jnp.zeros((1, d), x.dtype), jnp.full((1, d), jnp.nan, x.dtype)])
    row = jnp.minimum(owner, requests - 1)
    first = held + jnp.arange(tokens) - within  # each token's request's first token, in ``inputs``
    previous_of_token = jnp.where(parents >= 0, first + parents, row * window + window - 1)
    # An unchecked parent outside its row (traced, no checkify) reads NaN, so the bug shows,
    # and never another request's token.
    previous_of_token = jnp.where((parents >= -1) & (parents < within), previous_of_token, nan)
    entry = jnp.arange(held)
    previous_of_entry = jnp.where(entry % window > 0, entry - 1, zero)
    previous = jnp.concatenate([previous_of_entry, previous_of_token, jnp.array([zero, nan])])
    chain = [held + jnp.arange(tokens)]
    for _ in range(window):  # static: one gather of T indices per step back
        chain.append(jnp.take(previous, chain[-1]))
    windows = jnp.take(inputs, jnp.stack(chain[::-1], axis=1), axis=0)  # (T, window + 1, D)
    y = causal_conv1d(windows, weight, bias, **conv)[:, -1]
    kept = (owner < requests) & (jnp.take(read, row) != PAD_SLOT_ID)
    return jnp.where(kept[:, None], y, jnp.zeros((), y.dtype))


def _valid_history(rows, path, window: int):
    """The slots with their valid inputs moved to the end (zeros before): after a step of
    ``1 + k`` tokens whose accepted ones are ``path (R, k + 1)`` (indices, then ``-1``), the
    valid history is the slot's first ``window - 1`` inputs (before that step's tokens),
    then its inputs ``window - 1 + path``, of the ``state_len = window + k`` it holds."""
    state_len = rows.shape[1]
    valid = window - 1 + jnp.sum(path >= 0, axis=1)  # (R,)
    j = jnp.arange(state_len)[None, :] - (state_len - valid)[:, None]  # index in the valid history
    on_path = jnp.take_along_axis(path, jnp.clip(j - (window - 1), 0, path.shape[1] - 1), axis=1)
    source = jnp.where(j < window - 1, j, window - 1 + on_path)
    moved = jnp.take_along_axis(rows, jnp.clip(source, 0, state_len - 1)[..., None], axis=1)
    return jnp.where((j >= 0)[..., None], moved, jnp.zeros((), rows.dtype))


def _state_after(rows, x, qsl, consumed):
    """``(R, state_len, D)`` in the pool's dtype: the last ``state_len`` inputs of each request's
    sequence once it has consumed ``consumed[r]`` of its tokens of the step: the slot's
    inputs, then its tokens."""
    state_len = rows.shape[1]
    q = consumed[:, None] + jnp.arange(state_len)  # in (slot ++ tokens) coordinates
    from_rows = jnp.take_along_axis(rows, jnp.minimum(q, state_len - 1)[..., None], axis=1)
    token = jnp.clip(qsl[:-1, None] + q - state_len, 0, x.shape[0] - 1)
    from_x = jnp.take(x, token, axis=0).astype(rows.dtype)
    return jnp.where((q < state_len)[..., None], from_rows, from_x)


def _crossings(qsl, read, size: int, slots, computed):
    """``(consumed, targets)``, ``(R, M)`` each: of this step's tokens, how many each request
    has consumed at the end of block ``m``, and the slot its state goes to there where the
    step crosses that boundary (``-1`` elsewhere, for a pad row, and for a block not
    cached)."""
    counts = qsl[1:] - qsl[:-1]
    boundary = (jnp.arange(slots.shape[1]) + 1) * size  # tokens consumed at the end of block m
    consumed = boundary[None, :] - computed[:, None]
    crossed = (consumed > 0) & (consumed <= counts[:, None]) & (read != PAD_SLOT_ID)[:, None] & (slots >= 0)
    return consumed, jnp.where(crossed, slots, -1).astype(jnp.int32)


def _write_blocks(pool, rows, x, qsl, read, size: int, slots, computed):
    """The pool with each request's state after every block boundary this step crosses,
    written to the slot named for that block."""
    consumed, target = _crossings(qsl, read, size, slots, computed)
    for m in range(slots.shape[1]):  # M is static and small: one gather-scatter each
        pool = write_slots(pool, target[:, m], _state_after(rows, x, qsl, jnp.clip(consumed[:, m], 0, None)))
    return pool


# --------------------------------------------------------------------------- checks


def _check_pool(pool, window: int, d: int, dtype) -> tuple[int, int]:
    shape = tuple(pool.shape)
    if len(shape) != 3 or shape[2] != d or shape[1] < window:
        raise OP.value(
            f"pool must be (S, state_len, D) with state_len >= (W - 1) * dilation = {window} and D = {d}, got {shape}"
        )
    if np.dtype(pool.dtype).kind != "f" or jnp.promote_types(dtype, pool.dtype) != np.dtype(pool.dtype):
        check_dtype(OP, "pool", pool, dtype, hint=" (or a wider float dtype that holds x's values exactly)")
    return shape[0], shape[1]


def _check_query_start_loc(qsl, tokens: int):
    if not isinstance(qsl, (jax.Array, jax.ShapeDtypeStruct)):
        qsl = jnp.asarray(qsl)
    if np.dtype(qsl.dtype).kind not in "iu" or qsl.ndim != 1 or qsl.shape[0] < 2:
        raise OP.value(
            f"query_start_loc must be (R + 1,) integers, R >= 1 requests, got shape {tuple(qsl.shape)} of "
            f"{np.dtype(qsl.dtype)}"
        )
    OP.check((qsl[0] == 0) & jnp.all(qsl[1:] >= qsl[:-1]) & (qsl[-1] <= tokens),
             f"query_start_loc must start at 0, never decrease and end at most at T = {tokens} (the tokens of x), "
             "got {query_start_loc}", query_start_loc=qsl)
    return qsl.astype(jnp.int32)


def _check_positions(positions, tokens: int, blocks):
    if blocks is not None:
        raise OP.value("positions with block_size: prefix caching counts a request's tokens as one document; pass "
                       "one or the other")
    with OP.words():
        positions = as_segment_ids(positions, (tokens,), "x's shape without D, (T,)", name="positions")
    OP.check(positions >= 0, "positions must be non-negative (the step's padding is the tokens after "
             "query_start_loc[-1] and the pad rows), got {positions}", positions=positions)
    return positions == 0


def _check_acceptance(accepted, path, requests: int, state_len: int, window: int):
    """``(R, k + 1)`` int32: each row's accepted tokens of the previous step (``-1`` after),
    from ``num_accepted_tokens`` (a chain: ``arange(a)``) or ``accepted_path``; or ``None``."""
    most = state_len - window + 1
    if accepted is not None and path is not None:
        raise OP.value("num_accepted_tokens and accepted_path say the same thing (for a chain of drafts and for a "
                       "tree); pass one")
    if accepted is not None:
        accepted = check_row_values("num_accepted_tokens", accepted, requests, "iu", OP)
        OP.check((accepted >= 1) & (accepted <= most),
                 f"num_accepted_tokens must be in [1, state_len - (W - 1) * dilation + 1] = [1, {most}] (the slot "
                 f"holds {state_len - window} draft positions beyond the window), got {{num_accepted_tokens}}",
                 num_accepted_tokens=accepted)
        index = jnp.arange(most, dtype=jnp.int32)
        return jnp.where(index[None, :] < accepted.astype(jnp.int32)[:, None], index[None, :], -1)
    if path is None:
        return None
    path = jnp.asarray(path)
    if path.ndim != 2 or path.shape != (requests, most) or np.dtype(path.dtype).kind != "i":
        raise OP.value(f"accepted_path must be (R, state_len - (W - 1) * dilation + 1) = ({requests}, {most}) signed "
                       f"integers, got shape {tuple(path.shape)} of {np.dtype(path.dtype)}")
    valid = path >= 0
    prefix = valid[:, :-1] | ~valid[:, 1:]  # no index after a -1
    increasing = (path[:, 1:] > path[:, :-1]) | ~valid[:, 1:]
    OP.check((path >= -1) & (path < most) & valid[:, :1] & jnp.pad(prefix & increasing, ((0, 0), (1, 0)),
                                                                    constant_values=True),
             f"accepted_path must hold, per row, increasing indices in [0, {most}) (the accepted tokens of the "
             "previous step, at least one), then -1; got {accepted_path}", accepted_path=path)
    return path.astype(jnp.int32)


def _check_parents(parents, owner, within, requests: int, blocks, starts):
    if blocks is not None or starts is not None:
        raise OP.value("parents (a tree of drafts) with block_size or positions: prefix caching and documents count "
                       "a request's tokens as a chain; pass one or the other")
    parents = jnp.asarray(parents)
    if tuple(parents.shape) != tuple(owner.shape) or np.dtype(parents.dtype).kind != "i":
        raise OP.value(f"parents must be (T,) = {tuple(owner.shape)} signed integers (-1: the slot's inputs), got "
                       f"shape {tuple(parents.shape)} of {np.dtype(parents.dtype)}")
    OP.check((owner >= requests) | ((parents >= -1) & (parents < within)),
             "parents must name, for each token of a request, an earlier token of it (its index among the "
             "request's tokens) or -1 (the slot's inputs), got {parents}", parents=parents)
    return parents.astype(jnp.int32)


def _check_blocks(block_size, block_indices, num_computed_tokens, requests: int, slots: int):
    if block_size is None:
        if block_indices is not None or num_computed_tokens is not None:
            raise OP.value("block_indices and num_computed_tokens are for prefix caching: pass block_size too")
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise OP.value(f"block_size must be a positive int, got {block_size!r}")
    if block_indices is None or num_computed_tokens is None:
        raise OP.value("block_size needs block_indices (R, M) and num_computed_tokens (R,)")
    block_indices = jnp.asarray(block_indices)
    if block_indices.ndim != 2 or block_indices.shape[0] != requests or np.dtype(block_indices.dtype).kind != "i":
        raise OP.value(f"block_indices must be (R, M) = ({requests}, M) signed integers, got shape "
                       f"{tuple(block_indices.shape)} of {np.dtype(block_indices.dtype)}")
    OP.check((block_indices == PAD_SLOT_ID) | ((block_indices >= 0) & (block_indices < slots)),
             f"block_indices must be slots of the pool, in [0, {slots}), or {PAD_SLOT_ID} for a block not cached; "
             "got {block_indices}", block_indices=block_indices)
    computed = check_row_values("num_computed_tokens", num_computed_tokens, requests, "iu", OP)
    return int(block_size), block_indices.astype(jnp.int32), computed.astype(jnp.int32)
