"""``maskconv_kernels.compat.vllm``: vLLM's ``causal_conv1d_fn`` / ``causal_conv1d_update`` face, against its contract.

The oracles below are the face's contract as read from vLLM (vllm-project/vllm@03c6dad,
``vllm/model_executor/layers/mamba/ops/causal_conv1d.py``, with PR #56196's fix), written
in float64 NumPy from its statement, not from the library's code: for a row with window
``h (dim, W - 1)`` and tokens ``z``, ``u = h ++ z``, ``out[t] = act(bias + sum_k w[:, k] *
u[t + k])``, and the states written are slices of ``u``. Outputs are compared within the
tolerance of ``W`` float32 products and a bias (rounded once to x's dtype); states are
copies of inputs, so pools are compared bit for bit, every element, NaN payloads included
(an element the face must not write holds NaN or a value it must keep).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.harness import ON_GPU
from support.numerics import assert_close
from support.tiers import tiered

from maskconv_kernels import causal_conv1d
from maskconv_kernels.compat import vllm

F32, BF16 = np.dtype("float32"), np.dtype(jnp.bfloat16)
D = 8  # dim: small, one size for every test
PAD = vllm.PAD_SLOT_ID
# Each call compiles once per shape (about a second on a 2-core CPU), so the tests share
# shapes where they can: prefill steps of T = 22 tokens and 6 rows over a pool of 10 slots,
# update steps of 4 rows, width 4 with S = 5 columns (W + 1, as Mamba's pool; or W - 1 plus
# two drafts).
SLOTS = 10


# --------------------------------------------------------------------- oracles


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _outputs(u, weight, bias, activation, n):
    """``(dim, n)`` float64: ``act(bias + sum_k w[:, k] * u[:, t + k])``."""
    u, w = np.asarray(u, np.float64), np.asarray(weight, np.float64)
    width = w.shape[1]
    out = sum(w[:, k:k + 1] * u[:, k:k + n] for k in range(width))
    if bias is not None:
        out = out + np.asarray(bias, np.float64)[:, None]
    return _silu(out) if activation in ("silu", "swish", True) else out


def _slots(idx, i, last, initial):
    """Row ``i``'s (read, write) slots."""
    if idx is None:
        return i, i
    idx = np.asarray(idx)
    if idx.ndim == 1:
        return int(idx[i]), int(idx[i])
    if last is None:
        return int(idx[i, 0]), int(idx[i, 0])
    return int(idx[i, initial[i]]), int(idx[i, last[i]])


def fn_ref(x, weight, bias, pool, qsl, idx=None, has_init=None, activation="silu", pad_slot_id=PAD,
           first=None, last=None, initial=None, computed=None, block=0):
    """vLLM's ``causal_conv1d_fn`` contract: ``(out (dim, T) float64, new pool)``, the pool in its dtype."""
    pool = np.asarray(pool)
    new = pool.copy()
    xp = np.asarray(x).astype(pool.dtype)  # x rounded to the pool's dtype first
    width = np.shape(weight)[1]
    k = width - 1
    out = np.zeros(xp.shape)
    for i in range(len(qsl) - 1):
        read, write = _slots(idx, i, last, initial)
        n = int(qsl[i + 1] - qsl[i])
        if (pad_slot_id is not None and read == pad_slot_id) or n == 0:
            continue
        h = pool[read][:, :k] if has_init is not None and has_init[i] else np.zeros((pool.shape[1], k), pool.dtype)
        u = np.concatenate([h, xp[:, qsl[i]:qsl[i + 1]]], axis=1)
        out[:, qsl[i]:qsl[i + 1]] = _outputs(u, weight, bias, activation, n)
        if write != pad_slot_id:
            new[write][:, :k] = u[:, n:n + k]
        if last is not None:  # APC: the state at every block boundary the chunk crosses
            f, l, c0 = int(first[i]), int(last[i]), int(computed[i])
            p_last = block * ((c0 + n - 1) // block)
            for j in range(l - f):
                p = p_last - (l - f - 1 - j) * block
                assert p > c0, "the contract's precondition"
                new[int(idx[i, f + j])][:, :k] = u[:, p - c0:p - c0 + k]
    return out, new


def update_ref(rows, weight, bias, pool, idx=None, accepted=None, activation=None, pad_slot_id=PAD, last=None,
               initial=None):
    """vLLM's ``causal_conv1d_update`` contract on ``rows`` (each ``(dim, n_i)``): ``(outs, new pool)``."""
    pool = np.asarray(pool)
    new = pool.copy()
    k = np.shape(weight)[1] - 1
    outs = []
    for i, z in enumerate(rows):
        z = np.asarray(z).astype(pool.dtype)
        n = z.shape[1]
        outs.append(np.zeros(z.shape))
        read, write = _slots(idx, i, last, initial)
        if (pad_slot_id is not None and read == pad_slot_id) or n == 0:
            continue
        o = 0 if accepted is None else int(accepted[i]) - 1
        u = np.concatenate([pool[read][:, o:o + k], z], axis=1)
        outs[i] = _outputs(u, weight, bias, activation, n)
        if write == pad_slot_id:
            continue
        if accepted is None:
            new[write][:, :k] = u[:, n:n + k]
        else:  # the sliding window: without its oldest entry, then all n tokens
            new[write][:, :k - 1 + n] = u[:, 1:k + n]
    return outs, new


# --------------------------------------------------------------------- helpers


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))


def _assert_pool(actual, expected):
    assert actual.shape == expected.shape and np.dtype(actual.dtype) == expected.dtype
    np.testing.assert_array_equal(_bits(actual), _bits(expected))


