"""A causal_conv call checks its arguments once: its convolutions run masked_conv's checked
path on the problem's resized spec, never masked_conv's public checks again."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from support.numerics import random

import maskconv_kernels as mk
from maskconv_kernels.ops.causal_conv import causal_conv_stream
from maskconv_kernels.ops.causal_conv import checks as causal_checks
from maskconv_kernels.ops.masked_conv import api as masked_api
from maskconv_kernels.ops.masked_conv.spec import make_spec


def _refuse(*args, **kwargs):
    raise AssertionError("masked_conv's public checks ran inside a causal_conv call")


@pytest.mark.parametrize("call", ["zeros", "replicate", "transposed", "stream"])
def test_no_masked_conv_check_runs_inside_a_causal_conv_call(monkeypatch, call):
    x, k, b = random(0, (1, 9, 3), np.float32), random(1, (3, 3, 4), np.float32), random(2, (4,), np.float32)
    monkeypatch.setattr(masked_api, "make_spec", _refuse)
    monkeypatch.setattr(masked_api, "as_operand", _refuse)
    run = {
        "zeros": lambda: mk.causal_conv(x, k, b),
        "replicate": lambda: mk.causal_conv(x, k, b, padding_mode="replicate", strides=2),
        "transposed": lambda: mk.causal_conv_transpose(x, k, b, strides=2),
        "stream": lambda: causal_conv_stream(x[:, 4:], causal_conv_stream(x[:, :4], None, k, b)[1], k, b)[0],
    }[call]
    assert np.all(np.isfinite(np.asarray(jax.jit(run)())))


@pytest.mark.parametrize("call", ["zeros", "channels_first", "transposed", "stream"])
def test_a_causal_conv_call_builds_one_conv_spec(monkeypatch, call):
    x, k = random(0, (1, 9, 3), np.float32), random(1, (3, 3, 4), np.float32)
    built = []

    def counted(*args, **kwargs):
        built.append(kwargs)
        return make_spec(*args, **kwargs)

    monkeypatch.setattr(causal_checks, "make_spec", counted)
    run = {
        "zeros": lambda: mk.causal_conv(x, k),
        "channels_first": lambda: mk.causal_conv(
            x.transpose(0, 2, 1), k.transpose(2, 1, 0), dimension_numbers=("NCH", "OIH", "NCH")),
        "transposed": lambda: mk.causal_conv_transpose(x, k, strides=2),
        "stream": lambda: causal_conv_stream(x, None, k)[0],
    }[call]
    y = run()
    assert len(built) == 1 and np.all(np.isfinite(np.asarray(y)))


def test_a_resized_spec_keeps_its_checks_and_refuses_a_mask_it_cannot_carry():
    spec = make_spec(jax.ShapeDtypeStruct((1, 8, 3), np.float32), jax.ShapeDtypeStruct((3, 3, 4), np.float32), None,
                     padding=((2, 0),))
    longer = spec.resized((12,), ((0, 0),), kernel_shape=(2, 3, 8))
    assert (longer.in_spatial, longer.padding, longer.window, longer.c_out) == ((12,), ((0, 0),), (2,), 8)
    assert longer.out_spatial == (11,) and longer.dtype == spec.dtype and longer.precision == spec.precision
    with pytest.raises(ValueError, match="input channels stay"):
        spec.resized((8,), ((2, 0),), kernel_shape=(3, 2, 4))
    partial = make_spec(jax.ShapeDtypeStruct((1, 8, 3), np.float32), jax.ShapeDtypeStruct((3, 3, 4), np.float32),
                        mk.causal_mask(3, include_current=False), padding=((2, 0),))
    with pytest.raises(ValueError, match="every tap active"):
        partial.resized((8,), ((2, 0),), kernel_shape=(2, 3, 4))
