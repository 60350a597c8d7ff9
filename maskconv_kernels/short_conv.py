"""Short causal convolutions of sequence models, in the field's terms: :func:`causal_conv1d`.

Mamba / Mamba-2, gated DeltaNet, Hyena, LFM2 and RWKV-style token shifts run a
depthwise causal 1-D convolution of width 2 to 4 over ``(B, L, D)`` activations, trained
on packed documents (``segment_ids``) and served from a state of the last inputs. This
is Dao-AILab's ``causal_conv1d_fn`` (``seq_idx``, ``initial_states``,
``return_final_states``, bias and SiLU) channels-last in JAX, built on
:func:`maskconv_kernels.masked_conv` (``feature_group_count=D``, ``padding="CAUSAL"``),
so it inherits its contract: a position never reads a later one, nor (with
``segment_ids``) one of another document: selected, never multiplied, so the gradient
across documents is exactly 0.0 and a NaN in one document changes no other's output.
Its derivatives, of every order, are those of ``masked_conv``'s three maps.

:func:`causal_conv1d_reference` is the float64 NumPy oracle, written from
causal-conv1d's math (its ``causal_conv1d_ref``) with segments and states added.

Serving: :func:`causal_conv1d_update` takes one or several new tokens per row from a
pool of states ``(S, state_len, D)`` (``state_indices`` choose each row's slot for
continuous batching, :data:`PAD_SLOT_ID` rows touch nothing; linear or, with
``cache_seqlens``, circular states), in place under ``jax.jit`` with donation;
:func:`causal_conv1d_update_reference` is its float64 NumPy oracle.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .api import masked_conv
from .spec import as_operand, as_segment_ids

__all__ = [
    "causal_conv1d", "causal_conv1d_reference", "ACTIVATIONS",
    "causal_conv1d_update", "causal_conv1d_update_reference", "PAD_SLOT_ID",
]

# causal-conv1d's names: "swish" is SiLU's other name.
ACTIVATIONS = (None, "silu", "swish")


def _check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish' (the same), got {activation!r}")


def _check_operands(x, weight, bias, dilation):
    """The shapes shared by the full convolution and the decode step; returns ``(W, D, state length)``."""
    if x.ndim != 3:
        raise ValueError(f"x must be (B, L, D), got shape {tuple(x.shape)}")
    d = x.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != d:
        raise ValueError(
            f"weight must be (W, D) = (width, {d}) to match x of shape {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError(f"weight needs a width of at least 1, got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (d,):
        raise ValueError(f"bias must be (D,) = ({d},), got {tuple(bias.shape)}")
    if isinstance(dilation, bool) or not isinstance(dilation, (int, np.integer)) or dilation < 1:
        raise ValueError(f"dilation must be a positive int, got {dilation!r}")
    width = int(weight.shape[0])
    return width, d, (width - 1) * int(dilation)


def _check_state(name: str, state, batch: int, state_len: int, d: int, dtype) -> None:
    expected = (batch, state_len, d)
    if tuple(state.shape) != expected:
        raise ValueError(
            f"{name} must be (B, (W - 1) * dilation, D) = {expected}, got {tuple(state.shape)}"
        )
    if np.dtype(state.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have x's dtype {np.dtype(dtype)}, got {np.dtype(state.dtype)}")


def causal_conv1d(
    x: jax.typing.ArrayLike,
    weight: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    segment_ids: jax.typing.ArrayLike | None = None,
    initial_state: jax.typing.ArrayLike | None = None,
    return_final_state: bool = False,
    activation: str | None = None,
    dilation: int = 1,
    implementation: str | None = None,
    interpret: bool = False,
    config=None,
):
    """Depthwise causal 1-D convolution: ``y[b, l, d] = act(bias[d] + sum_t weight[t, d] * x[b, l - (W-1-t) * dilation, d])``.

    Args:
      x: ``(B, L, D)``, float32, bfloat16 or float16.
      weight: ``(W, D)``; its dtype may be wider than x's (Mamba keeps float32 weights
        for bfloat16 activations).
      bias: ``(D,)`` or ``None``.
      segment_ids: ``(B, L)`` integers or ``None``: packed documents. No tap crosses a
        document boundary; negative ids mark padding, whose outputs are zero and which
        receives no gradient.
      initial_state: ``(B, (W - 1) * dilation, D)`` in x's dtype, the inputs before
        ``x[:, 0]`` (zeros when ``None``); differentiable. With ``segment_ids`` it belongs
        to each row's first document.
      return_final_state: also return the state after ``x``: its last ``(W - 1) *
        dilation`` inputs (the initial state's too, if ``x`` is shorter), in x's dtype;
        with ``segment_ids``, those of each row's last document (zeros before its start
        and in an all-padding row).
      activation: ``None`` or ``"silu"`` (``"swish"``).
      dilation: the taps' spacing.
      implementation: as in :func:`masked_conv` (``None``: chosen per platform), except
        ``"pallas_triton"``: the fused kernels of :mod:`maskconv_kernels.short_conv_kernels`
        (bias, SiLU and selects in the convolution's one pass; NVIDIA GPUs, or any platform
        with ``interpret=True``). Differentiable once, in reverse mode (a
        ``jax.custom_vjp``): ``jax.jvp`` and second derivatives raise there.
      interpret: run a kernel implementation in its interpreter (any platform, slowly).
      config: the implementation's config (``short_conv_kernels.BlockSizes`` for
        ``"pallas_triton"``), or ``None`` for its default.

    Returns:
      ``y``: ``(B, L, D)`` in x's dtype, accumulated in float32 (bias and activation
      applied in float32, rounded once), or ``(y, final_state)``.
    """
    _check_activation(activation)
    x, weight = as_operand("x", x), as_operand("weight", weight)
    bias = None if bias is None else as_operand("bias", bias)
    width, d, state_len = _check_operands(x, weight, bias, dilation)
    batch, length = x.shape[:2]
    ids = None if segment_ids is None else as_segment_ids(segment_ids, x.shape[:-1])
    xe, ide = x, ids
    if initial_state is not None:
        initial_state = as_operand("initial_state", initial_state)
        _check_state("initial_state", initial_state, batch, state_len, d, x.dtype)
    if implementation == "pallas_triton":
        return _fused(x, weight, bias, ids, initial_state, return_final_state, activation, dilation, config, interpret)
    if initial_state is not None:
        # The state is the input before position 0, of the row's first document; the
        # outputs at the state's own positions are dropped.
        xe = jnp.concatenate([initial_state, x], axis=1)
        if ids is not None:
            ide = jnp.concatenate([jnp.broadcast_to(ids[:, :1], (batch, state_len)), ids], axis=1)
    acc = jnp.promote_types(jnp.float32, jnp.promote_types(x.dtype, weight.dtype))
    y = masked_conv(
        xe, weight[:, None, :], np.ones(width, bool), padding="CAUSAL", dilation=dilation, feature_group_count=d,
        preferred_element_type=acc, implementation=implementation, segment_ids=ide, interpret=interpret,
        config=config,
    )[:, xe.shape[1] - length :]
    if bias is not None:
        y = y + bias.astype(acc)
    if activation is not None:
        y = jax.nn.silu(y)
    if ids is not None:
        y = jnp.where((ids >= 0)[..., None], y, jnp.zeros((), y.dtype))  # bias and activation included
    y = y.astype(x.dtype)
    if not return_final_state:
        return y
    return y, _final_state(xe, ide, state_len)


def _fused(x, weight, bias, ids, initial_state, return_final_state, activation, dilation, config, interpret):
    """The ``"pallas_triton"`` path: the fused kernels, and the final state by gathers."""
    from . import short_conv_kernels  # Pallas: imported when this path runs

    y = short_conv_kernels.causal_conv1d_fused(
        x, weight, bias, ids, initial_state, activation=activation, dilation=dilation, config=config,
        interpret=interpret,
    )
    if not return_final_state:
        return y
    return y, short_conv_kernels.final_state(x, initial_state, ids, (weight.shape[0] - 1) * dilation)


def _final_state(xe, ids, state_len: int):
    """The last ``state_len`` inputs of ``xe`` ``(B, T, D)``; with ``ids``, of each row's last document."""
    batch, total, d = xe.shape
    if state_len == 0:
        return jnp.zeros((batch, 0, d), xe.dtype)
    if ids is None:
        tail = xe[:, max(total - state_len, 0) :]
        return jnp.pad(tail, ((0, 0), (state_len - tail.shape[1], 0), (0, 0)))
    positions = jnp.arange(total)
    end = jnp.max(jnp.where(ids >= 0, positions, -1), axis=1)  # last non-padding position, -1 if none
    last_id = jnp.take_along_axis(ids, jnp.maximum(end, 0)[:, None], axis=1)
    index = end[:, None] - state_len + 1 + jnp.arange(state_len)  # (B, state_len)
    safe = jnp.clip(index, 0, total - 1)
    keep = (index >= 0) & (end[:, None] >= 0) & (jnp.take_along_axis(ids, safe, axis=1) == last_id)
    values = jnp.take_along_axis(xe, safe[..., None], axis=1)
    return jnp.where(keep[..., None], values, jnp.zeros((), xe.dtype))


