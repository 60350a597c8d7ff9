"""``causal_conv1d_step``: a continuous-batching scheduler's steps against ``causal_conv1d`` on
each request's whole sequence.

A schedule runs requests through steps of a fixed size (``T`` tokens, ``R`` requests,
padded), as a server does: prefill chunks of any length (1, and fewer than ``W - 1``,
included), decode steps, pad rows, requests that start fresh in slots full of NaN. Each
request's outputs, concatenated over its steps, must equal ``causal_conv1d``'s on its
whole sequence within the dtype's rounding (two programs: XLA may contract their
multiply-adds differently), and its states, which are copies of its inputs, bit for bit.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close, random
from support.tiers import tiered

from maskconv_kernels.ops.causal_conv1d import PAD_SLOT_ID, causal_conv1d, causal_conv1d_step

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)
D = 8


def _run(seqs, schedule, w, b, *, pool, slots, tokens, requests, block=None, **kw):
    """Runs ``schedule`` (a list of steps, each ``{request: chunk length}``); returns each
    request's outputs, concatenated, and the pool after the last step.

    Request ``r`` lives in slot ``slots[r]``; its first step starts it fresh. ``block``:
    ``(K, block_slots (n_requests, M))`` for prefix caching.
    """
    done = {r: 0 for r in range(len(seqs))}
    outs = {r: [] for r in range(len(seqs))}
    step = jax.jit(lambda x, pool, *a, **k: causal_conv1d_step(x, pool, w, b, **k, **kw), static_argnames=("block_size",))
    for chunks in schedule:
        x = np.zeros((tokens, D), seqs[0].dtype)
        qsl, read, fresh, computed, table = [0], [], [], [], []
        for r, n in chunks.items():
            x[qsl[-1]:qsl[-1] + n] = seqs[r][done[r]:done[r] + n]
            qsl.append(qsl[-1] + n)
            read.append(slots[r])
            fresh.append(done[r] > 0)
            computed.append(done[r])
            if block is not None:
                table.append(block[1][r])
        while len(read) < requests:  # pad rows, with tokens of their own: NaN, never read
            x[qsl[-1]:qsl[-1] + 1] = np.nan
            qsl.append(qsl[-1] + 1)
            read.append(PAD_SLOT_ID)
            fresh.append(True)
            computed.append(0)
            if block is not None:
                table.append(np.full_like(block[1][0], PAD_SLOT_ID))
        extra = {}
        if block is not None:
            extra = dict(block_size=block[0], block_indices=jnp.asarray(np.stack(table)),
                         num_computed_tokens=jnp.asarray(computed))
        y, pool = step(jnp.asarray(x), pool, query_start_loc=jnp.asarray(qsl), state_indices=jnp.asarray(read),
                       has_initial_state=jnp.asarray(fresh), **extra)
        y = np.asarray(y)
        assert (y[qsl[len(chunks)]:] == 0).all(), "padding and pad rows give zeros"
        for i, (r, n) in enumerate(chunks.items()):
            outs[r].append(y[qsl[i]:qsl[i + 1]])
            done[r] += n
    return {r: np.concatenate(o) for r, o in outs.items()}, pool


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))


# Three requests: a long prefill in chunks of 3, 1 (shorter than W - 1) and 5, then decode;
# a short one; one that starts late. Steps of 12 tokens and 4 requests.
SCHEDULE = [
    {0: 3, 1: 2},
    {0: 1, 1: 1, 2: 6},
    {0: 5, 2: 1},
    {0: 1, 1: 1, 2: 1},
    {0: 1, 2: 4},
]
LENGTHS = (11, 4, 12)


@pytest.mark.parametrize("width, dilation, x_dtype, pool_dtype", tiered(
    [(4, 1, F32, F32), (2, 1, F32, F32), (4, 2, BF16, F32), (3, 1, BF16, BF16)],
    lambda c: c[0] == 4, spread=True,
), ids=["W4", "W2", "W4_d2_bf16_f32pool", "W3_bf16"])
def test_every_request_equals_causal_conv1d_on_its_whole_sequence(width, dilation, x_dtype, pool_dtype):
    seqs = [np.asarray(random(10 + r, (n, D), x_dtype)) for r, n in enumerate(LENGTHS)]
    w, b = random(1, (width, D), F32, scale=0.5), random(2, (D,), F32, scale=0.5)
    state_len = (width - 1) * dilation + 1  # one more than the window reads: Mamba keeps W
    pool = jnp.full((6, state_len, D), jnp.nan, pool_dtype)  # unused slots and fresh requests' old content: NaN
    slots = {0: 4, 1: 0, 2: 2}
    outs, pool = _run(seqs, SCHEDULE, w, b, pool=pool, slots=slots, tokens=12, requests=4, activation="silu",
                      dilation=dilation)
    for r, seq in enumerate(seqs):
        full, final = causal_conv1d(jnp.asarray(seq)[None], w, b, activation="silu", dilation=dilation,
                                    return_final_state=True)
        scale = float(np.abs(seq.astype(np.float64)).max() * np.abs(np.asarray(w)).max() * width + 1)
        assert_close(outs[r], full[0], x_dtype, width, scale)
        # The slot holds the last state_len inputs (copies), the final state's window among them.
        slot = np.asarray(np.asarray(pool)[slots[r]], np.float64)
        padded = np.concatenate([np.zeros((state_len, D)), np.asarray(seq, np.float64)])  # a fresh start: zeros before
        np.testing.assert_array_equal(slot, padded[-state_len:])
        np.testing.assert_array_equal(slot[state_len - final.shape[1]:], np.asarray(final[0], np.float64))
    assert np.isnan(np.asarray(np.asarray(pool)[[1, 3, 5]], np.float64)).all(), "slots nobody named are untouched"


# The TPU's kernels, named (interpreted off a TPU): a step of R tokens for R requests runs
# the decode kernel when each request has one token, and the mixed step's kernel otherwise.
TPU_KERNEL = dict(implementation="pallas_mosaic_tpu", interpret=jax.default_backend() != "tpu")
DECODE_ONLY = [{0: 1, 1: 1, 2: 1}, {0: 1, 2: 1}, {0: 1, 1: 1, 2: 1}, {1: 1}, {0: 1, 1: 1, 2: 1}]


@pytest.mark.parametrize("x_dtype, pool_dtype", [(F32, F32), (BF16, F32)], ids=["f32", "bf16_f32pool"])
def test_decode_steps_on_the_tpu_kernel_equal_causal_conv1d(x_dtype, pool_dtype):
    """Steps of one token a request (T = R = 4, pad rows with NaN tokens among them) from NaN
    slots: each request's outputs are causal_conv1d's on its whole sequence within rounding,
    its slot its last inputs bit for bit, and no other slot is touched."""
    lengths = (4, 4, 4)
    seqs = [np.asarray(random(30 + r, (n, D), x_dtype)) for r, n in enumerate(lengths)]
    w, b = random(5, (4, D), F32, scale=0.5), random(6, (D,), F32, scale=0.5)
    pool = jnp.full((6, 3, D), jnp.nan, pool_dtype)
    slots = {0: 5, 1: 0, 2: 3}
    outs, pool = _run(seqs, DECODE_ONLY, w, b, pool=pool, slots=slots, tokens=4, requests=4, activation="silu",
                      **TPU_KERNEL)
    for r, seq in enumerate(seqs):
        full = causal_conv1d(jnp.asarray(seq)[None], w, b, activation="silu")[0]
        assert_close(outs[r], full, x_dtype, 4, float(np.abs(seq.astype(np.float64)).max() * 2 + 1))
        padded = np.concatenate([np.zeros((3, D)), np.asarray(seq, np.float64)])
        np.testing.assert_array_equal(np.asarray(np.asarray(pool)[slots[r]], np.float64), padded[-3:])
    assert np.isnan(np.asarray(np.asarray(pool)[[1, 2, 4]], np.float64)).all(), "slots nobody named are untouched"


def test_a_step_of_r_tokens_that_is_not_one_each_takes_the_mixed_kernel():
    """T = R, but one request has two tokens and one none: the decode kernel's path is not
    taken (a runtime branch) but the mixed step's kernel's, and the step equals the
    composition's within rounding, its states bit for bit."""
    x, w, b = random(0, (4, D)), random(1, (4, D), scale=0.5), random(2, (D,))
    pool = random(3, (5, 3, D))
    kw = dict(query_start_loc=jnp.array([0, 2, 3, 4, 4]), state_indices=jnp.array([4, 0, PAD_SLOT_ID, 2]),
              activation="silu")
    y, new = causal_conv1d_step(x, pool, w, b, **kw, **TPU_KERNEL)
    ry, rnew = causal_conv1d_step(x, pool, w, b, **kw, implementation="xla")
    assert_close(y, ry, F32, 4, 4.0)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(rnew))


