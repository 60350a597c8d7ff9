"""``causal_conv1d``: causal-conv1d's semantics, against float64 oracles written from its math.

The forward against :func:`causal_conv1d_reference` (NumPy, float64); the gradients
(x, weight, bias, initial state) against jax's autodiff of a float64 shift-and-add
written here from the formula, with no library code. Packed documents: each one's
outputs equal the document run on its own, bit for bit.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from support.lowering import cuda_lowering
from support.tiers import tiered
from support.numerics import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels.ops.causal_conv1d import backends
from maskconv_kernels.ops.causal_conv1d import causal_conv1d, causal_conv1d_reference

# XLA's Triton custom call, where Pallas' Triton lowering puts a kernel.
TRITON_CALL = "__gpu$xla.gpu.triton"

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)


def _ids(seed, batch, length):
    """Documents of random lengths in each row, trailing padding in some."""
    rng = np.random.default_rng(seed)
    ids = np.full((batch, length), -1, np.int32)
    for row in ids:
        end = length - int(rng.integers(0, 4))
        cuts = np.sort(rng.choice(np.arange(1, max(end, 2)), min(2, max(end - 1, 0)), replace=False))
        row[:end] = 10 + np.searchsorted(cuts, np.arange(end), side="right")
    return ids


def _inputs(seed, batch, length, dim, width, x_dtype, w_dtype, dilation=1):
    x = random(seed, (batch, length, dim), x_dtype)
    w = random(seed + 1, (width, dim), w_dtype, scale=0.5)
    b = random(seed + 2, (dim,), w_dtype, scale=0.5)
    state = random(seed + 3, (batch, (width - 1) * dilation, dim), x_dtype)
    return x, w, b, state


def _oracle(x, w, b, ids, state, activation, dilation):
    """float64 jnp: ``y[l] = act(b + sum_t w[t] * xe[l + S - (W-1-t) d])`` with document selects."""
    batch, length, dim = x.shape
    width = w.shape[0]
    s = (width - 1) * dilation
    xe = jnp.concatenate([state, x], axis=1)
    first = ids[:, :1] if state is not None else jnp.full((batch, 1), -(2**30))
    ide = jnp.concatenate([jnp.broadcast_to(first, (batch, s)), ids], axis=1)
    y = jnp.zeros((batch, length, dim), x.dtype)
    for t in range(width):
        back = (width - 1 - t) * dilation
        same = ((ide[:, s - back : s - back + length] == ids) & (ids >= 0))[..., None]
        y = y + jnp.where(same, xe[:, s - back : s - back + length] * w[t], 0.0)
    if b is not None:
        y = y + b
    if activation:
        y = y * jax.nn.sigmoid(y)
    return jnp.where((ids >= 0)[..., None], y, 0.0)


GRID = [
    # width, dim, length, dilation, bias, activation, x dtype, weight dtype, segments, initial state
    *itertools.product((2, 3, 4), (5,), (1, 13), (1,), (True,), ("silu",), (F32,), (F32,), (False, True), (False, True)),
    (4, 64, 129, 1, False, None, F32, F32, True, False),
    (4, 40, 151, 2, True, "silu", F32, F32, True, True),
    (8, 24, 67, 1, True, None, F32, F32, False, True),
    (4, 48, 33, 1, True, "silu", BF16, BF16, True, False),
    (4, 48, 33, 1, True, "silu", F16, F16, False, True),
    (4, 48, 33, 1, True, "silu", BF16, F32, True, True),  # Mamba's default: 16-bit activations, float32 weights
    (3, 16, 9, 3, False, "silu", F16, F32, True, False),
]


def _grid_id(case):
    w, d, l, dil, bias, act, xd, wd, seg, st = case
    return f"W{w}_D{d}_L{l}_d{dil}{'_bias' if bias else ''}{'_silu' if act else ''}_{xd}-{wd}{'_seg' if seg else ''}{'_state' if st else ''}"


@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_forward_and_final_state_match_the_reference(case):
    width, dim, length, dilation, bias, activation, x_dtype, w_dtype, segmented, stateful = case
    x, w, b, state = _inputs(0, 2, length, dim, width, x_dtype, w_dtype, dilation)
    kw = dict(
        segment_ids=_ids(1, 2, length) if segmented else None, initial_state=state if stateful else None,
        activation=activation, dilation=dilation, return_final_state=True,
    )
    y, final = jax.jit(lambda x, w, b: causal_conv1d(x, w, b if bias else None, **kw))(x, w, b)
    ry, rfinal = causal_conv1d_reference(x, w, b if bias else None, **kw)
    assert y.dtype == x_dtype and final.dtype == x_dtype and final.shape == (2, (width - 1) * dilation, dim)
    scale = float(np.abs(np.asarray(x, np.float64)).max() * np.abs(np.asarray(w, np.float64)).max()) + 1
    assert_close(y, ry, x_dtype, width, scale)
    np.testing.assert_array_equal(np.asarray(final, np.float64), rfinal)  # copies, not sums


# The README's command: widths 3 and 4, dilations 1 and 3, float16 and Mamba's mixed
# dtypes, with segments and states; the slow tier the other named cases and the grid's
# small ones (the forward's grid is the fast tier's).
FAST_GRADIENTS = [GRID[-1]]


@pytest.mark.parametrize(
    "case", tiered([c for c in GRID if c[1] > 5 or c[2] == 13], lambda c: c in FAST_GRADIENTS), ids=_grid_id,
)
def test_gradients_match_autodiff_of_a_float64_oracle(case):
    """dx, dweight, dbias and dinitial_state, against jax's float64 autodiff of the formula."""
    width, dim, length, dilation, bias, activation, x_dtype, w_dtype, segmented, stateful = case
    x, w, b, state = _inputs(2, 2, length, dim, width, x_dtype, w_dtype, dilation)
    ids = _ids(3, 2, length) if segmented else np.zeros((2, length), np.int32)
    dy = random(4, x.shape, x_dtype)

    def ours(x, w, b, state):
        return causal_conv1d(
            x, w, b if bias else None, segment_ids=ids if segmented else None,
            initial_state=state if stateful else None, activation=activation, dilation=dilation,
        )

    _, vjp = jax.vjp(ours, x, w, b, state)
    grads = vjp(dy)
    with jax.enable_x64(True):
        as64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        zeros = jnp.zeros_like(as64(state))

        def oracle(x, w, b, state):
            return _oracle(x, w, b if bias else None, jnp.asarray(ids), state if stateful else zeros, activation, dilation)

        _, vjp64 = jax.vjp(oracle, *map(as64, (x, w, b, state)))
        expected = [np.asarray(g) for g in vjp64(as64(dy))]
    names = ("dx", "dweight", "dbias", "dinitial_state")
    reductions = (width, 2 * length, 2 * length, width)
    for name, got, want, reduction, like in zip(names, grads, expected, reductions, (x, w, b, state)):
        assert got.dtype == like.dtype, name
        if (name == "dbias" and not bias) or (name == "dinitial_state" and not stateful):
            assert not np.asarray(got, np.float64).any(), name
            continue
        scale = float(np.abs(np.asarray(dy, np.float64)).max()) * max(1.0, float(np.abs(np.asarray(x, np.float64)).max()))
        scale *= max(1.0, float(np.abs(np.asarray(w, np.float64)).max())) * (width + 1)
        assert_close(got, want, got.dtype, reduction, scale)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_packed_documents_equal_documents_run_alone_bit_for_bit(dtype):
    """The packed-vs-unpacked check: a document's outputs in a packed row are its outputs alone.

    Alone: each document in its own row, right-padded (negative ids) to the packed
    length, as an unpacked batch is; and, from two tokens on, at its own length. (A
    one-token document at its own length is a different program: jax 0.10's CPU
    compiler folds the three taps that read only padding away and fuses the one product
    left with the bias add, one rounding fewer: the last bit can differ there.)
    """
    rng = np.random.default_rng(5)
    lengths, dim, width = [37, 5, 64, 1, 2, 57], 48, 4
    docs = [random(10 + i, (1, n, dim), dtype) for i, n in enumerate(lengths)]
    w, b = random(1, (width, dim), np.float32, scale=0.5), random(2, (dim,), np.float32)
    packed = jnp.concatenate(docs, axis=1)
    total = packed.shape[1]
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])[None].astype(np.int32)
    silu = jax.jit(lambda x, ids: causal_conv1d(x, w, b, segment_ids=ids, activation="silu"))
    alone = jax.jit(lambda x: causal_conv1d(x, w, b, activation="silu"))
    y = np.asarray(silu(packed, ids))
    start = 0
    for doc, n in zip(docs, lengths):
        row = jnp.zeros((1, total, dim), dtype).at[:, :n].set(doc)
        row_ids = np.where(np.arange(total) < n, int(rng.integers(0, 100)), -1)[None].astype(np.int32)
        np.testing.assert_array_equal(np.asarray(silu(row, row_ids))[:, :n], y[:, start : start + n])
        if n > 1:
            np.testing.assert_array_equal(np.asarray(alone(doc)), y[:, start : start + n])
        start += n


