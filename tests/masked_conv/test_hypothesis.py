"""Random shapes, masks and geometry against the float64 reference.

One test per backend, so that progress shows. The number of examples comes from the
hypothesis profile (conftest.py): a few per backend in the README's test command, more
in the slow tier that .ci/run adds (``HYPOTHESIS_PROFILE=ci``), where the interpreted
kernel backends run too.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from support.implementations import BACKENDS, backend_params
from support.numerics import assert_close, random
from hypothesis import assume, given
from hypothesis import strategies as st

from maskconv_kernels import masked_conv_reference
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference_vjp


@st.composite
def problems(draw, max_stride=3, group_counts=(1, 1, 2)):
    ndim = draw(st.integers(1, 2))
    window = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    groups = draw(st.sampled_from(group_counts))
    c_in = groups * draw(st.integers(1, 3))
    c_out = groups * draw(st.integers(1, 3))
    full = draw(st.booleans())
    mask_shape = (*window, c_in // groups, c_out) if full else window
    seed = draw(st.integers(0, 2**16))
    bits = np.random.default_rng(seed).random(mask_shape) < draw(st.floats(0.2, 0.9))
    strides = tuple(draw(st.integers(1, max_stride)) for _ in range(ndim))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(ndim))
    padding = draw(
        st.one_of(
            st.sampled_from(["SAME", "VALID"] + (["CAUSAL"] if ndim == 1 else [])),
            st.tuples(*[st.tuples(st.integers(-1, 4), st.integers(-1, 4)) for _ in range(ndim)]),
        )
    )
    need = [d * (k - 1) + 1 for d, k in zip(dilation, window)]
    spatial = tuple(draw(st.integers(n + 2, n + 8)) for n in need)  # room for -1 padding on both sides
    x_shape = (draw(st.integers(1, 2)), *spatial, c_in)
    kernel_shape = (*window, c_in // groups, c_out)
    args = dict(strides=strides, dilation=dilation, padding=padding, feature_group_count=groups)
    return seed, x_shape, kernel_shape, bits, args


_PARAMS = backend_params()


def _takes(conv, **args) -> bool:
    """Whether ``conv`` runs a small problem with these arguments (strides, groups)."""
    x, k = np.zeros((1, 8, 8, 2), conv.dtype), np.zeros((3, 3, 2 // args.get("feature_group_count", 1), 2), conv.dtype)
    return conv.unsupported(x, k, np.ones((3, 3)), **args) is None


@pytest.mark.parametrize("name", _PARAMS)
@given(data=st.data())
def test_random_problems_match_reference(name, data):
    conv = BACKENDS[name]
    # Draw only what the backend takes (pallas_mosaic_gpu: stride 1, no groups), in its dtype.
    strategy = problems(
        max_stride=3 if _takes(conv, strides=2) else 1,
        group_counts=(1, 1, 2) if _takes(conv, feature_group_count=2) else (1,),
    )
    seed, x_shape, kernel_shape, bits, args = data.draw(strategy)
    x, k = random(seed, x_shape, conv.dtype), random(seed + 1, kernel_shape, conv.dtype)
    assume(conv.unsupported(x, k, bits, **args) is None)  # e.g. groups on a kernel backend
    ref = masked_conv_reference(x, k, bits, **args)
    dy = random(seed + 2, ref.shape, conv.dtype)
    rdx, rdk = masked_conv_reference_vjp(x, k, bits, dy, **args)
    reduction = int(np.prod(kernel_shape[:-1]))
    pixels = int(np.prod(ref.shape[:-1]))
    y, vjp = jax.vjp(lambda x, k: conv(x, k, bits, **args), x, k)
    scale = lambda a: float(np.abs(np.asarray(a, np.float64)).max())
    assert_close(y, ref, conv.dtype, reduction, scale(x) * scale(k))
    dx, dk = vjp(dy)
    assert_close(dx, rdx, conv.dtype, reduction * kernel_shape[-1], scale(dy) * scale(k))
    assert_close(dk, rdk, conv.dtype, pixels, scale(dy) * scale(x))
    masked = ~np.broadcast_to(bits.reshape(bits.shape + (1,) * (len(kernel_shape) - bits.ndim)), kernel_shape)
    assert (np.asarray(dk)[masked] == 0.0).all()
