"""The xla backend's CPU convolutions over boxes at every offset and padding.

jaxlib 0.10's CPU convolution reads garbage when a low padding is negative, in the
forward pass or in the input gradient (whose low padding is ``window - 1 - lo``), and
the garbage changes from run to run. A box of active taps has its own padding, shifted
by its offset in the window, so every offset, padding and stride is swept here with the
"conv" strategy (what CPUs run) against the float64 reference.
"""
from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from conftest import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels.reference import masked_conv_reference, masked_conv_reference_vjp
from maskconv_kernels.xla import XlaConfig

WIDTH = 5


def _box_masks():
    """Every run of 1 or 2 active taps in a 1x5 window."""
    boxes = []
    for start, size in itertools.product(range(WIDTH), (1, 2)):
        if start + size <= WIDTH:
            bits = np.zeros((1, WIDTH), bool)
            bits[0, start : start + size] = True
            boxes.append(pytest.param(bits, id=f"taps{start}-{start + size - 1}"))
    return boxes


def _check(bits, padding, stride, dilation):
    x, k = random(0, (1, 3, 9, 2)), random(1, (1, WIDTH, 2, 3))
    kw = dict(padding=padding, strides=(1, stride), dilation=(1, dilation))
    f = jax.jit(lambda x, k: mk.masked_conv(x, k, bits, implementation="xla", config=XlaConfig("conv"), **kw))
    y, vjp = jax.vjp(f, x, k)
    dy = random(2, y.shape)
    dx, dk = jax.jit(vjp)(dy)
    rdx, rdk = masked_conv_reference_vjp(x, k, bits, dy, **kw)
    taps = int(bits.sum())
    scale = lambda a: float(np.abs(a).max())  # noqa: E731
    assert_close(y, masked_conv_reference(x, k, bits, **kw), np.float32, taps * 2, scale(x) * scale(k))
    assert_close(dx, rdx, np.float32, taps * 3, scale(dy) * scale(k))
    assert_close(dk, rdk, np.float32, int(np.prod(y.shape[:-1])), scale(dy) * scale(x))


@pytest.mark.parametrize("bits", _box_masks())
@pytest.mark.parametrize("lo", [0, 2, 4])
def test_box_at_every_offset_with_low_padding(bits, lo):
    _check(bits, ((0, 0), (lo, 4 - lo)), stride=1, dilation=1)


@pytest.mark.slow
@pytest.mark.parametrize("bits", _box_masks())
@pytest.mark.parametrize("lo, hi", [(-1, 3), (1, -1), (3, 0), (5, -2)])
@pytest.mark.parametrize("stride, dilation", [(1, 2), (2, 1)])
def test_box_at_every_offset_with_any_padding_stride_and_dilation(bits, lo, hi, stride, dilation):
    _check(bits, ((0, 0), (lo, hi)), stride=stride, dilation=dilation)
