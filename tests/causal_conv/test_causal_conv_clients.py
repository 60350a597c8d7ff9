"""Real clients, written here from their published semantics, streamed against their full pass.

* A Wan-style causal residual block (Wan 2.1's video VAE): RMS norm, SiLU, causal 3x3x3
  convolutions and a 1x1x1 shortcut, then Wan's downsampling: a stride-2 3x3 convolution
  over pixels (zero-padded after, as its ``ZeroPad2d(0, 1, 0, 1)``) and a (3, 1, 1) time
  convolution of stride 2.
* A Mimi / EnCodec-style causal 1-D encoder (SEANet): a width-7 convolution, then for
  strides 2, 4, 5 and 8 a residual unit (ELU, width-3 convolution, ELU, width-1
  convolution, added) and a width-2s convolution of stride s doubling the channels, then
  a residual unit and a width-3 convolution.

Each runs as one full pass and as a stream of chunks (1+4+4, 1+1+... and the longest
divisible chunk; frames are held back until the model's total stride divides them, as
Mimi's streaming does), each layer with its own :class:`CausalConvState`. Streamed equals
full: bit for bit on the kernel backends; on ``"xla"`` within the float32 roundings of
the layers' reductions. NaN in future frames stays there, and gradients into the future
are exactly 0.0.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from support.causal import IMPLS, bits, impl_params
from support.numerics import TOLERANCE, random

F32 = np.dtype(np.float32)


def rms_norm(h, gamma, eps=1e-6):
    """Wan's RMS_norm: over channels, per frame and pixel."""
    return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps) * gamma


@dataclasses.dataclass
class Layers:
    """How the model calls its convolutions: one full pass, or one chunk of a stream (each layer its own state)."""

    impl: object
    states: dict | None = None  # None: the full pass

    def __call__(self, name, h, kernel, bias=None, **kw):
        if self.states is None:
            return self.impl.conv(h, kernel, bias, **kw)
        y, self.states[name] = self.impl.stream(h, self.states.get(name), kernel, bias, **kw)
        return y


@dataclasses.dataclass(frozen=True)
class Client:
    name: str
    model: Callable  # model(conv, params, x)
    params: dict
    x_shape: tuple
    stride: int  # frames in per frame out
    reductions: tuple  # each layer's taps x input channels

    def inputs(self, seed):
        return random(seed, self.x_shape, F32)


def _k(seed, shape):
    fan_in = int(np.prod(shape[:-1]))
    return random(seed, shape, F32, scale=1.0 / np.sqrt(fan_in))


def wan_block(conv, p, x):
    h = conv("conv1", jax.nn.silu(rms_norm(x, p["g1"])), p["k1"], p["b1"])
    h = conv("conv2", jax.nn.silu(rms_norm(h, p["g2"])), p["k2"], p["b2"])
    h = h + conv("shortcut", x, p["ks"])
    h = conv("down_hw", h, p["kd"], p["bd"], strides=(1, 2, 2), padding=((0, 1), (0, 1)))
    return conv("down_t", h, p["kt"], p["bt"], strides=(2, 1, 1))


def _wan(c_in=3, c=4, hw=6):
    p = {
        "g1": 1.0 + random(60, (c_in,), F32, 0.1), "k1": _k(61, (3, 3, 3, c_in, c)), "b1": random(62, (c,), F32, 0.1),
        "g2": 1.0 + random(63, (c,), F32, 0.1), "k2": _k(64, (3, 3, 3, c, c)), "b2": random(65, (c,), F32, 0.1),
        "ks": _k(66, (1, 1, 1, c_in, c)),
        "kd": _k(67, (1, 3, 3, c, c)), "bd": random(68, (c,), F32, 0.1),
        "kt": _k(69, (3, 1, 1, c, c)), "bt": random(70, (c,), F32, 0.1),
    }
    reductions = (27 * c_in, 27 * c, c_in, 9 * c, 3 * c)
    return Client("wan_block", wan_block, p, (1, 17, hw, hw, c_in), 2, reductions)


MIMI_STRIDES = (2, 4, 5, 8)


def residual_unit(conv, name, p, h, dilation=1):
    y = conv(f"{name}.a", jax.nn.elu(h), p[f"{name}.ka"], p[f"{name}.ba"], dilation=dilation)
    return h + conv(f"{name}.b", jax.nn.elu(y), p[f"{name}.kb"], p[f"{name}.bb"])


def mimi_encoder(conv, p, x):
    h = conv("conv_in", x, p["conv_in"], p["conv_in.b"])
    for i, s in enumerate(MIMI_STRIDES):
        h = residual_unit(conv, f"res{i}", p, h)
        h = conv(f"down{i}", jax.nn.elu(h), p[f"down{i}"], p[f"down{i}.b"], strides=s)
    h = residual_unit(conv, "res_out", p, h, dilation=2)
    return conv("conv_out", jax.nn.elu(h), p["conv_out"], p["conv_out.b"])