def _prefix_step(**changes):
    """A step with prefix caching (K = 4, state_len 3, 12 slots of random states): request 0
    (9 tokens, 2 before) crosses 4 tokens after 2 of them (a block state that mixes slot and
    tokens) and 8 after 6; request 1 (one decode token, 7 before) crosses 8 at its last
    token (a block state and its own at the same row); request 2 has no token and starts
    fresh (its slot cleared); request 3 (6 tokens, fresh) crosses 4, its second block not
    cached; then a pad row with a NaN token, and NaN padding. ``changes``: the keywords to
    replace."""
    x = np.full((20, D), np.nan, np.float32)
    x[:17] = np.asarray(random(40, (17, D)))
    kw = dict(query_start_loc=jnp.array([0, 9, 10, 10, 16, 17]), state_indices=jnp.array([0, 1, 2, 3, PAD_SLOT_ID]),
              has_initial_state=jnp.array([True, True, False, False, True]), block_size=4,
              block_indices=jnp.array([[5, 6, PAD_SLOT_ID], [PAD_SLOT_ID, 7, PAD_SLOT_ID], [9, 10, 11],
                                       [8, PAD_SLOT_ID, PAD_SLOT_ID], [4, 4, 4]]),
              num_computed_tokens=jnp.array([2, 7, 0, 0, 0]), activation="silu")
    kw.update(changes)
    return jnp.asarray(x), random(41, (12, 3, D)), random(42, (4, D), scale=0.5), random(43, (D,)), kw


