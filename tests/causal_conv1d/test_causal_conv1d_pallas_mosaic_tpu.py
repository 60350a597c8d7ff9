"""What is ``causal_conv1d(implementation="pallas_mosaic_tpu")``'s alone: its Mosaic TPU kernels.

The shared suite (test_causal_conv1d.py) runs these kernels against the oracles,
through exactness, determinism and the derivatives above the first: compiled on a TPU,
in Pallas' interpreter elsewhere (the slow tier). Here: blocks small enough that test
sizes take several, with the halos, a last partial block of positions and of channels,
a halo of two tiles (a long dilation) and bfloat16 activations, against the oracles; the
TPU lowering from a CPU host (two named Mosaic kernels, no convolution); the refusals,
the dispatch and the config. Without a TPU the kernels run in Pallas' interpreter.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close
from support.short_conv import BF16, F32, check_against_oracles, ids, inputs
from support.tiers import tiered

from maskconv_kernels.ops.causal_conv1d import backends, causal_conv1d, causal_conv1d_step, causal_conv1d_update
from maskconv_kernels.ops.causal_conv1d.checks import make_problem
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import KERNELS, PREFERRED_FROM, Config
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu.config import DECODE_KERNEL, MIXED_KERNEL, halo_rows

NAME = "pallas_mosaic_tpu"
RECORD = backends.REGISTRY.get(NAME)
INTERPRET = jax.default_backend() != "tpu"  # compiled where they run, interpreted elsewhere
SMALL = Config(block_positions=16, block_channels=128, backward_block_positions=32, backward_block_channels=128)

# batch, length, dim, width, dilation, bias, activation, x dtype, weight dtype, segments, state, config
CASES = {
    # several blocks of positions and of channels, each with a remainder
    "L100_D300_W4_seg_state": (2, 100, 300, 4, 1, True, "silu", F32, F32, True, True, SMALL),
    # S = 21: the halo is two tiles (32 rows), a block one halo
    "L70_D20_W8_d3_state": (2, 70, 20, 8, 3, True, "silu", F32, F32, False, True,
                            Config(block_positions=32, backward_block_positions=32)),
    # Mamba's dtypes: bfloat16 activations and state, float32 weights
    "L50_D136_W4_bf16_seg_state": (2, 50, 136, 4, 1, True, "silu", BF16, F32, True, True, SMALL),
    # no bias, no activation, no state: the front is zeros, and a block longer than the sequence
    "L13_D8_W2_plain": (1, 13, 8, 2, 1, False, None, F32, F32, False, False, None),
    # the defaults' blocks (one block of 1024 and 512 positions), segments without a state
    "L1100_D160_W4_seg_default": (2, 1100, 160, 4, 1, True, "silu", F32, F32, True, False, None),
}


@pytest.mark.parametrize("name", tiered(sorted(CASES), lambda n: not INTERPRET or n.startswith("L100")))
def test_blocks_halos_and_remainders_match_the_oracles(name):
    batch, length, dim, width, dilation, bias, activation, x_dtype, w_dtype, segmented, stateful, config = CASES[name]
    x, w, b, state, dy = inputs(3, batch, length, dim, width, x_dtype, w_dtype, dilation)
    conv = lambda x, w, b=None, **kw: causal_conv1d(x, w, b, implementation=NAME, interpret=INTERPRET,  # noqa: E731
                                                    config=config, **kw)
    check_against_oracles(conv, x, w, b if bias else None, state if stateful else None, dy,
                          ids(5, batch, length) if segmented else None, activation=activation, dilation=dilation)


def test_the_halo_is_the_state_in_whole_tiles():
    assert [halo_rows(s) for s in (0, 1, 3, 16, 17, 21)] == [16, 16, 16, 16, 32, 32]
    # A block is whole halos, and no longer than the sequence needs.
    assert Config(block_positions=48).blocks(False, 5000, 64, 21) == (64, 64)
    assert Config().blocks(True, 37, 4128, 3) == (48, 512)
    assert Config().blocks(False, 2048, 100, 3) == (1024, 100)


def test_decode_blocks_are_whole_dmas():
    """A decode step's channels divide D (each row's slot is one DMA per block), all of D
    up to 8192 channels; its rows are the batch's, up to ``decode_rows``."""
    assert Config().decode_blocks(4, 48) == (4, 48)
    assert Config().decode_blocks(256, 8192) == (8, 8192)
    assert Config(decode_channels=4096).decode_blocks(64, 8192) == (8, 4096)
    assert Config(decode_channels=4096, decode_rows=32).decode_blocks(64, 6144) == (32, 3072)
    assert Config(decode_channels=1024).decode_blocks(3, 4128) == (3, 4128)  # no multiple of 128 divides it