def _assert_out(actual, expected, weight, bias, dtype, *inputs):
    """Within the tolerance of ``W`` products and a bias, relative to the inputs' magnitude."""
    width = np.shape(weight)[1]
    biggest = max(float(np.nanmax(np.abs(np.asarray(a, np.float64)), initial=0.0)) for a in inputs)
    scale = biggest * float(np.abs(np.asarray(weight, np.float64)).max()) * width
    scale += 0.0 if bias is None else float(np.abs(np.asarray(bias, np.float64)).max())
    assert_close(actual, expected, dtype, width + 1, scale)


def _normal(rng, shape, dtype=F32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def _params(rng, width):
    return _normal(rng, (D, width), F32, 0.5), _normal(rng, (D,), F32, 0.5)


def _qsl(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


# --------------------------------------------------------------------- causal_conv1d_fn

# Six rows: 5 tokens; 1 and 2 (fewer than W - 1 from W = 4 and 3); a row of no token; a pad
# row (its tokens NaN); 7 tokens. Then 3 tokens of no row (NaN).
FN_COUNTS = [5, 1, 0, 4, 2, 7]
FN_SLOTS = np.array([7, 2, 4, PAD, 0, 9], np.int32)
FN_HAS_INIT = np.array([True, False, True, True, True, False])


def _fn_case(seed, width, x_dtype=F32, pool_dtype=F32, columns=2):
    """``(x, weight, bias, pool, qsl)``: the pool's slots nobody reads, the columns ``>= W - 1``
    and the slots of rows without an initial state hold NaN; so do the pad row's tokens
    and the tokens after the last row."""
    rng = np.random.default_rng(seed)
    k = width - 1
    qsl = _qsl(FN_COUNTS)
    x = _normal(rng, (D, int(qsl[-1]) + 3), x_dtype)
    x[:, qsl[3]:qsl[4]] = np.nan
    x[:, qsl[-1]:] = np.nan
    pool = _normal(rng, (10, D, k + columns), pool_dtype)
    pool[:, :, k:] = np.nan
    unread = [s for s in range(10) if s not in FN_SLOTS[FN_HAS_INIT & (FN_SLOTS != PAD)]]
    pool[unread] = np.nan
    weight, bias = _params(rng, width)
    return x, weight, bias, pool, qsl


FN_WIDTHS = [(2, True), (3, True), (4, True), (5, True), (6, True), (4, False)]


# Widths 2 and 4 in the README's command; 3, 5 and 6 in the slow tier (a compile each).
@pytest.mark.parametrize("width, initial", tiered(FN_WIDTHS, lambda c: c[0] in (2, 4), spread=True),
                         ids=["W2", "W3", "W4", "W5", "W6", "W4_no_initial_state"])
def test_fn_matches_the_contract(width, initial):
    x, weight, bias, pool, qsl = _fn_case(width, width)
    has_init = FN_HAS_INIT if initial else None
    out, new = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, FN_SLOTS, has_init)
    expected, expected_pool = fn_ref(x, weight, bias, pool, qsl, FN_SLOTS, has_init)
    assert out.shape == x.shape and out.dtype == F32
    _assert_out(out, expected, weight, bias, F32, x, pool[:, :, :width - 1])
    _assert_pool(new, expected_pool)
    assert not np.asarray(out)[:, qsl[3]:qsl[4]].any() and not np.asarray(out)[:, qsl[-1]:].any()


@pytest.mark.parametrize("x_dtype, pool_dtype", [(BF16, F32), (F32, BF16)], ids=["bf16_x_f32_pool", "f32_x_bf16_pool"])
def test_fn_rounds_x_to_the_pools_dtype(x_dtype, pool_dtype):
    """A float32 pool with bfloat16 x: exact states, float32 sums, one rounding to bfloat16;
    a bfloat16 pool with float32 x: x rounded to bfloat16 first (vLLM's ``x.to(conv_states.dtype)``)."""
    x, weight, bias, pool, qsl = _fn_case(11, 4, x_dtype, pool_dtype)
    out, new = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, FN_SLOTS, FN_HAS_INIT, activation="swish")
    expected, expected_pool = fn_ref(x, weight, bias, pool, qsl, FN_SLOTS, FN_HAS_INIT, activation="swish")
    assert out.dtype == x_dtype and new.dtype == pool_dtype
    _assert_out(out, expected, weight, bias, BF16, x, pool[:, :, :3])
    _assert_pool(new, expected_pool)


def test_fn_without_cache_indices_row_i_uses_slot_i():
    x, weight, bias, pool, qsl = _fn_case(3, 4)
    x[:, qsl[3]:qsl[4]] = 1.0  # row 3 is a request here (slot 3)
    pool[[1, 3]] = _normal(np.random.default_rng(3), (2, D, 5))
    out, new = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, has_initial_state=FN_HAS_INIT)
    expected, expected_pool = fn_ref(x, weight, bias, pool, qsl, None, FN_HAS_INIT)
    _assert_out(out, expected, weight, bias, F32, x[:, :qsl[-1]], pool[:6, :, :3])
    _assert_pool(new, expected_pool)