def causal_conv1d_reference(
    x, weight, bias=None, *, segment_ids=None, initial_state=None, return_final_state=False, activation=None,
    dilation=1,
):
    """Float64 NumPy oracle of :func:`causal_conv1d` (same arguments; outputs in float64).

    A loop over taps on padded arrays: tap ``t`` of position ``l`` reads position
    ``l - (W - 1 - t) * dilation`` where that is in the same document (the state counts
    as the first document's), else nothing.
    """
    _check_activation(activation)
    x = np.asarray(x, np.float64)
    weight = np.asarray(weight, np.float64)
    batch, length, d = x.shape
    width = weight.shape[0]
    state_len = (width - 1) * dilation
    state = np.zeros((batch, state_len, d)) if initial_state is None else np.asarray(initial_state, np.float64)
    xe = np.concatenate([state, x], axis=1)
    ids = np.zeros((batch, length), np.int64) if segment_ids is None else np.asarray(segment_ids, np.int64)
    # Zeros before the state belong to no document; the state to the first position's.
    ide = np.concatenate([np.broadcast_to(ids[:, :1], (batch, state_len)), ids], axis=1)
    if initial_state is None:
        ide[:, :state_len] = np.iinfo(np.int64).min
    y = np.zeros((batch, length, d))
    for t in range(width):
        back = (width - 1 - t) * dilation
        source = slice(state_len - back, state_len - back + length)
        same = (ide[:, source] == ids) & (ids >= 0)
        y += np.where(same[..., None], xe[:, source] * weight[t], 0.0)
    if bias is not None:
        y += np.asarray(bias, np.float64)
    if activation is not None:
        y = y / (1 + np.exp(-y))
    y = np.where((ids >= 0)[..., None], y, 0.0)
    if not return_final_state:
        return y
    if segment_ids is None:
        return y, xe[:, xe.shape[1] - state_len :]
    final = np.zeros((batch, state_len, d))
    for b in range(batch):
        kept = np.flatnonzero(ide[b] >= 0)
        if kept.size:
            end = kept[-1]
            for j in range(state_len):
                q = end - state_len + 1 + j
                if q >= 0 and ide[b, q] == ide[b, end]:
                    final[b, j] = xe[b, q]
    return y, final


