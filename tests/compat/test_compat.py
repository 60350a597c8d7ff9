"""``maskconv_kernels.compat.causal_conv1d``: Dao-AILab causal-conv1d's face, against its semantics.

The oracles below are causal-conv1d's ``causal_conv1d_ref`` and ``causal_conv1d_update_ref``
(``causal_conv1d/causal_conv1d_interface.py``) in float64 NumPy, with what only its CUDA
kernels define: ``seq_idx`` (a tap reads only its own document; negative ids are padding,
whose outputs are 0), and ``conv_state_indices`` (row ``b`` uses slot
``conv_state_indices[b]``; -1 gives zeros and touches no slot). Outputs are compared
within the dtype's tolerance for a sum of ``width`` products plus the bias; states hold
copies of inputs, so they are compared bit for bit.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close, random
from support.short_conv import implementation_params
from support.tiers import tiered

from maskconv_kernels.compat import causal_conv1d as compat

F32, BF16 = np.dtype("float32"), np.dtype(jnp.bfloat16)


# --------------------------------------------------------------------- oracles


def _silu(v):
    return v / (1.0 + np.exp(-v))


def dao_fn_ref(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None):
    """``causal_conv1d_ref`` with the kernels' ``seq_idx``: ``(out, final_states)`` in float64.

    x ``(B, D, L)``, weight ``(D, W)``, initial_states ``(B, D, W - 1)``. With ``seq_idx`` and
    ``initial_states`` (refused by causal-conv1d, allowed here) the state belongs to each
    row's first document, and the final state is that of its last.
    """
    x, w = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    batch, dim, length = x.shape
    width = w.shape[1]
    init = np.zeros((batch, dim, width - 1)) if initial_states is None else np.asarray(initial_states, np.float64)
    ext = np.concatenate([init, x], axis=-1)  # position q of x at q + width - 1
    out = np.zeros((batch, dim, length))
    ids = None if seq_idx is None else np.asarray(seq_idx)
    doc = lambda q: ids[:, 0] if q < 0 else ids[:, q]  # noqa: E731  (the state: the first document's)
    for l in range(length):
        for k in range(width):
            q = l - (width - 1) + k
            term = w[:, k] * ext[:, :, l + k]
            if ids is not None:
                term = np.where((doc(q) == ids[:, l])[:, None], term, 0.0)
            out[:, :, l] += term
    if bias is not None:
        out += np.asarray(bias, np.float64)[:, None]
    if ids is not None:
        out = np.where(ids[:, None, :] < 0, 0.0, out)
    if activation is not None:
        out = _silu(out)
    final = ext[:, :, ext.shape[-1] - (width - 1):]
    if ids is not None:  # the last document's inputs only: zeros before its start
        final = final.copy()
        for b in range(batch):
            valid = np.flatnonzero(ids[b] >= 0)
            if valid.size == 0:
                final[b] = 0.0
                continue
            last = ids[b, valid[-1]]
            for j in range(width - 1):
                q = valid[-1] - (width - 2) + j
                if q > valid[-1] or (q >= 0 and ids[b, q] != last) or (q < 0 and ids[b, 0] != last):
                    final[b, :, j] = 0.0
                elif q >= 0:
                    final[b, :, j] = x[b, :, q]
                else:
                    final[b, :, j] = init[b, :, width - 1 + q]
    return out, final


def dao_update_ref(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None):
    """``causal_conv1d_update_ref`` over a pool, as the update kernel: ``(out, new_pool)`` in float64."""
    one_token = np.ndim(x) == 2
    x = np.asarray(x, np.float64)
    x = x[..., None] if one_token else x
    pool = np.array(conv_state, np.float64)
    w = np.asarray(weight, np.float64)
    batch, dim, tokens = x.shape
    width, state_len = w.shape[1], pool.shape[-1]
    out = np.zeros(x.shape)
    for b in range(batch):
        slot = b if conv_state_indices is None else int(conv_state_indices[b])
        if slot < 0:
            continue  # a padding row: zeros out, no slot touched
        state = pool[slot].copy()
        if cache_seqlens is None:
            x_new = np.concatenate([state, x[b]], axis=-1)
            pool[slot] = x_new[:, x_new.shape[-1] - state_len:]
        else:
            seqlen = int(cache_seqlens[b])
            window = (seqlen + np.arange(-(width - 1), 0)) % state_len
            x_new = np.concatenate([state[:, window], x[b]], axis=-1)
            for t in range(tokens):
                pool[slot][:, (seqlen + t) % state_len] = x[b, :, t]
        start = x_new.shape[-1] - tokens - (width - 1)
        for t in range(tokens):
            out[b, :, t] = (w * x_new[:, start + t : start + t + width]).sum(-1)
        if bias is not None:
            out[b] += np.asarray(bias, np.float64)[:, None]
        if activation is not None:
            out[b] = _silu(out[b])
    return (out[..., 0] if one_token else out), pool


def _assert_out_close(actual, expected, x, weight, bias, dtype):
    """Within the tolerance of ``width`` products and a bias (SiLU does not grow the error)."""
    width = np.shape(weight)[-1]
    scale = float(np.abs(np.asarray(x, np.float64)).max() * np.abs(np.asarray(weight, np.float64)).max() * width)
    scale += 0.0 if bias is None else float(np.abs(np.asarray(bias, np.float64)).max())
    assert_close(actual, expected, dtype, width + 1, scale)


# --------------------------------------------------------------------- causal_conv1d_fn

FN_CASES = [
    # (batch, dim, seqlen, width, dtype, bias, activation, initial_states, return_final_states)
    (2, 8, 33, 4, F32, True, "silu", False, False),
    (1, 5, 1, 4, F32, False, None, True, True),  # shorter than the window: the state shows in the final one
    (2, 16, 7, 2, BF16, True, "swish", True, True),  # bfloat16 x, float32 weight and bias (Mamba's)
    (3, 3, 20, 3, F32, False, "silu", False, True),
    (2, 4, 9, 1, F32, True, None, False, True),  # width 1: empty states
]


@pytest.mark.parametrize(
    "batch, dim, seqlen, width, dtype, has_bias, activation, has_init, return_final",
    tiered(FN_CASES, lambda c: c in FN_CASES[:3], spread=True),
    ids=[f"B{c[0]}_D{c[1]}_L{c[2]}_W{c[3]}_{c[4].name}_{'bias' if c[5] else 'nobias'}_{c[6]}"
         f"{'_init' if c[7] else ''}{'_final' if c[8] else ''}" for c in FN_CASES],
)
def test_fn_matches_causal_conv1d_ref(batch, dim, seqlen, width, dtype, has_bias, activation, has_init, return_final):
    x = random(1, (batch, dim, seqlen), dtype)
    weight, bias = random(2, (dim, width), scale=0.5), (random(3, (dim,)) if has_bias else None)
    init = random(4, (batch, dim, width - 1), dtype) if has_init else None
    result = compat.causal_conv1d_fn(x, weight, bias, initial_states=init, return_final_states=return_final,
                                     activation=activation)
    expected, final = dao_fn_ref(x, weight, bias, initial_states=init, activation=activation)
    out = result[0] if return_final else result
    assert out.shape == (batch, dim, seqlen) and out.dtype == dtype
    _assert_out_close(out, expected, x, weight, bias, dtype)
    if return_final:
        assert result[1].shape == (batch, dim, width - 1) and result[1].dtype == dtype
        np.testing.assert_array_equal(np.asarray(result[1], np.float64), final)


PACKED = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, -1, -1], [5, 5, 5, 5, 5, 5, 7, 7, -1, 3, 3, 3]], np.int32)


@pytest.mark.parametrize("implementation", implementation_params())
def test_fn_packed_documents_match_the_kernels_seq_idx(implementation):
    """Each document alone, padding (negative ids) zero even with a bias, on every implementation."""
    x = random(5, (2, 8, PACKED.shape[1]))
    weight, bias = random(6, (8, 4), scale=0.5), random(7, (8,))
    out = compat.causal_conv1d_fn(x, weight, bias, seq_idx=PACKED, activation="silu", implementation=implementation,
                                  interpret=implementation != "xla")
    expected, _ = dao_fn_ref(x, weight, bias, seq_idx=PACKED, activation="silu")
    _assert_out_close(out, expected, x, weight, bias, F32)
    assert not np.asarray(out)[:, :, PACKED[0] < 0][0].any()


def test_fn_packed_documents_are_exact():
    """A NaN in one document changes no other's output, and no gradient crosses a boundary."""
    x = random(8, (2, 8, PACKED.shape[1]))
    weight, bias = random(9, (8, 3)), random(10, (8,))
    f = lambda x: compat.causal_conv1d_fn(x, weight, bias, seq_idx=PACKED)  # noqa: E731
    poisoned = x.at[0, :, 3:5].set(jnp.nan)  # row 0's document 1
    others = PACKED[0] != 1
    np.testing.assert_array_equal(np.asarray(f(poisoned))[0][:, others], np.asarray(f(x))[0][:, others])
    dx = jax.grad(lambda x: f(x)[0, :, 5:10].sum())(x)  # row 0's document 2
    outside = np.ones(PACKED.shape, bool)
    outside[0, 5:10] = False
    assert not np.asarray(dx).transpose(0, 2, 1)[outside].any()