def _apc_case(seed, block, width=4):
    """Rows scheduled as vLLM's scheduler does (``f = c0 // B``, ``l = (c0 + n - 1) // B``, the
    initial state in block ``(c0 - 1) // B``), each with its own block table row of distinct
    slots: a fresh 37-token chunk (several boundaries); a 2-token chunk (fewer than W - 1)
    that ends inside a block; a chunk from ``c0 = 6`` whose first boundary is 2 tokens in
    (its state takes an entry of the previous state); a pad row; a chunk that ends on a
    boundary."""
    rng = np.random.default_rng(seed)
    computed = np.array([0, 2 * block, 6, 0, block], np.int32)
    counts = np.array([37, 2, 12, 3, block], np.int32)
    has_init = computed > 0
    first = computed // block
    last = (computed + counts - 1) // block
    initial = np.maximum(computed - 1, 0) // block
    columns = 6
    table = np.arange(5 * columns, dtype=np.int32).reshape(5, columns)
    table[3] = PAD
    qsl = _qsl(counts)
    x = _normal(rng, (D, int(qsl[-1]) + 2))
    x[:, qsl[3]:qsl[4]] = np.nan
    pool = _normal(rng, (5 * columns + 2, D, width + 1))
    pool[:, :, width - 1:] = np.nan
    pool[-2:] = np.nan  # slots in no table
    weight, bias = _params(rng, width)
    meta = dict(first=first, last=last, initial=initial, computed=computed, block=block)
    return x, weight, bias, pool, qsl, table, has_init, meta


def _apc_kwargs(meta):
    return dict(block_idx_first_scheduled_token=meta["first"], block_idx_last_scheduled_token=meta["last"],
                initial_state_idx=meta["initial"], num_computed_tokens=meta["computed"],
                block_size_to_align=meta["block"])


def test_fn_prefix_caching_writes_every_block_state():
    """B = 8 (vLLM's smallest, its BLOCK_M); the next test runs B = 16."""
    block = 8
    x, weight, bias, pool, qsl, table, has_init, meta = _apc_case(block, block)
    out, new = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, table, has_init, **_apc_kwargs(meta))
    expected, expected_pool = fn_ref(x, weight, bias, pool, qsl, table, has_init, **meta)
    _assert_out(out, expected, weight, bias, F32, x, pool[:, :, :3])
    _assert_pool(new, expected_pool)
    # Block k of the fresh 37-token row holds the state after (k + 1) * B tokens: its inputs.
    x32 = np.asarray(x, np.float32)
    for k in range(meta["last"][0] - meta["first"][0]):
        np.testing.assert_array_equal(np.asarray(new)[table[0, k]][:, :3], x32[:, (k + 1) * block - 3:(k + 1) * block])


def test_fn_chunk_shorter_than_the_window_writes_the_write_slot_not_the_read_slot():
    """vLLM#56196: under APC a chunk of fewer than W - 1 tokens writes its end state to the
    write slot (block_idx_last_scheduled_token) and leaves the read slot, a prefix block
    other requests may share, as it was. B = 16; no activation."""
    rng = np.random.default_rng(5)
    weight, bias = _params(rng, 4)
    pool = _normal(rng, (6, D, 4))
    x = _normal(rng, (D, 2))
    table = np.array([[3, 5]], np.int32)  # reads block 0 (slot 3), writes block 1 (slot 5)
    kw = dict(block_idx_first_scheduled_token=np.array([1]), block_idx_last_scheduled_token=np.array([1]),
              initial_state_idx=np.array([0]), num_computed_tokens=np.array([16]), block_size_to_align=16)
    out, new = vllm.causal_conv1d_fn(x, weight, bias, pool, np.array([0, 2]), table, np.array([True]), False, **kw)
    _assert_pool(np.asarray(new)[3], pool[3])  # the shared block, untouched
    np.testing.assert_array_equal(np.asarray(new)[5][:, :3], np.concatenate([pool[3][:, 2:3], x], axis=1))
    _assert_pool(np.asarray(new)[5][:, 3:], pool[5][:, 3:])
    expected, _ = fn_ref(x, weight, bias, pool, [0, 2], table, [True], None, first=[1], last=[1], initial=[0],
                         computed=[16], block=16)  # activation=False: the identity
    _assert_out(out, expected, weight, bias, F32, x, pool)


def test_fn_pad_rows_give_zeros_and_touch_nothing():
    x, weight, bias, pool, qsl = _fn_case(6, 4)
    slots = np.array([PAD, PAD, PAD, PAD, PAD, PAD], np.int32)
    out, new = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, slots, FN_HAS_INIT)
    assert not np.asarray(out).any()
    _assert_pool(new, pool)


def test_fn_nan_in_another_row_reaches_no_other_output_or_state():
    x, weight, bias, pool, qsl = _fn_case(7, 4)
    clean_out, clean_pool = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, FN_SLOTS, FN_HAS_INIT)
    poisoned = x.copy()
    poisoned[:, qsl[0]:qsl[1]] = np.nan  # row 0's tokens
    out, new = vllm.causal_conv1d_fn(poisoned, weight, bias, pool, qsl, FN_SLOTS, FN_HAS_INIT)
    others = np.ones(x.shape[1], bool)
    others[qsl[0]:qsl[1]] = False
    np.testing.assert_array_equal(_bits(np.asarray(out)[:, others]), _bits(np.asarray(clean_out)[:, others]))
    assert np.isnan(np.asarray(out)[:, qsl[0]:qsl[1]]).all()
    keep = [s for s in range(10) if s != FN_SLOTS[0]]
    _assert_pool(np.asarray(new)[keep], np.asarray(clean_pool)[keep])


def test_fn_gradients_reach_only_what_the_outputs_read():
    """The gradient of every output with respect to the pool is exactly zero outside the
    windows read (rows with an initial state and tokens: slots 7 and 0, columns 0:W-1), and
    with respect to x at the pad row's and the trailing tokens (NaN): nothing unread is
    multiplied."""
    x, weight, bias, pool, qsl = _fn_case(80, 4)
    loss = lambda x, w, b, pool: vllm.causal_conv1d_fn(x, w, b, pool, qsl, FN_SLOTS, FN_HAS_INIT)[0].sum()  # noqa: E731
    grads = [np.asarray(g) for g in jax.grad(loss, (0, 1, 2, 3))(x, weight, bias, pool)]
    assert all(np.isfinite(g).all() for g in grads)
    dx, dpool = grads[0], grads[3]
    read = np.zeros(dpool.shape, bool)
    read[[7, 0], :, :3] = True
    assert not dpool[~read].any() and dpool[read].all()
    assert not dx[:, qsl[3]:qsl[4]].any() and not dx[:, qsl[-1]:].any()