# --------------------------------------------------------------------------- serving

# causal-conv1d's and vLLM's PAD_SLOT_ID: a row of the batch that holds no request.
PAD_SLOT_ID = -1


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
):
    """New tokens of each row from its slot of a state pool: ``(y, new_conv_state)``.

    causal-conv1d's ``causal_conv1d_update`` (``cache_seqlens``, ``conv_state_indices``)
    channels-last, functional, with several tokens per call. Row ``b`` reads and rewrites
    slot ``state_indices[b]`` of the pool and no other; its outputs are those
    :func:`causal_conv1d` gives for its tokens after the inputs the slot holds, computed
    by :func:`causal_conv1d` itself (``initial_state``: the slot's last
    ``(W - 1) * dilation`` inputs), so that decoding a sequence step by step from an
    empty slot gives the full forward's outputs bit for bit wherever XLA compiles the
    two programs' arithmetic alike. (It need not: LLVM may contract a product and an add
    into one FMA, choosing per program, and vector and scalar code may evaluate SiLU
    differently; the README's *Serving* section says where this was seen.)

    Under ``jax.jit(..., donate_argnums=1)`` the pool is updated in place: one gather of
    the rows' slots, one scatter of them back, no copy of the pool.

    Args:
      x: ``(B, T, D)``, or ``(B, D)`` for one token; float32, bfloat16 or float16.
      conv_state: the pool, ``(S, state_len, D)`` in x's dtype, ``state_len >= (W - 1) *
        dilation``. Linear (``cache_seqlens=None``): a slot holds the last ``state_len``
        inputs of its sequence, oldest first (Mamba keeps ``state_len = W``). Circular
        (``cache_seqlens`` given): input ``p`` of a sequence lives at ``p % state_len``.
      weight, bias, activation, dilation, implementation: as in :func:`causal_conv1d`.
      state_indices: ``(B,)`` signed integers or ``None`` (row ``b`` uses slot ``b``; then
        ``S == B``). :data:`PAD_SLOT_ID` (-1) marks a row that holds no request: its
        outputs are zeros and it reads and writes nothing. Concrete indices are checked
        (in ``[0, S)`` or -1, and no slot twice); traced ones cannot be, so a traced index
        outside ``[0, S)`` other than -1 writes nothing and reads NaN (its outputs are
        NaN, so the error shows, unless ``has_initial_state`` is false there), as jax's
        ``mode="fill"`` gathers and ``mode="drop"`` scatters do, and two rows naming one
        slot write it in an unspecified order.
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
      :func:`causal_conv1d`), and the new pool (same shape and dtype as ``conv_state``).
    """
    _check_activation(activation)
    x, weight = as_operand("x", x), as_operand("weight", weight)
    conv_state = as_operand("conv_state", conv_state)
    bias = None if bias is None else as_operand("bias", bias)
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be (B, T, D), or (B, D) for one token, got shape {tuple(x.shape)}")
    one_token = x.ndim == 2
    xt = x[:, None] if one_token else x
    _, d, window = _check_operands(xt, weight, bias, dilation)
    batch, tokens = xt.shape[:2]
    slots, state_len = _check_pool(conv_state, window, d, x.dtype, batch if state_indices is None else None)
    indices = None if state_indices is None else _check_state_indices(state_indices, batch, slots)
    if cache_seqlens is not None:
        cache_seqlens = _check_row_values("cache_seqlens", cache_seqlens, batch, "iu")
        if state_len == 0:
            raise ValueError("cache_seqlens (a circular state) needs conv_state with state_len >= 1, got 0")
    if has_initial_state is not None:
        has_initial_state = _check_row_values("has_initial_state", has_initial_state, batch, "b")

    if indices is None:
        rows = conv_state
    else:
        indices = indices.astype(jnp.promote_types(indices.dtype, jnp.int32))  # room for `slots` below
        inside = (indices >= 0) & (indices < slots)
        rows = jnp.take(conv_state, jnp.clip(indices, 0, slots - 1), axis=0)
        rows = jnp.where(inside[:, None, None], rows, jnp.full((), jnp.nan, rows.dtype))
    if has_initial_state is not None:
        rows = jnp.where(has_initial_state[:, None, None], rows, jnp.zeros((), rows.dtype))
    if cache_seqlens is None:
        before = rows[:, state_len - window :]
        new_rows = jnp.concatenate([rows, xt], axis=1)[:, tokens:]
    else:
        seqlens = cache_seqlens.astype(jnp.int32)[:, None]
        before = jnp.take_along_axis(rows, ((seqlens + jnp.arange(-window, 0)) % state_len)[..., None], axis=1)
        kept = min(tokens, state_len)  # a longer x overwrites its own first tokens
        written = (seqlens + jnp.arange(tokens - kept, tokens)) % state_len
        new_rows = jax.vmap(lambda row, at, values: row.at[at].set(values))(rows, written, xt[:, tokens - kept :])
    y = causal_conv1d(
        xt, weight, bias, initial_state=before, activation=activation, dilation=dilation,
        implementation=implementation,
    )
    if indices is None:
        new_state = new_rows
    else:
        y = jnp.where((indices == PAD_SLOT_ID)[:, None, None], jnp.zeros((), y.dtype), y)
        # Rows without a slot (padding, out of range) write nowhere: index `slots` is dropped.
        new_state = conv_state.at[jnp.where(inside, indices, slots)].set(new_rows, mode="drop")
    return (y[:, 0] if one_token else y), new_state