@pytest.mark.parametrize("field, value", [("block_positions", 24), ("block_positions", 0), ("block_channels", 100),
                                          ("backward_block_channels", 8192), ("backward_block_positions", 1.5),
                                          ("decode_rows", 0), ("decode_channels", 200), ("decode_channels", 16384)])
def test_config_says_what_a_block_must_be(field, value):
    with pytest.raises(ValueError, match=f"Config.{field} must be (a multiple of|an int from)"):
        Config(**{field: value})


def test_config_takes_a_bool_for_where_states_come_from():
    with pytest.raises(TypeError, match="Config.step_states_from_frame must be a bool"):
        Config(step_states_from_frame=1)


# --------------------------------------------------------------------------- lowering for a TPU


def _mamba(dtype, batch=4, length=2048, dim=1536, width=4):
    shapes = [((batch, length, dim), dtype), ((width, dim), jnp.float32), ((dim,), jnp.float32),
              ((batch, width - 1, dim), dtype), ((batch, length), jnp.int32)]
    return [jax.ShapeDtypeStruct(shape, d) for shape, d in shapes]


@pytest.mark.parametrize("dtype, implementation", [(BF16, NAME), (F32, NAME), (BF16, None)], ids=str)
def test_value_and_grad_lowers_for_tpu_to_the_two_named_kernels_and_no_convolution(dtype, implementation):
    """Named, and as the TPU's default (``implementation=None``), lowered from a CPU host."""
    def loss(x, w, b, state, seg):
        y = causal_conv1d(x, w, b, segment_ids=seg, initial_state=state, activation="silu",
                          implementation=implementation)
        return y.astype(jnp.float32).sum()

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    text = f.trace(*_mamba(dtype)).lower(lowering_platforms=("tpu",)).as_text()
    assert len(re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text)) == 2
    for kernel in KERNELS:
        assert len(re.findall(f'kernel_name = "{kernel}"', text)) == 1, kernel
    assert "stablehlo.convolution" not in text


# --------------------------------------------------------------------------- refusals and dispatch


def test_needs_a_tpu_or_interpret_mode_and_refuses_float16_activations():
    problem = make_problem(np.zeros((1, 8, 4), np.float32), np.zeros((3, 4), np.float32))[0]
    assert RECORD.unsupported(problem, "tpu") is None
    assert RECORD.unsupported(problem, "cpu", interpret=True) is None
    for platform in ("cpu", "cuda"):
        assert "lower for TPUs (tpu) only" in RECORD.unsupported(problem, platform)
    half = make_problem(np.zeros((1, 8, 4), np.float16), np.zeros((3, 4), np.float32))[0]
    assert "TPUs have no float16 arithmetic" in RECORD.unsupported(half, "tpu")
    # implementation=None on a TPU: the kernels where they run and a sequence is one of their
    # blocks long at least; xla for the rest (decode steps: one position)
    assert backends.REGISTRY.preference["tpu"] == (NAME, "xla")
    long = make_problem(np.zeros((1, PREFERRED_FROM, 4), jnp.bfloat16), np.zeros((3, 4), np.float32))[0]
    assert backends.REGISTRY.choose(long, "tpu").name == NAME
    assert backends.REGISTRY.choose(problem, "tpu").name == "xla"
    assert "implementation=None takes the kernels from" in RECORD.not_preferred(problem, "tpu")
    assert backends.REGISTRY.choose(make_problem(np.zeros((1, PREFERRED_FROM, 4), np.float16),
                                                 np.zeros((3, 4), np.float32))[0], "tpu").name == "xla"
    assert backends.REGISTRY.choose(long, "cpu").name == "xla"
    # float16 weights with bfloat16 activations are converted, as float32 ones are
    mixed = make_problem(np.zeros((1, 8, 4), jnp.bfloat16), np.zeros((3, 4), np.float16))[0]
    assert RECORD.unsupported(mixed, "tpu") is None


