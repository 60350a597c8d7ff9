"""The causality audit along time (``maskconv_kernels.audit_causal``, ``assert_causal``) over whole encoders.

Time is the audited position axis (``position_axes=(1,)``): an output frame may see
input frames up to its own (``include_current=True``), everything else of a frame (its
pixels, channels, the batch) belongs to it. Flagged: Cosmos-style GroupNorm over time,
EnCodec-style reflect padding at the start of a stream. Passing: a stack of
``causal_conv`` layers with RMS norm, and encoders with strides or upsampling, whose
outputs are put on the input's frame grid first (the audit compares positions of x and
y one to one: see :func:`on_input_frames`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from support.numerics import random

import maskconv_kernels as mk

AUDIT = dict(position_axes=(1,), include_current=True, checks=("gradient", "nan"))


def rms_norm(h, eps=1e-6):
    """Over channels, per frame and pixel (Wan's and Mimi's norm): causal."""
    h32 = h.astype(jnp.float32)
    return (h32 * lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)).astype(h.dtype)


def group_norm_over_time(h, groups, eps=1e-6):
    """Cosmos' GroupNorm(32): statistics over every frame, pixel and channel of a group."""
    n, *rest, c = h.shape
    g = h.reshape(n, *rest, groups, c // groups)
    axes = tuple(range(1, g.ndim - 2)) + (g.ndim - 1,)
    mean = g.mean(axis=axes, keepdims=True)
    var = ((g - mean) ** 2).mean(axis=axes, keepdims=True)
    return ((g - mean) * lax.rsqrt(var + eps)).reshape(h.shape)


def on_input_frames(y, frames: int, stride: int):
    """A downsampling encoder's outputs on the input's frame grid: output ``t`` at frame ``t * stride``.

    The audit pairs output and input positions one to one; output ``t`` of a stride-``S``
    encoder may see input frames up to ``t * S``, which is what frame ``t * S`` of the grid
    may see. The other frames hold zeros, which depend on nothing.
    """
    grid = jnp.zeros((y.shape[0], frames, *y.shape[2:]), y.dtype)
    return grid.at[:, : y.shape[1] * stride : stride].set(y)


def _video_kernels(seed, c, count):
    return [random(seed + i, (3, 3, 3, c, c), np.float32, scale=0.3) for i in range(count)]


@pytest.mark.slow  # the fast tier flags reflect padding
def test_cosmos_style_group_norm_over_time_is_flagged():
    x = random(50, (1, 5, 4, 4, 4), np.float32)
    k1, k2 = _video_kernels(51, 4, 2)

    def cosmos_block(x):
        h = mk.causal_conv(x, k1, padding_mode="replicate")
        h = jax.nn.silu(group_norm_over_time(h, groups=2))
        return mk.causal_conv(h, k2, padding_mode="replicate")

    report = mk.audit_causal(cosmos_block, x, **AUDIT)
    assert not report.passed
    gradient = next(c for c in report.checks if c.check == "gradient")
    assert gradient.first.output == (0,) and gradient.first.input[0] > 0  # frame 0 sees the future
    with pytest.raises(mk.CausalityError):
        mk.assert_causal(cosmos_block, x, **AUDIT)
    # The same block normalised per frame (RMS over channels) passes.
    mk.assert_causal(lambda x: mk.causal_conv(jax.nn.silu(rms_norm(mk.causal_conv(x, k1))), k2), x, **AUDIT)


def test_reflect_padding_at_the_stream_start_is_flagged():
    """EnCodec's causal SConv1d pads the past with ``reflect``: frames 1 .. k-1 mirrored before frame 0."""
    x = random(52, (2, 12, 3), np.float32)
    k = random(53, (7, 3, 4), np.float32, scale=0.3)

    def encodec_conv(x):
        padded = jnp.pad(x, ((0, 0), (6, 0), (0, 0)), mode="reflect")
        return lax.conv_general_dilated(padded, k, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))

    report = mk.audit_causal(encodec_conv, x, **AUDIT)
    assert not report.passed
    first = next(c for c in report.checks if c.check == "nan").first
    assert first.output == (0,)
    # The library's padding modes read no later frame.
    for mode in ("zeros", "replicate"):
        mk.assert_causal(lambda x: mk.causal_conv(x, k, padding_mode=mode), x, **AUDIT)


@pytest.mark.parametrize("video", [False, True], ids=["audio", "video"])
def test_a_stack_of_causal_convs_with_rms_norm_passes(video):
    if video:
        x = random(54, (1, 7, 3, 3, 4), np.float32)
        kernels = _video_kernels(55, 4, 3)
    else:
        x = random(54, (2, 16, 4), np.float32)
        kernels = [random(55 + i, (3, 4, 4), np.float32, scale=0.5) for i in range(3)]

    def stack(x):
        h = x
        for i, k in enumerate(kernels):
            h = h + mk.causal_conv(jax.nn.silu(rms_norm(h)), k, dilation=(2**i,) + (1,) * (x.ndim - 3),
                                   padding_mode="replicate" if i == 0 else "zeros")
        return h

    report = mk.assert_causal(stack, x, **AUDIT)
    assert report.passed and len(report.audited) == x.shape[1]


@pytest.mark.slow
def test_strided_encoders_and_upsampling_decoders_pass_on_the_input_grid():
    x = random(56, (1, 17, 4), np.float32)
    k_down = random(57, (4, 4, 4), np.float32, scale=0.5)  # k = 2 s: EnCodec's downsampling conv
    k_up = random(58, (4, 4, 4), np.float32, scale=0.5)

    def encoder(x):  # two stride-2 layers: output t sees input frames up to 4 t
        h = mk.causal_conv(x, k_down, strides=2)
        return on_input_frames(mk.causal_conv(jax.nn.elu(h), k_down, strides=2), x.shape[1], 4)

    mk.assert_causal(encoder, x, **AUDIT)

    def leaky_encoder(x):  # a strided layer padded on both sides, as a "SAME" convolution is
        y = lax.conv_general_dilated(x, k_down, (2,), ((1, 2),), dimension_numbers=("NWC", "WIO", "NWC"))
        return on_input_frames(y, x.shape[1], 2)

    assert not mk.audit_causal(leaky_encoder, x, **AUDIT).passed

    def decoder(x):  # upsampling by 2: output u sees input frames up to u // 2, so the pair (2t, 2t+1) is frame t's
        y = mk.causal_conv_transpose(x, k_up, strides=2)
        return y.reshape(y.shape[0], x.shape[1], 2, y.shape[-1])

    mk.assert_causal(decoder, x, **AUDIT)