def _is_traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


def _check_pool(conv_state, window: int, d: int, dtype, batch: int | None):
    """Checks the pool: ``(S, state_len >= window, D)`` in ``dtype``, ``S == batch`` unless ``None``.

    Returns ``(S, state_len)``.
    """
    shape = tuple(conv_state.shape)
    if len(shape) != 3 or shape[2] != d or shape[1] < window:
        raise ValueError(
            f"conv_state must be (S, state_len, D) with state_len >= (W - 1) * dilation = {window} and D = {d}, "
            f"got {shape}"
        )
    if batch is not None and shape[0] != batch:
        raise ValueError(
            f"conv_state has {shape[0]} slots but x has {batch} rows: without state_indices row b uses slot b, "
            "so they must be equal; pass state_indices (B,) to choose each row's slot in a larger pool"
        )
    if np.dtype(conv_state.dtype) != np.dtype(dtype):
        raise TypeError(
            f"conv_state must have x's dtype {np.dtype(dtype)}, got {np.dtype(conv_state.dtype)}: it holds past "
            "inputs, so allocate it in the dtype of the inputs"
        )
    return shape[0], shape[1]


def _check_row_values(name: str, value, batch: int, kinds: str):
    """One value per row: ``(B,)`` of a dtype kind in ``kinds`` (``"iu"`` integers, ``"b"`` bools)."""
    if not isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
        value = jnp.asarray(value)
    dtype = np.dtype(value.dtype)
    if dtype.kind not in kinds:
        what = "integers" if kinds == "iu" else "bools"
        raise TypeError(f"{name} must hold {what}, one per row of x, got dtype {dtype}")
    if tuple(value.shape) != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},), one per row of x, got {tuple(value.shape)}")
    if kinds == "iu" and not _is_traced(value) and (np.asarray(value) < 0).any():
        raise ValueError(f"{name} must be non-negative, got {np.asarray(value).tolist()}")
    return value