def test_a_decode_step_lowered_for_tpu_is_one_kernel_on_the_donated_pool():
    """``causal_conv1d_update`` (one token a row, a pool of slots) with ``implementation=None``,
    lowered for a TPU from a CPU host: one Mosaic kernel, the decode kernel, whose second
    output is the pool operand's buffer, and the pool donated by the caller; no gather,
    scatter or convolution around it. Lowered for CPU, the same call composes XLA ops."""
    from maskconv_kernels import causal_conv1d_update

    x, pool = jax.ShapeDtypeStruct((64, 1536), jnp.bfloat16), jax.ShapeDtypeStruct((128, 3, 1536), jnp.bfloat16)
    w, b = jax.ShapeDtypeStruct((4, 1536), jnp.float32), jax.ShapeDtypeStruct((1536,), jnp.float32)
    idx = jax.ShapeDtypeStruct((64,), jnp.int32)
    step = jax.jit(lambda x, pool, w, b, idx: causal_conv1d_update(x, pool, w, b, activation="silu",
                                                                 state_indices=idx), donate_argnums=1)
    text = step.trace(x, pool, w, b, idx).lower(lowering_platforms=("tpu",)).as_text()
    assert len(re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text)) == 1
    assert f'kernel_name = "{DECODE_KERNEL}"' in text
    assert re.search(r"output_operand_aliases = \[#stablehlo\.output_operand_alias<output_tuple_indices = \[1\]", text)
    assert "tf.aliasing_output = 1" in text  # the caller's pool is donated to the new pool
    for op in ("stablehlo.scatter", "stablehlo.gather", "stablehlo.convolution"):
        assert op not in text, op
    cpu = step.trace(x, pool, w, b, idx).lower(lowering_platforms=("cpu",)).as_text()
    assert "tpu_custom_call" not in cpu and "stablehlo.scatter" in cpu


def test_a_serving_step_of_one_token_a_request_lowers_for_tpu_to_the_decode_kernel():
    """``causal_conv1d_step`` with as many tokens as requests (a decode step's shape),
    ``implementation=None``, lowered for a TPU: the decode kernel behind a runtime branch on
    ``query_start_loc`` (one token each), the mixed step's kernel in the other branch; for
    CPU, no Mosaic kernel."""
    from maskconv_kernels import causal_conv1d_step

    rows, dim = 64, 2048
    x, pool = jax.ShapeDtypeStruct((rows, dim), jnp.bfloat16), jax.ShapeDtypeStruct((2 * rows, 3, dim), jnp.float32)
    w, b = jax.ShapeDtypeStruct((4, dim), jnp.float32), jax.ShapeDtypeStruct((dim,), jnp.float32)
    qsl, idx = jax.ShapeDtypeStruct((rows + 1,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32)
    step = jax.jit(lambda x, pool, w, b, qsl, idx: causal_conv1d_step(
        x, pool, w, b, query_start_loc=qsl, state_indices=idx, activation="silu"), donate_argnums=1)
    text = step.trace(x, pool, w, b, qsl, idx).lower(lowering_platforms=("tpu",)).as_text()
    assert f'kernel_name = "{DECODE_KERNEL}"' in text and f'kernel_name = "{MIXED_KERNEL}"' in text
    assert "stablehlo.case" in text or "stablehlo.if" in text
    assert "tf.aliasing_output = 1" in text
    cpu = step.trace(x, pool, w, b, qsl, idx).lower(lowering_platforms=("cpu",)).as_text()
    assert "tpu_custom_call" not in cpu


@pytest.mark.parametrize("implementation", [None, NAME])
@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_a_mixed_serving_step_lowers_for_tpu_to_one_kernel_on_the_donated_pool(pool_dtype, implementation):
    """``causal_conv1d_step`` of prefill chunks and decode tokens (200 tokens: three whole
    tiles and a partial one), by default or named, lowered for a TPU: one Mosaic kernel, the
    mixed step's, aliasing the donated pool; no convolution around it, and no gather or
    scatter but of the per-token metadata (int32 vectors). For CPU by default: no kernel."""
    from maskconv_kernels import causal_conv1d_step

    tokens, requests, dim = 200, 8, 2048
    x, pool = jax.ShapeDtypeStruct((tokens, dim), jnp.bfloat16), jax.ShapeDtypeStruct((64, 3, dim), pool_dtype)
    w, b = jax.ShapeDtypeStruct((4, dim), jnp.float32), jax.ShapeDtypeStruct((dim,), jnp.float32)
    qsl, idx = jax.ShapeDtypeStruct((requests + 1,), jnp.int32), jax.ShapeDtypeStruct((requests,), jnp.int32)
    step = jax.jit(lambda x, pool, w, b, qsl, idx: causal_conv1d_step(
        x, pool, w, b, query_start_loc=qsl, state_indices=idx, activation="silu", implementation=implementation),
        donate_argnums=1)
    text = step.trace(x, pool, w, b, qsl, idx).lower(lowering_platforms=("tpu",)).as_text()
    assert len(re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text)) == 1
    assert f'kernel_name = "{MIXED_KERNEL}"' in text
    assert re.search(r"output_operand_aliases = \[#stablehlo\.output_operand_alias<output_tuple_indices = \[1\]", text)
    assert "tf.aliasing_output = 1" in text
    assert "stablehlo.convolution" not in text
    for op in re.finditer(r"stablehlo\.(scatter|gather)", text):
        result = text[op.end():].split("->", 1)[1].split(None, 1)[0]
        assert re.fullmatch(r"tensor<\d+xi32>", result), (op.group(0), result)
    if implementation is None:
        assert "tpu_custom_call" not in step.trace(x, pool, w, b, qsl, idx).lower(lowering_platforms=("cpu",)).as_text()