# --------------------------------------------------------------------- causal_conv1d_update

UPDATE_SLOTS = np.array([3, PAD, 0, 5], np.int32)


def _update_case(seed, width, layout, columns, pool_dtype=F32, x_dtype=F32):
    """``(x, rows, qsl, pool, weight, bias)``: four rows (the second a pad row, its tokens NaN);
    ``layout`` "one" ``(B, dim)``, "multi" ``(B, dim, 3)`` or "varlen" ``(T, dim)`` with rows
    of 3, 2, 0 and 1 tokens and two tokens of no row (NaN). Slots nobody reads are NaN."""
    rng = np.random.default_rng(seed)
    pool = _normal(rng, (SLOTS, D, columns), pool_dtype)
    pool[[1, 2, 4, 6, 7, 8, 9]] = np.nan
    pool[0] = _normal(rng, (D, columns), pool_dtype)
    weight, bias = _params(rng, width)
    if layout == "varlen":
        counts = [3, 2, 0, 1]
        qsl = _qsl(counts)
        x = _normal(rng, (int(qsl[-1]) + 2, D), x_dtype)
        x[qsl[1]:qsl[2]] = np.nan
        x[qsl[-1]:] = np.nan
        rows = [x[qsl[i]:qsl[i + 1]].T for i in range(4)]
        return x, rows, qsl, pool, weight, bias
    x = _normal(rng, (4, D) if layout == "one" else (4, D, 3), x_dtype)
    x[1] = np.nan
    rows = [r[:, None] if layout == "one" else r for r in x]
    return x, rows, None, pool, weight, bias


def _layout(outs, layout, like):
    """The oracle's per-row outputs in x's layout."""
    if layout == "one":
        return np.stack([o[:, 0] for o in outs])
    if layout == "multi":
        return np.stack(outs)
    out = np.zeros(like.shape)
    at = 0
    for o in outs:
        out[at:at + o.shape[1]] = o.T
        at += o.shape[1]
    return out


UPDATE_LAYOUTS = [("multi", 2), ("multi", 3), ("multi", 4), ("multi", 5), ("multi", 6), ("one", 4), ("varlen", 4)]


@pytest.mark.parametrize("layout, width", tiered(UPDATE_LAYOUTS, lambda c: c[1] in (2, 4), spread=True),
                         ids=[f"{layout}_W{width}" for layout, width in UPDATE_LAYOUTS])
def test_update_matches_the_contract(layout, width):
    x, rows, qsl, pool, weight, bias = _update_case(width, width, layout, width + 1)
    kw = {} if qsl is None else dict(query_start_loc=qsl, max_query_len=3)
    out, new = vllm.causal_conv1d_update(x, pool, weight, bias, "silu", UPDATE_SLOTS, **kw)
    outs, expected_pool = update_ref(rows, weight, bias, pool, UPDATE_SLOTS, activation="silu")
    assert out.shape == x.shape and out.dtype == F32
    expected = _layout(outs, layout, x)
    _assert_out(out, expected, weight, bias, F32, rows[0], rows[2], pool[[0, 3, 5]])
    _assert_pool(new, expected_pool)
    assert not np.asarray(out)[1 if layout != "varlen" else slice(qsl[1], qsl[2])].any()


@pytest.mark.parametrize("layout, width", [("multi", 4), ("varlen", 2)])
def test_update_num_accepted_tokens_keeps_vllms_sliding_window(layout, width):
    """Random acceptance: each row reads the window at column ``a - 1`` and writes the window
    without its oldest entry, then all its tokens, to columns ``0 : W - 2 + n``."""
    drafts = 2
    x, rows, qsl, pool, weight, bias = _update_case(20, width, layout, width - 1 + drafts)
    for seed in range(3):
        accepted = np.random.default_rng(seed).integers(1, drafts + 2, size=4).astype(np.int32)
        kw = {} if qsl is None else dict(query_start_loc=qsl, max_query_len=3)
        out, new = vllm.causal_conv1d_update(x, pool, weight, bias, True, UPDATE_SLOTS, accepted, **kw)
        outs, expected_pool = update_ref(rows, weight, bias, pool, UPDATE_SLOTS, accepted, activation=True)
        _assert_out(out, _layout(outs, layout, x), weight, bias, F32, rows[0], rows[2], pool[[0, 3, 5]])
        _assert_pool(new, expected_pool)


def test_update_block_tables_read_one_slot_and_write_another():
    """APC: 2-D block tables, read at ``initial_state_idx``, write at
    ``block_idx_last_scheduled_token``; the read slot is untouched where they differ."""
    x, rows, _, pool, weight, bias = _update_case(21, 4, "multi", 5)
    table = np.array([[3, 6, 4], [PAD, PAD, PAD], [0, 2, 1], [5, 5, 5]], np.int32)
    initial, last = np.array([0, 0, 0, 1]), np.array([1, 0, 2, 1])
    for accepted in (None, np.array([2, 1, 3, 1], np.int32)):
        out, new = vllm.causal_conv1d_update(x, pool, weight, bias, "silu", table, accepted,
                                             block_idx_last_scheduled_token=last, initial_state_idx=initial)
        outs, expected_pool = update_ref(rows, weight, bias, pool, table, accepted, "silu", last=last,
                                         initial=initial)
        _assert_out(out, np.stack(outs), weight, bias, F32, rows[0], rows[2], pool[[0, 3, 5]])
        _assert_pool(new, expected_pool)
        _assert_pool(np.asarray(new)[[3, 0]], pool[[3, 0]])  # rows 0 and 2 read slots 3 and 0, write others