def test_fn_packed_with_states_has_causal_conv1ds_meaning():
    """seq_idx with initial_states and final states (causal-conv1d refuses the pair): the state
    belongs to each row's first document, the final state is its last document's."""
    x = random(11, (2, 6, PACKED.shape[1]))
    weight, init = random(12, (6, 4)), random(13, (2, 6, 3))
    out, final = compat.causal_conv1d_fn(x, weight, None, PACKED, init, True)
    expected, expected_final = dao_fn_ref(x, weight, seq_idx=PACKED, initial_states=init)
    _assert_out_close(out, expected, x, weight, None, F32)
    np.testing.assert_array_equal(np.asarray(final, np.float64), expected_final)


def test_fn_final_states_out_is_checked_and_the_states_returned():
    x, weight = random(14, (2, 4, 6)), random(15, (4, 3))
    buffer = jnp.zeros((2, 4, 2))
    out, final = compat.causal_conv1d_fn(x, weight, return_final_states=True, final_states_out=buffer)
    np.testing.assert_array_equal(final, x[:, :, -2:])
    assert not buffer.any()  # JAX arrays are immutable: the states come back instead
    with pytest.raises(ValueError, match=r"final_states_out must be \(batch, dim, width - 1\) = \(2, 4, 2\), got \(2, 2, 4\)"):
        compat.causal_conv1d_fn(x, weight, return_final_states=True, final_states_out=jnp.zeros((2, 2, 4)))
    with pytest.raises(ValueError, match=r"final_states_out is where the final states go with return_final_states=True"):
        compat.causal_conv1d_fn(x, weight, final_states_out=buffer)


