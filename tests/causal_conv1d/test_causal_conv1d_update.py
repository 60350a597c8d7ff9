"""``causal_conv1d_update``: causal-conv1d's update semantics over a state pool, decoding bit for bit.

Against :func:`causal_conv1d_update_reference` (float64 NumPy, written from causal-conv1d's
``causal_conv1d_update_ref``): linear and circular states, state indices with padding
rows, several tokens per call, widths 2-4 and 8, dilation, bias and SiLU, 16-bit
activations with float32 weights, pools whose unused slots are NaN. Then: decoding step
by step equals the full forward bit for bit; a row's result does not depend on other
slots; the pool is updated in place under jit with donation; bad input raises a clear
error and overwrites nothing.
"""
from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lowering import cuda_lowering
from support.numerics import assert_close, random
from support.tiers import tiered

from maskconv_kernels.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d,
    causal_conv1d_update,
    causal_conv1d_update_reference,
)

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)
SLOTS = 7


def _bits(a) -> np.ndarray:
    """The bit patterns of a float array (NaN payloads and signed zeros included)."""
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _pool(seed, state_len, dim, dtype, used):
    """``(SLOTS, state_len, dim)``: random in the ``used`` slots, NaN in every other."""
    pool = np.full((SLOTS, state_len, dim), np.nan, np.float32)
    values = np.asarray(random(seed, (SLOTS, state_len, dim)), np.float32)
    pool[used] = values[used]
    return jnp.asarray(pool.astype(dtype))


@dataclasses.dataclass(frozen=True)
class Case:
    width: int
    dim: int
    tokens: int | None  # None: x is (B, D), one token
    dilation: int = 1
    extra: int = 0  # state_len - (W - 1) * dilation
    circular: bool = False
    bias: bool = True
    activation: str | None = "silu"
    x_dtype: np.dtype = F32
    w_dtype: np.dtype = F32

    @property
    def id(self) -> str:
        t = "x2d" if self.tokens is None else f"T{self.tokens}"
        return (
            f"W{self.width}_D{self.dim}_{t}_d{self.dilation}_len+{self.extra}{'_circ' if self.circular else ''}"
            f"{'_bias' if self.bias else ''}{'_silu' if self.activation else ''}_{self.x_dtype}-{self.w_dtype}"
        )


CASES = [
    # causal-conv1d's update grid: widths 2-4, 1/4/5 tokens, with and without cache_seqlens, bias, SiLU, dtypes
    *(Case(w, 16, t, circular=c, extra=e) for w in (2, 3, 4) for t in (None, 4) for c, e in ((False, 0), (True, 5))),
    Case(2, 9, 5, bias=False, activation=None, circular=True, extra=1),
    Case(4, 33, 5, bias=False, extra=1),  # Mamba's state: W inputs
    Case(8, 24, 3, dilation=2, extra=3, circular=True),
    Case(8, 24, 1, dilation=1),
    Case(3, 16, 7, dilation=2, circular=True),  # more tokens than the state holds
    Case(4, 48, None, x_dtype=BF16, w_dtype=BF16),
    Case(4, 48, 5, x_dtype=F16, w_dtype=F16, circular=True, extra=2),
    Case(4, 48, 4, x_dtype=BF16, w_dtype=F32, extra=1),  # Mamba's default: 16-bit activations, float32 weights
    Case(3, 32, None, x_dtype=F16, w_dtype=F32, circular=True, extra=4),
]


# The default (on a TPU the one-launch decode kernel, elsewhere xla's composition) and the
# kernel named, interpreted off a TPU (linear states; circular ones run its forward kernel
# between the gather and the scatter).
TPU_KERNEL = dict(implementation="pallas_mosaic_tpu", interpret=jax.default_backend() != "tpu")
IMPLEMENTATIONS = [pytest.param({}, id="default"), pytest.param(TPU_KERNEL, id="pallas_mosaic_tpu")]


