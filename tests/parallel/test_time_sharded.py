"""Time-sharded ``causal_conv`` and ``causal_conv_transpose`` (context parallelism for video and
audio) against the single-device call, in the contiguous and zigzag layouts.

What is compared how: outputs and gradients within the dtype's rounding of the single
call. XLA's convolutions block by shape, so a chunk and the whole clip may sum in another
order (``docs/causal_conv.md``); even a depthwise layer's shifted products, summed in one
order, differ in the last bit on jax 0.12's CPU compiler, which contracts multiply-adds
into FMAs differently in the two programs (12% of one case's outputs, 1 ulp), where jax
0.10 and 0.11 gave the same bits. NaN from a border on, in
time order, changes no earlier output bit. The compiled program exchanges frames by
collective-permutes and gathers nothing. The checks need 8 devices (a CPU session has
them, ``tests/conftest.py``; elsewhere ``test_on_8_forced_cpu_devices`` runs this file in
a fresh interpreter with 8 forced CPU devices).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from support.mesh import has_mesh_already, needs_mesh, run_on_forced_cpu_devices
from support.numerics import assert_close, random
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels import parallel

F32 = np.dtype(np.float32)
SHARDS = 4


@has_mesh_already
def test_on_8_forced_cpu_devices():
    run_on_forced_cpu_devices(__file__)


def _clips(seed, n, frames):
    """Clip ids along time, the same for every pixel of a frame: clips cross the chunk borders."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, frames), 3, replace=False))
    return np.stack([np.searchsorted(cuts, np.arange(frames), side="right") + 10 * i for i in range(n)]).astype(np.int32)


# name: (x shape, kernel shape, layer keywords, transposed, segmented)
LAYERS = {
    "video_3x3x3": ((2, 16, 4, 4, 3), (3, 3, 3, 3, 4), dict(padding="SAME"), False, False),
    "video_replicate": ((2, 16, 4, 4, 3), (3, 3, 3, 3, 4), dict(padding="SAME", padding_mode="replicate"), False, False),
    "video_time_stride_2": ((2, 16, 4, 4, 3), (3, 3, 3, 3, 4), dict(padding="SAME", strides=(2, 1, 1)), False, False),
    # LTX-2's decoder: frame 0 repeated before it, the spatial axes reflected (each chunk pads its own frames).
    "video_reflect": ((2, 16, 4, 4, 3), (3, 3, 3, 3, 4), dict(padding_mode="replicate", spatial_padding_mode="reflect"),
                      False, False),
    "audio_dilated_clips": ((2, 32, 3), (3, 3, 5), dict(dilation=2), False, True),
    "audio_depthwise": ((2, 32, 4), (4, 1, 4), dict(feature_group_count=4), False, False),
    "audio_channels_first": ((2, 3, 32), (5, 3, 3), dict(dimension_numbers=("NCH", "OIH", "NCH")), False, False),
    "upsample_x2": ((2, 16, 3), (4, 3, 5), dict(strides=2), True, False),
}
# The fast tier: three layers, each in one layout.
FAST = (("video_3x3x3", "zigzag"), ("audio_dilated_clips", "contiguous"), ("upsample_x2", "zigzag"))
CASES = [(name, layout) for name in LAYERS for layout in ("contiguous", "zigzag")]


def _time_axis(kw) -> int:
    return 2 if "dimension_numbers" in kw else 1