def test_a_prefix_caching_step_lowers_for_tpu_to_the_mixed_kernel_and_its_refusal():
    """``causal_conv1d_step`` with prefix caching and ``write_indices``, by default, lowered
    for a TPU: one Mosaic kernel, the mixed step's, aliasing the donated pool, in a
    run-time branch beside the composition (taken where slot writes would race with
    reads), whose scatter of states the lowering holds; without them there is none (the
    mixed serving step's test above)."""
    from maskconv_kernels import causal_conv1d_step

    tokens, requests, dim, blocks = 200, 8, 2048, 16
    x, pool = jax.ShapeDtypeStruct((tokens, dim), jnp.bfloat16), jax.ShapeDtypeStruct((64, 3, dim), jnp.float32)
    w, b = jax.ShapeDtypeStruct((4, dim), jnp.float32), jax.ShapeDtypeStruct((dim,), jnp.float32)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    step = jax.jit(lambda x, pool, w, b, qsl, idx, out, table, computed: causal_conv1d_step(
        x, pool, w, b, query_start_loc=qsl, state_indices=idx, write_indices=out, block_size=16, block_indices=table,
        num_computed_tokens=computed, activation="silu"), donate_argnums=1)
    text = step.trace(x, pool, w, b, ints(requests + 1), ints(requests), ints(requests), ints(requests, blocks),
                      ints(requests)).lower(lowering_platforms=("tpu",)).as_text()
    assert len(re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text)) == 1
    assert f'kernel_name = "{MIXED_KERNEL}"' in text
    assert "tf.aliasing_output = 1" in text
    scattered = [text[op.end():].split("->", 1)[1].split(None, 1)[0] for op in re.finditer(r"stablehlo\.scatter", text)]
    assert any(not re.fullmatch(r"tensor<[\dx]+xi32>", r) for r in scattered), "the composition's branch"


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("given", ["num_accepted_tokens", "positions"])
def test_a_step_after_accepted_drafts_or_with_positions_lowers_for_tpu_to_the_mixed_kernel(given, pool_dtype):
    """``causal_conv1d_step`` by default, lowered for a TPU, with ``num_accepted_tokens`` (a
    slot of ``W - 1 + 2`` inputs: the slots' histories shifted by a run-time sublane roll)
    or with ``positions`` (documents that start inside requests: each token's reach as a
    second int32 column): one Mosaic kernel, the mixed step's, aliasing the donated pool;
    the decode kernel is not in it."""
    tokens, requests, dim = 200, 8, 2048
    slot_len, length = (5, requests) if given == "num_accepted_tokens" else (3, tokens)
    x, pool = jax.ShapeDtypeStruct((tokens, dim), jnp.bfloat16), jax.ShapeDtypeStruct((64, slot_len, dim), pool_dtype)
    w, b = jax.ShapeDtypeStruct((4, dim), jnp.float32), jax.ShapeDtypeStruct((dim,), jnp.float32)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    step = jax.jit(lambda x, pool, w, b, qsl, idx, values: causal_conv1d_step(
        x, pool, w, b, query_start_loc=qsl, state_indices=idx, activation="silu", **{given: values}),
        donate_argnums=1)
    text = step.trace(x, pool, w, b, ints(requests + 1), ints(requests), ints(length)).lower(
        lowering_platforms=("tpu",)).as_text()
    assert len(re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text)) == 1
    assert f'kernel_name = "{MIXED_KERNEL}"' in text and DECODE_KERNEL not in text
    assert "tf.aliasing_output = 1" in text