def _skip_float16(impl, case):
    if impl and F16 in (case.x_dtype,):
        pytest.skip("pallas_mosaic_tpu refuses float16 activations (TPUs have no float16 arithmetic)")


# causal-conv1d's grid at width 4 and every named case in the README's command; widths 2 and 3 in the slow tier.
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "case", tiered(CASES, lambda c: (c.width == 4 and not c.circular) or c in CASES[12::2]), ids=lambda c: c.id,
)
def test_update_matches_the_reference(case, impl):
    """Rows: two in slots, one padding, one starting a new sequence in a NaN slot."""
    _skip_float16(impl, case)
    window = (case.width - 1) * case.dilation
    state_len = window + case.extra
    indices = np.array([4, PAD_SLOT_ID, 0, 6], np.int32)
    pool = _pool(0, state_len, case.dim, case.x_dtype, used=[0, 4])  # slot 6: NaN, started afresh
    has_initial_state = np.array([True, True, True, False])
    shape = (4, case.dim) if case.tokens is None else (4, case.tokens, case.dim)
    x = random(1, shape, case.x_dtype)
    w = random(2, (case.width, case.dim), case.w_dtype, scale=0.5)
    b = random(3, (case.dim,), case.w_dtype, scale=0.5) if case.bias else None
    seqlens = np.array([11, 0, 3, 0], np.int32) if case.circular else None
    kw = dict(
        activation=case.activation, dilation=case.dilation, cache_seqlens=seqlens, has_initial_state=has_initial_state,
    )

    y, new_pool = jax.jit(lambda x, pool, idx: causal_conv1d_update(x, pool, w, b, state_indices=idx, **kw, **impl))(
        x, pool, indices
    )
    ry, rpool = causal_conv1d_update_reference(x, pool, w, b, state_indices=indices, **kw)
    assert y.shape == x.shape and y.dtype == case.x_dtype
    assert new_pool.shape == pool.shape and new_pool.dtype == pool.dtype
    scale = float(np.abs(np.asarray(x, np.float64)).max() * np.abs(np.asarray(w, np.float64)).max()) + 1
    assert_close(y, ry, case.x_dtype, case.width, scale)
    assert not np.asarray(y[1], np.float64).any(), "a padding row's outputs are zeros"
    np.testing.assert_array_equal(np.asarray(new_pool, np.float64), rpool)  # copies, not sums
    untouched = [s for s in range(SLOTS) if s not in indices]
    np.testing.assert_array_equal(_bits(new_pool)[untouched], _bits(pool)[untouched])


def test_without_state_indices_row_b_uses_slot_b():
    x, w = random(0, (3, 2, 8)), random(1, (4, 8))
    pool = random(2, (3, 3, 8))
    y, new = causal_conv1d_update(x, pool, w)
    ry, rnew = causal_conv1d_update_reference(x, pool, w)
    assert_close(y, ry, F32, 4, 4.0)
    np.testing.assert_array_equal(np.asarray(new, np.float64), rnew)


# --------------------------------------------------------------------------- bit for bit with the full forward

# (width, dilation, bias). Width 2 has a bias here: with none, the whole sum is one add of
# two products, which LLVM contracts into an FMA on either product, choosing per compiled
# program (per channel, even, within one): there the full forward itself is not bitwise
# the same across sequence lengths (at D = 24, say). The README's *Serving* section has
# the measurements.
EXACT = [(2, 1, True), (2, 3, True), (3, 1, False), (4, 1, True), (4, 1, False), (4, 2, True), (8, 1, True)]