def _refused(kw, slots: int, path=None) -> bool:
    """Whether ``causal_conv1d_step(**kw)`` over a pool of ``slots`` is refused to the TPU
    kernels (``step._kernels_refuse`` on the arguments as the step derives them)."""
    from maskconv_kernels.ops.causal_conv1d.step import _crossings, _kernels_refuse
    from maskconv_kernels.ops.causal_conv1d.update import fresh_rows, slot_codes

    read, started = kw["state_indices"], kw.get("has_initial_state")
    write = kw.get("write_indices", read)
    crossed = None
    if "block_size" in kw:
        crossed = _crossings(kw["query_start_loc"], read, kw["block_size"], kw["block_indices"],
                             kw["num_computed_tokens"])[1]
    codes = slot_codes(read, write, fresh_rows(started, read), slots)
    return bool(_kernels_refuse(kw["query_start_loc"], read, codes, crossed, slots, path,
                                separate="write_indices" in kw))


def test_the_race_checks_two_ways_agree():
    """The race check's pairwise compares (small steps) and its scatters (large ones) give
    the same answer on random targets (``-1``: none; duplicates included) and slot codes
    (negative ones included: pad rows, fresh rows, indices outside the pool)."""
    from maskconv_kernels.ops.causal_conv1d.step import _races_counted, _races_pairwise

    rng = np.random.default_rng(0)
    draws, requests, per_row, slots = 400, 5, 3, 8
    reads = np.stack([rng.permutation(slots)[:requests] for _ in range(draws)])  # a slot read once at most (checked)
    reads = np.where(rng.random(reads.shape) < 0.3, rng.integers(-3, 0, size=reads.shape), reads)
    target = rng.integers(0, slots, size=(draws, requests * per_row))
    target = np.where(rng.random(target.shape) < 0.85, -1, target)
    owner = rng.integers(0, requests, size=target.shape)
    args = [jnp.asarray(a, jnp.int32) for a in (target, owner, reads)]
    pairwise, counted = (np.asarray(jax.vmap(functools.partial(f, slots=slots))(*args))
                         for f in (_races_pairwise, _races_counted))
    np.testing.assert_array_equal(pairwise, counted)
    assert 0.2 < np.mean(pairwise) < 0.8, "the draws exercise both answers"