def test_initial_state_continues_the_sequence():
    """Splitting a sequence in two, with the first part's final state as the second's initial state, changes nothing."""
    x, w, b, _ = _inputs(6, 2, 40, 16, 4, F32, F32, dilation=2)
    whole = causal_conv1d(x, w, b, activation="silu", dilation=2)
    first, state = causal_conv1d(x[:, :23], w, b, activation="silu", dilation=2, return_final_state=True)
    second = causal_conv1d(x[:, 23:], w, b, activation="silu", dilation=2, initial_state=state)
    np.testing.assert_array_equal(np.concatenate([first, second], axis=1), whole)


def test_nan_in_one_document_reaches_no_other():
    x, w, b, state = _inputs(7, 2, 30, 8, 4, F32, F32)
    ids = _ids(8, 2, 30)
    f = jax.jit(lambda x, state: causal_conv1d(x, w, b, segment_ids=ids, initial_state=state, activation="silu"))
    clean = np.asarray(f(x, state))
    for doc in np.unique(ids[ids >= 0]):
        poisoned = jnp.where(jnp.asarray((ids == doc) | (ids < 0))[..., None], jnp.nan, x)
        y = np.asarray(f(poisoned, state))
        np.testing.assert_array_equal(y[ids != doc], clean[ids != doc])
    assert (clean[ids < 0] == 0).all()
    # The gradient of one document's outputs is zero outside it, the state included for later documents.
    doc = int(ids[0, -1]) if ids[0, -1] >= 0 else int(ids[0][ids[0] >= 0][-1])
    gx, gs = jax.grad(lambda x, s: jnp.where(jnp.asarray(ids == doc)[..., None], f(x, s), 0).sum(), (0, 1))(x, state)
    assert (np.asarray(gx)[ids != doc] == 0).all()
    if ids[0, 0] != doc:
        assert (np.asarray(gs)[0] == 0).all()


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(segment_ids=np.zeros((2, 9), np.float32)), TypeError, r"segment_ids must hold integers"),
        (dict(segment_ids=np.zeros((2, 8), np.int32)), ValueError, r"segment_ids must have x's shape.*\(2, 9\)"),
        (dict(weight=np.ones((4, 5), np.float32)), ValueError, r"weight must be \(W, D\) = \(width, 6\)"),
        (dict(weight=np.ones((4,), np.float32)), ValueError, r"weight must be \(W, D\)"),
        (dict(bias=np.ones((5,), np.float32)), ValueError, r"bias must be \(D,\) = \(6,\)"),
        (dict(initial_state=np.ones((2, 2, 6), np.float32)), ValueError, r"initial_state must be .*\(2, 3, 6\)"),
        (dict(initial_state=np.ones((2, 3, 6), np.float16)), TypeError, r"initial_state must have x's dtype float32"),
        (dict(activation="gelu"), ValueError, r"activation must be None, 'silu'"),
        (dict(dilation=0), ValueError, r"dilation must be a positive int"),
        (dict(x=np.ones((9, 6), np.float32)), ValueError, r"x must be \(B, L, D\)"),
    ],
)
def test_bad_input_says_what_is_wrong(change, error, match):
    args = dict(x=np.ones((2, 9, 6), np.float32), weight=np.ones((4, 6), np.float32), bias=None) | change
    with pytest.raises(error, match=match):
        causal_conv1d(args.pop("x"), args.pop("weight"), **args)