def _decode(x, w, b, *, activation, dilation, tokens, circular, impl=None):
    """Decodes ``x`` ``(B, L, D)`` ``tokens`` at a time, each row in its own slot of a NaN-filled pool.

    Rows 0 and 1 live in slots 5 and 2, between them a padding row; the pool starts all
    NaN (``has_initial_state=False`` on the first call), under jit with donation.
    Returns the outputs ``(B, L, D)`` and the final pool.
    """
    batch, length, dim = x.shape
    window = (w.shape[0] - 1) * dilation
    state_len = window + (2 if circular else 0)
    pool = jnp.full((SLOTS, state_len, dim), jnp.nan, x.dtype)
    slots = jnp.array([5, PAD_SLOT_ID, 2], jnp.int32)
    rows = jnp.stack([x[0], jnp.zeros_like(x[0]), x[1]])

    def step(chunk, pool, seqlen, fresh):
        return causal_conv1d_update(
            chunk, pool, w, b, activation=activation, dilation=dilation, state_indices=slots,
            cache_seqlens=jnp.full((3,), seqlen, jnp.int32) if circular else None,
            has_initial_state=jnp.full((3,), jnp.logical_not(fresh)), **(impl or {}),
        )

    step = jax.jit(step, donate_argnums=1)
    outputs = []
    for start in range(0, length, tokens):
        y, pool = step(rows[:, start : start + tokens], pool, start, start == 0)
        assert not np.asarray(y[1], np.float64).any()
        outputs.append(y)
    y = jnp.concatenate(outputs, axis=1)
    return jnp.stack([y[0], y[2]]), pool


def _exact_cases():
    """Every (width, dilation, bias) x tokens per call x state x dtype; a spread of them in the fast tier."""
    fast = {
        (4, 1, False, 3, True, BF16), (2, 3, True, 1, True, F32), (8, 1, True, 3, False, F32),
    }
    grid = itertools.product(EXACT, (1, 3), (False, True), (F32, BF16))
    for (width, dilation, bias), tokens, circular, dtype in grid:
        case = (width, dilation, bias, tokens, circular, dtype)
        name = f"W{width}_d{dilation}{'_bias' if bias else ''}_T{tokens}_{'circular' if circular else 'linear'}_{dtype}"
        yield pytest.param(*case, id=name, marks=() if case in fast else pytest.mark.slow)


def _check_decoding(width, dilation, bias, tokens, circular, dtype, impl, bitwise: bool):
    """Decodes with ``impl`` from a NaN pool against the full forward (bit for bit, or within
    rounding); the rows' final slots bit for bit (copies), every other slot untouched."""
    x = random(0, (2, 19, 24), dtype)
    w = random(1, (width, 24), np.float32, scale=0.5)
    b = random(2, (24,), np.float32) if bias else None
    expected, final = jax.jit(
        lambda x: causal_conv1d(x, w, b, activation="silu", dilation=dilation, return_final_state=True)
    )(x)
    got, pool = _decode(x, w, b, activation="silu", dilation=dilation, tokens=tokens, circular=circular, impl=impl)
    if bitwise:
        np.testing.assert_array_equal(_bits(got), _bits(expected))
    else:
        assert_close(got, expected, dtype, width, 4.0)
    if not circular:
        np.testing.assert_array_equal(_bits(pool[jnp.array([5, 2])]), _bits(final))
    untouched = [s for s in range(SLOTS) if s not in (5, 2)]
    assert np.isnan(np.asarray(pool[jnp.array(untouched)], np.float32)).all()


@pytest.mark.parametrize("width,dilation,bias,tokens,circular,dtype", list(_exact_cases()))
def test_decoding_equals_the_full_forward_bit_for_bit(width, dilation, bias, tokens, circular, dtype):
    # XLA's composition, named: on a TPU the default is the decode kernel, whose float32
    # arithmetic is the forward kernel's, not XLA's (the test below)
    _check_decoding(width, dilation, bias, tokens, circular, dtype, dict(implementation="xla"), bitwise=True)


@pytest.mark.parametrize("width,dilation,bias,tokens,dtype", [(8, 1, True, 3, F32), (4, 2, True, 1, BF16),
                                                             (4, 1, False, 1, F32)], ids=str)