_SERVING_GRADIENTS = {
    "update": lambda x, pool, w, b, qsl, idx, blocks: causal_conv1d_update(
        x[:8, None], pool, w, b, activation="silu", state_indices=idx)[0].sum(),
    "decode or mixed step": lambda x, pool, w, b, qsl, idx, blocks: causal_conv1d_step(
        x, pool, w, b, query_start_loc=qsl, state_indices=idx, activation="silu")[0].sum(),
    "prefix step": lambda x, pool, w, b, qsl, idx, blocks: causal_conv1d_step(
        x, pool, w, b, query_start_loc=qsl, state_indices=idx, activation="silu", block_size=16,
        block_indices=blocks, num_computed_tokens=idx, write_indices=idx[::-1])[1].sum(),
    "step with positions": lambda x, pool, w, b, qsl, idx, blocks: causal_conv1d_step(
        x, pool, w, b, query_start_loc=qsl, state_indices=idx, activation="silu",
        positions=jnp.arange(x.shape[0]) % 7)[0].sum(),
}


@pytest.mark.parametrize("call", list(_SERVING_GRADIENTS))
@pytest.mark.parametrize("outer_jit", [False, True])
def test_the_serving_kernels_gradients_lower_for_tpu(call, outer_jit):
    """The values and gradients of the serving calls whose TPU kernels take the composition's
    derivatives (a ``custom_vjp``), through a jitted call and under ``jit``, lower for a TPU
    with the kernel in the forward: the ``custom_vjp`` closes over no tracer (one did:
    its backward, traced after the call's trace had ended, held that trace's values, and
    lowering it failed on the chip only, where the kernel's branch is kept)."""
    tokens, requests, dim = 40, 8, 256
    f = jax.jit(_SERVING_GRADIENTS[call])
    grad = jax.value_and_grad(f, argnums=(0, 1, 2, 3))  # the value: the kernel's, kept
    grad = jax.jit(grad) if outer_jit else grad
    args = (jax.ShapeDtypeStruct((tokens, dim), jnp.float32), jax.ShapeDtypeStruct((20, 3, dim), jnp.float32),
            jax.ShapeDtypeStruct((4, dim), jnp.float32), jax.ShapeDtypeStruct((dim,), jnp.float32),
            jax.ShapeDtypeStruct((requests + 1,), jnp.int32), jax.ShapeDtypeStruct((requests,), jnp.int32),
            jax.ShapeDtypeStruct((requests, 2), jnp.int32))
    text = jax.jit(grad).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_the_mixed_step_kernel_storing_every_state_row_lowers_for_tpu(pool_dtype):
    """With ``Config(step_states_from_frame=False)`` at the default tiles (every token's
    would-be state stored, no aligned window load nor run-time sublane roll), the mixed
    step's kernel lowers for a TPU to one named Mosaic kernel, and its module differs from
    the default's (which takes ending requests' states from the frame)."""
    from maskconv_kernels.ops.causal_conv1d import pallas_mosaic_tpu as tpu
    from maskconv_kernels.ops.causal_conv1d.checks import problem_of

    tokens, requests, dim = 200, 8, 2048
    x, pool = jnp.zeros((tokens, dim), jnp.bfloat16), jnp.zeros((64, 3, dim), pool_dtype)
    w, b = jnp.zeros((4, dim), jnp.float32), jnp.zeros((dim,), jnp.float32)
    problem = problem_of(x[None], w, b, None, pool, activation="silu", dilation=1)
    ints = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731

    def lowered(config):
        step = jax.jit(lambda x, pool, qsl, reads, writes, owner, within: tpu.step(
            x, pool, w, b, qsl, reads, writes, owner, within, problem=problem, config=config))
        args = (x, pool, ints(requests + 1), ints(requests), ints(requests), ints(tokens), ints(tokens))
        return step.trace(*args).lower(lowering_platforms=("tpu",)).as_text()

    text = lowered(Config(step_states_from_frame=False))
    assert len(re.findall(r"stablehlo\.custom_call @tpu_custom_call\(", text)) == 1
    assert f'kernel_name = "{MIXED_KERNEL}"' in text
    assert text != lowered(Config())