def test_fn_gradients_match_the_reference():
    """Gradients through the transposes, for x, weight, bias and initial_states: those of
    ``sum(out * g)`` against jax.grad of ``causal_conv1d_ref`` in float64."""
    x, weight, bias, init = random(16, (2, 5, 11)), random(17, (5, 4)), random(18, (5,)), random(19, (2, 5, 3))
    g = random(20, (2, 5, 11))
    loss = lambda x, w, b, s: (compat.causal_conv1d_fn(x, w, b, initial_states=s) * g).sum()  # noqa: E731
    dx, dw, db, ds = jax.grad(loss, (0, 1, 2, 3))(x, weight, bias, init)
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        ref = lambda x, w, b, s: (_jax_ref(x, w, b, s) * f64(g)).sum()  # noqa: E731
        expected = jax.grad(ref, (0, 1, 2, 3))(f64(x), f64(weight), f64(bias), f64(init))
    for actual, want, reduction in zip((dx, dw, db, ds), expected, (4, 2 * 11, 2 * 11, 4)):
        scale = float(np.abs(g).max() * max(np.abs(weight).max(), np.abs(x).max(), 1.0))
        assert_close(actual, np.asarray(want), F32, reduction, scale)


def _jax_ref(x, w, b, s):
    """``causal_conv1d_ref`` in jax.numpy (float64 under enable_x64), for its gradients."""
    ext = jnp.concatenate([s, x], axis=-1)
    width, length = w.shape[1], x.shape[-1]
    return sum(w[:, k, None] * ext[:, :, k : k + length] for k in range(width)) + b[:, None]


