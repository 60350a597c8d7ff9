"""``causal_conv1d``'s shared suite: every implementation against float64 oracles written from
causal-conv1d's math, through one harness (:mod:`support.short_conv`).

Each implementation of its registry that runs here (``xla``; ``pallas_triton`` and
``pallas_mosaic_gpu`` compiled on a GPU, interpreted elsewhere, with tiles small enough
that test sizes take several): the forward against :func:`causal_conv1d_reference`
(NumPy, float64); the gradients (x, weight, bias, initial state) against jax's autodiff
of a float64 shift-and-add written from the formula, with no library code; packed
documents, each one's outputs equal to the document run on its own, bit for bit; NaN
isolation across documents; determinism, vmap, empty sequences, and the kernels'
derivatives above the first (the op's primitives). Then the op's own checks: errors, the
cuda lowering and the per-platform choice, the causality audit. Each backend's module
holds what is its alone (its config, its lowering, its compile for sm_90).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from support import harness
from support.lowering import cuda_lowering
from support.numerics import assert_close, random
from support.short_conv import (
    BF16, F32, GRID, IMPLS, check_against_oracles, check_derivatives_of_every_order, check_nan_isolation,
    check_packed_equals_alone, grid_id, ids, inputs,
)

import maskconv_kernels as mk
from maskconv_kernels.ops.causal_conv1d import backends, causal_conv1d

# XLA's Triton custom call, where Pallas' Triton lowering puts a kernel.
TRITON_CALL = "__gpu$xla.gpu.triton"
KERNEL_BACKENDS = {n: i for n, i in IMPLS.items() if i.implementation != "xla"}
# The README's command: a dilated float16 case on every implementation, and Mamba's mixed
# dtypes (16-bit activations, float32 weights, segments and a state) on all but the
# interpreted kernels; the slow tier the rest. The kernels take the grid's cases of 16 channels and more (several channel
# tiles); the 5-channel grid of widths, lengths, segments and states is xla's.
FAST = [GRID[-1], GRID[-2]]
ORACLE_CASES = [
    *harness.cases({"xla": IMPLS["xla"]}, GRID, lambda impl, case: case in FAST, grid_id),
    *harness.cases(KERNEL_BACKENDS, [c for c in GRID if c[1] >= 16],
                   lambda impl, case: case in FAST[: 1 if impl.slow else 2], grid_id),
]


@pytest.mark.parametrize("name, case", ORACLE_CASES)
def test_matches_the_oracles(name, case):
    """Forward, final state and every gradient of one case, against the float64 oracles."""
    width, dim, length, dilation, bias, activation, x_dtype, w_dtype, segmented, stateful = case
    x, w, b, state, dy = inputs(0, 2, length, dim, width, x_dtype, w_dtype, dilation)
    check_against_oracles(IMPLS[name], x, w, b if bias else None, state if stateful else None, dy,
                          ids(5, 2, length) if segmented else None, activation=activation, dilation=dilation)


@pytest.mark.parametrize("name", harness.params(IMPLS))
def test_nan_in_one_document_reaches_no_other_and_gradients_stay_inside(name):
    conv = IMPLS[name]
    x, w, b, state, _ = inputs(7, 2, 30, 16, 4, F32, F32)
    doc = ids(8, 2, 30)
    doc[0] = np.where(doc[0] >= 0, doc[0] + 100, doc[0])  # row 0's documents are not row 1's
    check_nan_isolation(lambda x, s: conv(x, w, b, segment_ids=doc, initial_state=s, activation="silu"), x, state, doc)


@pytest.mark.parametrize("name, dtype", harness.cases(IMPLS, [F32, BF16], lambda impl, dtype: dtype == F32, str))
def test_packed_documents_equal_documents_run_alone_bit_for_bit(name, dtype):
    conv = IMPLS[name]
    check_packed_equals_alone(lambda x, w, b, ids: conv(x, w, b, segment_ids=ids, activation="silu"), dtype)


@pytest.mark.parametrize("name", harness.params(IMPLS, slow=lambda impl: True))
def test_two_runs_are_bit_identical(name):
    conv = IMPLS[name]
    x, w, b, state, dy = inputs(9, 2, 45, 20, 4, BF16, F32)
    doc = ids(10, 2, 45)

    def run():
        f = lambda x, w, b, s: conv(x, w, b, segment_ids=doc, initial_state=s, activation="silu")  # noqa: E731
        y, vjp = jax.vjp(f, x, w, b, state)
        return [np.asarray(a) for a in (y, *vjp(dy))]

    for first, second in zip(run(), run()):
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("name", harness.params(KERNEL_BACKENDS, slow=lambda i: True))
def test_derivatives_of_every_order_match_the_xla_implementation(name):
    """Forward mode, reverse over reverse, a Hessian and a transposed JVP through the
    kernels, against the xla implementation's: the backend supplies a forward and a
    backward, the op's primitives every derivative above the first."""
    x, w, b, state, _ = inputs(21, 2, 11, 16, 3, F32, F32, dilation=2)
    kw = dict(segment_ids=jnp.asarray(ids(26, 2, 11)), activation="silu", dilation=2)
    check_derivatives_of_every_order(lambda x, w, b, s: IMPLS[name](x, w, b, initial_state=s, **kw),
                                     lambda x, w, b, s: IMPLS["xla"](x, w, b, initial_state=s, **kw), x, w, b, state)