def test_the_decode_kernel_decodes_as_the_full_forward(width, dilation, bias, tokens, dtype):
    """The TPU's one-launch decode kernel (interpreted off a TPU), step by step from a NaN
    pool: the full forward's outputs within rounding (its arithmetic is the forward
    kernel's: ``bias + sum_t w[t] x[p - back(t)]`` in float32, that order, rounded once,
    with the tanh sigmoid), its final state bit for bit (copies)."""
    _check_decoding(width, dilation, bias, tokens, False, dtype, TPU_KERNEL, bitwise=False)


def test_the_decode_kernel_differentiates_as_the_composition():
    """The kernel's derivative is the composition's (its custom VJP), for x, the pool, the
    weight and the bias; finite with a pad row (the composition's were NaN there: it read
    the pad row's slot as NaN and multiplied its zero cotangent by it)."""
    x, w, b = random(0, (3, 2, 16)), random(1, (4, 16)), random(2, (16,))
    pool, indices = random(3, (5, 3, 16)), jnp.array([4, PAD_SLOT_ID, 1], jnp.int32)

    def loss(impl):
        def f(x, pool, w, b):
            y, new = causal_conv1d_update(x, pool, w, b, activation="silu", state_indices=indices, **impl)
            return (y ** 2).sum() + (new * jnp.arange(16.0)).sum()
        return jax.grad(f, argnums=(0, 1, 2, 3))(x, pool, w, b)

    for got, expected in zip(loss(TPU_KERNEL), loss(dict(implementation="xla"))):
        assert_close(got, expected, F32, 8, 8.0)


def test_a_rows_result_does_not_depend_on_other_slots():
    """The same rows over two pools that differ only in slots no row names: the same bits."""
    x, w, b = random(0, (3, 2, 16), BF16), random(1, (4, 16)), random(2, (16,))
    indices = jnp.array([3, PAD_SLOT_ID, 1], jnp.int32)
    named = _pool(3, 3, 16, BF16, used=[1, 3])
    other = jnp.asarray(np.asarray(named).copy())
    other = other.at[jnp.array([0, 2, 4, 5, 6])].set(random(4, (5, 3, 16), BF16))
    f = jax.jit(lambda pool: causal_conv1d_update(x, pool, w, b, activation="silu", state_indices=indices))
    (y1, p1), (y2, p2) = f(named), f(other)
    np.testing.assert_array_equal(_bits(y1), _bits(y2))
    np.testing.assert_array_equal(_bits(p1[jnp.array([1, 3])]), _bits(p2[jnp.array([1, 3])]))
    assert np.isfinite(np.asarray(y1, np.float32)).all()


# --------------------------------------------------------------------------- in place

@pytest.mark.parametrize("circular,impl", [(False, {}), (True, {}),
                                           (False, TPU_KERNEL)],
                         ids=["linear", "circular", "linear-pallas_mosaic_tpu"])
def test_the_pool_is_updated_in_place_under_jit_with_donation(circular, impl):
    """The compiled program aliases the pool to its output and holds no copy of it; the buffer is reused.

    On every platform: the alias in the module's header, temporaries smaller than the pool as
    the platform stores it (a copy would need all of it: its tiles padded on a TPU), and the
    output in the donated buffer. XLA:CPU's HLO is also read (no copy op, a scatter into
    the pool); other compilers write the update in their own ops and layouts."""
    slots, dim = 256, 32  # the pool much larger than the step's temporaries, tiles padded or not
    pool = jnp.zeros((slots, 3, dim))
    x, w, b = random(0, (4, 1, dim)), random(1, (4, dim)), random(2, (dim,))
    indices = jnp.array([9, PAD_SLOT_ID, 40, 3], jnp.int32)
    seqlens = jnp.array([5, 0, 2, 7], jnp.int32) if circular else None
    update = jax.jit(
        lambda x, pool, idx, n: causal_conv1d_update(x, pool, w, b, state_indices=idx, cache_seqlens=n, **impl),
        donate_argnums=1,
    )
    compiled = update.lower(x, pool, indices, seqlens).compile()
    hlo = compiled.as_text()
    header = next(line for line in hlo.splitlines() if line.startswith("HloModule"))
    assert "input_output_alias={ {1}: (1, {}" in header, header  # output 1 (the pool) is parameter 1's buffer
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= pool.nbytes, memory
    assert memory.temp_size_in_bytes < memory.alias_size_in_bytes, memory
    if jax.default_backend() == "cpu":
        pool_shape = f"f32[{slots},3,{dim}]"
        copies = re.findall(rf"= {re.escape(pool_shape)}\{{[^}}]*\}} copy\(", hlo)
        assert not copies, copies
        if not impl:  # the composition scatters; the decode kernel writes the slots in its loop
            assert re.search(rf"= {re.escape(pool_shape)}\{{[^}}]*\}} scatter\(", hlo), hlo
    address = pool.unsafe_buffer_pointer()
    _, new = update(x, pool, indices, seqlens)
    assert pool.is_deleted() and new.unsafe_buffer_pointer() == address