@pytest.mark.parametrize("segmented", [False, True])
def test_lowered_for_cuda_it_is_elementwise_no_convolution_and_no_dot(segmented):
    """implementation=None for cuda: the forward and both gradients hold no convolution (cuDNN may
    choose Winograd or FFT) and no dot (a grouped convolution's batched dot, one tiny GEMM per channel)."""
    x, w, b, state = _inputs(9, 2, 64, 32, 4, BF16, F32)
    ids = _ids(10, 2, 64) if segmented else None

    def loss(x, w, b, state):
        y = causal_conv1d(x, w, b, segment_ids=ids, initial_state=state, activation="silu")
        return y.astype(jnp.float32).sum()

    with cuda_lowering():
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).trace(x, w, b, state)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    # Shifted products, and the weight gradient's reductions over batch and positions.
    assert "stablehlo.multiply" in text and "stablehlo.reduce" in text
    assert "stablehlo.convolution" not in text
    assert "stablehlo.dot_general" not in text
    assert TRITON_CALL not in text  # xla first: on an H200 it beats the fused kernels


def test_implementation_none_is_chosen_per_platform_when_lowered(monkeypatch):
    """``implementation=None`` binds the op's primitives with no backend: each lowering takes the
    first of ``PREFERENCE`` that runs the problem on its platform. With the fused kernels first,
    one export for ``("cpu", "cuda")`` holds them in its cuda branch and xla's maps in its cpu
    branch, and runs here as ``implementation="xla"`` does."""
    monkeypatch.setattr(backends.REGISTRY, "preference", ("pallas_triton", "xla"))
    x, w, b, state = _inputs(30, 2, 64, 32, 4, F32, F32)
    ids = _ids(31, 2, 64)

    def value_and_grad(implementation):
        def loss(x, w, b, state):
            return causal_conv1d(x, w, b, segment_ids=ids, initial_state=state, activation="silu",
                                 implementation=implementation).sum()

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

    with cuda_lowering():
        cuda = jax.jit(value_and_grad(None)).trace(x, w, b, state).lower(lowering_platforms=("cuda",)).as_text()
        exported = export.export(jax.jit(value_and_grad(None)), platforms=("cpu", "cuda"),
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(x, w, b, state)
    cpu = jax.jit(value_and_grad(None)).trace(x, w, b, state).lower(lowering_platforms=("cpu",)).as_text()
    assert cuda.count(f"@{TRITON_CALL}(") == 3, "the forward, backward and state-gradient kernels"
    assert TRITON_CALL not in cpu
    text = exported.mlir_module()
    assert text.count(f"@{TRITON_CALL}(") == 3 and "stablehlo.case" in text
    if jax.default_backend() == "cpu":
        got, expected = exported.call(x, w, b, state), jax.jit(value_and_grad("xla"))(x, w, b, state)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            assert_close(g, e, F32, 2 * 64 * 4, float(np.abs(np.asarray(e)).max()) + 1.0)


def _mamba_style_block(params, x, conv):
    """Two layers of projection, short causal conv, SiLU and gating, with residuals: ``(1, L, D) -> (1, L, D)``."""
    for w_in, w_conv, b_conv, w_out in params:
        u, z = jnp.split(x @ w_in, 2, axis=-1)
        u = jax.nn.silu(conv(u, w_conv, b_conv))
        x = x + (u * jax.nn.silu(z)) @ w_out
    return x


def _block_params(dim, inner, width, seed=11):
    keys = [random(seed + i, shape, np.float32, scale=0.3) for i, shape in enumerate(
        [(dim, 2 * inner), (width, inner), (inner,), (inner, dim)] * 2)]
    return [tuple(keys[i : i + 4]) for i in (0, 4)]


def test_the_causality_audit_passes_a_packed_mamba_block_and_fails_it_on_lax_conv():
    """visible(p, q) = same document and not later: causal_conv1d with segment_ids passes at every
    position; the same block on lax.conv depthwise (what a model writes by hand) leaks across documents."""
    length, dim, inner, width = 24, 4, 6, 4
    ids = np.repeat(np.arange(3), [7, 9, 8])[None].astype(np.int32)
    params = _block_params(dim, inner, width)

    def ours(u, w, b):
        return causal_conv1d(u, w, b, segment_ids=ids)

    def lax_conv(u, w, b):
        y = jax.lax.conv_general_dilated(
            u, w[:, None, :], (1,), [(width - 1, 0)], dimension_numbers=("NWC", "WIO", "NWC"),
            feature_group_count=u.shape[-1],
        )
        return y + b

    def visible(p, q):
        return (ids[0][p[..., 0]] == ids[0][q[..., 0]]) & (q[..., 0] <= p[..., 0])

    x = random(20, (1, length, dim))
    passed = mk.audit_causal(lambda x: _mamba_style_block(params, x, ours), x, visible=visible, positions="all")
    assert passed.passed, passed
    leaky = mk.audit_causal(lambda x: _mamba_style_block(params, x, lax_conv), x, visible=visible, positions="all")
    assert not leaky.passed
    # The first document cannot leak; the first position of each later one reads the one before.
    gradient = leaky.check("gradient")
    failing = set(np.asarray(leaky.audited)[gradient.failing].tolist())
    assert min(failing) == 7 and {7, 16} <= failing