def test_the_bookkeeping_by_scatters_equals_the_bookkeeping_by_compares(monkeypatch):
    """The mixed step's index bookkeeping (each token's request, the tiles that store state
    rows, the race check) by scatters (large steps) gives the kernels the same step as by
    compares (small ones): outputs and pool bit for bit, at prefix caching with
    ``write_indices`` and at a race the check refuses."""
    from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import config

    for changes in (dict(write_indices=jnp.array([0, 11, 2, 3, PAD_SLOT_ID])),
                    dict(write_indices=jnp.array([0, 9, 2, 1, PAD_SLOT_ID]))):
        x, pool, w, b, kw = _prefix_step(**changes)
        # A new jit each time: the bookkeeping is chosen when the step is traced.
        run = lambda: jax.jit(lambda *a: causal_conv1d_step(*a, **kw, **TPU_KERNEL))(x, pool, w, b)  # noqa: E731
        compared = run()
        monkeypatch.setattr(config, "COMPARE_PAIRS", 0)
        scattered = run()
        monkeypatch.undo()
        for a, b_ in zip(compared, scattered):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


def test_prefix_caching_and_write_indices_on_the_mixed_kernel_equal_the_composition():
    """The TPU kernels named (interpreted off a TPU): a step with prefix caching takes the
    mixed step's kernel (nothing in it races), its outputs within rounding of XLA's
    composition and every block state, own state and cleared slot its bits; with
    ``write_indices`` too (one request's state to a new slot)."""
    for changes in ({}, dict(write_indices=jnp.array([0, 11, 2, 3, PAD_SLOT_ID]))):
        x, pool, w, b, kw = _prefix_step(**changes)
        assert not _refused(kw, pool.shape[0])
        y, new = causal_conv1d_step(x, pool, w, b, **kw, **TPU_KERNEL)
        ry, rnew = causal_conv1d_step(x, pool, w, b, **kw, implementation="xla")
        assert_close(y, ry, F32, 4, 4.0)
        np.testing.assert_array_equal(np.asarray(new), np.asarray(rnew))
        assert not np.asarray(new)[2].any(), "a fresh request without tokens clears its slot"


@pytest.mark.parametrize("changes", [
    dict(block_indices=jnp.array([[5, 6, -1], [-1, 7, -1], [9, 10, 11], [1, -1, -1], [4, 4, 4]])),
    dict(block_indices=jnp.array([[5, 6, -1], [-1, 6, -1], [9, 10, 11], [8, -1, -1], [4, 4, 4]])),
    dict(write_indices=jnp.array([0, 9, 2, 1, PAD_SLOT_ID])),
    dict(write_indices=jnp.array([0, 1, 9, 3, PAD_SLOT_ID]), has_initial_state=jnp.array([True, True, True, False, True])),
    dict(write_indices=jnp.array([0, 1, 2, 3, 9])),
], ids=["block_state_to_a_slot_another_reads", "one_slot_two_block_states", "own_state_to_a_slot_another_reads",
        "a_request_without_tokens_copies_its_slot", "a_pad_row_writes"])
def test_steps_whose_slot_dmas_would_race_are_refused_to_the_kernels(changes):
    """Where the kernels' DMAs, made in token order, need not give the composition's pool
    (a slot written twice, a slot written by one request and read by another, a slot
    copied by a request without tokens, a pad row with a slot to write), the step is
    refused to the kernels (the composition runs when it runs), and its pool is the
    composition's."""
    x, pool, w, b, kw = _prefix_step(**changes)
    assert _refused(kw, pool.shape[0])
    _, new = causal_conv1d_step(x, pool, w, b, **kw, **TPU_KERNEL)
    _, rnew = causal_conv1d_step(x, pool, w, b, **kw, implementation="xla")
    np.testing.assert_array_equal(np.asarray(new), np.asarray(rnew))


def test_a_state_written_tiles_before_another_request_reads_its_slot_is_not_read():
    """Over three 32-token tiles: request 0 (tile 0) writes its state to slot 1, which
    request 2 (from tile 1 on) reads. The composition reads every slot first, so request
    2 reads slot 1's old inputs; the kernel, reading and writing in token order, would
    read request 0's on a TPU (Pallas' interpreter keeps the aliased pool's input apart,
    so there it reads the old ones anyway), so the step runs as the composition."""
    x, pool, w, b = random(0, (80, D)), random(1, (4, 3, D)), random(2, (4, D), scale=0.5), random(3, (D,))
    kw = dict(query_start_loc=jnp.array([0, 30, 40, 70]), state_indices=jnp.array([0, 3, 1]),
              write_indices=jnp.array([1, 3, 2]), activation="silu")
    y, new = causal_conv1d_step(x, pool, w, b, **kw, **TPU_KERNEL)
    ry, rnew = causal_conv1d_step(x, pool, w, b, **kw, implementation="xla")
    assert_close(y, ry, F32, 4, 4.0)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(rnew))