def test_lowered_for_cuda_the_pool_is_donated_and_scattered():
    """What a GPU server compiles (implementation=None, bfloat16 activations): the pool aliased, no convolution."""
    update = jax.jit(
        lambda x, pool, w, b, idx: causal_conv1d_update(x, pool, w, b, activation="silu", state_indices=idx),
        donate_argnums=1,
    )
    shapes = [((8, 1, 512), jnp.bfloat16), ((64, 3, 512), jnp.bfloat16), ((4, 512), jnp.float32),
              ((512,), jnp.float32), ((8,), jnp.int32)]
    with cuda_lowering():
        text = update.trace(*(jax.ShapeDtypeStruct(*s) for s in shapes)).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"tf\.aliasing_output = (\d+)", text) == ["1"]  # the pool argument is the second output
    assert "stablehlo.scatter" in text and "stablehlo.convolution" not in text


# --------------------------------------------------------------------------- bad input

X, W = random(0, (2, 1, 8)), random(1, (4, 8))
POOL = random(2, (5, 3, 8))

BAD = [
    # (what, arguments over the defaults, error, message)
    ("float indices", dict(state_indices=np.array([0.0, 1.0], np.float32)), TypeError, "signed integers"),
    ("unsigned indices", dict(state_indices=np.array([0, 1], np.uint32)), TypeError, "signed integers"),
    ("bool indices", dict(state_indices=np.array([True, False])), TypeError, "signed integers"),
    ("indices shape", dict(state_indices=np.array([[0, 1]], np.int32)), ValueError, r"shape \(B,\) = \(2,\)"),
    ("index past the pool", dict(state_indices=np.array([0, 5], np.int32)), ValueError, r"in \[0, 5\).*got \[0 5\]"),
    ("negative index", dict(state_indices=np.array([-2, 1], np.int32)), ValueError, r"or -1 .*got \[-2  1\]"),
    ("one slot twice", dict(state_indices=np.array([3, 3], np.int32)), ValueError, r"a slot for several rows.*got \[3 3\]"),
    ("float seqlens", dict(cache_seqlens=np.array([0.0, 1.0])), TypeError, "cache_seqlens must hold integers"),
    ("negative seqlens", dict(cache_seqlens=np.array([0, -1], np.int32)), ValueError, "non-negative"),
    ("int has_initial_state", dict(has_initial_state=np.array([1, 0])), TypeError, "has_initial_state must hold bools"),
    ("pool dtype", dict(conv_state=POOL.astype(jnp.bfloat16)), TypeError, "x's dtype float32"),
    ("short pool", dict(conv_state=POOL[:, :2]), ValueError, r"state_len >= \(W - 1\) \* dilation = 3"),
    ("pool dim", dict(conv_state=random(3, (5, 3, 7))), ValueError, "D = 8"),
    ("no indices, pool not B", dict(state_indices=None), ValueError, "5 slots but x has 2 rows"),
    ("x rank", dict(x=random(4, (2, 1, 1, 8))), ValueError, r"\(B, T, D\), or \(B, D\)"),
    ("weight dim", dict(weight=random(5, (4, 9))), ValueError, r"weight must be \(W, D\)"),
    ("activation", dict(activation="gelu"), ValueError, "activation must be None, 'silu'"),
    ("implementation", dict(implementation="cudnn"), ValueError, "implementation must be None or one of"),
    ("interpret", dict(interpret=1), TypeError, "interpret must be True or False"),
]