def _mimi(c=2):
    p, reductions, seed = {}, [], 80

    def add(name, shape):
        nonlocal seed
        p[name], p[f"{name}.b"] = _k(seed, shape), random(seed + 1, shape[-1:], F32, 0.1)
        reductions.append(int(np.prod(shape[:-1])))
        seed += 2

    def unit(name, ch):
        p[f"{name}.ka"], p[f"{name}.ba"] = _k(seed + 100, (3, ch, ch // 2)), random(seed + 101, (ch // 2,), F32, 0.1)
        p[f"{name}.kb"], p[f"{name}.bb"] = _k(seed + 102, (1, ch // 2, ch)), random(seed + 103, (ch,), F32, 0.1)
        reductions.extend([3 * ch, ch // 2])

    add("conv_in", (7, 1, c))
    for i, s in enumerate(MIMI_STRIDES):
        unit(f"res{i}", c)
        add(f"down{i}", (2 * s, c, 2 * c))
        c *= 2
    unit("res_out", c)
    add("conv_out", (3, c, c))
    total = int(np.prod(MIMI_STRIDES))
    return Client("mimi_encoder", mimi_encoder, p, (1, 1 + 2 * total, 1), total, tuple(reductions))


CLIENTS = {"wan_block": _wan, "mimi_encoder": _mimi}


def run_full(client, impl, x):
    return client.model(Layers(impl), client.params, x)


def run_stream(client, impl, x, chunks):
    """The model on ``chunks`` of x; frames beyond a multiple of its stride wait for the next chunk.

    Returns ``(outputs, frames consumed)``: the outputs of the frames consumed, concatenated.
    """
    layers = Layers(impl, states={})
    outs, pending, consumed, start = [], None, 0, 0
    for length in chunks:
        chunk = x[:, start : start + length]
        start += length
        pending = chunk if pending is None else jnp.concatenate([pending, chunk], axis=1)
        take = pending.shape[1] if consumed == 0 else pending.shape[1] // client.stride * client.stride
        if take:
            outs.append(client.model(layers, client.params, pending[:, :take]))
            consumed += take
            pending = pending[:, take:]
            if not pending.shape[1]:
                pending = None
    return jnp.concatenate(outs, axis=1), consumed


def _schedules(frames: int, stride: int):
    return {
        "1+4+4": [1] + [4] * ((frames - 1) // 4),
        "1+1+1": [1] * frames,
        "longest": [frames - stride * ((frames - 1) // stride), stride * ((frames - 1) // stride)],
    }


def _assert_stream_equals_full(impl, client, streamed, full):
    assert streamed.shape == full.shape
    if impl.exact_stream:
        np.testing.assert_array_equal(bits(streamed), bits(full))
        return
    # xla: each layer's float32 reduction rounds within TOLERANCE * sqrt(length) of its
    # output's scale (the stream and the full pass each), added over the layers.
    bound = 2 * TOLERANCE[F32] * sum(np.sqrt(r) for r in client.reductions) * float(jnp.abs(full).max())
    err = float(jnp.abs(streamed - full).max())
    assert err <= bound, (err, bound)


def _runs() -> list:
    """(client, schedule): the video block's 1+4+4 in the default run, the rest in the slow tier."""
    return [
        pytest.param(client, schedule, id=f"{client}-{schedule}",
                     marks=() if (client, schedule) == ("wan_block", "1+4+4") else (pytest.mark.slow,))
        for client in sorted(CLIENTS) for schedule in ("1+4+4", "1+1+1", "longest")
    ]


@pytest.mark.parametrize("impl_name", impl_params())
@pytest.mark.parametrize("client_name, schedule", _runs())
def test_streamed_in_chunks_equals_the_full_pass(client_name, schedule, impl_name):
    impl, client = IMPLS[impl_name], CLIENTS[client_name]()
    x = client.inputs(90)
    full = run_full(client, impl, x)  # skips where a layer is not the implementation's
    assert full.shape[1] == (x.shape[1] - 1) // client.stride + 1
    streamed, consumed = run_stream(client, impl, x, _schedules(x.shape[1], client.stride)[schedule])
    assert consumed == x.shape[1]
    _assert_stream_equals_full(impl, client, streamed, full)


# The audits of whole clients (the audio encoder's alone 27 s on the 2-core VM): the slow
# tier's; the fast tier streams the video block (above) and audits causal_conv stacks
# (test_causal_conv_audit.py).
@pytest.mark.slow
@pytest.mark.parametrize("client_name", ["wan_block", "mimi_encoder"])
def test_future_frames_stay_in_the_future(client_name):
    impl, client = IMPLS["xla"], CLIENTS[client_name]()
    x = client.inputs(91)
    frames, s = x.shape[1], client.stride
    cut = frames // 2 + 1
    seen = (cut - 1) // s + 1  # outputs t with t * S < cut
    clean = run_full(client, impl, x)
    poisoned = run_full(client, impl, x.at[:, cut:].set(jnp.nan))
    np.testing.assert_array_equal(bits(poisoned[:, :seen]), bits(clean[:, :seen]))
    assert np.isnan(np.asarray(poisoned[:, seen:])).any()  # the later outputs do read the NaN
    dx = jax.grad(lambda x: run_full(client, impl, x)[:, :seen].sum())(x)
    assert (np.asarray(dx[:, cut:]) == 0.0).all() and np.isfinite(np.asarray(dx)).all()
    assert np.abs(np.asarray(dx[:, :cut])).max() > 0
    # Streamed, the NaN arriving inside a chunk: the outputs before it are the clean ones.
    streamed, _ = run_stream(client, impl, x.at[:, cut:].set(jnp.nan), _schedules(frames, s)["longest"])
    _assert_stream_equals_full(impl, client, streamed[:, :seen], clean[:, :seen])
