"""Streaming: chunks through ``causal_conv_stream`` (and the transposed stream) equal one full pass.

Bit for bit on the kernel backends, whose reduction order is fixed by channel tiles;
on ``"xla"`` within the rounding bound of its dtype and reduction length (both the
stream and the full pass against the float64 oracle), as docs/causal_conv.md says.
Also: the first chunk of any length, later chunks a multiple of the stride, the state a
pytree that ``jit`` compiles once for, ``scan`` carries and donation takes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close, random
from support.causal import CASES, TRANSPOSED, bits, case_params, scale

import maskconv_kernels as mk
from maskconv_kernels.ops.causal_conv import (
    CausalConvState, causal_conv_reference, causal_conv_stream_init, causal_conv_transpose_reference,
)

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)


def schedules(frames: int, stride: int) -> dict[str, list[int]]:
    """Chunk lengths (summing to at most ``frames``): Wan's 1 + 4k, one stride at a time, the longest divisible chunk."""
    s = stride
    out = {
        "1+4s+4s": [1] + [4 * s] * ((frames - 1) // (4 * s)),
        "1+s+s": [1] + [s] * ((frames - 1) // s),
        "longest": [frames - s * ((frames - 1) // s), s * ((frames - 1) // s)],
        "2s+s": [2 * s] + [s] * ((frames - 2 * s) // s),
    }
    return {name: [c for c in chunks if c] for name, chunks in out.items() if sum(chunks) <= frames}


def _run(step, x, chunks, **kw):
    ys, state, start = [], None, 0
    for length in chunks:
        y, state = step(x[:, start : start + length], state, **kw)
        ys.append(y)
        start += length
    return jnp.concatenate(ys, axis=1), state


def _check_equal(impl, streamed, full, expected, dtype, reduction, scale):
    if impl.exact_stream:
        np.testing.assert_array_equal(bits(streamed), bits(full))
    else:
        assert_close(streamed, expected, dtype, reduction, scale)
        assert_close(full, expected, dtype, reduction, scale)


STREAMED = [CASES[0], CASES[1], CASES[2], CASES[4], CASES[6], CASES[7], CASES[8]]


@pytest.mark.parametrize("case", case_params(STREAMED))
def test_chunks_equal_the_full_pass(causal, case):
    if causal.slow and not case.small:
        pytest.skip("large for an interpreter: the xla implementation runs it")
    x, k, b = case.inputs(20, causal.dtype)
    causal.skip_unsupported(x, k, **case.kw)
    runs = schedules(case.x_shape[1], case.stride)
    if causal.slow:
        runs = {"1+4s+4s": runs["1+4s+4s"]}  # one schedule per case in an interpreter
    step = lambda c, st, **kw: causal.stream(c, st, k, b, **kw)  # noqa: E731
    for name, chunks in runs.items():
        total = sum(chunks)
        streamed, state = _run(step, x, chunks, **case.kw)
        full = causal.conv(x[:, :total], k, b, **case.kw)
        assert streamed.shape == full.shape, name
        expected = causal_conv_reference(x[:, :total], k, b, **case.kw)
        _check_equal(causal, streamed, full, expected, causal.dtype, case.reduction() + 1, scale(x, k) + 0.5)
        assert isinstance(state, CausalConvState) and state.frames.shape[1] == (case.window[0] - 1) * (
            case.kw.get("dilation", 1) if isinstance(case.kw.get("dilation", 1), int) else case.kw["dilation"][0])


@pytest.mark.parametrize("case", case_params(TRANSPOSED))
def test_transposed_chunks_of_any_length_equal_the_full_pass(causal, case):
    if causal.slow and not case.small:
        pytest.skip("large for an interpreter: the xla implementation runs it")
    x, k, b = case.inputs(21, causal.dtype)
    causal.transposed().skip_unsupported(x, k, **case.kw)
    frames = case.x_shape[1]
    runs = {"1+1+1": [1] * frames, "2+rest": [2, frames - 2], "whole": [frames]}
    if causal.slow:
        runs = {"2+rest": runs["2+rest"]}
    full = causal.transpose(x, k, b, **case.kw)
    expected = causal_conv_transpose_reference(x, k, b, **case.kw)
    reduction = -(-case.window[0] // case.stride) * int(np.prod(case.kernel_shape[1:-1])) + 1
    step = lambda c, st, **kw: causal.transpose_stream(c, st, k, b, **kw)  # noqa: E731
    for name, chunks in runs.items():
        streamed, _ = _run(step, x, chunks, **case.kw)
        assert streamed.shape == full.shape, name
        _check_equal(causal, streamed, full, expected, causal.dtype, reduction, scale(x, k) + 0.5)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_xla_streams_16_bit_video_within_the_bound(dtype):
    case = CASES[8]
    x, k, b = case.inputs(22, dtype)
    streamed, _ = _run(lambda c, st, **kw: mk.causal_conv_stream(c, st, k, b, **kw), x, [1, 4, 4, 4, 4], **case.kw)
    assert_close(streamed, causal_conv_reference(x, k, b, **case.kw), dtype, case.reduction() + 1, scale(x, k) + 0.5)


def test_a_fixed_chunk_compiles_once_scan_carries_the_state_and_donation_takes_it():
    x, k, b = random(23, (2, 1 + 4 * 6, 3), F32), random(24, (4, 3, 5), F32, scale=0.5), random(25, (5,), F32)
    traces = []

    def step(state, chunk):
        traces.append(chunk.shape)
        y, state = mk.causal_conv_stream(chunk, state, k, b, strides=2)
        return state, y

    y0, state = mk.causal_conv_stream(x[:, :1], None, k, b, strides=2)  # Wan's first frame
    jitted = jax.jit(step)
    ys, s = [], state
    for i in range(6):
        s, y = jitted(s, x[:, 1 + 4 * i : 5 + 4 * i])
        ys.append(y)
    assert len(traces) == 1  # one trace, one compilation, for six chunks
    loop = jnp.concatenate([y0, *ys], axis=1)
    np.testing.assert_array_equal(bits(loop), bits(jnp.concatenate([y0, *_run_scan(step, state, x)], axis=1)))
    assert_close(loop, causal_conv_reference(x, k, b, strides=2), F32, 4 * 3 + 1, scale(x, k) + 0.5)
    # Donated, the state's buffers are reused for the next one.
    donating = jax.jit(step, donate_argnums=0)
    fresh = jax.tree.map(jnp.copy, state)
    new, _ = donating(fresh, x[:, 1:5])
    assert fresh.frames.is_deleted()
    np.testing.assert_array_equal(bits(new.frames), bits(jitted(state, x[:, 1:5])[0].frames))


def _run_scan(step, state, x):
    chunks = jnp.moveaxis(x[:, 1:].reshape(x.shape[0], 6, 4, x.shape[-1]), 1, 0)
    _, ys = jax.lax.scan(step, state, chunks)
    return [ys[i] for i in range(ys.shape[0])]


@pytest.mark.parametrize("padding_mode", ["zeros", "replicate"])
def test_an_initial_state_starts_a_stream_as_none_does_even_traced(padding_mode):
    x, k = random(26, (1, 9, 4, 2), F32), random(27, (3, 3, 2, 3), F32)
    kw = dict(strides=(2, 1), padding_mode=padding_mode)
    by_none, _ = _run(lambda c, st, **a: mk.causal_conv_stream(c, st, k, **a), x, [1, 4, 4], **kw)
    init = causal_conv_stream_init(jax.ShapeDtypeStruct((1, 1, 4, 2), F32), k, **kw)
    assert not bool(init.started) and init.frames.shape == (1, 2, 4, 2)
    step = jax.jit(lambda c, st: mk.causal_conv_stream(c, st, k, **kw))  # the state traced
    ys, state, start = [], init, 0
    for length in (1, 4, 4):
        y, state = step(x[:, start : start + length], state)
        ys.append(y)
        start += length
    np.testing.assert_array_equal(bits(jnp.concatenate(ys, axis=1)), bits(by_none))


@pytest.mark.slow  # the fast tier's fuzzer streams segment layouts
def test_a_packed_stream_equals_the_packed_full_pass():
    x, k, b = random(28, (1, 12, 5, 2), F32), random(29, (3, 3, 2, 3), F32), random(30, (3,), F32)
    ids = np.zeros((1, 12, 5), np.int32)
    ids[:, 5:] = 1
    ids[:, 10:] = -1
    ids = jnp.asarray(ids)
    full = mk.causal_conv(x, k, b, segment_ids=ids)
    ys, state, start = [], None, 0
    for length in (1, 4, 3, 4):
        y, state = mk.causal_conv_stream(x[:, start : start + length], state, k, b,
                                         segment_ids=ids[:, start : start + length])
        ys.append(y)
        start += length
    expected = causal_conv_reference(x, k, b, segment_ids=ids)
    assert_close(jnp.concatenate(ys, axis=1), expected, F32, 9 * 2 + 1, scale(x, k) + 0.5)
    assert_close(full, expected, F32, 9 * 2 + 1, scale(x, k) + 0.5)
    assert state.segment_ids.shape == (1, 2, 5)


def test_a_stream_in_another_layout_keeps_its_state_channels_last():
    x, k = random(31, (2, 9, 3), F32), random(32, (3, 3, 4), F32)
    xc, kc = jnp.moveaxis(x, -1, 1), jnp.transpose(k, (2, 1, 0))  # (N, C, T), (O, I, W)
    dn = ("NCH", "OIH", "NCH")
    ys, last, state, state_last, start = [], [], None, None, 0
    for length in (1, 2, 6):
        y, state = mk.causal_conv_stream(xc[:, :, start : start + length], state, kc, dimension_numbers=dn)
        y_last, state_last = mk.causal_conv_stream(x[:, start : start + length], state_last, k)
        ys.append(y)
        last.append(y_last)
        start += length
    assert state.frames.shape == (2, 2, 3)
    np.testing.assert_array_equal(bits(state.frames), bits(state_last.frames))
    # The channels-last stream's programs, transposed: the same bits. Against the full pass
    # (other programs, whose multiply-adds XLA:CPU may contract otherwise on another CPU:
    # 2 of 72 outputs differ by an ulp on an AMD EPYC) within rounding.
    streamed = jnp.concatenate(ys, axis=2)
    np.testing.assert_array_equal(bits(streamed), bits(jnp.moveaxis(jnp.concatenate(last, axis=1), -1, 1)))
    full = mk.causal_conv(xc, kc, dimension_numbers=dn)
    assert_close(streamed, full, F32, 3 * 3, scale(x, k))


def test_a_traced_state_given_an_off_stride_chunk_gives_nan_after_the_start():
    # Under jit the state's `started` is traced and cannot be checked when the chunk is:
    # an off-stride chunk is computed as a first chunk, and poisoned if the stream had started.
    x, k = random(60, (1, 7, 3), F32), random(61, (3, 3, 4), F32)
    step = jax.jit(lambda c, s: mk.causal_conv_stream(c, s, k, strides=2))
    fresh = causal_conv_stream_init(x[:, :3], k, strides=2)
    y0, state = step(x[:, :3], fresh)  # a first chunk of 3 frames: fine traced too
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(mk.causal_conv(x[:, :3], k, strides=2)))
    y1, _ = step(x[:, 3:6], state)  # started, 3 frames with stride 2: the bug shows
    assert y1.shape == (1, 2, 4) and np.isnan(np.asarray(y1)).all()


def test_chunk_lengths_and_states_are_checked_in_the_streams_words():
    x, k = random(33, (1, 9, 3), F32), random(34, (3, 3, 3), F32)
    _, state = mk.causal_conv_stream(x[:, :1], None, k, strides=2)
    with pytest.raises(ValueError, match=r"causal_conv_stream: after the first chunk every chunk needs a multiple of "
                                         r"strides\[0\] = 2 frames .* got 3 frames; the first chunk may have any length"):
        mk.causal_conv_stream(x[:, 1:4], state, k, strides=2)
    with pytest.raises(ValueError, match=r"causal_conv_stream: state.frames must be \(N, \(k_T - 1\) \* d_T, \*spatial, "
                                         r"C_in\) = \(1, 4, 3\)"):
        mk.causal_conv_stream(x[:, 1:3], state, k, strides=2, dilation=2)
    with pytest.raises(TypeError, match=r"causal_conv_stream: state must be None .* got dict"):
        mk.causal_conv_stream(x[:, 1:3], {"frames": state.frames}, k, strides=2)
    with pytest.raises(ValueError, match=r"causal_conv_stream: segment_ids must be given with every chunk"):
        mk.causal_conv_stream(x[:, 1:3], state, k, segment_ids=jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(TypeError, match=r"causal_conv_stream: state.frames must have the chunk's dtype bfloat16, got float32"):
        mk.causal_conv_stream(x[:, 1:3].astype(jnp.bfloat16), state, k.astype(jnp.bfloat16), strides=2)
    with pytest.raises(ValueError, match=r"causal_conv_transpose_stream: state.frames must be \(N, ceil\(k_T / s_T\) - 1"):
        mk.causal_conv_transpose_stream(x[:, 1:3], state, random(35, (8, 3, 3), F32), strides=2)