@pytest.mark.parametrize("name", harness.params(KERNEL_BACKENDS, slow=lambda i: False))
def test_second_derivative_in_the_weight_runs(name):
    """A gradient of a gradient through the op's primitives (the fast tier's one): the
    backend's backward kernel gives the first, the op's reference the second."""
    x, w, b, _, _ = inputs(3, 1, 9, 8, 3, F32, F32)
    inner = lambda f: lambda w: jnp.sum(jax.grad(lambda x: jnp.sum(f(x, w, b, activation="silu") ** 2))(x) ** 2)  # noqa: E731
    got, want = jax.grad(inner(IMPLS[name]))(w), jax.grad(inner(IMPLS["xla"]))(w)
    assert_close(got, want, F32, 9 * 3 * 2, float(np.abs(np.asarray(want)).max()) + 1)


@pytest.mark.parametrize("name", harness.params(IMPLS))
def test_vmap_over_examples_folds_into_the_batch(name):
    conv = IMPLS[name]
    x, w, b, _, _ = inputs(13, 2, 9, 16, 3, F32, F32)
    f = lambda x: conv(x, w, b, activation="silu")  # noqa: E731
    np.testing.assert_array_equal(jax.vmap(f)(jnp.stack([x, 2 * x])), jnp.stack([f(x), f(2 * x)]))


@pytest.mark.parametrize("name", harness.params(IMPLS, slow=lambda impl: False))
def test_empty_sequences_give_empty_outputs_and_zero_gradients(name):
    conv = IMPLS[name]
    x, w = jnp.ones((2, 0, 8), jnp.float32), jnp.ones((4, 8), jnp.float32)
    state = jnp.ones((2, 3, 8), jnp.float32)
    assert conv(x, w, initial_state=state).shape == (2, 0, 8)
    gw, gs = jax.grad(lambda w, s: conv(x, w, initial_state=s).sum(), (0, 1))(w, state)
    assert not np.asarray(gw).any() and not np.asarray(gs).any()


# --------------------------------------------------------------------------- the op


def test_initial_state_continues_the_sequence():
    """Splitting a sequence in two, with the first part's final state as the second's initial state, changes nothing."""
    x, w, b, _, _ = inputs(6, 2, 40, 16, 4, F32, F32, dilation=2)
    whole = causal_conv1d(x, w, b, activation="silu", dilation=2)
    first, state = causal_conv1d(x[:, :23], w, b, activation="silu", dilation=2, return_final_state=True)
    second = causal_conv1d(x[:, 23:], w, b, activation="silu", dilation=2, initial_state=state)
    np.testing.assert_array_equal(np.concatenate([first, second], axis=1), whole)


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
    x, w, b, state, _ = inputs(9, 2, 64, 32, 4, BF16, F32)
    doc = ids(10, 2, 64) if segmented else None

    def loss(x, w, b, state):
        y = causal_conv1d(x, w, b, segment_ids=doc, initial_state=state, activation="silu")
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
    first of its platform's ``PREFERENCE`` that runs the problem there. With the fused kernels
    first on cuda, one export for ``("cpu", "cuda")`` holds them in its cuda branch and xla's
    maps in its cpu branch, and runs here as ``implementation="xla"`` does."""
    monkeypatch.setattr(backends.REGISTRY, "preference", {**backends.PREFERENCE, "cuda": ("pallas_triton", "xla")})
    x, w, b, state, _ = inputs(30, 2, 64, 32, 4, F32, F32)
    doc = ids(31, 2, 64)

    def value_and_grad(implementation):
        def loss(x, w, b, state):
            return causal_conv1d(x, w, b, segment_ids=doc, initial_state=state, activation="silu",
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

