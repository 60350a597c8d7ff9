"""vLLM's ``causal_conv1d_fn`` and ``causal_conv1d_update`` in JAX: its names, layouts, defaults and pool.

Code that calls vLLM's Mamba / short-conv ops ports by its import line::

    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update  # PyTorch
    from maskconv_kernels.compat.vllm import causal_conv1d_fn, causal_conv1d_update                       # JAX

and by taking the pool each call returns, since a JAX array cannot be written in place::

    out, conv_states = causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, ...)     # was: out = ...
    out, conv_state = causal_conv1d_update(x, conv_state, weight, bias, activation, ...)         # was: out = ...

Layouts are vLLM's logical shapes (JAX has no strides): ``weight (dim, W)``, the pool
``(N, dim, S)`` with ``S >= W - 1`` (vLLM's kernels take its SD cache as
``kv_cache.transpose(-1, -2)``: a port swaps those axes both ways), the prefill's ``x (dim,
T)``, the update's ``x (B, dim)``, ``(B, dim, L)`` or, with ``query_start_loc``, ``(T,
dim)``. The semantics are those of vLLM's ``vllm/model_executor/layers/mamba/ops/causal_conv1d.py``
(read at vllm-project/vllm@03c6dad): a row whose slot is ``pad_slot_id`` is padding (zero
outputs, nothing read or written); ``has_initial_state`` false starts a request fresh;
prefix caching (APC) writes the state at every block boundary a prefill chunk crosses to
the block's slot; speculative decoding keeps a sliding window that ``num_accepted_tokens``
reads from. The full contract is in each function's docstring.

Both run on :func:`maskconv_kernels.causal_conv1d_step`, the library's scheduler step:
each row's window (the ``W - 1`` state columns it reads) is gathered from the pool into a
pool of one slot per row in the library's ``(R, W - 1, dim)`` layout, the step computes
every output on one extended sequence (each request its own document: no value crosses
rows) and each row's end state, and the states are scattered back into the columns vLLM
writes. vLLM's APC block states (indexed by scheduled block, not by the step's absolute
block number) and its speculative sliding window (left-aligned, the window without its
oldest entry then every token; the step keeps a right-aligned one) are slices of each row's
window and tokens, gathered here with one gather and one scatter each, for all rows and
blocks (copies, so bit for bit). The pool itself is never transposed: the rows' columns are read and written
with one gather and one scatter each, whose windows run along ``dim`` (stride ``S`` in the
``(N, dim, S)`` layout; a JAX-native port would keep the pool as ``(N, S, dim)`` and call
``causal_conv1d_step`` directly). The library's contract holds through them: a slot not
read (no initial state, padding) is never multiplied, only selected away, so NaN in another
row's tokens, a pad row, an unused slot or an unused column reaches no output and no state.

Where this differs from vLLM, on purpose:

* Each function returns ``(out, new_conv_states)``: nothing is written in place (under
  ``jax.jit(..., donate_argnums=...)`` XLA reuses the pool's buffer). Every pool element
  not written below is bit-identical to the input.
* Under APC, a prefill chunk shorter than ``W - 1`` writes its end state to the write slot
  (``block_idx_last_scheduled_token``) and leaves the read slot, a possibly shared prefix
  block, as it was: vLLM at 03c6dad writes it to the read slot (vLLM#56196, whose fix is
  this behaviour).
* A varlen update (``query_start_loc``) without ``num_accepted_tokens`` is right for rows of
  any length up to ``max_query_len``; vLLM's kernel is right only for rows of exactly
  ``max_query_len`` tokens (``validate_data=True`` refuses the others, so a program tested
  here also runs there).
* Any width ``W >= 2`` (vLLM's Triton prefill takes 2 to 4, its update 2 to 6), any ``dim``,
  any integer dtype (signed for slots). ``cache_indices=None`` means row ``i`` uses slot
  ``i``, and ``has_initial_state=None`` that no row has an initial state (vLLM's prefill
  kernel needs both arrays). Tokens before ``query_start_loc[0]`` belong to no row: zeros.
* An ``activation`` other than ``None``, ``False``, ``True``, ``"silu"`` or ``"swish"`` raises
  (vLLM's prefill runs it as the identity, its update asserts).
* The prefix-caching arguments (``initial_state_idx``, ``block_idx_first_scheduled_token``,
  ``num_computed_tokens``) without ``block_idx_last_scheduled_token``, which turns APC on,
  raise instead of being ignored.
* Concrete index arrays are always checked (slots in the pool, ``query_start_loc``
  non-decreasing, ...), traced ones under ``jax.experimental.checkify``, as everywhere in
  this library. ``validate_data=True`` also checks what vLLM's kernels need and this face
  does not (its widths, ``block_size_to_align`` a multiple of 8, ``pad_slot_id`` given,
  varlen rows of ``max_query_len`` tokens), so that a call that passes here runs there.
* ``metadata`` (vLLM's precomputed Triton launch grid) is accepted and unused: there is no
  grid to launch.
* ``retrieve_parent_token (B, L)`` (EAGLE draft trees): each token after a row's first
  convolves along its parent chain, then the window, as vLLM's kernel walks it, for any
  width (vLLM's: 2 to 4); the states are written as without it. A parent that is not an
  earlier token of the row (vLLM's kernel would read outside the row) is refused.
* Derivatives are JAX's, with respect to ``x``, ``weight``, ``bias`` and the pool; an
  output's gradient is exactly zero at every pool element and token it does not read.

Each call checks its arguments on the host (concrete index arrays with NumPy, before
anything runs), then runs one compiled program per shape and static arguments (inlined
into the caller's program under ``jax.jit``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._core.args import as_operand, is_int
from .._core.errors import OpError
from ..ops.causal_conv1d import PAD_SLOT_ID as STEP_PAD, causal_conv1d_step

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "PAD_SLOT_ID"]

# vLLM's PAD_SLOT_ID (vllm.attention.backends.utils), and this library's.
PAD_SLOT_ID = -1

FN = OpError("compat.vllm.causal_conv1d_fn")
UPDATE = OpError("compat.vllm.causal_conv1d_update")

# vLLM's own limits, checked with validate_data=True only: the widths its Triton kernels
# take, and the tile its prefill's APC block boundaries must be a multiple of (BLOCK_M).
VLLM_WIDTHS = {"causal_conv1d_fn": (2, 4), "causal_conv1d_update": (2, 6)}
VLLM_BLOCK_M = 8


def causal_conv1d_fn(
    x: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None,
    conv_states: jax.typing.ArrayLike,
    query_start_loc: jax.typing.ArrayLike,
    cache_indices: jax.typing.ArrayLike | None = None,
    has_initial_state: jax.typing.ArrayLike | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int | None = PAD_SLOT_ID,
    block_idx_first_scheduled_token: jax.typing.ArrayLike | None = None,
    block_idx_last_scheduled_token: jax.typing.ArrayLike | None = None,
    initial_state_idx: jax.typing.ArrayLike | None = None,
    num_computed_tokens: jax.typing.ArrayLike | None = None,
    block_size_to_align: int = 0,
    metadata=None,
    validate_data: bool = False,
    *,
    implementation: str | None = None,
    interpret: bool = False,
):
    """vLLM's prefill / chunked prefill over a pool of states: ``(out, new_conv_states)``.

    Request ``i`` owns tokens ``x[:, qsl[i]:qsl[i + 1]]`` (``n`` of them, 0 allowed). With its
    window ``h (dim, W - 1)`` (the read slot's columns ``0:W-1`` if ``has_initial_state[i]``,
    else zeros: the slot is not read) and ``u = h ++ tokens``, its outputs are ``act(bias +
    sum_k weight[:, k] * u[t + k])`` (products summed in float32, bias and SiLU in float32,
    one rounding), and its end state ``u[n:n + W - 1]`` goes to the write slot's columns
    ``0:W-1`` (columns beyond are untouched). A row with no token writes nothing.

    Prefix caching (APC, on iff ``block_idx_last_scheduled_token`` is given): with ``B =
    block_size_to_align``, ``c0 = num_computed_tokens[i]``, ``f`` / ``l`` the row's first /
    last scheduled block, ``e = c0 + n`` and ``P = B * floor((e - 1) / B)`` (the last block
    boundary before ``e``), the state at each boundary ``p_j = P - (l - f - 1 - j) * B``, ``j
    = 0 .. l - f - 1`` (the ``W - 1`` inputs before sequence position ``p_j``: ``u[p_j - c0 :
    p_j - c0 + W - 1]``) goes to slot ``cache_indices[i, f + j]``, columns ``0:W-1``. With
    vLLM's scheduler metadata (``f = c0 // B``, ``l = (e - 1) // B``) block ``k`` holds the
    state after ``(k + 1) * B`` tokens and the last block the end state. Every ``p_j`` must
    exceed ``c0`` (checked).

    Args:
      x: ``(dim, T)``: the tokens of all requests back to back, then any padding; float.
        Rounded to the pool's dtype first, as vLLM's ``x.to(conv_states.dtype)``.
      weight: ``(dim, W)``, ``W >= 2``; may be wider than the pool (float32 weights).
      bias: ``(dim,)`` or ``None``.
      conv_states: the pool, ``(N, dim, S)``, ``S >= W - 1``, of a float dtype.
      query_start_loc: ``(R + 1,)`` integers, non-decreasing, at most ``T``; ``R`` static.
      cache_indices: ``None`` (row ``i`` uses slot ``i``), ``(R,)`` slots, or ``(R, M)``
        block tables (without APC a row uses column 0). Signed integers; may be traced.
      has_initial_state: ``(R,)`` bools or ``None`` (no row has one).
      activation: ``None`` or ``False`` (identity), ``"silu"``, ``"swish"`` or ``True`` (SiLU).
      pad_slot_id: static: a row whose read slot is this is padding (zero outputs, reads and
        writes nothing). ``None``: no row is.
      block_idx_first_scheduled_token, block_idx_last_scheduled_token: ``(R,)`` columns of
        ``cache_indices``: the first block to fill and the one that receives the end state.
      initial_state_idx: ``(R,)`` under APC: the column whose slot the row reads.
      num_computed_tokens: ``(R,)`` under APC: the request's tokens before this chunk.
      block_size_to_align: static: ``B``, positive under APC.
      metadata: vLLM's precomputed Triton grid: accepted, unused (there is no grid here).
      validate_data: also check what vLLM's kernels need and this face does not (the
        module's docstring lists it).
      implementation, interpret: as in :func:`maskconv_kernels.causal_conv1d`.

    Returns:
      ``out (dim, T)`` in x's dtype (zeros for padding, pad rows and tokens of no row), and
      the new pool, shaped and typed as ``conv_states``.

    Raises:
      ValueError, TypeError: bad arguments, naming the argument.
      NotImplementedError: ``implementation`` does not take this problem.
    """
    del metadata  # the launch grid vLLM's Triton kernel would use: nothing to launch here
    activation = _activation(FN, activation)
    x, weight, pool = as_operand("x", x), as_operand("weight", weight), as_operand("conv_states", conv_states)
    bias = None if bias is None else as_operand("bias", bias)
    if x.ndim != 2:
        raise FN.value(
            f"x must be (dim, T), the tokens of all requests back to back, channels first as vLLM's "
            f"causal_conv1d_fn takes them, got shape {tuple(x.shape)}" + (
                " (a batch of (batch, dim, seqlen) rows is causal-conv1d's layout: maskconv_kernels.compat."
                "causal_conv1d)" if x.ndim == 3 else "")
        )
    dim, tokens = (int(n) for n in x.shape)
    width = _check_operands(FN, x, weight, bias, dim, "(dim, T)")
    _check_pool(FN, "conv_states", pool, dim, width - 1)
    if validate_data:
        _check_vllm_width(FN, "causal_conv1d_fn", width)
    qsl = _check_query_start_loc(FN, query_start_loc, tokens)
    rows = qsl.shape[0] - 1
    counts = qsl[1:] - qsl[:-1]
    apc = block_idx_last_scheduled_token is not None
    if not apc and (block_idx_first_scheduled_token is not None or num_computed_tokens is not None):
        raise FN.value(
            "block_idx_first_scheduled_token and num_computed_tokens are for prefix caching (APC), which "
            "block_idx_last_scheduled_token turns on: pass it too, or drop them"
        )
    read, write, live, table = _rows(FN, "cache_indices", cache_indices, rows, int(pool.shape[0]), pad_slot_id,
                                     block_idx_last_scheduled_token, initial_state_idx)
    _check_distinct_writes(FN, write, live & (counts > 0), pad_slot_id)
    blocks, block_size = None, 0
    if apc:
        block_size, blocks = _check_blocks(FN, rows, block_size_to_align, block_idx_first_scheduled_token,
                                           block_idx_last_scheduled_token, num_computed_tokens, counts, live,
                                           validate_data)
    fresh = None if has_initial_state is None else _per_row(FN, "has_initial_state", has_initial_state, rows, "b")
    return _prefill(x, weight, bias, pool, qsl, read, write, live, fresh, table, blocks, activation=activation,
                    pad_slot_id=pad_slot_id, block_size=block_size, implementation=implementation,
                    interpret=interpret)


def causal_conv1d_update(
    x: jax.typing.ArrayLike,
    conv_state: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    activation: str | bool | None = None,
    conv_state_indices: jax.typing.ArrayLike | None = None,
    num_accepted_tokens: jax.typing.ArrayLike | None = None,
    query_start_loc: jax.typing.ArrayLike | None = None,
    max_query_len: int = -1,
    pad_slot_id: int | None = PAD_SLOT_ID,
    block_idx_last_scheduled_token: jax.typing.ArrayLike | None = None,
    initial_state_idx: jax.typing.ArrayLike | None = None,
    retrieve_parent_token: jax.typing.ArrayLike | None = None,
    validate_data: bool = False,
    *,
    implementation: str | None = None,
    interpret: bool = False,
):
    """vLLM's decode / speculative verify step over a pool of states: ``(out, new_conv_state)``.

    Row ``i`` (``n`` tokens ``z``) reads the window ``h = read_slot[:, o:o + W - 1]``, ``o =
    num_accepted_tokens[i] - 1`` if given, else 0; with ``u = h ++ z`` its outputs are
    ``act(bias + sum_k weight[:, k] * u[t + k])`` (float32 sums, one rounding). Then:

    * without ``num_accepted_tokens``: ``write_slot[:, 0:W-1] = u[n:n + W - 1]`` (columns
      beyond untouched);
    * with it (vLLM's sliding window): ``write_slot[:, 0:W-2+n] = u[1:W-1+n]``, the window
      without its oldest entry, then all ``n`` tokens, accepted or not; columns beyond
      untouched. The next call with ``num_accepted_tokens = a`` (1 + the drafts accepted,
      ``1 <= a <= n``) then reads the ``W - 1`` inputs ending at this call's ``a``-th token, so
      a rejected draft is never read; ``a = 1`` is a plain step from a prefill's state.

    Under APC (``block_idx_last_scheduled_token`` given) the read slot is
    ``conv_state_indices[i, initial_state_idx[i]]`` and the write slot
    ``conv_state_indices[i, block_idx_last_scheduled_token[i]]``; the read slot is left as it
    was when they differ. A row with no token writes nothing.

    Args:
      x: ``(B, dim)`` one token a row, ``(B, dim, L)`` ``L`` tokens a row, or with
        ``query_start_loc`` ``(T, dim)``, row ``i`` owning ``x[qsl[i]:qsl[i + 1]]``; float,
        rounded to the pool's dtype first.
      conv_state: the pool, ``(N, dim, S)``, ``S >= W - 1``; with ``num_accepted_tokens``
        ``S >= W - 2 + L`` (``L``: x's seqlen or ``max_query_len``).
      weight, bias: ``(dim, W)``, ``(dim,)`` or ``None``.
      activation: ``None``/``False``, or ``"silu"``/``"swish"``/``True``.
      conv_state_indices: ``None`` (row ``i`` uses slot ``i``), ``(B,)``, or ``(B, M)`` block
        tables (column 0 without APC). Signed integers; may be traced.
      num_accepted_tokens: ``(B,)`` integers or ``None``: turns the sliding window on.
      query_start_loc: ``(B + 1,)`` integers or ``None`` (varlen ``x``).
      max_query_len: static, with ``query_start_loc``: at least every row's count (checked).
        ``-1``: unknown; the sliding window then spans the whole slot.
      pad_slot_id: static: a row whose read slot is this is padding. ``None``: no row is.
      block_idx_last_scheduled_token, initial_state_idx: ``(B,)`` columns of
        ``conv_state_indices`` (APC).
      retrieve_parent_token: ``(B, L)`` integers or ``None``, EAGLE draft trees: for each
        token after a row's first, the index of its parent among the row's tokens (column
        0 is not read); the token's window follows its parent chain, then the window read
        from the slot. The states are written as without it.
      validate_data: also check what vLLM's kernels need and this face does not.
      implementation, interpret: as in :func:`maskconv_kernels.causal_conv1d`.

    Returns:
      ``out`` shaped like ``x`` in x's dtype, and the new pool, shaped and typed as
      ``conv_state``.
    """
    activation = _activation(UPDATE, activation)
    x, weight, pool = as_operand("x", x), as_operand("weight", weight), as_operand("conv_state", conv_state)
    bias = None if bias is None else as_operand("bias", bias)
    varlen = query_start_loc is not None
    if not varlen and x.ndim not in (2, 3):
        raise UPDATE.value(
            f"x must be (B, dim) for one token a row or (B, dim, L), channels first as vLLM's causal_conv1d_update "
            f"takes them, or (T, dim) with query_start_loc; got shape {tuple(x.shape)}"
        )
    if varlen and x.ndim != 2:
        raise UPDATE.value(f"x must be (T, dim) with query_start_loc, the rows' tokens back to back, got shape "
                           f"{tuple(x.shape)}")
    dim = int(x.shape[1])
    width = _check_operands(UPDATE, x, weight, bias, dim, "(T, dim)" if varlen else "(B, dim[, L])")
    window = width - 1
    _check_pool(UPDATE, "conv_state", pool, dim, window)
    slot_len = int(pool.shape[2])
    if validate_data:
        _check_vllm_width(UPDATE, "causal_conv1d_update", width)
        if pad_slot_id is None:
            raise UPDATE.value("validate_data=True: vLLM's causal_conv1d_update asserts pad_slot_id is not None")
    if varlen:
        qsl = _check_query_start_loc(UPDATE, query_start_loc, int(x.shape[0]))
        longest = _check_max_query_len(UPDATE, max_query_len, qsl)
    else:
        length = 1 if x.ndim == 2 else int(x.shape[2])
        qsl = np.arange(int(x.shape[0]) + 1, dtype=np.int32) * length
        longest = length
    rows = qsl.shape[0] - 1
    counts = qsl[1:] - qsl[:-1]
    read, write, live, _ = _rows(UPDATE, "conv_state_indices", conv_state_indices, rows, int(pool.shape[0]),
                                 pad_slot_id, block_idx_last_scheduled_token, initial_state_idx)
    _check_distinct_writes(UPDATE, write, live & (counts > 0), pad_slot_id)
    if validate_data and varlen:
        if longest is None:
            raise UPDATE.value("validate_data=True: vLLM's causal_conv1d_update needs max_query_len with "
                               "query_start_loc (its kernel's seqlen)")
        if num_accepted_tokens is None:
            UPDATE.check(~live | (counts == longest) | (counts == 0),
                         f"validate_data=True: vLLM's kernel writes a wrong state for a varlen row of fewer than "
                         f"max_query_len = {longest} tokens without num_accepted_tokens; got rows of {{counts}} "
                         "tokens", counts=counts)
    span = None
    if num_accepted_tokens is None:
        offset = np.zeros((rows,), np.int32)
    else:
        span = slot_len - window + 1 if longest is None else longest  # the tokens a sliding window holds
        offset = _check_accepted(num_accepted_tokens, rows, live, counts, window, slot_len, span, width)
    parents = None
    if retrieve_parent_token is not None:
        if validate_data and width > 4:
            raise UPDATE.value(f"validate_data=True: vLLM's causal_conv1d_update walks draft trees for widths 2 to 4, "
                               f"got {width}")
        tokens = int(x.shape[0]) if varlen else int(x.shape[0]) * length
        parents = _tree_parents(retrieve_parent_token, qsl, tokens, rows, longest)
    return _decode(x, weight, bias, pool, qsl, read, write, live, offset, parents, activation=activation,
                   pad_slot_id=pad_slot_id, varlen=varlen, span=span, implementation=implementation,
                   interpret=interpret)


def _tree_parents(retrieve_parent_token, qsl, tokens: int, rows: int, longest: int | None) -> jax.Array:
    """``(T,)`` int32: each token's parent among its row's tokens (``-1``: the row's first, whose
    parent is the window), from vLLM's ``retrieve_parent_token (B, L)``, whose first column is
    not read; ``-1`` for tokens of no row."""
    parent = _integers(UPDATE, "retrieve_parent_token", retrieve_parent_token, "i")
    if parent.ndim != 2 or parent.shape[0] != rows or (longest is not None and parent.shape[1] < longest):
        raise UPDATE.value(f"retrieve_parent_token must be (B, L) = ({rows}, L), L >= every row's tokens, got shape "
                           f"{tuple(parent.shape)}")
    qsl = jnp.asarray(qsl, jnp.int32)
    t = jnp.arange(tokens, dtype=jnp.int32)
    row = jnp.searchsorted(qsl, t, side="right").astype(jnp.int32) - 1  # -1 before the first row, R after the last
    owned = (row >= 0) & (row < rows)
    r = jnp.clip(row, 0, rows - 1)
    j = t - jnp.take(qsl, r)
    named = jnp.asarray(parent, jnp.int32)[r, jnp.clip(j, 0, parent.shape[1] - 1)]
    drafts = owned & (j > 0)
    UPDATE.check(~drafts | ((named >= 0) & (named < j)),
                 "retrieve_parent_token must name, for each token after a row's first, an earlier token of its row "
                 "(vLLM's kernel walks to it), got {retrieve_parent_token}", retrieve_parent_token=parent)
    return jnp.where(drafts, named, -1)


# --------------------------------------------------------------------------- the compiled step
#
# One jit per call rather than dozens of eager operations (each compiled per shape) after
# the checks; under the caller's jit it is inlined.


@functools.partial(jax.jit, static_argnames=("activation", "pad_slot_id", "block_size", "implementation", "interpret"))
def _prefill(x, weight, bias, pool, qsl, read, write, live, fresh, table, blocks, *, activation, pad_slot_id,
             block_size, implementation, interpret):
    """``causal_conv1d_fn`` on checked arguments: ``(out (dim, T), new pool)``."""
    dim, window = x.shape[0], weight.shape[1] - 1
    rows = qsl.shape[0] - 1
    counts = qsl[1:] - qsl[:-1]
    xt = x.T.astype(pool.dtype)  # (T, dim): the step's layout, in the pool's dtype as vLLM's x.to(...)
    columns = jnp.broadcast_to(jnp.arange(window), (rows, window))
    if fresh is None:
        h = jnp.zeros((rows, window, dim), pool.dtype)  # no slot is read at all
    else:
        h = jnp.where(fresh[:, None, None], _read(pool, read, columns), jnp.zeros((), pool.dtype))  # selected
    y, end = _conv(xt, qsl, h, live, weight, bias, activation, implementation, interpret)
    new_pool = pool
    if blocks is not None:
        new_pool = _write_block_states(new_pool, table, block_size, *blocks, h, xt, qsl, counts, live, pad_slot_id)
    new_pool = _write(new_pool, write, columns, end, (live & (counts > 0))[:, None], pad_slot_id)
    return y.T.astype(x.dtype), new_pool


@functools.partial(jax.jit, static_argnames=("activation", "pad_slot_id", "varlen", "span", "implementation",
                                             "interpret"))
def _decode(x, weight, bias, pool, qsl, read, write, live, offset, parents, *, activation, pad_slot_id, varlen, span,
            implementation, interpret):
    """``causal_conv1d_update`` on checked arguments: ``(out like x, new pool)``. ``span``: the
    sliding window's tokens (``None``: no sliding window); ``parents``: a draft tree's
    (``None``: chains). A tree changes the outputs only: the states are written as vLLM's
    kernel writes them, the window and then the tokens in the row's order."""
    window = weight.shape[1] - 1
    rows, dim = qsl.shape[0] - 1, x.shape[1]
    counts = qsl[1:] - qsl[:-1]
    x3 = None if varlen else (x[..., None] if x.ndim == 2 else x)
    xt = x if varlen else jnp.swapaxes(x3, 1, 2).reshape(-1, dim)  # (T, dim): the step's layout
    xt = xt.astype(pool.dtype)  # vLLM's x.to(conv_state.dtype)
    h = _read(pool, read, offset[:, None] + jnp.arange(window))
    y, end = _conv(xt, qsl, h, live, weight, bias, activation, implementation, interpret, parents)
    writing = (live & (counts > 0))[:, None]
    if span is None:
        columns = jnp.broadcast_to(jnp.arange(window), (rows, window))
        new_pool = _write(pool, write, columns, end, writing, pad_slot_id)
    else:
        columns = jnp.broadcast_to(jnp.arange(window - 1 + span), (rows, window - 1 + span))
        shifted = _inputs(h, xt, qsl, columns + 1)  # u[1:]: the window without its oldest entry, then the tokens
        new_pool = _write(pool, write, columns, shifted, writing & (columns < window - 1 + counts[:, None]),
                          pad_slot_id)
    out = y.astype(x.dtype)
    if not varlen:
        out = jnp.swapaxes(out.reshape(x3.shape[0], x3.shape[2], dim), 1, 2)
        out = out[..., 0] if x.ndim == 2 else out
    return out, new_pool


def _conv(xt, qsl, h, live, weight, bias, activation, implementation, interpret, parents=None):
    """``(y (T, dim), end (R, W - 1, dim))`` by :func:`~maskconv_kernels.causal_conv1d_step`.

    ``h (R, W - 1, dim)`` (each row's window, already selected) is the step's pool, one slot
    a row; pad rows are the step's ``PAD_SLOT_ID`` rows (zero outputs, their slot never
    read). A leading pad request owns the tokens before ``qsl[0]``, so they are zeros too.
    ``end[r]`` is ``u[n:n + W - 1]``, the row's last inputs (copies, in the pool's dtype).
    """
    rows = h.shape[0]
    pad = jnp.full((1,), STEP_PAD, jnp.int32)
    slots = jnp.where(live, jnp.arange(rows, dtype=jnp.int32), STEP_PAD)
    return causal_conv1d_step(
        xt, h, weight.T, bias, query_start_loc=jnp.concatenate([jnp.zeros((1,), jnp.int32), qsl.astype(jnp.int32)]),
        state_indices=jnp.concatenate([pad, slots]), activation=activation, implementation=implementation,
        interpret=interpret, parents=parents,
    )


def _inputs(h, xt, qsl, positions):
    """``(R, C, dim)``: ``u[positions[r, c]]`` of each row, ``u = h[r] ++ its tokens``.

    A position past the row's tokens reads another row's token or padding (clipped): the
    caller writes none of those.
    """
    window, tokens = h.shape[1], xt.shape[0]
    from_h = jnp.take_along_axis(h, jnp.clip(positions, 0, window - 1)[..., None], axis=1)
    if tokens == 0:
        return from_h
    from_x = jnp.take(xt, jnp.clip(qsl[:-1, None] + positions - window, 0, tokens - 1), axis=0)
    return jnp.where((positions < window)[..., None], from_h, from_x)


def _write_block_states(pool, table, size: int, first, last, computed, h, xt, qsl, counts, live, pad_slot_id):
    """The pool with each row's state at every APC block boundary its chunk crosses.

    At most ``J = min(M, (T - 2) // B + 1)`` boundaries lie strictly inside a chunk of at most
    ``T`` tokens (the precondition ``p_j > c0``, checked), so ``J`` static columns hold them
    all: one gather and one scatter for every row and block.
    """
    rows, table_len = table.shape
    window, tokens = h.shape[1], xt.shape[0]
    most = min(table_len, (tokens - 2) // size + 1) if tokens >= 2 else 0
    if most == 0:
        return pool
    j = jnp.arange(most)
    filled = last - first
    boundary = size * ((computed + counts - 1) // size)  # P: the last block boundary before the chunk's end
    start = boundary[:, None] - (filled[:, None] - 1 - j) * size - computed[:, None]  # p_j - c0: where in u
    used = (live & (counts > 0))[:, None] & (j < filled[:, None]) & (start >= 1)
    slots = jnp.take_along_axis(table, jnp.clip(first[:, None] + j, 0, table_len - 1), axis=1)  # (R, J)
    states = _inputs(h, xt, qsl, (start[:, :, None] + jnp.arange(window)).reshape(rows, most * window))
    columns = jnp.broadcast_to(jnp.arange(window), (rows * most, window))
    return _write(pool, slots.reshape(-1), columns, states.reshape(rows * most, window, -1), used.reshape(-1, 1),
                  pad_slot_id)


def _read(pool, slots, columns):
    """``(R, C, dim)``: ``pool[slots[r], :, columns[r, c]]``, NaN where the slot or column is
    outside the pool (a traced index out of range shows in the outputs instead of reading
    another row's state). One gather whose windows run along ``dim``: no transpose."""
    n, _, length = pool.shape
    inside = (slots >= 0)[:, None] & (slots < n)[:, None] & (columns >= 0) & (columns < length)
    return pool.at[jnp.where(inside, slots[:, None], n), :, jnp.where(inside, columns, length)].get(
        mode="fill", fill_value=jnp.nan)


def _write(pool, slots, columns, values, where, pad_slot_id):
    """The pool with ``values[r, c] (dim,)`` at ``pool[slots[r], :, columns[r, c]]`` where
    ``where[r, c]`` (broadcast), the slot is in the pool and is not ``pad_slot_id``; every
    other element as it was, bit for bit (the rest of the scatter is dropped)."""
    n = pool.shape[0]
    ok = (slots >= 0) & (slots < n)
    if pad_slot_id is not None:
        ok = ok & (slots != pad_slot_id)
    target = jnp.where(where & ok[:, None], slots[:, None], n)  # n: outside the pool, dropped
    return pool.at[target, :, columns].set(values.astype(pool.dtype), mode="drop")


# --------------------------------------------------------------------------- checks
#
# Index arrays are checked where they are known: concrete ones on the host with NumPy
# (an error before anything runs), traced ones by OpError.check's checkify checks.


def _activation(op: OpError, activation) -> str | None:
    """vLLM's activations: ``True``, ``"silu"``, ``"swish"`` are SiLU; ``None``, ``False`` none."""
    if activation is True or (isinstance(activation, str) and activation in ("silu", "swish")):
        return "silu"
    if activation is None or activation is False:
        return None
    raise op.value(f"activation must be None, False, True, 'silu' or 'swish' (the last three: SiLU), got "
                   f"{activation!r}")


def _check_operands(op: OpError, x, weight, bias, dim: int, layout: str) -> int:
    """x a float array; ``weight (dim, W)``, ``W >= 2``; ``bias (dim,)``. Returns ``W``."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise op.type(f"x must hold floats, got dtype {np.dtype(x.dtype)}")
    shape = tuple(weight.shape)
    if len(shape) != 2 or shape[0] != dim or shape[1] < 2:
        hint = ""
        if len(shape) == 2 and shape[1] == dim:
            hint = " (maskconv_kernels.causal_conv1d's (W, dim) weight: pass weight.T)"
        raise op.value(f"weight must be (dim, W) = ({dim}, W >= 2) to match x of shape {tuple(x.shape)} read as "
                       f"{layout}, got {shape}{hint}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise op.value(f"bias must be (dim,) = ({dim},) or None, got {tuple(bias.shape)}")
    return shape[1]


def _check_pool(op: OpError, name: str, pool, dim: int, window: int) -> None:
    shape = tuple(pool.shape)
    if len(shape) != 3 or shape[1] != dim or shape[2] < window:
        raise op.value(
            f"{name} must be (N, dim, S) with dim = {dim} and S >= W - 1 = {window}, vLLM's layout (its SD cache "
            f"is passed as kv_cache.transpose(-1, -2): swap those axes), got {shape}"
        )
    if not jnp.issubdtype(pool.dtype, jnp.floating):
        raise op.type(f"{name} must hold floats (x is rounded to its dtype), got dtype {np.dtype(pool.dtype)}")


def _check_vllm_width(op: OpError, function: str, width: int) -> None:
    low, high = VLLM_WIDTHS[function]
    if not low <= width <= high:
        raise op.value(f"validate_data=True: vLLM's {function} takes widths {low} to {high}, got W = {width} "
                       "(this face takes any W >= 2: drop validate_data to run it here)")


def _check_query_start_loc(op: OpError, qsl, tokens: int):
    qsl = _integers(op, "query_start_loc", qsl, "iu")
    if qsl.ndim != 1 or qsl.shape[0] < 2:
        raise op.value(f"query_start_loc must be (R + 1,) integers for R >= 1 rows, got shape {tuple(qsl.shape)}")
    qsl = qsl.astype(np.int32)
    op.check((qsl[0] >= 0) & (qsl[1:] >= qsl[:-1]).all() & (qsl[-1] <= tokens),
             f"query_start_loc must be non-negative, never decrease and end at most at T = {tokens} (the tokens of "
             "x), got {query_start_loc}", query_start_loc=qsl)
    return qsl


def _check_max_query_len(op: OpError, max_query_len, qsl) -> int | None:
    """``max_query_len`` (static) checked against the rows' counts; ``None`` for -1 (unknown)."""
    if not is_int(max_query_len) or (max_query_len < 1 and max_query_len != -1):
        raise op.value(f"max_query_len must be a static int >= 1 (the longest row's tokens), or -1 for unknown, got "
                       f"{max_query_len!r}")
    if max_query_len == -1:
        return None
    counts = qsl[1:] - qsl[:-1]
    op.check(counts <= max_query_len,
             f"max_query_len = {max_query_len} must be at least every row's tokens, got rows of {{counts}} (from "
             "query_start_loc)", counts=counts)
    return int(max_query_len)


def _rows(op: OpError, name: str, indices, rows: int, slots: int, pad_slot_id, last, initial):
    """Each row's slots: ``(read (R,), write (R,), live (R,), table)``: int32, int32, bool
    (the read slot is not ``pad_slot_id``), and the ``(R, M)`` block table under APC, else
    ``None``."""
    if pad_slot_id is not None and not is_int(pad_slot_id):
        raise op.type(f"pad_slot_id must be a static int or None, got {pad_slot_id!r}")
    apc = last is not None
    if initial is not None and not apc:
        raise op.value("initial_state_idx is for prefix caching (APC), which block_idx_last_scheduled_token turns "
                       "on: pass it too, or drop initial_state_idx")
    if indices is None:
        if apc:
            raise op.value(f"prefix caching (block_idx_last_scheduled_token) needs {name} as (R, M) block tables")
        if slots < rows:
            raise op.value(f"without {name} row i uses slot i, so the pool needs at least R = {rows} slots, got "
                           f"{slots}: pass {name} (R,) to choose each row's slot")
        read = np.arange(rows, dtype=np.int32)
        return read, read, np.ones((rows,), bool), None
    table = _integers(op, name, indices, "i")
    if table.ndim not in (1, 2) or table.shape[0] != rows or (table.ndim == 2 and table.shape[1] < 1):
        raise op.value(f"{name} must be (R,) slots or (R, M) block tables, R = {rows} rows (from x or "
                       f"query_start_loc), got shape {tuple(table.shape)}")
    if apc and table.ndim != 2:
        raise op.value(f"prefix caching (block_idx_last_scheduled_token) needs {name} as (R, M) block tables, got "
                       f"shape {tuple(table.shape)}")
    table = table.astype(np.int32)
    if table.ndim == 1:
        read = write = table
    elif not apc:
        read = write = table[:, 0]
    else:
        if initial is None:
            raise op.value("prefix caching (block_idx_last_scheduled_token) needs initial_state_idx (R,): the "
                           f"column of {name} whose slot each row reads")
        columns = table.shape[1]
        initial = _per_row(op, "initial_state_idx", initial, rows, "iu").astype(np.int32)
        last = _per_row(op, "block_idx_last_scheduled_token", last, rows, "iu").astype(np.int32)
        for what, value in (("initial_state_idx", initial), ("block_idx_last_scheduled_token", last)):
            op.check(value < columns, f"{what} must be columns of {name}, in [0, {columns}), got {{value}}",
                     value=value)
        xp = _namespace(table, initial, last)
        read = xp.take_along_axis(table, xp.clip(initial, 0, columns - 1)[:, None], axis=1)[:, 0]
        write = xp.take_along_axis(table, xp.clip(last, 0, columns - 1)[:, None], axis=1)[:, 0]
    xp = _namespace(read, write)
    live = xp.ones(read.shape, bool) if pad_slot_id is None else read != pad_slot_id
    pad = "" if pad_slot_id is None else f" (pad_slot_id = {pad_slot_id} marks a row without a request)"
    op.check(~live | ((read >= 0) & (read < slots)),
             f"{name}: each row's read slot must be a slot of the pool, in [0, {slots}){pad}; got {{slots}}",
             slots=read)
    unwritten = xp.zeros(write.shape, bool) if pad_slot_id is None else write == pad_slot_id
    op.check(~live | unwritten | ((write >= 0) & (write < slots)),
             f"{name}: each row's write slot must be a slot of the pool, in [0, {slots}){pad}; got {{slots}}",
             slots=write)
    return read, write, live, table if apc else None


def _check_distinct_writes(op: OpError, write, writing, pad_slot_id) -> None:
    """No two rows that write name one write slot (the result would depend on the order)."""
    if pad_slot_id is not None:
        writing = writing & (write != pad_slot_id)
    xp = _namespace(write, writing)
    same = (write[:, None] == write[None, :]) & writing[:, None] & writing[None, :] & ~xp.eye(write.shape[0],
                                                                                               dtype=bool)
    op.check(~same, "two rows write one slot (each request needs its own write slot); write slots {slots}",
             slots=write)


def _check_blocks(op: OpError, rows: int, size, first, last, computed, counts, live, validate: bool):
    """APC's block metadata: ``(B, (first, last, computed))``, each ``(R,)`` int32, checked."""
    if not is_int(size) or size < 1:
        raise op.value(f"block_size_to_align must be a positive int under prefix caching (APC), got {size!r}")
    if validate and size % VLLM_BLOCK_M:
        raise op.value(f"validate_data=True: vLLM's causal_conv1d_fn needs block_size_to_align a multiple of "
                       f"{VLLM_BLOCK_M} (its BLOCK_M), got {size}")
    if first is None or computed is None:
        raise op.value("prefix caching (block_idx_last_scheduled_token) needs block_idx_first_scheduled_token (R,) "
                       "and num_computed_tokens (R,) too")
    first = _per_row(op, "block_idx_first_scheduled_token", first, rows, "iu").astype(np.int32)
    computed = _per_row(op, "num_computed_tokens", computed, rows, "iu").astype(np.int32)
    last = _per_row(op, "block_idx_last_scheduled_token", last, rows, "iu").astype(np.int32)
    filled = last - first
    boundary = size * ((computed + counts - 1) // size)
    op.check(~live | ((filled >= 0) & ((filled == 0) | (boundary - (filled - 1) * size > computed))),
             f"block_idx_first_scheduled_token must not exceed block_idx_last_scheduled_token, and every block "
             f"boundary they name must lie inside the row's chunk: P - (l - f - 1) * B > num_computed_tokens, "
             f"B = {size}, P the last multiple of B before num_computed_tokens + the row's tokens (vLLM's "
             "scheduler sets f = c0 // B, l = (c0 + n - 1) // B); got f = {first}, l = {last}, "
             "num_computed_tokens {computed}, rows of {counts} tokens",
             first=first, last=last, computed=computed, counts=counts)
    return int(size), (first, last, computed)


def _check_accepted(accepted, rows: int, live, counts, window: int, slot_len: int, span: int, width: int):
    """``num_accepted_tokens`` checked against the pool's columns; returns the window's first
    column per row, ``num_accepted_tokens - 1``."""
    if window - 1 + span > slot_len:
        raise UPDATE.value(
            f"conv_state must hold W - 2 + L = {window - 1 + span} columns for the sliding window of "
            f"num_accepted_tokens (W = {width}, L = {span} tokens a row), got S = {slot_len}: allocate "
            f"(N, dim, {window - 1 + span}), as vLLM's speculative decoding does"
        )
    accepted = _per_row(UPDATE, "num_accepted_tokens", accepted, rows, "iu").astype(np.int32)
    UPDATE.check(~live | ((accepted >= 1) & (accepted - 1 + window <= slot_len)),
                 f"num_accepted_tokens must be in [1, S - W + 2] = [1, {slot_len - window + 1}] (the window it "
                 f"reads starts at column num_accepted_tokens - 1 of a slot of S = {slot_len}), got "
                 "{num_accepted_tokens}", num_accepted_tokens=accepted)
    UPDATE.check(~live | (counts <= span),
                 f"every row's tokens must fit the sliding window: at most S - W + 2 = {span} with "
                 "max_query_len=-1, got rows of {counts}", counts=counts)
    return accepted - 1


def _per_row(op: OpError, name: str, value, rows: int, kinds: str):
    """One value per row, ``(R,)``, of a dtype kind in ``kinds`` (``"b"`` bools, ``"iu"`` integers >= 0)."""
    value = _integers(op, name, value, kinds)
    if tuple(value.shape) != (rows,):
        raise op.value(f"{name} must have shape (R,) = ({rows},), one per row, got {tuple(value.shape)}")
    if kinds != "b":
        op.check(value >= 0, f"{name} must be non-negative, got {{value}}", value=value)
    return value


def _integers(op: OpError, name: str, value, kinds: str):
    """``value`` as a NumPy array if it is concrete (checked on the host), else the tracer;
    its dtype kind in ``kinds``."""
    value = value if isinstance(value, jax.core.Tracer) else np.asarray(value)
    if np.dtype(value.dtype).kind not in kinds:
        what = {"b": "bools", "i": "signed integers", "iu": "integers"}[kinds]
        raise op.type(f"{name} must hold {what}, got dtype {np.dtype(value.dtype)}")
    return value


def _namespace(*arrays):
    """NumPy for concrete arrays, jax.numpy if any is traced."""
    return jnp if any(isinstance(a, jax.core.Tracer) for a in arrays) else np