def test_update_float32_pool_with_bfloat16_x():
    x, rows, _, pool, weight, bias = _update_case(22, 4, "multi", 3, pool_dtype=F32, x_dtype=BF16)
    out, new = vllm.causal_conv1d_update(x, pool, weight, bias, "silu", UPDATE_SLOTS)
    outs, expected_pool = update_ref(rows, weight, bias, pool, UPDATE_SLOTS, activation="silu")
    assert out.dtype == BF16 and new.dtype == F32
    _assert_out(out, np.stack(outs), weight, bias, BF16, rows[0], rows[2], pool[[0, 3, 5]])
    _assert_pool(new, expected_pool)


def test_update_nan_outside_the_window_reaches_nothing():
    """NaN in a slot's columns outside its window, in other rows' tokens and in pad rows:
    every other output and state is bit for bit the clean run's."""
    x, rows, _, pool, weight, bias = _update_case(23, 4, "multi", 5)
    accepted = np.array([2, 1, 1, 3], np.int32)  # windows: columns 1:4 of slot 3, 0:3 of slot 0, 2:5 of slot 5
    clean_out, clean_pool = vllm.causal_conv1d_update(x, pool, weight, bias, True, UPDATE_SLOTS, accepted)
    poisoned_pool = pool.copy()
    poisoned_pool[3][:, 0] = poisoned_pool[0][:, 3:] = poisoned_pool[5][:, :2] = np.nan
    poisoned = x.copy()
    poisoned[2] = np.nan  # row 2's tokens
    out, new = vllm.causal_conv1d_update(poisoned, poisoned_pool, weight, bias, True, UPDATE_SLOTS, accepted)
    for row, slot in ((0, 3), (3, 5)):
        np.testing.assert_array_equal(_bits(np.asarray(out)[row]), _bits(np.asarray(clean_out)[row]))
        np.testing.assert_array_equal(_bits(np.asarray(new)[slot]), _bits(np.asarray(clean_pool)[slot]))
    assert not np.asarray(out)[1].any()


def test_block_tables_without_prefix_caching_use_column_0():
    """(R, M) indices without block_idx_last_scheduled_token: each row reads and writes the
    slot in column 0, as with (R,) indices (the other columns, here out of the pool, unread)."""
    x, weight, bias, pool, qsl = _fn_case(4, 4)
    table = np.stack([FN_SLOTS, np.full(6, 99, np.int32)], axis=1)
    for a, b in zip(vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, table, FN_HAS_INIT),
                    vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, FN_SLOTS, FN_HAS_INIT)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    x, _, _, pool, weight, bias = _update_case(4, 4, "multi", 5)
    table = np.stack([UPDATE_SLOTS, np.full(4, 99, np.int32)], axis=1)
    for a, b in zip(vllm.causal_conv1d_update(x, pool, weight, bias, "silu", table),
                    vllm.causal_conv1d_update(x, pool, weight, bias, "silu", UPDATE_SLOTS)):
        np.testing.assert_array_equal(_bits(a), _bits(b))


# --------------------------------------------------------------------- replays


def _full(seq, weight, bias, activation="silu"):
    """``maskconv_kernels.causal_conv1d`` on a whole sequence ``(dim, L)``: ``(dim, L)``."""
    return np.asarray(causal_conv1d(jnp.asarray(seq.T)[None], jnp.asarray(weight.T), jnp.asarray(bias),
                                    activation=activation)[0]).T


def test_chunked_prefill_then_decode_equals_causal_conv1d_on_each_whole_sequence():
    """Three requests through the face as a server runs them, in steps of a fixed size (22
    tokens, 6 rows, pad rows filling the rest): prefill chunks of 3, 1 and 5 tokens, of 2
    (fewer than W - 1), 5 and 2, of 6 and 3, then five one-token decode steps. Each
    request's outputs, concatenated, equal causal_conv1d's on its whole sequence within
    float32 rounding, and its slot holds its last W - 1 inputs bit for bit (copies). Not
    bit for bit for the outputs: these are two programs, which XLA may compile with
    different multiply-add contractions (docs/design/fma_contraction.md); on CPU with jax
    0.10.2 and 0.11.2 they were equal bit for bit."""
    rng = np.random.default_rng(30)
    width = 4
    weight, bias = _params(rng, width)
    seqs = [_normal(rng, (D, 14)) for _ in range(3)]
    slots = np.array([4, 0, 2], np.int32)
    pool = np.full((SLOTS, D, width + 1), np.nan, np.float32)  # fresh requests' slots hold NaN: never read
    done = [0, 0, 0]
    outs = [[], [], []]
    for chunks in ({0: 3, 1: 2}, {0: 1, 1: 5, 2: 6}, {0: 5, 1: 2, 2: 3}):
        x = np.full((D, 22), np.nan, np.float32)  # tokens of no row: NaN
        qsl, idx, init = [0], [], []
        for r, n in chunks.items():
            x[:, qsl[-1]:qsl[-1] + n] = seqs[r][:, done[r]:done[r] + n]
            qsl.append(qsl[-1] + n)
            idx.append(slots[r])
            init.append(done[r] > 0)
        while len(idx) < 6:  # pad rows, the first with a NaN token
            qsl.append(qsl[-1] + (len(idx) == len(chunks)))
            idx.append(PAD)
            init.append(True)
        out, pool = vllm.causal_conv1d_fn(x, weight, bias, pool, np.array(qsl), np.array(idx, np.int32),
                                          np.array(init))
        for i, (r, n) in enumerate(chunks.items()):
            outs[r].append(np.asarray(out)[:, qsl[i]:qsl[i + 1]])
            done[r] += n
    for _ in range(5):  # one token a row, (B, dim)
        x = np.stack([seqs[r][:, done[r]] for r in range(3)] + [np.full((D,), np.nan)]).astype(np.float32)
        out, pool = vllm.causal_conv1d_update(x, pool, weight, bias, "silu", np.append(slots, PAD).astype(np.int32))
        for r in range(3):
            outs[r].append(np.asarray(out)[r][:, None])
            done[r] += 1
    for r, seq in enumerate(seqs):
        got = np.concatenate(outs[r], axis=1)
        assert got.shape == seq.shape
        _assert_out(got, _full(seq, weight, bias), weight, bias, F32, seq)
        np.testing.assert_array_equal(np.asarray(pool)[slots[r]][:, :width - 1], seq[:, -(width - 1):])