def _ragged_step(rng, lengths, codes, tokens, dim, slots, state_len, x_dtype, pool_dtype):
    """``(qsl, x, pool, owner, within)`` of a step of requests of ``lengths`` tokens (request
    8 a pad row): random tokens, NaN for the pad row's and the padding; random states in the
    slots ``codes`` reads, NaN in every other; each token's request (``R`` for padding) and
    its index in it."""
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x = rng.standard_normal((tokens, dim)).astype(np.float32)
    x[qsl[-1]:] = np.nan
    x[qsl[8]:qsl[9]] = np.nan  # the pad row's tokens
    pool = np.full((slots, state_len, dim), np.nan, np.float32)
    for c in codes:
        if c >= 0:
            pool[c] = rng.standard_normal((state_len, dim))
    owner = np.repeat(np.arange(len(lengths)), lengths)
    owner = np.concatenate([owner, np.full(tokens - len(owner), len(lengths))]).astype(np.int32)
    within = (np.arange(tokens) - np.append(qsl, qsl[-1])[owner]).astype(np.int32)
    return qsl, jnp.asarray(x, x_dtype), jnp.asarray(pool, pool_dtype), owner, within


def _mixed_oracle(x, pool, w, bias, qsl, reads, writes, problem, blocks=None):
    """float64: each request's outputs over its slot's last inputs (zeros where it reads
    none, NaN outside the pool) then its tokens, and the pool with its last ``S`` inputs
    written, then each block state (``blocks = (K, targets, computed)``); pad rows and
    padding tokens: zeros out, nothing written; a request without tokens: zeros written
    where it starts fresh, else nothing."""
    from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu.config import NAN, PAD, ZEROS

    x, pool, w = (np.asarray(a, np.float64) for a in (x, pool, w))
    y, new, sl = np.zeros_like(x), pool.copy(), pool.shape[1]
    cached = []
    for r, code in enumerate(reads):
        tokens = x[qsl[r]:qsl[r + 1]]
        if not len(tokens) and code == ZEROS and writes[r] >= 0:
            new[writes[r]] = 0.0
        if code == PAD or not len(tokens):
            continue
        slot = {ZEROS: np.zeros_like(pool[0]), NAN: np.full_like(pool[0], np.nan)}.get(code, pool[max(code, 0)])
        seq = np.concatenate([slot, tokens])
        pre = sum(w[t] * seq[sl - problem.back(t):sl - problem.back(t) + len(tokens)] for t in range(problem.width))
        pre = pre + np.asarray(bias, np.float64)
        y[qsl[r]:qsl[r + 1]] = pre / (1 + np.exp(-pre))
        if writes[r] >= 0:
            new[writes[r]] = seq[-sl:]
        if blocks is not None:
            size, targets, computed = blocks
            for m, target in enumerate(targets[r]):
                consumed = (m + 1) * size - computed[r]
                if 0 < consumed <= len(tokens) and target >= 0:
                    cached.append((target, seq[consumed:consumed + sl]))
    for target, state in cached:
        new[target] = state
    return y, new


@pytest.mark.parametrize("width, dilation, state_len, x_dtype, pool_dtype",
                         [(4, 1, 3, F32, F32), (3, 2, 5, BF16, BF16), (4, 1, 3, BF16, F32)],
                         ids=["W4_f32", "W3_d2_S5_bf16_bf16pool", "W4_bf16_f32pool"])
