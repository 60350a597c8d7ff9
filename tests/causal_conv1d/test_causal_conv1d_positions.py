"""Packing by positions (RecurrentGemma's ``segment_pos``, MaxText's positions): 0 starts a
document anywhere, a negative position is padding.

Every form (the full pass, the decode update, the scheduler step, the Flax ShortConv
modules) must give each document's outputs as if it ran alone from zeros, bit for bit
where the programs are the same and within the dtype's rounding where they differ; a
state is read only by a row whose first token continues its document; and a document
may start inside a multi-token decode chunk, which segment ids at the chunk's start
cannot say.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels.ops.causal_conv1d import causal_conv1d_reference

F32 = np.dtype(np.float32)
D, W = 6, 4
POSITIONS = np.array([
    [-1, -1, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5],  # left-padded prompt, then two more documents
    [7, 8, 9, 0, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1],    # continues the state's document, then three
])
L = POSITIONS.shape[1]


def _ids(positions):
    """The documented conversion: the running count of starts, -1 for padding."""
    ids = np.cumsum(positions == 0, axis=1)
    return np.where(positions < 0, -1, ids)


def _alone(x, weight, bias, positions, state):
    """Each document run alone by the float64 reference: zeros before it, or the state for
    the document a row continues; zeros at padding."""
    y = np.zeros(x.shape)
    ids = _ids(positions)
    for b in range(x.shape[0]):
        for doc in set(ids[b].tolist()) - {-1}:
            where = np.flatnonzero(ids[b] == doc)
            initial = state[b:b + 1] if doc == 0 else None
            y[b, where] = causal_conv1d_reference(x[b:b + 1, where], weight, bias, initial_state=initial,
                                                  activation="silu")[0]
    return y


def test_positions_are_the_segment_ids_they_convert_to_and_each_document_runs_alone():
    x, w, b, state = random(1, (2, L, D)), random(2, (W, D)), random(3, (D,)), random(4, (2, W - 1, D))
    y, final = mk.causal_conv1d(x, w, b, positions=POSITIONS, initial_state=state, activation="silu",
                                return_final_state=True)
    # Row 1 continues the state's document (ids 0, as the state's); row 0 starts with padding.
    np.testing.assert_array_equal(np.asarray(y), np.asarray(mk.causal_conv1d(
        x, w, b, segment_ids=_ids(POSITIONS), initial_state=state.at[0].set(0.0), activation="silu")))
    assert_close(y, _alone(np.asarray(x, np.float64), w, b, POSITIONS, np.asarray(state, np.float64)), F32, W, 4.0)
    assert not np.asarray(y)[0, :2].any()  # padding
    np.testing.assert_array_equal(np.asarray(final[0]), np.asarray(x[0, -3:]))
    np.testing.assert_array_equal(np.asarray(final[1, 0]), 0.0)  # the last document began 2 tokens ago: 1 zero
    np.testing.assert_array_equal(np.asarray(final[1, 1:]), np.asarray(x[1, -2:]))


def test_a_state_is_read_only_by_a_row_that_continues_its_document():
    x, w = random(5, (2, 5, D)), random(6, (W, D))
    state = jnp.full((2, W - 1, D), jnp.nan)
    starts = np.array([[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]])
    y = mk.causal_conv1d(x, w, positions=starts, initial_state=state)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(mk.causal_conv1d(x, w, positions=starts)))
    continued = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    dstate = jax.grad(lambda s: mk.causal_conv1d(x, w, positions=continued, initial_state=s).sum())(random(7, state.shape))
    assert np.abs(np.asarray(dstate[0])).min() > 0 and not np.asarray(dstate[1]).any()  # exactly 0.0


def test_positions_with_segment_ids_is_an_error_naming_both():
    x, w = random(8, (2, L, D)), random(9, (W, D))
    with pytest.raises(ValueError, match=r"^causal_conv1d: pass segment_ids or positions, not both"):
        mk.causal_conv1d(x, w, segment_ids=_ids(POSITIONS), positions=POSITIONS)
    with pytest.raises(ValueError, match=r"^causal_conv1d: positions must have"):
        mk.causal_conv1d(x, w, positions=POSITIONS[:, :3])
    with pytest.raises(TypeError, match=r"^causal_conv1d: positions must hold integers"):
        mk.causal_conv1d(x, w, positions=POSITIONS.astype(np.float32))


@pytest.mark.parametrize("chunks", [(1,) * L, (3, 1, 4, 2, 4), (L,)], ids=["tokens", "chunks", "one"])
def test_decoding_in_chunks_with_positions_equals_the_full_pass(chunks):
    """Documents start inside chunks (row 1's at 3, 4 and 12, row 0's at 6 and 8); the pool's
    slots start as NaN: only a row that continues its document reads its slot."""
    x, w, b = random(10, (2, L, D)), random(11, (W, D)), random(12, (D,))
    full = mk.causal_conv1d(x, w, b, positions=POSITIONS, activation="silu")
    pool, ys, start = jnp.full((2, W - 1, D), jnp.nan), [], 0
    pool = pool.at[1].set(0.0)  # row 1 continues a document: its slot holds its (zero) past
    step = jax.jit(lambda x, pool, pos: mk.causal_conv1d_update(x, pool, w, b, activation="silu", positions=pos))
    for n in chunks:
        y, pool = step(x[:, start:start + n], pool, POSITIONS[:, start:start + n])
        ys.append(y)
        start += n
    assert_close(jnp.concatenate(ys, axis=1), full, F32, W, 4.0)
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(
        mk.causal_conv1d(x, w, b, positions=POSITIONS, return_final_state=True)[1]))


def test_the_update_takes_one_token_and_refuses_circular_states():
    x, w = random(13, (2, D)), random(14, (W, D))
    pool = random(15, (2, W - 1, D))
    y, new = mk.causal_conv1d_update(x, pool, w, positions=np.array([0, 5]))
    expected, _ = mk.causal_conv1d_update(x, pool.at[0].set(0.0), w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(new[0, :-1]), 0.0)  # a new document: zeros before its first token
    with pytest.raises(ValueError, match=r"^causal_conv1d_update: positions takes linear states only"):
        mk.causal_conv1d_update(x, pool, w, positions=np.array([0, 5]), cache_seqlens=np.array([3, 3]))


def _schedule_step(w, b, seqs, positions, chunks_per_step, tokens=12):
    """Runs requests through scheduler steps of ``tokens`` tokens (two requests, slots 0 and
    2 of a NaN pool); returns each request's outputs concatenated and the pool."""
    pool = jnp.full((3, W - 1, D), jnp.nan)
    step = jax.jit(lambda x, pool, qsl, fresh, pos: mk.causal_conv1d_step(
        x, pool, w, b, query_start_loc=qsl, state_indices=jnp.array([0, 2]), has_initial_state=fresh,
        activation="silu", positions=pos))
    done, outs = [0, 0], [[], []]
    for chunks in chunks_per_step:
        x, pos, qsl = np.zeros((tokens, D), np.float32), np.zeros(tokens, np.int32), [0]
        for r, n in enumerate(chunks):
            a = qsl[-1]
            x[a:a + n], pos[a:a + n] = seqs[r][done[r]:done[r] + n], positions[r][done[r]:done[r] + n]
            qsl.append(a + n)
        y, pool = step(x, pool, jnp.array(qsl), jnp.array([d > 0 for d in done]), pos)
        for r, n in enumerate(chunks):
            outs[r].append(np.asarray(y[qsl[r]:qsl[r + 1]]))
            done[r] += n
    return [np.concatenate(o) for o in outs], pool