# --------------------------------------------------------------------- causal_conv1d_update

UPDATE_CASES = [
    # (tokens (None: x is (batch, dim)), width, state_len, circular, pooled)
    (None, 4, 3, False, False),
    (3, 4, 6, False, True),
    (None, 3, 5, True, True),
    (4, 2, 3, True, True),  # more tokens than state_len - (width - 1): the window wraps
    (7, 4, 5, True, False),  # more tokens than the state holds
]


@pytest.mark.parametrize(
    "tokens, width, state_len, circular, pooled", tiered(UPDATE_CASES, lambda c: c in UPDATE_CASES[1:4], spread=True),
    ids=[f"T{c[0] or 'none'}_W{c[1]}_S{c[2]}{'_circular' if c[3] else ''}{'_pool' if c[4] else ''}" for c in UPDATE_CASES],
)
def test_update_matches_causal_conv1d_update_ref(tokens, width, state_len, circular, pooled):
    batch, dim = 4, 6
    x = random(21, (batch, dim) if tokens is None else (batch, dim, tokens))
    weight, bias = random(22, (dim, width), scale=0.5), random(23, (dim,))
    slots = 9 if pooled else batch
    pool = random(24, (slots, dim, state_len))
    indices = np.array([7, -1, 2, 4], np.int32) if pooled else None
    seqlens = np.array([0, 5, 13, 2], np.int32) if circular else None
    out, new_pool = compat.causal_conv1d_update(x, pool, weight, bias, "silu", seqlens, indices)
    expected, expected_pool = dao_update_ref(x, pool, weight, bias, "silu", seqlens, indices)
    assert out.shape == x.shape and new_pool.shape == pool.shape
    _assert_out_close(out, expected, x, weight, bias, F32)
    np.testing.assert_array_equal(np.asarray(new_pool, np.float64), expected_pool)
    if pooled:
        assert not np.asarray(out)[1].any()  # the padding row
        untouched = [s for s in range(slots) if s not in indices]
        np.testing.assert_array_equal(np.asarray(new_pool)[untouched], np.asarray(pool)[untouched])


def test_update_under_jit_with_traced_indices_and_donation():
    x, weight, bias = random(25, (3, 5, 2)), random(26, (5, 4)), random(27, (5,))
    pool = random(28, (6, 5, 4))
    indices, seqlens = jnp.array([5, 0, -1], jnp.int32), jnp.array([3, 9, 1], jnp.int32)
    expected, expected_pool = dao_update_ref(x, pool, weight, bias, None, np.asarray(seqlens), np.asarray(indices))
    step = jax.jit(compat.causal_conv1d_update, donate_argnums=1)
    out, new_pool = step(x, jnp.array(pool), weight, bias, None, seqlens, indices)
    _assert_out_close(out, expected, x, weight, bias, F32)
    np.testing.assert_array_equal(np.asarray(new_pool, np.float64), expected_pool)


def test_update_gradients_are_finite_with_a_pad_row():
    """A pad row (index -1) reads zeros, not NaN: its outputs are zeroed, so its zero cotangents
    reach the weight, the bias and x as zeros (with NaN there every gradient was NaN)."""
    x, weight, bias = random(32, (3, 5, 2)), random(33, (5, 4)), random(34, (5,))
    pool, indices = random(35, (6, 5, 3)), jnp.array([5, -1, 0], jnp.int32)

    def loss(x, weight, bias):
        out, _ = compat.causal_conv1d_update(x, pool, weight, bias, "silu", None, indices)
        return (out ** 2).sum()

    for grad in jax.grad(loss, argnums=(0, 1, 2))(x, weight, bias):
        assert np.isfinite(np.asarray(grad)).all()
    assert not np.asarray(jax.grad(loss)(x, weight, bias))[1].any()  # the pad row's inputs get no gradient