def _check_state_indices(state_indices, batch: int, slots: int):
    """``(B,)`` integers; concrete ones in ``[0, slots)`` or :data:`PAD_SLOT_ID`, no slot twice."""
    if not isinstance(state_indices, (jax.Array, jax.ShapeDtypeStruct)):
        state_indices = jnp.asarray(state_indices)
    dtype = np.dtype(state_indices.dtype)
    if dtype.kind != "i":
        raise TypeError(
            f"state_indices must hold signed integers (a slot of conv_state per row, {PAD_SLOT_ID} for none), "
            f"got dtype {dtype}"
        )
    if tuple(state_indices.shape) != (batch,):
        raise ValueError(
            f"state_indices must have shape (B,) = ({batch},), one per row of x, got {tuple(state_indices.shape)}"
        )
    if _is_traced(state_indices):
        return state_indices
    values = np.asarray(state_indices).astype(np.int64)
    bad = values[(values != PAD_SLOT_ID) & ((values < 0) | (values >= slots))]
    if bad.size:
        raise ValueError(
            f"state_indices must be slots of conv_state, in [0, {slots}), or {PAD_SLOT_ID} for a row without a "
            f"request; got {sorted(set(bad.tolist()))}"
        )
    used = values[values != PAD_SLOT_ID]
    if np.unique(used).size != used.size:
        twice = sorted({int(v) for v in used if (used == v).sum() > 1})
        raise ValueError(f"state_indices names slots {twice} for several rows: each row needs its own slot")
    return state_indices


def causal_conv1d_update_reference(
    x, conv_state, weight, bias=None, *, activation=None, dilation=1, state_indices=None, cache_seqlens=None,
    has_initial_state=None,
):
    """Float64 NumPy oracle of :func:`causal_conv1d_update` (same arguments): ``(y, new_conv_state)`` in float64.

    Written from causal-conv1d's ``causal_conv1d_update_ref``, one row at a time: the
    row's window of inputs before ``x`` (the slot's last ``(W - 1) * dilation``, or in
    circular mode those at ``(cache_seqlens - k) % state_len``), the convolution over
    window and tokens, then the tokens written back. Padding rows give zeros and write
    nothing. Indices are assumed valid.
    """
    _check_activation(activation)
    x = np.asarray(x, np.float64)
    one_token = x.ndim == 2
    x = x[:, None] if one_token else x
    weight = np.asarray(weight, np.float64)
    pool = np.array(conv_state, np.float64)
    batch, tokens, d = x.shape
    width = weight.shape[0]
    window, state_len = (width - 1) * dilation, pool.shape[1]
    slots = np.arange(batch) if state_indices is None else np.asarray(state_indices)
    y = np.zeros_like(x)
    for b, slot in enumerate(slots):
        if slot == PAD_SLOT_ID:
            continue
        row = pool[slot].copy()
        if has_initial_state is not None and not has_initial_state[b]:
            row[:] = 0.0
        if cache_seqlens is None:
            before = row[state_len - window :]
            row = np.concatenate([row, x[b]])[tokens:]
        else:
            n = int(cache_seqlens[b])
            before = row[[(n - window + j) % state_len for j in range(window)]]
            for t in range(tokens):
                row[(n + t) % state_len] = x[b, t]
        xe = np.concatenate([before, x[b]])
        for t in range(tokens):
            y[b, t] = sum(weight[k] * xe[t + k * dilation] for k in range(width))
        if bias is not None:
            y[b] += np.asarray(bias, np.float64)
        if activation is not None:
            y[b] = y[b] / (1 + np.exp(-y[b]))
        pool[slot] = row
    return (y[:, 0] if one_token else y), pool