@pytest.mark.slow  # the step's own replay is the fast tier's
def test_the_scheduler_step_with_positions_replays_each_requests_full_pass():
    w, b = random(16, (W, D)), random(17, (D,))
    positions = [np.array([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]), np.array([0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1])]
    seqs = [np.asarray(random(18 + r, (len(p), D))) for r, p in enumerate(positions)]
    outs, pool = _schedule_step(w, b, seqs, positions, [(2, 1), (5, 4), (1, 1), (3, 5)])
    for r in range(2):
        full, state = mk.causal_conv1d(seqs[r][None], w, b, positions=positions[r][None], activation="silu",
                                       return_final_state=True)
        assert_close(outs[r], full[0], F32, W, 4.0)
        np.testing.assert_array_equal(np.asarray(pool[2 * r]), np.asarray(state[0]))
    # Request 1's last document began two tokens before the end: the state is zero before it.
    np.testing.assert_array_equal(np.asarray(pool[2, 0]), 0.0)


def test_the_scheduler_step_refuses_negative_positions_and_prefix_caching_with_positions():
    w = random(20, (W, D))
    x, pool = random(21, (4, D)), jnp.zeros((2, W - 1, D))
    kw = dict(query_start_loc=jnp.array([0, 4]), state_indices=jnp.array([0]))
    with pytest.raises(ValueError, match=r"^causal_conv1d_step: positions must be non-negative"):
        mk.causal_conv1d_step(x, pool, w, positions=np.array([-1, 0, 1, 2]), **kw)
    with pytest.raises(ValueError, match=r"^causal_conv1d_step: positions with block_size"):
        mk.causal_conv1d_step(x, pool, w, positions=np.array([0, 1, 2, 3]), block_size=2,
                              block_indices=jnp.array([[1, -1]]), num_computed_tokens=jnp.array([0]), **kw)


def test_the_flax_short_conv_decodes_a_recurrentgemma_style_prompt_by_positions():
    """linen and nnx: a left-padded prompt prefilled, then decoded token by token with the
    sampler's positions, equals the full pass over the whole sequence."""
    pytest.importorskip("flax")
    from flax import nnx

    from maskconv_kernels.flax import ShortConv
    from maskconv_kernels.flax import nnx as mk_nnx

    x = random(22, (2, 9, D))
    positions = np.array([[-1, -1, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    linen = ShortConv(kernel_size=W, activation="silu", decode=True)
    variables = linen.init(jax.random.key(0), x)
    full = ShortConv(kernel_size=W, activation="silu").apply({"params": variables["params"]}, x, positions=positions)
    cache = {"cache": variables["cache"]}
    y, cache = linen.apply({"params": variables["params"], **cache}, x[:, :6], positions=positions[:, :6],
                           mutable=["cache"])
    ys = [y]
    for t in range(6, 9):
        y, cache = linen.apply({"params": variables["params"], **cache}, x[:, t:t + 1],
                               positions=positions[:, t:t + 1], mutable=["cache"])
        ys.append(y)
    assert_close(jnp.concatenate(ys, axis=1), full, F32, W, 4.0)

    module = mk_nnx.ShortConv(D, W, activation="silu", rngs=nnx.Rngs(0))
    full = module(x, positions=positions)
    module.init_cache(x.shape)
    ys = [module(x[:, :4], positions=positions[:, :4], decode=True)]
    ys += [module(x[:, t:t + 1], positions=positions[:, t:t + 1], decode=True) for t in range(4, 9)]
    assert_close(jnp.concatenate(ys, axis=1), full, F32, W, 4.0)