def test_speculative_replay_reads_the_window_ending_at_the_last_accepted_token():
    """A prefill, then verify steps of ``1 + k`` tokens (k = 2 drafts) with random acceptance
    (0 to k drafts), the rejected drafts NaN: each next call's ``num_accepted_tokens = a``
    reads the window ending at the previous call's ``a``-th token, so every accepted output
    equals the full sequence's and no rejected draft reaches one."""
    rng = np.random.default_rng(31)
    width, drafts = 4, 2
    weight, bias = _params(rng, width)
    seq = _normal(rng, (D, 60))
    k = width - 1
    pool = np.full((SLOTS, D, k + drafts), np.nan, np.float32)
    x = np.full((D, 22), np.nan, np.float32)
    x[:, :5] = seq[:, :5]
    qsl = np.array([0, 5, 5, 5, 5, 5, 5], np.int32)  # one request, five empty rows
    slots = np.array([1, PAD, PAD, PAD, PAD, PAD], np.int32)
    out, pool = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, slots, np.zeros(6, bool))
    got, done, accepted = [np.asarray(out)[:, :5]], 5, 1  # a = 1: a plain step from the prefill's state
    tokens = 1 + drafts
    while done + tokens <= seq.shape[1]:
        a = int(rng.integers(1, tokens + 1))
        x = np.full((4, D, tokens), np.nan, np.float32)  # rows 1 to 3: pad rows
        x[0, :, :a] = seq[:, done:done + a]
        out, pool = vllm.causal_conv1d_update(x, pool, weight, bias, True, np.array([1, PAD, PAD, PAD], np.int32),
                                              np.array([accepted, 1, 1, 1], np.int32))
        got.append(np.asarray(out)[0, :, :a])
        done, accepted = done + a, a
    got = np.concatenate(got, axis=1)
    _assert_out(got, _full(seq[:, :done], weight, bias), weight, bias, F32, seq)


# --------------------------------------------------------------------- jit, backends


def test_jit_with_traced_indices_and_the_pool_donated():
    x, weight, bias, pool, qsl, table, has_init, meta = _apc_case(40, 8)

    def prefill(x, pool, qsl, table, has_init, first, last, initial, computed):
        return vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, table, has_init, "silu", PAD, first, last, initial,
                                     computed, 8)

    fn = jax.jit(prefill, donate_argnums=1)
    operands = [jnp.asarray(a) for a in (qsl, table, has_init, meta["first"], meta["last"], meta["initial"],
                                         meta["computed"])]
    header = next(line for line in fn.lower(jnp.asarray(x), jnp.asarray(pool), *operands).compile().as_text()
                  .splitlines() if line.startswith("HloModule"))
    assert "input_output_alias={ {1}: (1, {}" in header, header  # the pool is updated in place
    out, new = fn(jnp.asarray(x), jnp.asarray(pool), *operands)
    expected, expected_pool = fn_ref(x, weight, bias, pool, qsl, table, has_init, **meta)
    _assert_out(out, expected, weight, bias, F32, x, pool[:, :, :3])
    _assert_pool(new, expected_pool)

    xu, rows, qslu, poolu, wu, bu = _update_case(41, 4, "varlen", 5)
    update = jax.jit(lambda x, pool, idx, a, q: vllm.causal_conv1d_update(
        x, pool, wu, bu, "silu", idx, a, q, max_query_len=3))
    accepted = np.array([3, 1, 1, 2], np.int32)
    out, new = update(jnp.asarray(xu), jnp.asarray(poolu), jnp.asarray(UPDATE_SLOTS), jnp.asarray(accepted),
                      jnp.asarray(qslu))
    outs, expected_pool = update_ref(rows, wu, bu, poolu, UPDATE_SLOTS, accepted, activation="silu")
    _assert_out(out, _layout(outs, "varlen", xu), wu, bu, F32, rows[0], rows[2], poolu[[0, 3, 5]])
    _assert_pool(new, expected_pool)


def test_pallas_triton_backend_interpreted():
    """The step's fused kernels (interpreted off GPUs) through the face: outputs within
    float32 rounding of the oracle, states bit for bit (copies, whatever the backend)."""
    x, rows, _, pool, weight, bias = _update_case(50, 4, "multi", 3)
    try:
        out, new = vllm.causal_conv1d_update(x, pool, weight, bias, "silu", UPDATE_SLOTS,
                                             implementation="pallas_triton", interpret=not ON_GPU)
    except NotImplementedError as e:
        pytest.xfail(f"unsupported: {e}")
    outs, expected_pool = update_ref(rows, weight, bias, pool, UPDATE_SLOTS, activation="silu")
    _assert_out(out, np.stack(outs), weight, bias, F32, rows[0], rows[2], pool[[0, 3, 5]])
    _assert_pool(new, expected_pool)