@pytest.mark.parametrize("from_frame", [False, True], ids=["states_stored", "states_from_frame"])
def test_the_mixed_step_kernel_over_many_tiles_and_channel_blocks(width, dilation, state_len, x_dtype, pool_dtype,
                                                                  from_frame):
    """The mixed step's kernel alone, at tiles of 16 tokens and blocks of 128 channels: 150
    tokens (ten tiles, the last partial) of requests of 0 to 37 tokens begun in one tile and
    ended tiles later (two of them with their first tokens, which read the slot, in two
    tiles; two tiles where no token reads a slot), decode tokens back to back, fresh rows
    (zeros), a slot outside the pool (NaN), pad rows, NaN padding tokens after the last
    request and NaN in every slot not read: outputs within rounding of a float64 oracle,
    states bit for bit. ``from_frame`` (``Config.step_states_from_frame``): two tiles where
    only long requests end take their states from the frame, one of them two rows before
    the tile's end (its window is the frame's last 16 rows)."""
    from maskconv_kernels.ops.causal_conv1d import pallas_mosaic_tpu as tpu
    from maskconv_kernels.ops.causal_conv1d.checks import problem_of
    from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu.config import NAN, PAD, ZEROS

    rng = np.random.default_rng(width + state_len)
    lengths = [1, 1, 20, 2, 1, 37, 0, 3, 1, 1, 30, 5, 1, 17, 7, 2]  # requests 7 and 15 cross a tile's end
    codes = [4, 9, 1, ZEROS, 7, 12, 3, 8, PAD, 0, 15, NAN, 5, ZEROS, 6, 11]
    writes = [c if c >= 0 else (13 if c == ZEROS else -1) for c in codes]
    writes[13] = 14
    qsl, x, pool, owner, within = _ragged_step(rng, lengths, codes, 150, 256, 16, state_len, x_dtype, pool_dtype)
    dim = x.shape[1]
    w, bias = rng.standard_normal((width, dim)).astype(np.float32) * 0.5, rng.standard_normal(dim).astype(np.float32)
    problem = problem_of(x[None], jnp.asarray(w), jnp.asarray(bias), None, pool, activation="silu", dilation=dilation)
    y, new = tpu.step(x, pool, jnp.asarray(w), jnp.asarray(bias), jnp.asarray(qsl), jnp.asarray(codes, jnp.int32),
                      jnp.asarray(writes, jnp.int32), jnp.asarray(owner), jnp.asarray(within), problem=problem,
                      config=Config(step_tokens=16, step_channels=128, step_states_from_frame=from_frame),
                      interpret=INTERPRET)
    ry, rnew = _mixed_oracle(x, pool, w, bias, qsl, codes, writes, problem)
    y = np.asarray(y, np.float64)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ry))  # the NaN slot's request's first tokens only
    scale = float(np.nanmax(np.abs(np.asarray(x, np.float64))) * np.abs(w).max()) + 1  # the shared suite's bound
    assert_close(y[~np.isnan(ry)], ry[~np.isnan(ry)], x_dtype, width, scale)
    assert not y[qsl[-1]:].any() and not y[qsl[8]:qsl[9]].any()
    np.testing.assert_array_equal(np.asarray(new, np.float64), np.asarray(jnp.asarray(rnew, pool_dtype), np.float64))