def test_accepted_drafts_on_the_mixed_kernel_equal_the_composition():
    """A step after speculative decoding, the TPU kernels named: rows whose accepted tokens
    are a chain (``num_accepted_tokens``, or an ``accepted_path`` prefix) take the mixed
    step's kernel, each slot's history shifted to end at its last accepted input, the
    rejected rows after it NaN and never read: outputs within rounding of the
    composition's, states its bits. A row whose path leaves the chain (a tree's branch) is
    refused to the kernel: the composition runs."""
    from maskconv_kernels.ops.causal_conv1d.step import _check_acceptance

    x, w, b = random(0, (24, D)), random(1, (4, D), scale=0.5), random(2, (D,))
    pool = np.array(random(3, (6, 5, D)))  # state_len 5: W - 1 = 3 and k = 2 drafts
    pool[1, 4:] = pool[2, 3:] = np.nan  # rejected drafts: 1 and 2 rows before the slots' last
    kw = dict(query_start_loc=jnp.array([0, 3, 6, 9, 20]), state_indices=jnp.array([0, 1, 2, 3]),
              has_initial_state=jnp.array([True, True, True, False]), activation="silu")
    chains = [dict(num_accepted_tokens=jnp.array([3, 2, 1, 3])),
              dict(accepted_path=jnp.array([[0, 1, 2], [0, 1, -1], [0, -1, -1], [0, 1, 2]]))]
    for accepted in chains:
        y, new = causal_conv1d_step(x, jnp.asarray(pool), w, b, **kw, **accepted, **TPU_KERNEL)
        ry, rnew = causal_conv1d_step(x, jnp.asarray(pool), w, b, **kw, **accepted, implementation="xla")
        assert np.isfinite(np.asarray(y)[:20]).all()
        assert_close(y, ry, F32, 4, 4.0)
        np.testing.assert_array_equal(np.asarray(new), np.asarray(rnew))
    tree = jnp.array([[0, 2, -1], [0, 1, -1], [0, -1, -1], [0, 1, 2]])
    path = _check_acceptance(None, tree, 4, 5, 3)
    assert _refused(kw, 6, path)
    assert not _refused(kw, 6, _check_acceptance(None, chains[1]["accepted_path"], 4, 5, 3))
    pool[0, 3] = np.nan  # a rejected draft of the branch not taken
    _, new = causal_conv1d_step(x, jnp.asarray(pool), w, b, **kw, accepted_path=tree, **TPU_KERNEL)
    _, rnew = causal_conv1d_step(x, jnp.asarray(pool), w, b, **kw, accepted_path=tree, implementation="xla")
    np.testing.assert_array_equal(np.asarray(new), np.asarray(rnew))