def test_ported_decode_loop_continues_the_prefill():
    """Mamba's serving loop as written for causal-conv1d: prefill returns the final states, the
    update takes them as conv_state and returns the next one; the outputs are the full pass's."""
    x, weight, bias = random(29, (2, 8, 12)), random(30, (8, 4), scale=0.5), random(31, (8,))
    full = compat.causal_conv1d_fn(x, weight, bias, activation="silu")
    out, conv_state = compat.causal_conv1d_fn(x[:, :, :7], weight, bias, return_final_states=True, activation="silu")
    steps = [out]
    for t in range(7, 12):
        y, conv_state = compat.causal_conv1d_update(x[:, :, t], conv_state, weight, bias, "silu")
        steps.append(y[:, :, None])
    _assert_out_close(jnp.concatenate(steps, axis=-1), np.asarray(full, np.float64), x, weight, bias, F32)
    np.testing.assert_array_equal(conv_state, x[:, :, -3:])


# --------------------------------------------------------------------- errors in causal-conv1d's words


@pytest.mark.parametrize("call, error, match", [
    (lambda: compat.causal_conv1d_fn(jnp.ones((2, 8, 16)), jnp.ones((4, 8))), ValueError,
     r"weight must be \(dim, width\) = \(8, width >= 1\).*got \(4, 8\).*\(width, dim\) weight: pass weight.T"),
    (lambda: compat.causal_conv1d_fn(jnp.ones((2, 16, 8)), jnp.ones((8, 4))), ValueError,
     r"x looks channels-last, \(batch, seqlen, dim\).*maskconv_kernels.causal_conv1d"),
    (lambda: compat.causal_conv1d_fn(jnp.ones((8, 16)), jnp.ones((8, 4))), ValueError,
     r"x must be \(batch, dim, seqlen\).*got shape \(8, 16\): x needs a batch axis, x\[None\] gives one"),
    (lambda: compat.causal_conv1d_fn(jnp.ones((2, 8, 16)), jnp.ones((8, 4)), seq_idx=jnp.zeros((2, 8), int)),
     ValueError, r"seq_idx must have \(batch, seqlen\), x's shape without dim = \(2, 16\), got \(2, 8\)"),
    (lambda: compat.causal_conv1d_fn(jnp.ones((2, 8, 16)), jnp.ones((8, 4)), initial_states=jnp.ones((2, 3, 8))),
     ValueError, r"initial_states must be \(batch, dim, width - 1\) = \(2, 8, 3\), got \(2, 3, 8\)"),
    (lambda: compat.causal_conv1d_fn(jnp.ones((2, 8, 16)), jnp.ones((8, 4)), activation="relu"), ValueError,
     r"activation must be None, 'silu' or 'swish'"),
    (lambda: compat.causal_conv1d_update(jnp.ones((2, 8)), jnp.ones((2, 3, 8)), jnp.ones((8, 4))), ValueError,
     r"conv_state must be \(slots, dim, state_len\) with dim = 8 and state_len >= width - 1 = 3, got \(2, 3, 8\)"),
    (lambda: compat.causal_conv1d_update(jnp.ones((2, 8)), jnp.ones((5, 8, 3)), jnp.ones((8, 4))), ValueError,
     r"conv_state has 5 slots but x has 2 rows.*conv_state_indices"),
    (lambda: compat.causal_conv1d_update(jnp.ones((2, 8)), jnp.ones((2, 8, 3), jnp.bfloat16), jnp.ones((8, 4))),
     TypeError, r"conv_state must have x's dtype float32, got bfloat16"),
    (lambda: compat.causal_conv1d_update(jnp.ones((2, 8)), jnp.ones((5, 8, 3)), jnp.ones((8, 4)),
                                         conv_state_indices=np.array([1, 1], np.int32)),
     ValueError, r"^causal_conv1d_update: conv_state_indices names a slot for several rows"),
], ids=["weight_transposed", "x_channels_last", "x_unbatched", "seq_idx_shape", "initial_states_layout",
        "activation", "conv_state_layout", "conv_state_slots", "conv_state_dtype", "indices_twice"])
def test_errors_name_causal_conv1ds_layouts(call, error, match):
    with pytest.raises(error, match=match):
        call()