@pytest.mark.parametrize("pool_dtype", [F32, BF16], ids=["f32pool", "bf16pool"])
@pytest.mark.parametrize("from_frame", [False, True], ids=["states_stored", "states_from_frame"])
def test_the_mixed_step_kernel_writes_block_states_over_many_tiles(pool_dtype, from_frame):
    """Prefix caching in the mixed step's kernel (``blocks``), at tiles of 16 tokens and
    blocks of 128 channels: requests of 1-33 tokens with 0-13 before them cross block
    boundaries (K = 4) at every offset in a tile, within their first ``S`` tokens (a state
    of slot and tokens) and past them, at their last token (a block state and their own
    at one row), in tiles that also end short requests and in tiles that end only long
    ones; blocks not cached (``-1``); requests without tokens, one starting fresh (zeros
    written) and one reading its slot (nothing); NaN in every slot not read and in the
    padding. Outputs within rounding of a float64 oracle, every state bit for bit."""
    from maskconv_kernels.ops.causal_conv1d import pallas_mosaic_tpu as tpu
    from maskconv_kernels.ops.causal_conv1d.checks import problem_of
    from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu.config import PAD, ZEROS

    rng = np.random.default_rng(7)
    lengths = [9, 1, 0, 33, 1, 17, 0, 6, 22, 2]
    computed = [2, 7, 0, 0, 10, 3, 5, 1, 13, 6]
    codes = [0, 1, ZEROS, ZEROS, 4, 5, 6, 7, PAD, 9]
    writes = [c if c >= 0 else (-1 if c == PAD else r + 10) for r, c in enumerate(codes)]
    size, cached, state_len, dim, tokens = 4, 10, 3, 256, 100
    slots = 64
    targets = np.full((len(lengths), cached), -1, np.int32)
    free = iter(range(24, slots))
    for r, n in enumerate(lengths):
        for m in range(cached):
            if 0 < (m + 1) * size - computed[r] <= n and (r + m) % 5:  # some boundaries not cached
                targets[r, m] = next(free)
    qsl, x, pool, owner, within = _ragged_step(rng, lengths, codes, tokens, dim, slots, state_len, F32, pool_dtype)
    w, bias = rng.standard_normal((4, dim)).astype(np.float32) * 0.5, rng.standard_normal(dim).astype(np.float32)
    problem = problem_of(x[None], jnp.asarray(w), jnp.asarray(bias), None, pool, activation="silu", dilation=1)
    blocks = (size, jnp.asarray(targets), jnp.asarray(computed, jnp.int32))
    y, new = tpu.step(x, pool, jnp.asarray(w), jnp.asarray(bias), jnp.asarray(qsl), jnp.asarray(codes, jnp.int32),
                      jnp.asarray(writes, jnp.int32), jnp.asarray(owner), jnp.asarray(within), problem=problem,
                      config=Config(step_tokens=16, step_channels=128, step_states_from_frame=from_frame),
                      interpret=INTERPRET, blocks=blocks)
    ry, rnew = _mixed_oracle(x, pool, w, bias, qsl, codes, writes, problem, blocks=(size, targets, computed))
    y = np.asarray(y, np.float64)
    scale = float(np.nanmax(np.abs(np.asarray(x, np.float64))) * np.abs(w).max()) + 1
    assert_close(y[:qsl[-1]], ry[:qsl[-1]], F32, 4, scale)
    assert (targets >= 0).sum() >= 12 and not np.asarray(new, np.float64)[writes[2]].any()
    np.testing.assert_array_equal(np.asarray(new, np.float64), np.asarray(jnp.asarray(rnew, pool_dtype), np.float64))


@pytest.mark.parametrize("pool_dtype", [F32, BF16], ids=["f32pool", "bf16pool"])
def test_the_mixed_step_kernel_halves_its_tokens_until_its_buffers_fit_vmem(pool_dtype):
    """Its slot buffers hold 8 float32 rows a token, so the largest Config (256 tokens x
    8,192 channels, as wide as the decode kernel's blocks) would ask for 178 MiB with a
    float32 pool: fitted, the tokens halve until 8 MiB of the VMEM limit stay free, no
    further; the default's blocks are left as they are."""
    from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu.config import VMEM_LIMIT_BYTES, MiB
    from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu.mixed import MixedStatic

    problem = make_problem(jnp.zeros((1, 8, 8192), BF16), jnp.zeros((4, 8192)), jnp.zeros(8192), activation="silu")[0]
    itemsize, budget = np.dtype(pool_dtype).itemsize, VMEM_LIMIT_BYTES - 8 * MiB
    fitted = MixedStatic(problem=problem, state_len=3, tile=256, channels=8192).fitted(2, itemsize)
    assert fitted.tile == 32 and fitted.channels == 8192 and fitted.vmem_bytes(2, itemsize) <= budget
    assert MixedStatic(problem=problem, state_len=3, tile=64, channels=8192).vmem_bytes(2, itemsize) > budget
    default = MixedStatic(problem=problem, state_len=3, tile=Config().step_tokens, channels=Config().step_channels)
    assert default.fitted(2, itemsize) == default
    Config(step_channels=8192)
    with pytest.raises(ValueError, match="step_channels must be a multiple of 128 from 128 to 8192"):
        Config(step_channels=8320)