def _call(**changes):
    args = dict(x=X, conv_state=POOL, weight=W, state_indices=np.array([1, 3], np.int32))
    args.update(changes)
    return causal_conv1d_update(
        args.pop("x"), args.pop("conv_state"), args.pop("weight"), **args,
    )


@pytest.mark.parametrize("what,changes,error,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_and_overwrites_nothing(what, changes, error, message):
    """In the words of the function called: the checks it shares with causal_conv1d name it too."""
    before = np.asarray(POOL).copy()
    with pytest.raises(error, match=message) as raised:
        _call(**changes)
    assert str(raised.value).startswith("causal_conv1d_update: "), str(raised.value)
    np.testing.assert_array_equal(_bits(POOL), _bits(before))


def test_the_full_convolution_names_itself_in_the_checks_it_shares():
    with pytest.raises(ValueError, match=r"^causal_conv1d: weight must be \(W, D\)"):
        causal_conv1d(X, random(5, (4, 9)))
    with pytest.raises(ValueError, match=r"^causal_conv1d: implementation must be None or one of"):
        causal_conv1d(X, W, implementation="cudnn")


def test_a_donated_pool_survives_an_error_raised_while_tracing():
    pool = jnp.asarray(np.asarray(POOL))
    update = jax.jit(lambda pool, idx: causal_conv1d_update(X, pool, W, state_indices=idx), donate_argnums=0)
    with pytest.raises(TypeError, match="signed integers"):
        update(pool, jnp.array([0.0, 1.0]))
    assert not pool.is_deleted()
    np.testing.assert_array_equal(_bits(pool), _bits(POOL))


def test_traced_indices_out_of_range_write_nothing_and_give_nan():
    """Under jit the indices cannot be checked: a row outside the pool reads NaN and writes nowhere."""
    x = random(0, (4, 2, 8))
    indices = jnp.array([5, -3, 2, PAD_SLOT_ID], jnp.int32)  # 5 slots: rows 0 and 1 are out of range
    y, new = jax.jit(lambda idx: causal_conv1d_update(x, POOL, W, state_indices=idx))(indices)
    assert np.isnan(np.asarray(y[:2])).all()
    ry, rnew = causal_conv1d_update_reference(x[2:3], POOL, W, state_indices=np.array([2]))
    assert_close(y[2:3], ry, F32, 4, 4.0)
    assert not np.asarray(y[3]).any()
    np.testing.assert_array_equal(np.asarray(new, np.float64), rnew)  # slot 2 written, no other


def test_a_pool_of_empty_slots_runs_without_the_decode_kernel():
    """Width 1 with ``state_len = 0``: nothing to move, so the kernel named runs the composition
    (the decode kernel's DMAs of empty slabs failed; found by the fuzz's slow tier)."""
    x, weight = random(0, (2, 3, 8)), random(1, (1, 8))
    pool = jnp.zeros((3, 0, 8), jnp.float32)
    indices = jnp.array([2, 0], jnp.int32)
    got = causal_conv1d_update(x, pool, weight, activation="silu", state_indices=indices, **TPU_KERNEL)
    want = causal_conv1d_update(x, pool, weight, activation="silu", state_indices=indices, implementation="xla")
    assert got[1].shape == pool.shape
    assert_close(got[0], want[0], np.float32, 1, 4.0)