@needs_mesh
@pytest.mark.parametrize("name, layout", tiered(CASES, lambda c: tuple(c) in FAST, spread=True))
def test_time_sharded_equals_one_device(name, layout):
    x_shape, k_shape, kw, transposed, segmented = LAYERS[name]
    x, k, b = random(1, x_shape, F32), random(2, k_shape, F32, scale=0.3), random(3, k_shape[-1:], F32)
    if "dimension_numbers" in kw:
        b = random(3, (k_shape[0],), F32)
    ids = None
    if segmented:  # channels-last layers: (N, T, *spatial) ids, one clip per frame
        clips = _clips(4, x_shape[0], x_shape[1])
        ids = jnp.asarray(np.broadcast_to(clips.reshape(clips.shape + (1,) * (len(x_shape) - 3)), x_shape[:-1]))
    axis = _time_axis(kw)
    zigzag = layout == "zigzag"
    into = (lambda a: a) if not zigzag else (lambda a: None if a is None else parallel.to_zigzag(a, SHARDS, axis=axis))  # noqa: E731
    back = (lambda a: a) if not zigzag else (lambda a: parallel.from_zigzag(np.asarray(a), SHARDS, axis=axis))  # noqa: E731
    mesh = jax.make_mesh((SHARDS, 2), ("time", "data"), axis_types=(AxisType.Auto,) * 2)
    sharded_op = parallel.time_sharded_causal_conv_transpose if transposed else parallel.time_sharded_causal_conv
    single_op = mk.causal_conv_transpose if transposed else mk.causal_conv
    ids_in_layout = into(ids)

    def sharded(x, k, b):
        return sharded_op(x, k, b, mesh=mesh, axis_name="time", layout=layout, batch_axis="data",
                          segment_ids=ids_in_layout, **kw)

    def single(x, k, b):
        return single_op(x, k, b, segment_ids=ids, **kw)

    forward = jax.jit(sharded)
    y, y1 = back(forward(into(x), k, b)), jax.jit(single)(x, k, b)
    assert y.shape == y1.shape
    reduction = int(np.prod(k_shape[:-1]))
    scale = float(np.abs(np.asarray(x)).max() * np.abs(np.asarray(k)).max())
    assert_close(y, y1, F32, reduction, scale)
    text = forward.lower(into(x), k, b).compile().as_text()
    assert "all-gather" not in text and "collective-permute" in text

    dy = random(5, y1.shape, F32)
    dx, dk = jax.jit(lambda x, k, b: jax.vjp(sharded, x, k, b)[1](into(dy))[:2])(into(x), k, b)
    dx1, dk1 = jax.jit(lambda x, k, b: jax.vjp(single, x, k, b)[1](dy)[:2])(x, k, b)
    dy_max = float(np.abs(np.asarray(dy)).max())
    assert_close(back(dx), dx1, F32, reduction, dy_max * float(np.abs(np.asarray(k)).max()))
    assert_close(dk, dk1, F32, int(np.prod(y1.shape[:-1])), dy_max * float(np.abs(np.asarray(x)).max()))


@needs_mesh
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_nan_in_later_frames_never_reaches_earlier_outputs(layout):
    mesh = jax.make_mesh((SHARDS,), ("time",), axis_types=(AxisType.Auto,))
    x, k = random(11, (1, 16, 3, 3, 2), F32), random(12, (3, 3, 3, 2, 2), F32)
    into = (lambda a: a) if layout == "contiguous" else (lambda a: parallel.to_zigzag(a, SHARDS))  # noqa: E731
    back = (lambda a: a) if layout == "contiguous" else (lambda a: parallel.from_zigzag(np.asarray(a), SHARDS))  # noqa: E731
    conv = jax.jit(lambda x: parallel.time_sharded_causal_conv(x, k, mesh=mesh, axis_name="time", layout=layout,
                                                               padding="SAME"))
    clean = np.asarray(back(conv(into(x))))
    for border in range(1, 16):
        y = np.asarray(back(conv(into(x.at[:, border:].set(jnp.nan)))))
        np.testing.assert_array_equal(y[:, :border], clean[:, :border], err_msg=f"border at {border}")
        assert np.isnan(y[:, border:]).any()


@needs_mesh
def test_time_sharding_limits_are_reported():
    mesh = jax.make_mesh((SHARDS,), ("time",), axis_types=(AxisType.Auto,))
    x, k = jnp.ones((1, 16, 2)), jnp.ones((3, 2, 2))

    def call(x, k, **kw):
        return parallel.time_sharded_causal_conv(x, k, mesh=mesh, axis_name="time", **kw)

    with pytest.raises(ValueError, match=r"the number of frames 12 must be a multiple of the 4 shards along 'time' "
                                         r"times 2"):
        call(x[:, :12], k, layout="zigzag")
    with pytest.raises(ValueError, match=r"each chunk holds 2 positions but needs a halo of \(k_T - 1\) \* d_T = 4"):
        call(x, k, dilation=2, layout="zigzag")
    with pytest.raises(ValueError, match=r"each chunk holds 4 frames, not a multiple of strides\[0\] = 3"):
        call(x, k, strides=3)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['mask'\]"):
        call(x, k, mask=None)
    with pytest.raises(ValueError, match="time_sharded_causal_conv: padding_mode must be"):
        call(x, k, padding_mode="reflect")