@pytest.mark.parametrize("x_dtype, pool_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)])
def test_positions_on_the_mixed_kernel_equal_the_composition(x_dtype, pool_dtype):
    """Documents starting inside requests (``positions``), over three 32-token tiles, the
    TPU kernels named: the mixed step's kernel gives the composition's outputs within
    rounding and its states bit for bit. Request 0 starts a document at its 13th token
    (the NaN tokens before it reach nothing after); request 1 is a decode token at
    position 0 (its NaN slot is not read); request 2 has two tokens, the second a start
    (its state mixes zeros and that token); request 3 starts fresh; request 4 is a decode
    token continuing its slot; request 5 starts one at its second-to-last token, in a tile
    where no other state is written (its state, zeros before the start, is stored, not
    copied from the frame); then a pad row and padding."""
    lengths, first = [30, 1, 2, 4, 1, 30], [5, 0, 7, 0, 9, 3]
    starts_at = {0: 12, 2: 1, 5: 28}  # a document start at this token of the request
    positions, qsl = [], [0]
    for r, (n, p) in enumerate(zip(lengths, first)):
        pos = list(range(p, p + n))
        if r in starts_at:
            j = starts_at[r]
            pos[j:] = range(n - j)
        positions += pos
        qsl.append(qsl[-1] + n)
    tokens = 80
    positions = np.array(positions + [0] * (tokens - len(positions)), np.int32)
    x = np.array(random(0, (tokens, D)), np.float32)
    x[qsl[-1]:] = np.nan  # padding
    x[qsl[0]:qsl[0] + 12] = np.nan  # request 0's first document
    pool = np.array(random(1, (8, 3, D)), np.float32)
    pool[1] = np.nan  # request 1's slot: its token starts a document
    kw = dict(query_start_loc=jnp.array(qsl + [qsl[-1]]), state_indices=jnp.array([0, 1, 2, 3, 4, 5, PAD_SLOT_ID]),
              has_initial_state=jnp.array([True, True, True, False, True, True, True]),
              positions=jnp.asarray(positions), activation="silu")
    x, pool = jnp.asarray(x).astype(x_dtype), jnp.asarray(pool).astype(pool_dtype)
    w, b = random(2, (4, D), scale=0.5), random(3, (D,))
    y, new = causal_conv1d_step(x, pool, w, b, **kw, **TPU_KERNEL)
    ry, rnew = causal_conv1d_step(x, pool, w, b, **kw, implementation="xla")
    y, ry = np.asarray(y, np.float32), np.asarray(ry, np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ry))
    assert np.isnan(y[:12]).all() and np.isfinite(y[12:qsl[-1]]).all()
    assert_close(np.nan_to_num(y), np.nan_to_num(ry), x_dtype, 4, 4.0, operands=F32)
    np.testing.assert_array_equal(_bits(np.asarray(new, np.float32)), _bits(np.asarray(rnew, np.float32)))
    assert not np.asarray(new, np.float32)[2, :2].any() and not np.asarray(new, np.float32)[5, :1].any()


def test_a_fresh_request_without_tokens_clears_its_slot_on_the_mixed_kernel():
    """No prefix caching nor ``write_indices``: a request without tokens that starts fresh
    writes zeros to its slot, as the composition does (the kernel once left the slot as it
    was), and one that reads its slot leaves it."""
    x, pool, w, b = random(0, (16, D)), random(1, (4, 3, D)), random(2, (4, D), scale=0.5), random(3, (D,))
    kw = dict(query_start_loc=jnp.array([0, 5, 5, 5, 16]), state_indices=jnp.array([0, 1, 2, 3]),
              has_initial_state=jnp.array([True, False, True, False]), activation="silu")
    y, new = causal_conv1d_step(x, pool, w, b, **kw, **TPU_KERNEL)
    ry, rnew = causal_conv1d_step(x, pool, w, b, **kw, implementation="xla")
    np.testing.assert_array_equal(np.asarray(new), np.asarray(rnew))
    assert not np.asarray(new)[1].any() and np.array_equal(np.asarray(new)[2], np.asarray(pool)[2])


def test_nan_in_other_requests_pad_rows_and_slots_reaches_no_output_or_state():
    seqs = [np.asarray(random(20 + r, (n, D), F32)) for r, n in enumerate(LENGTHS)]
    w, b = random(3, (4, D), F32), random(4, (D,), F32)
    slots = {0: 1, 1: 3, 2: 5}
    clean, clean_pool = _run(seqs, SCHEDULE, w, b, pool=jnp.zeros((6, 3, D)), slots=slots, tokens=12, requests=4)
    poisoned = [s.copy() for s in seqs]
    poisoned[1][:] = np.nan  # another request's tokens (its own outputs become NaN)
    pool = jnp.zeros((6, 3, D)).at[jnp.array([0, 2, 4])].set(jnp.nan)  # slots nobody reads
    outs, pool = _run(poisoned, SCHEDULE, w, b, pool=pool, slots=slots, tokens=12, requests=4)
    for r in (0, 2):
        np.testing.assert_array_equal(_bits(outs[r]), _bits(clean[r]))
        np.testing.assert_array_equal(_bits(pool[slots[r]]), _bits(clean_pool[slots[r]]))
    assert np.isnan(outs[1]).all()