def test_metadata_is_accepted_and_unused():
    x, weight, bias, pool, qsl = _fn_case(60, 3)
    out, _ = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, FN_SLOTS, FN_HAS_INIT, metadata=object())
    plain, _ = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, FN_SLOTS, FN_HAS_INIT)
    np.testing.assert_array_equal(_bits(out), _bits(plain))


def _chain_outputs(row, window, parents, weight, bias):
    """Each token's output along its parent chain (a row ``(dim, n)``, its window ``(dim, W - 1)``):
    ``causal_conv1d`` on the window then the chain, its last output."""
    outs = []
    for t in range(row.shape[1]):
        chain = [t]
        while chain[-1] > 0:
            chain.append(int(parents[chain[-1]]))
        u = np.concatenate([window, row[:, chain[::-1]]], axis=1)
        outs.append(np.asarray(causal_conv1d(jnp.asarray(u.T)[None], weight.T, bias, activation="silu")[0, -1]))
    return np.stack(outs, axis=1)


@pytest.mark.parametrize("layout", ["multi", "varlen"])
def test_update_retrieve_parent_token_walks_each_drafts_parent_chain(layout):
    """EAGLE trees: each token's output is the chain's (its parent, grandparent, ..., then the
    window read), a NaN draft reaches none of its siblings' or cousins' outputs, and the pool
    is written as without the tree (vLLM's kernel writes the same states)."""
    x, rows, qsl, pool, weight, bias = _update_case(70, 4, layout, 5)
    tree = np.array([[0, 0, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0]], np.int32)  # row 0: two siblings; row 2: a chain
    x = np.array(x)
    nan_draft = (0, slice(None), 1) if layout == "multi" else (1,)  # row 0's first draft
    x[nan_draft] = np.nan
    rows[0] = np.array(rows[0])
    rows[0][:, 1] = np.nan
    kw = dict(max_query_len=3, query_start_loc=qsl) if layout == "varlen" else {}
    out, new = vllm.causal_conv1d_update(x, pool, weight, bias, "silu", UPDATE_SLOTS, retrieve_parent_token=tree, **kw)
    plain_out, plain_pool = vllm.causal_conv1d_update(x, pool, weight, bias, "silu", UPDATE_SLOTS, **kw)
    np.testing.assert_array_equal(_bits(new), _bits(plain_pool))
    out = np.asarray(out, np.float64)
    for i, slot in enumerate(UPDATE_SLOTS):
        if slot == PAD or rows[i].shape[1] == 0:
            continue
        expected = _chain_outputs(np.asarray(rows[i], np.float64), np.asarray(pool[slot][:, :3], np.float64),
                                  tree[i], np.asarray(weight, np.float64), np.asarray(bias, np.float64))
        got = out[i] if layout == "multi" else out[qsl[i]:qsl[i + 1]].T
        finite = np.isfinite(expected).all(axis=0)
        assert_close(got[:, finite], expected[:, finite], F32, 4, float(np.abs(expected[:, finite]).max() + 1))
        assert np.isnan(got[:, ~finite]).all()
    assert np.isfinite(out[0][:, [0, 2]] if layout == "multi" else out[[0, 2]]).all(), "the NaN draft reached its sibling"


def test_update_retrieve_parent_token_refuses_a_parent_outside_the_row():
    x, _, _, pool, weight, bias = _update_case(71, 4, "multi", 3)
    with pytest.raises(ValueError, match=r"retrieve_parent_token must name, for each token after a row's first, an "
                                         r"earlier token"):
        vllm.causal_conv1d_update(x, pool, weight, bias, "silu", UPDATE_SLOTS,
                                  retrieve_parent_token=np.array([[0, 0, 2]] * 4, np.int32))
    with pytest.raises(ValueError, match=r"retrieve_parent_token must be \(B, L\) = \(4, L\)"):
        vllm.causal_conv1d_update(x, pool, weight, bias, "silu", UPDATE_SLOTS,
                                  retrieve_parent_token=np.zeros((3, 3), np.int32))


# --------------------------------------------------------------------- bad input

FN_ARGS = dict(x=np.zeros((D, 6), np.float32), weight=np.ones((D, 4), np.float32), bias=None,
               conv_states=np.zeros((4, D, 3), np.float32), query_start_loc=np.array([0, 2, 5], np.int32),
               cache_indices=np.array([0, 1], np.int32))
APC = dict(cache_indices=np.array([[0, 1], [2, 3]], np.int32), block_idx_first_scheduled_token=np.array([0, 0]),
           block_idx_last_scheduled_token=np.array([0, 0]), initial_state_idx=np.array([0, 0]),
           num_computed_tokens=np.array([0, 0]), block_size_to_align=8)


