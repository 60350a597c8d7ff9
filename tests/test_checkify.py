"""Arguments that are data (slot indices, offsets, a stream's state) checked when traced too.

Concrete, each raises a ``ValueError`` when the function is called. Traced (under ``jit``,
``vmap``, ``scan``), the same check runs under ``jax.experimental.checkify.checkify``, and
its error must carry the eager call's message word for word; without ``checkify`` the
check compiles to nothing and the documented NaN shows instead.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import maskconv_kernels as mk
from support.tiers import tiered
from maskconv_kernels.compat import causal_conv1d as dao
from maskconv_kernels.ops.causal_conv import causal_conv_stream_init

D, W = 8, 4
RNG = np.random.default_rng(0)
X2 = RNG.standard_normal((2, D)).astype(np.float32)
POOL = RNG.standard_normal((4, W - 1, D)).astype(np.float32)
WEIGHT = RNG.standard_normal((W, D)).astype(np.float32)


def _eager_message(f, *args) -> str:
    with pytest.raises(ValueError) as raised:
        f(*args)
    return str(raised.value)


def _checked_message(f, *args) -> str | None:
    err, _ = jax.jit(checkify.checkify(f))(*args)
    return err.get()


def _update(x, pool, slots):
    return mk.causal_conv1d_update(x, pool, WEIGHT, state_indices=slots)


def _update_circular(x, pool, seqlens):
    return mk.causal_conv1d_update(x, pool, WEIGHT, cache_seqlens=seqlens)


def _dao_update(x, pool, slots):  # Dao-AILab's layouts: x (B, D), pool (S, D, state_len)
    return dao.causal_conv1d_update(x, pool, WEIGHT.T, conv_state_indices=slots)


def _step(x, pool, qsl, slots, accepted, blocks):
    return mk.causal_conv1d_step(
        x, pool, WEIGHT, query_start_loc=qsl, state_indices=slots, num_accepted_tokens=accepted,
        block_size=2, block_indices=blocks, num_computed_tokens=jnp.zeros(2, jnp.int32))


def _tree_step(x, pool, qsl, slots, parents, path):
    return mk.causal_conv1d_step(x, pool, WEIGHT, query_start_loc=qsl, state_indices=slots, parents=parents,
                                 accepted_path=path)


STEP_POOL = RNG.standard_normal((6, W, D)).astype(np.float32)  # one draft position beyond the window
STEP_X = RNG.standard_normal((6, D)).astype(np.float32)
GOOD_STEP = (jnp.array([0, 2, 4]), jnp.array([0, 1]), jnp.array([1, 2]), jnp.array([[2, 3], [4, 5]]))
GOOD_TREE = (jnp.array([0, 2, 4]), jnp.array([0, 1]), jnp.array([-1, 0, -1, 0, 0, 0]), jnp.array([[0, 1], [1, -1]]))

CASES = {  # name: (function, good arguments, bad arguments)
    "slot past the pool": (_update, (X2, POOL, np.array([0, 3])), (X2, POOL, np.array([0, 4]))),
    "negative slot": (_update, (X2, POOL, np.array([-1, 3])), (X2, POOL, np.array([-2, 3]))),
    "one slot twice": (_update, (X2, POOL[:2], np.array([1, 0])), (X2, POOL[:2], np.array([1, 1]))),
    "negative cache_seqlens": (_update_circular, (X2, POOL[:2], np.array([0, 5])), (X2, POOL[:2], np.array([0, -1]))),
    "Dao-AILab's conv_state_indices": (
        _dao_update, (X2, POOL.transpose(0, 2, 1), np.array([2, 3])), (X2, POOL.transpose(0, 2, 1), np.array([2, 9]))),
    "query_start_loc decreasing": (_step, (STEP_X, STEP_POOL, *GOOD_STEP),
                                   (STEP_X, STEP_POOL, jnp.array([0, 4, 2]), *GOOD_STEP[1:])),
    "query_start_loc past T": (_step, (STEP_X, STEP_POOL, *GOOD_STEP),
                               (STEP_X, STEP_POOL, jnp.array([0, 2, 7]), *GOOD_STEP[1:])),
    "num_accepted_tokens past the drafts": (_step, (STEP_X, STEP_POOL, *GOOD_STEP),
                                            (STEP_X, STEP_POOL, *GOOD_STEP[:2], jnp.array([1, 3]), GOOD_STEP[3])),
    "a parent after its child": (_tree_step, (STEP_X, STEP_POOL, *GOOD_TREE),
                                 (STEP_X, STEP_POOL, *GOOD_TREE[:2], jnp.array([-1, 1, -1, 0, 0, 0]), GOOD_TREE[3])),
    "accepted_path not increasing": (_tree_step, (STEP_X, STEP_POOL, *GOOD_TREE),
                                     (STEP_X, STEP_POOL, *GOOD_TREE[:3], jnp.array([[1, 0], [1, -1]]))),
    "block slot past the pool": (_step, (STEP_X, STEP_POOL, *GOOD_STEP),
                                 (STEP_X, STEP_POOL, *GOOD_STEP[:3], jnp.array([[2, 3], [4, 6]]))),
}


# The fast tier: causal_conv1d_update's slots, in its names and in Dao-AILab's (the
# scheduler step's checks, a larger program, are the slow tier's).
@pytest.mark.parametrize("name", tiered(CASES, lambda n: n in ("slot past the pool", "Dao-AILab's conv_state_indices")))
def test_traced_misuse_gives_the_eager_message_under_checkify(name):
    f, good, bad = CASES[name]
    message = _eager_message(f, *bad)
    assert _checked_message(f, *bad) == f"{message} (`check` failed)"
    assert _checked_message(f, *good) is None
    # The checked function's values are the unchecked one's.
    _, checked = jax.jit(checkify.checkify(f))(*good)
    for a, b in zip(jax.tree.leaves(checked), jax.tree.leaves(jax.jit(f)(*good))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_without_checkify_the_check_compiles_to_nothing_and_the_nan_shows():
    f, _, bad = CASES["slot past the pool"]
    hlo = jax.jit(f).lower(*bad).as_text()
    assert "check" not in hlo.lower() and "callback" not in hlo.lower()
    y, pool = jax.jit(f)(*bad)
    assert np.isnan(np.asarray(y)[1]).all() and np.isfinite(np.asarray(y)[0]).all()
    np.testing.assert_array_equal(np.asarray(pool)[[1, 2, 3]], POOL[[1, 2, 3]])  # slot 4 of 4 writes nothing


def test_checks_under_vmap_name_the_bad_example():
    pools = jnp.stack([POOL, POOL])
    slots = jnp.array([[0, 1], [2, 5]])  # the second pool's rows name slot 5 of 4
    f = jax.vmap(_update, in_axes=(None, 0, 0))
    err, _ = jax.jit(checkify.checkify(f))(X2, pools, slots)
    assert "in [0, 4)" in err.get() and "got [2 5]" in err.get()
    err, _ = jax.jit(checkify.checkify(f))(X2, pools, jnp.array([[0, 1], [2, 3]]))
    assert err.get() is None


def test_checks_inside_a_scanned_decode_loop():
    """A decode loop over tokens, each step's slots read from the scanned inputs: the
    step that names a bad slot is reported, the others are not."""
    tokens = RNG.standard_normal((5, 2, D)).astype(np.float32)

    def loop(pool, slots):
        def body(pool, inputs):
            x, s = inputs
            y, pool = _update(x, pool, s)
            return pool, y

        return jax.lax.scan(body, pool, (tokens, slots))

    good = jnp.array([[0, 1]] * 5)
    err, _ = jax.jit(checkify.checkify(loop))(POOL, good)
    assert err.get() is None
    err, _ = jax.jit(checkify.checkify(loop))(POOL, good.at[3].set(jnp.array([3, 3])))
    assert "names a slot for several rows" in err.get() and "got [3 3]" in err.get()


def test_an_off_stride_chunk_of_a_started_stream_under_checkify():
    x = RNG.standard_normal((1, 7, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 4)).astype(np.float32)

    def chunk(c, s):
        return mk.causal_conv_stream(c, s, k, strides=2)

    _, started = chunk(x[:, :3], None)
    message = _eager_message(chunk, x[:, 3:6], started)
    assert _checked_message(chunk, x[:, 3:6], started) == f"{message} (`check` failed)"
    # A fresh state (not started) may take any length, traced or not.
    assert _checked_message(chunk, x[:, :3], causal_conv_stream_init(x[:, :3], k, strides=2)) is None
    assert _checked_message(chunk, x[:, 3:5], started) is None  # a multiple of the stride