def test_prefix_caching_writes_each_block_state_and_a_new_request_starts_from_one():
    """Blocks of K = 4 tokens: a request of 11 tokens in chunks of 3, 1, 5, 2 (the chunk of
    one token, shorter than W - 1, completes block 0) leaves the states after 4 and 8
    tokens in the slots named for them; a second request with the same first 8 tokens
    starts from block 1's slot and gives the outputs the full sequence gives."""
    seq = np.asarray(random(30, (11, D), F32))
    w, b = random(5, (4, D), F32), random(6, (D,), F32)
    pool = jnp.full((8, 3, D), jnp.nan)
    table = np.array([[5, 6, PAD_SLOT_ID]])  # block 0's state to slot 5, block 1's to slot 6
    schedule = [{0: 3}, {0: 1}, {0: 5}, {0: 2}]
    outs, pool = _run([seq], schedule, w, b, pool=pool, slots={0: 0}, tokens=6, requests=2, block=(4, table))
    full = np.asarray(causal_conv1d(jnp.asarray(seq)[None], w, b)[0])
    for block, slot in ((1, 5), (2, 6)):
        np.testing.assert_array_equal(np.asarray(pool[slot]), seq[block * 4 - 3:block * 4])
    assert_close(outs[0], full, F32, 4, float(np.abs(seq).max() * np.abs(np.asarray(w)).max() * 4 + 1))
    # A new request with the cached prefix: it reads slot 6 and writes its own slot 7.
    x = np.zeros((6, D), np.float32)
    x[:3] = seq[8:]
    y, pool = causal_conv1d_step(jnp.asarray(x), pool, w, b, query_start_loc=jnp.array([0, 3]),
                                 state_indices=jnp.array([6]), write_indices=jnp.array([7]))
    assert_close(y[:3], full[8:], F32, 4, float(np.abs(seq).max() * np.abs(np.asarray(w)).max() * 4 + 1))
    np.testing.assert_array_equal(np.asarray(pool[7]), seq[-3:])
    np.testing.assert_array_equal(np.asarray(pool[6]), seq[5:8])  # the cached block is kept


def test_the_pool_is_updated_in_place_under_jit_with_donation():
    pool = jnp.zeros((64, 3, D))
    w, b = random(7, (4, D), F32), random(8, (D,), F32)
    step = jax.jit(lambda x, pool, q, s: causal_conv1d_step(x, pool, w, b, query_start_loc=q, state_indices=s),
                   donate_argnums=1)
    args = (jnp.ones((16, D)), pool, jnp.array([0, 5, 6, 6, 10]), jnp.array([3, 9, PAD_SLOT_ID, 40]))
    header = next(line for line in step.lower(*args).compile().as_text().splitlines() if line.startswith("HloModule"))
    assert "input_output_alias={ {1}: (1, {}" in header, header
    address = pool.unsafe_buffer_pointer()
    _, new = step(*args)
    assert pool.is_deleted() and new.unsafe_buffer_pointer() == address


@pytest.mark.parametrize("changes, error, message", [
    (dict(query_start_loc=np.array([0, 3, 2])), ValueError, r"query_start_loc must start at 0, never decrease.*got \[0 3 2\]"),
    (dict(pool=np.zeros((4, 3, D), jnp.bfloat16)), TypeError, r"pool must have x's dtype float16"),
    (dict(pool=np.zeros((4, 2, D), np.float32)), ValueError, r"pool must be \(S, state_len, D\) with state_len >= \(W - 1\) \* dilation = 3"),
    (dict(state_indices=np.array([1, 1])), ValueError, r"state_indices names a slot for several rows.*got \[1 1\]"),
    (dict(block_size=4), ValueError, r"block_size needs block_indices"),
    (dict(x=np.zeros((2, 6, D), np.float16)), ValueError, r"x must be \(T, D\)"),
    (dict(parents=np.array([-1, 1, -1, 0, 1, 0])), ValueError, r"parents must name.*an earlier token.*got \[-1  1"),
    (dict(parents=np.zeros((5,), np.int32)), ValueError, r"parents must be \(T,\) = \(6,\) signed integers"),
    (dict(parents=np.zeros((6,), np.int32) - 1, block_size=4, block_indices=np.zeros((2, 1), np.int32),
          num_computed_tokens=np.zeros(2, np.int32)), ValueError, r"parents \(a tree of drafts\) with block_size"),
    (dict(accepted_path=np.array([[0, -1], [-1, 0]])), ValueError, r"accepted_path must hold.*then -1"),
    (dict(accepted_path=np.array([[0], [0]])), ValueError, r"accepted_path must be \(R, .*\) = \(2, 2\)"),
    (dict(accepted_path=np.array([[0, 1], [0, 1]]), num_accepted_tokens=np.array([1, 1])), ValueError,
     r"num_accepted_tokens and accepted_path say the same thing"),
])
def test_bad_input_names_the_argument(changes, error, message):
    args = dict(x=np.zeros((6, D), np.float16), pool=np.zeros((4, 3, D), np.float32), weight=np.ones((4, D), np.float16),
                query_start_loc=np.array([0, 2, 5]), state_indices=np.array([0, 1])) | changes
    if "accepted_path" in changes:  # one draft position beyond the window
        args["pool"] = np.zeros((4, 4, D), np.float32)
    with pytest.raises(error, match="^causal_conv1d_step: " + message):
        causal_conv1d_step(args.pop("x"), args.pop("pool"), args.pop("weight"), **args)