@pytest.mark.parametrize("changes, error, message", [
    (dict(x=np.zeros((1, D, 6), np.float32)), ValueError, r"x must be \(dim, T\)"),
    (dict(x=np.zeros((D, 6), np.int32)), TypeError, r"x must hold floats, got dtype int32"),
    (dict(weight=np.ones((4, D), np.float32)), ValueError,
     r"weight must be \(dim, W\) = \(8, W >= 2\).*pass weight\.T"),
    (dict(weight=np.ones((D, 1), np.float32)), ValueError, r"weight must be \(dim, W\)"),
    (dict(bias=np.ones(3, np.float32)), ValueError, r"bias must be \(dim,\) = \(8,\)"),
    (dict(conv_states=np.zeros((4, D, 2), np.float32)), ValueError, r"conv_states must be \(N, dim, S\) with dim = 8 "
                                                                    r"and S >= W - 1 = 3.*got \(4, 8, 2\)"),
    (dict(conv_states=np.zeros((4, D, 3), np.int32)), TypeError, r"conv_states must hold floats"),
    (dict(query_start_loc=np.array([0, 4, 2])), ValueError, r"query_start_loc must .* never decrease.*got \[0 4 2\]"),
    (dict(query_start_loc=np.array([0.0, 2.0])), TypeError, r"query_start_loc must hold integers"),
    (dict(cache_indices=np.array([0, 4], np.int32)), ValueError, r"cache_indices: each row's read slot must be a slot "
                                                                 r"of the pool, in \[0, 4\).*got \[0 4\]"),
    (dict(cache_indices=np.array([0.0, 1.0])), TypeError, r"cache_indices must hold signed integers"),
    (dict(cache_indices=np.array([0, 1, 2], np.int32)), ValueError, r"cache_indices must be \(R,\) slots or \(R, M\)"),
    (dict(cache_indices=np.array([1, 1], np.int32)), ValueError, r"two rows write one slot"),
    (dict(has_initial_state=np.array([1, 0])), TypeError, r"has_initial_state must hold bools"),
    (dict(activation="relu"), ValueError, r"activation must be None, False, True, 'silu' or 'swish'"),
    (dict(num_computed_tokens=np.array([0, 0])), ValueError, r".*num_computed_tokens are for prefix caching"),
    (dict(initial_state_idx=np.array([0, 0])), ValueError, r"initial_state_idx is for prefix caching"),
    (dict(APC, cache_indices=np.array([0, 1], np.int32)), ValueError,
     r".*needs cache_indices as \(R, M\) block tables"),
    (dict(APC, block_size_to_align=0), ValueError, r"block_size_to_align must be a positive int"),
    (dict(APC, block_idx_last_scheduled_token=np.array([1, 0])), ValueError,
     r".*every block boundary they name must lie inside the row's chunk"),
    (dict(APC, initial_state_idx=np.array([0, 2])), ValueError, r"initial_state_idx must be columns of cache_indices"),
    (dict(APC, validate_data=True, block_size_to_align=12), ValueError, r"validate_data=True: .*multiple of 8"),
    (dict(weight=np.ones((D, 5), np.float32), conv_states=np.zeros((4, D, 4), np.float32), validate_data=True),
     ValueError, r"validate_data=True: vLLM's causal_conv1d_fn takes widths 2 to 4, got W = 5"),
])
def test_fn_bad_input_names_the_argument(changes, error, message):
    args = dict(FN_ARGS, **changes)
    with pytest.raises(error, match="^compat.vllm.causal_conv1d_fn: " + message):
        vllm.causal_conv1d_fn(**args)


UPDATE_ARGS = dict(x=np.zeros((2, D, 2), np.float32), conv_state=np.zeros((4, D, 4), np.float32),
                   weight=np.ones((D, 4), np.float32), conv_state_indices=np.array([0, 1], np.int32))


@pytest.mark.parametrize("changes, error, message", [
    (dict(x=np.zeros((2, D, 2, 1), np.float32)), ValueError, r"x must be \(B, dim\) for one token"),
    (dict(x=np.zeros((2, D, 2), np.float32), query_start_loc=np.array([0, 1, 2])), ValueError,
     r"x must be \(T, dim\) with query_start_loc"),
    (dict(conv_state_indices=None, conv_state=np.zeros((1, D, 4), np.float32)), ValueError,
     r"without conv_state_indices row i uses slot i, so the pool needs at least R = 2 slots, got 1"),
    (dict(num_accepted_tokens=np.array([1, 1]), conv_state=np.zeros((4, D, 3), np.float32)), ValueError,
     r"conv_state must hold W - 2 \+ L = 4 columns for the sliding window"),
    (dict(num_accepted_tokens=np.array([0, 1])), ValueError, r"num_accepted_tokens must be in \[1, S - W \+ 2\] = "
                                                             r"\[1, 2\].*got \[0 1\]"),
    (dict(num_accepted_tokens=np.array([1.0, 1.0])), TypeError, r"num_accepted_tokens must hold integers"),
    (dict(x=np.zeros((4, D), np.float32), query_start_loc=np.array([0, 3, 4]), max_query_len=2), ValueError,
     r"max_query_len = 2 must be at least every row's tokens, got rows of \[3 1\]"),
    (dict(x=np.zeros((4, D), np.float32), query_start_loc=np.array([0, 3, 4]), max_query_len=3, validate_data=True),
     ValueError, r"validate_data=True: vLLM's kernel writes a wrong state"),
    (dict(pad_slot_id=None, validate_data=True), ValueError, r"validate_data=True: .*asserts pad_slot_id is not None"),
    (dict(x=np.zeros((4, D), np.float32), query_start_loc=np.array([0, 3, 4]), validate_data=True), ValueError,
     r"validate_data=True: vLLM's causal_conv1d_update needs max_query_len with query_start_loc"),
    (dict(conv_state_indices=np.array([[0], [1]], np.int32), block_idx_last_scheduled_token=np.array([0, 0])),
     ValueError, r".*needs initial_state_idx \(R,\)"),
])
def test_update_bad_input_names_the_argument(changes, error, message):
    args = dict(UPDATE_ARGS, **changes)
    with pytest.raises(error, match="^compat.vllm.causal_conv1d_update: " + message):
        vllm.causal_conv1d_update(**args)


def test_validate_data_accepts_what_vllm_runs():
    """``validate_data=True`` refuses only what vLLM's kernels would not run: a call they
    take gives what the call without it gives."""
    x, weight, bias, pool, qsl = _fn_case(70, 4)
    checked = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, FN_SLOTS, FN_HAS_INIT, validate_data=True)
    plain = vllm.causal_conv1d_fn(x, weight, bias, pool, qsl, FN_SLOTS, FN_HAS_INIT)
    for a, b in zip(checked, plain):
        np.testing.assert_array_equal(_bits(a), _bits(b))
