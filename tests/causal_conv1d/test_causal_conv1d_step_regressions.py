"""``causal_conv1d_step`` against the serving bugs of the public trackers, one case each.

Each test names the bug whose class it rules out; the semantics are ported, not the code.
Prefix caching with a chunk shorter than ``W - 1`` (vLLM#56196, Megatron#6711) is
``test_causal_conv1d_step.py::test_prefix_caching_writes_each_block_state_and_a_new_request_starts_from_one``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close, random

from maskconv_kernels.ops.causal_conv1d import PAD_SLOT_ID, causal_conv1d, causal_conv1d_step

F32 = np.dtype(np.float32)
D, W = 8, 4


def _full(seq, w):
    return np.asarray(causal_conv1d(jnp.asarray(seq)[None], w, activation="silu")[0])


def _scale(seq, w):
    return float(np.abs(np.asarray(seq)).max() * np.abs(np.asarray(w)).max() * W + 1)


def test_vllm_44296_50272_drafts_need_a_state_widened_by_k():
    """LFM2's short conv corrupted its state at the first rejected draft until the state
    was widened by the number of drafts. Here a slot of ``W - 1`` inputs refuses a step
    that says more than one token was accepted, and a slot of ``W - 1 + k`` inputs gives
    the full pass at the first rejected draft."""
    seq, w = np.asarray(random(1, (12, D), F32)), random(2, (W, D), F32)
    narrow = jnp.zeros((2, W - 1, D))
    with pytest.raises(ValueError, match=r"num_accepted_tokens must be in \[1, state_len - \(W - 1\) \* dilation "
                                         r"\+ 1\] = \[1, 1\]"):
        causal_conv1d_step(jnp.zeros((4, D)), narrow, w, query_start_loc=jnp.array([0, 3]),
                           state_indices=jnp.array([0]), num_accepted_tokens=jnp.array([2]))
    k = 2
    pool = jnp.full((2, W - 1 + k, D), jnp.nan)
    step = lambda x, pool, fresh, accepted: causal_conv1d_step(
        jnp.asarray(x), pool, w, query_start_loc=jnp.array([0, 3]), state_indices=jnp.array([1]),
        has_initial_state=jnp.array([fresh]), num_accepted_tokens=jnp.array([accepted]), activation="silu")
    x = np.concatenate([seq[:3], np.zeros((1, D), np.float32)])
    y1, pool = step(x, pool, False, k + 1)
    x = np.concatenate([seq[3:4], np.full((2, D), np.nan, np.float32), np.zeros((1, D), np.float32)])  # 2 rejected
    y2, pool = step(x, pool, True, k + 1)
    x = np.concatenate([seq[4:7], np.zeros((1, D), np.float32)])
    y3, _ = step(x, pool, True, 1)  # the first draft was rejected: the window ends at the root
    got = np.concatenate([y1[:3], y2[:1], y3[:3]])
    assert_close(got, _full(seq[:7], w), F32, W, _scale(seq, w))


def test_vllm_52942_48475_zero_drafts_and_zero_accepted():
    """A zero-draft row in a speculative batch read a stale state column (vLLM#52942); a
    discarded row with ``num_accepted_tokens == 0`` indexed column -1 and crashed a GPU
    (vLLM#48475). Here a row of one token beside rows of ``1 + k`` gives the full pass, and
    0 accepted is refused by name."""
    k = 2
    seqs = [np.asarray(random(10 + r, (8, D), F32)) for r in range(2)]
    w = random(3, (W, D), F32)
    pool = jnp.full((3, W - 1 + k, D), jnp.nan)
    x = np.zeros((8, D), np.float32)
    x[:4], x[4:8] = seqs[0][:4], seqs[1][:4]
    y1, pool = causal_conv1d_step(jnp.asarray(x), pool, w, query_start_loc=jnp.array([0, 4, 8]),
                                  state_indices=jnp.array([0, 2]), has_initial_state=jnp.array([False, False]),
                                  activation="silu")
    x = np.zeros((8, D), np.float32)
    x[0] = seqs[0][4]                                          # row 0: zero drafts
    x[1:4] = np.concatenate([seqs[1][4:6], np.full((1, D), np.nan, np.float32)])  # row 1: 1 + 2, the last rejected
    step = lambda x, pool, accepted: causal_conv1d_step(
        jnp.asarray(x), pool, w, query_start_loc=jnp.array([0, 1, 4]), state_indices=jnp.array([0, 2]),
        num_accepted_tokens=jnp.asarray(accepted), activation="silu")
    y2, pool = step(x, pool, [k + 1, k + 1])
    x = np.zeros((8, D), np.float32)
    x[0], x[1] = seqs[0][5], seqs[1][6]
    y3, _ = step(x, pool, [k + 1, 2])  # row 0's one token and row 1's first two were accepted
    assert_close(np.concatenate([y1[:4], y2[:1], y3[:1]]), _full(seqs[0][:6], w), F32, W, _scale(seqs[0], w))
    assert_close(np.concatenate([y1[4:8], y2[1:3], y3[1:2]]), _full(seqs[1][:7], w), F32, W, _scale(seqs[1], w))
    with pytest.raises(ValueError, match=r"num_accepted_tokens must be in \[1, .*got \[3 0\]"):
        step(x, pool, [3, 0])


def test_sglang_30974_vllm_36639_pad_rows_read_and_write_nothing():
    """Uninitialised ``PAD_SLOT_ID`` rows hung a server (sglang#30974) and tripped a
    CUDA-graph assertion (vLLM#36639). Here a step of pad rows only, with NaN tokens and a
    NaN pool, gives zeros and leaves every slot's bits as they were; a pad row's tokens
    beside a real row's reach nothing."""
    w = random(4, (W, D), F32)
    pool = jnp.asarray(np.where(np.arange(3)[:, None, None] == 1, np.nan, np.asarray(random(5, (3, W - 1, D), F32))))
    x = jnp.full((6, D), jnp.nan)
    y, new = causal_conv1d_step(x, pool, w, query_start_loc=jnp.array([0, 2, 6]),
                                state_indices=jnp.array([PAD_SLOT_ID, PAD_SLOT_ID]))
    assert (np.asarray(y) == 0).all()
    np.testing.assert_array_equal(np.asarray(new).view(np.uint32), np.asarray(pool).view(np.uint32))
    seq = np.asarray(random(6, (4, D), F32))
    x = x.at[2:6].set(seq)
    y, new = causal_conv1d_step(x, pool, w, query_start_loc=jnp.array([0, 2, 6]),
                                state_indices=jnp.array([PAD_SLOT_ID, 0]), has_initial_state=jnp.array([True, False]),
                                activation="silu")
    assert (np.asarray(y[:2]) == 0).all()
    assert_close(y[2:], _full(seq, w), F32, W, _scale(seq, w))


def test_vllm_48375_a_block_crossed_by_drafts_is_not_cached():
    """With drafts and prefix caching, a Mamba state at a boundary that unverified drafts
    crossed was published and spread to every request sharing the prefix (vLLM#48375: the
    block drop was ignored). Here a row whose drafts cross a boundary names
    ``PAD_SLOT_ID`` for that block and its slot keeps its bits; the block a prefill
    completed is cached, and a request starting from it gives the full pass."""
    k, K = 2, 4
    seq, w = np.asarray(random(7, (12, D), F32)), random(8, (W, D), F32)
    pool = jnp.full((6, W - 1 + k, D), jnp.nan)
    x = np.zeros((8, D), np.float32)
    x[:5] = seq[:5]
    _, pool = causal_conv1d_step(jnp.asarray(x), pool, w, query_start_loc=jnp.array([0, 5]),
                                 state_indices=jnp.array([0]), has_initial_state=jnp.array([False]), block_size=K,
                                 block_indices=jnp.array([[3, 4]]), num_computed_tokens=jnp.array([0]))
    x = np.zeros((8, D), np.float32)
    x[:3] = np.concatenate([seq[5:7], np.full((1, D), np.nan, np.float32)])  # tokens 5, 6, 7: 7 is a draft, rejected
    _, pool = causal_conv1d_step(jnp.asarray(x), pool, w, query_start_loc=jnp.array([0, 3]),
                                 state_indices=jnp.array([0]), num_accepted_tokens=jnp.array([k + 1]), block_size=K,
                                 block_indices=jnp.array([[PAD_SLOT_ID, PAD_SLOT_ID]]),
                                 num_computed_tokens=jnp.array([5]))
    assert np.isnan(np.asarray(pool[4])).all(), "the block the drafts crossed is not cached"
    x = np.zeros((8, D), np.float32)
    x[:8] = seq[4:12]
    y, _ = causal_conv1d_step(jnp.asarray(x), pool, w, query_start_loc=jnp.array([0, 8]),
                              state_indices=jnp.array([3]), write_indices=jnp.array([5]), activation="silu")
    assert_close(y, _full(seq, w)[4:], F32, W, _scale(seq, w))


def test_an_unchecked_parent_outside_its_row_reads_nan_not_another_request():
    """Traced ``parents`` are checked under ``checkify`` only; unchecked, a parent that names a
    token outside its row makes that token's output NaN (the bug shows) and no other
    request's output changes."""
    w = random(9, (W, D), F32)
    x = jnp.asarray(random(10, (6, D), F32))
    step = jax.jit(lambda x, parents: causal_conv1d_step(
        x, jnp.zeros((2, W - 1, D)), w, query_start_loc=jnp.array([0, 3, 6]), state_indices=jnp.array([0, 1]),
        parents=parents))
    good = np.asarray(step(x, jnp.array([-1, 0, 1, -1, 0, 1]))[0])
    bad = np.asarray(step(x, jnp.array([-1, 0, 4, -1, 0, 1]))[0])  # token 2 names token 4 (the other row's)
    assert np.isnan(bad[2]).all()
    np.testing.assert_array_equal(bad[[0, 1, 3, 4, 5]], good[[0, 1, 3, 4, 5]])