def test_lowered_it_holds_one_short_convolution_and_no_loop_over_requests():
    """One call on the extended sequence: no while loop, no convolution (the depthwise maps)."""
    w = random(9, (4, D), F32)
    text = jax.jit(lambda x, pool, q, s: causal_conv1d_step(x, pool, w, query_start_loc=q, state_indices=s)).lower(
        jnp.ones((16, D)), jnp.zeros((8, 3, D)), jnp.array([0, 5, 16]), jnp.array([1, 2])).as_text()
    assert "stablehlo.while" not in text and "stablehlo.convolution" not in text
    assert re.search(r"stablehlo\.scatter", text)


@pytest.mark.parametrize("kernel", [{}, TPU_KERNEL], ids=["default", "tpu_mixed_kernel"])
@pytest.mark.parametrize("width, drafts", [(4, 2), (2, 3)])
def test_speculative_decoding_never_reads_a_rejected_draft(width, drafts, kernel):
    """Each decode step carries the last accepted token and ``k`` drafts, the rejected ones
    NaN; with the previous step's ``num_accepted_tokens`` every accepted output equals the
    full sequence's and no NaN reaches an output or the state later tokens read. With the
    TPU kernels named (interpreted off a TPU), the mixed step's kernel shifts each slot's
    history to end at its last accepted input."""
    rng = np.random.default_rng(width)
    seq = np.asarray(random(40, (40, D), F32))
    w, b = random(41, (width, D), F32), random(42, (D,), F32)
    state_len = width - 1 + drafts
    pool = jnp.full((3, state_len, D), jnp.nan)
    step = jax.jit(lambda x, pool, q, fresh, a: causal_conv1d_step(
        x, pool, w, b, query_start_loc=q, state_indices=jnp.array([1]), has_initial_state=fresh,
        num_accepted_tokens=a, activation="silu", **kernel))
    full = np.asarray(causal_conv1d(jnp.asarray(seq)[None], w, b, activation="silu")[0])
    tokens = 1 + drafts
    # The prompt: 5 tokens, all accepted.
    x = np.zeros((8, D), np.float32)
    x[:5] = seq[:5]
    y, pool = step(jnp.asarray(x), pool, jnp.array([0, 5]), jnp.array([False]), jnp.array([drafts + 1]))
    got, done, accepted = [np.asarray(y[:5])], 5, drafts + 1
    while done + tokens <= len(seq):
        a_next = int(rng.integers(1, tokens + 1))  # how many of this step's tokens the verifier keeps
        x = np.zeros((8, D), np.float32)
        x[:a_next] = seq[done:done + a_next]
        x[a_next:tokens] = np.nan  # the rejected drafts
        y, pool = step(jnp.asarray(x), pool, jnp.array([0, tokens]), jnp.array([True]), jnp.array([accepted]))
        got.append(np.asarray(y[:a_next]))
        done, accepted = done + a_next, a_next
    got = np.concatenate(got)
    assert np.isfinite(got).all()
    assert_close(got, full[:done], F32, width, float(np.abs(seq).max() * np.abs(np.asarray(w)).max() * width + 1))
