"""``padding_id``: MaxText's packing convention (documents ``1, 2, ...``, padding ``0``) said explicitly.

Without it, id 0 is a document: MaxText's ids run without an error, and a right-padded
row's final state is its padding's inputs, from which decoding would continue. With
``padding_id=0`` the ids equal to it are padding (zero outputs, no gradient, never read)
and the final state is that of the row's real tokens: the state of the unpadded sequence.
Checked against the float64 oracle given the library's own convention (``0`` -> ``-1``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close, random

from maskconv_kernels.ops.causal_conv1d import causal_conv1d, causal_conv1d_reference
from maskconv_kernels.parallel import sequence_sharded_causal_conv1d

F32 = np.dtype("float32")
D, W = 6, 4

# MaxText's packed rows: documents 1, 2, ... back to back, right-padded with 0. Row 1's
# last document (2 tokens) is shorter than the state (3 inputs); row 2 holds one document.
MAXTEXT_IDS = np.array([
    [1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 2, 2, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0],
], np.int32)
REAL = (MAXTEXT_IDS != 0).sum(axis=1)


def _maxtext_inputs(dtype=F32):
    """``x`` with NaN at every padding position: no output, state or gradient may read one."""
    x = np.array(random(0, MAXTEXT_IDS.shape + (D,), dtype))
    x[MAXTEXT_IDS == 0] = np.nan
    return jnp.asarray(x)


@pytest.mark.parametrize("dilation", [1, 2])
def test_padding_id_zero_takes_maxtext_ids_against_the_oracle(dilation):
    x, weight, bias = _maxtext_inputs(), random(1, (W, D)), random(2, (D,))
    y, state = causal_conv1d(x, weight, bias, segment_ids=MAXTEXT_IDS, padding_id=0, activation="silu",
                             dilation=dilation, return_final_state=True)
    ours = np.where(MAXTEXT_IDS == 0, -1, MAXTEXT_IDS)
    finite = np.nan_to_num(np.asarray(x))  # the oracle multiplies: where the op selects, it reads zeros
    y_ref, state_ref = causal_conv1d_reference(finite, weight, bias, segment_ids=ours, activation="silu",
                                               dilation=dilation, return_final_state=True)
    scale = float(np.abs(bias).max() + W * np.abs(finite).max() * np.abs(weight).max())
    assert_close(y, y_ref, F32, W + 1, scale)
    assert not np.asarray(y)[MAXTEXT_IDS == 0].any()  # padding outputs are zeros, not bias or NaN
    np.testing.assert_array_equal(state, state_ref)  # copies of inputs: exact


@pytest.mark.parametrize("dilation", [1, 2])
def test_final_state_is_the_unpadded_sequences(dilation):
    """Each row's state equals the state of its real tokens run without padding (MaxText's
    ``conv_state = x[:, -(K - 1):]`` of the unpadded row, zeros before a short last document)."""
    x, weight = _maxtext_inputs(), random(3, (W, D))
    _, state = causal_conv1d(x, weight, segment_ids=MAXTEXT_IDS, padding_id=0, dilation=dilation,
                             return_final_state=True)
    for b, n in enumerate(REAL):
        _, alone = causal_conv1d(x[b:b + 1, :n], weight, segment_ids=MAXTEXT_IDS[b:b + 1, :n], padding_id=0,
                                 dilation=dilation, return_final_state=True)
        np.testing.assert_array_equal(state[b], alone[0])
    # Row 2 is one document: its state is its last (W - 1) * dilation real inputs, as MaxText keeps them.
    np.testing.assert_array_equal(state[2], x[2, REAL[2] - (W - 1) * dilation:REAL[2]])


def test_without_padding_id_zero_is_a_document():
    """The silent case the keyword exists for: id 0 read as a document hands back padding as the state."""
    x = jnp.asarray(np.nan_to_num(np.asarray(_maxtext_inputs()), nan=7.0))
    _, state = causal_conv1d(x, random(4, (W, D)), segment_ids=MAXTEXT_IDS, return_final_state=True)
    assert (np.asarray(state[:, -1]) == 7.0).all()  # the newest input each row hands on is padding
    _, state = causal_conv1d(x, random(4, (W, D)), segment_ids=MAXTEXT_IDS, padding_id=0, return_final_state=True)
    assert (np.asarray(state) != 7.0).all()


def test_padding_receives_no_gradient_and_is_never_read():
    x, weight, bias = _maxtext_inputs(), random(5, (W, D)), random(6, (D,))

    def loss(x, weight, bias):
        y, state = causal_conv1d(x, weight, bias, segment_ids=MAXTEXT_IDS, padding_id=0, activation="silu",
                                 return_final_state=True)
        return (y ** 2).sum() + (state ** 2).sum()

    gx, gw, gb = jax.grad(loss, (0, 1, 2))(x, weight, bias)
    assert np.isfinite(np.asarray(loss(x, weight, bias)))
    assert all(np.isfinite(np.asarray(g)).all() for g in (gw, gb))
    assert not np.asarray(gx)[MAXTEXT_IDS == 0].any() and np.isfinite(np.asarray(gx)).all()


def test_other_ids_keep_their_meaning():
    """``padding_id=0`` adds id 0 to the padding; negative ids stay padding, other ids documents."""
    ids = np.array([[1, 1, 3, 3, 3, -1, 0, 0]], np.int32)
    x, weight = random(7, (1, 8, D)), random(8, (W, D))
    got = causal_conv1d(x, weight, segment_ids=ids, padding_id=0)
    expected = causal_conv1d(x, weight, segment_ids=np.where(ids == 0, -1, ids))
    np.testing.assert_array_equal(got, expected)


def test_sequence_sharded_takes_padding_id():
    # Two devices: the host's CPUs (tests/conftest.py gives every session 8), which a
    # one-chip TPU machine has too; the unsharded pass runs there as well, for the bits.
    cpus = jax.devices("cpu")
    mesh = jax.make_mesh((2,), ("seq",), devices=cpus[:2])
    ids = np.concatenate([MAXTEXT_IDS, np.zeros((3, 3), np.int32)], axis=1)  # 16 positions, 8 a shard
    x, weight = random(9, ids.shape + (D,)), random(10, (W, D))
    got = sequence_sharded_causal_conv1d(x, weight, mesh=mesh, axis_name="seq", segment_ids=ids, padding_id=0,
                                         return_final_state=True)
    with jax.default_device(cpus[0]):
        expected = causal_conv1d(x, weight, segment_ids=ids, padding_id=0, return_final_state=True)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(padding_id=0), ValueError, r"padding_id says which segment id marks padding, but no segment_ids"),
    (dict(padding_id=0, positions=np.zeros((1, 5), np.int32)), ValueError, r"with positions, padding is a negative"),
    (dict(padding_id=0.0, segment_ids=np.zeros((1, 5), np.int32)), TypeError, r"padding_id must be an int"),
], ids=["no_ids", "positions", "float"])
def test_padding_id_errors_name_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        causal_conv1d(jnp.ones((1, 5, D)), jnp.ones((W, D)), **kwargs)
