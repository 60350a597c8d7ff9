"""``causal_conv``'s implementations as its suites call them (:mod:`support.harness`), and its cases.

Every implementation of :data:`maskconv_kernels.ops.causal_conv.IMPLEMENTATIONS` that runs
here enters the suites: ``"xla"`` as it is, kernel backends compiled on GPUs and in their
interpreters elsewhere, in the dtype they take (:func:`support.harness.suite_dtype`).
An implementation that does not take a case skips it with its own reason (its
``NotImplementedError`` is tested once, in test_causal_conv.py). The kernel backends'
reduction order is fixed by channel tiles, so their streams must equal the full pass
bit for bit (``exact_stream``); ``"xla"``'s is its libraries' (within a bound).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from support import harness
from support.harness import Op
from support.numerics import random

import maskconv_kernels as mk
from maskconv_kernels.ops.causal_conv import backends
from maskconv_kernels.ops.causal_conv.checks import make_problem

__all__ = [
    "CAUSAL_CONV", "CAUSAL_CONV_TRANSPOSE", "case_params", "Impl", "IMPLS", "MISSING", "impl_params", "INTERPRETED",
    "Case", "CASES", "TRANSPOSED", "bits", "scale",
]


def _problem(name, transposed):
    def problem(x, kernel, bias=None, segment_ids=None, **kw):
        return make_problem(name, x, kernel, bias, segment_ids, transposed=transposed, **kw)[0].spec

    return problem


def _probe(dtype):
    return _problem("causal_conv", False)(np.zeros((1, 4, 4, 2), dtype), np.zeros((3, 3, 2, 2), dtype))


CAUSAL_CONV = Op(mk.causal_conv, backends.REGISTRY, _problem("causal_conv", False), _probe)
CAUSAL_CONV_TRANSPOSE = Op(mk.causal_conv_transpose, backends.REGISTRY, _problem("causal_conv_transpose", True), _probe)


@dataclasses.dataclass(frozen=True)
class Impl(harness.Implementation):
    """One implementation of ``causal_conv``, its transpose and their streams, as the suites call them."""

    @property
    def exact_stream(self) -> bool:
        """Streams equal the full pass bit for bit (a reduction order fixed by tiles, not by shapes).

        Not ``xla`` (XLA's convolution orders its sum by shape), nor Triton's interpreter:
        it runs ``tl.dot`` as NumPy's matmul, whose BLAS picks a summation order by shape
        (8 ulp apart on an AMD EPYC). The compiled Triton kernels keep the claim. Nor the
        Mosaic TPU kernels interpreted: their dots are XLA:CPU's, whose bits for one row
        depend on the rows beside it, and a block holds as many pixels as the problem
        (a chunk) has, up to its size."""
        shape_dependent = {"triton", "pallas_mosaic_tpu"}
        return self.implementation != "xla" and not (self.implementation in shape_dependent and self.interpret)

    def conv(self, x, kernel, bias=None, **kw):
        return self(x, kernel, bias, **kw)

    def transposed(self) -> Impl:
        """The same implementation of ``causal_conv_transpose``."""
        return dataclasses.replace(self, op=CAUSAL_CONV_TRANSPOSE)

    def transpose(self, x, kernel, bias=None, **kw):
        return self.transposed()(x, kernel, bias, **kw)

    def stream(self, x_chunk, state, kernel, bias=None, **kw):
        return mk.causal_conv_stream(x_chunk, state, kernel, bias, **self.kwargs(**kw))

    def transpose_stream(self, x_chunk, state, kernel, bias=None, **kw):
        return mk.causal_conv_transpose_stream(x_chunk, state, kernel, bias, **self.kwargs(**kw))


IMPLS, MISSING = harness.implementations(CAUSAL_CONV, kind=Impl)
# Interpreters run the shared suites in the slow tier; the default run keeps one smoke
# case of each (test_causal_conv.py's test_each_interpreted_kernel_backend_smoke).
INTERPRETED = sorted(name for name, impl in IMPLS.items() if impl.slow)


def impl_params() -> list:
    """Every implementation's test id (:func:`support.harness.params`), interpreted ones in the slow tier."""
    return harness.params(IMPLS)


# --------------------------------------------------------------------------- cases (awkward sizes on purpose)


@dataclasses.dataclass(frozen=True)
class Case:
    """A layer: ``x (N, T, *spatial, C_in)``, the window ``(k_T, *k_spatial)``, C_out and keyword arguments."""

    name: str
    x_shape: tuple
    window: tuple
    c_out: int
    kw: dict = dataclasses.field(default_factory=dict)
    small: bool = True  # cheap enough for the interpreters
    fast: bool = True  # in the default run (the rest in the slow tier)

    @property
    def kernel_shape(self):
        return (*self.window, self.x_shape[-1] // self.kw.get("feature_group_count", 1), self.c_out)

    @property
    def stride(self) -> int:
        s = self.kw.get("strides", 1)
        return s if isinstance(s, int) else s[0]

    def reduction(self) -> int:
        return int(np.prod(self.kernel_shape[:-1]))

    def inputs(self, seed, dtype):
        x = random(seed, self.x_shape, dtype)
        k = random(seed + 1, self.kernel_shape, dtype, scale=0.5)
        b = random(seed + 2, (self.c_out,), dtype, scale=0.5)
        return x, k, b


CASES = [
    Case("audio_T17_C3_k4_s2", (2, 17, 3), (4,), 5, dict(strides=2)),
    Case("audio_T23_k3_d3", (1, 23, 4), (3,), 4, dict(dilation=3), fast=False),
    Case("audio_T9_k5_s3_replicate", (2, 9, 3), (5,), 2, dict(strides=3, padding_mode="replicate"), fast=False),
    Case("audio_T1_k3", (1, 1, 3), (3,), 2, fast=False),
    Case("spec_T11_F7_k3x3_s2x1", (1, 11, 7, 3), (3, 3), 4, dict(strides=(2, 1))),
    Case("spec_T8_F6_k2x3_d1x2_pairs", (2, 8, 6, 2), (2, 3), 3, dict(padding=((0, 2),), dilation=(1, 2)), fast=False),
    Case("spec_T9_F5_groups2_replicate", (1, 9, 5, 4), (3, 3), 4, dict(feature_group_count=2, padding_mode="replicate"),
         fast=False),
    Case("video_T9_6x5_k333", (1, 9, 6, 5, 3), (3, 3, 3), 4, small=False, fast=False),
    Case("video_T17_5x4_k333_s2_replicate", (1, 17, 5, 4, 2), (3, 3, 3), 3,
         dict(strides=(2, 1, 1), padding_mode="replicate"), small=False),
    Case("video_T7_4x4_k311_groups2_valid", (1, 7, 4, 4, 4), (3, 1, 1), 4,
         dict(feature_group_count=2, padding="VALID"), small=False, fast=False),
]


TRANSPOSED = [
    Case("audio_T7_k4_up2", (2, 7, 3), (4,), 5, dict(strides=2)),  # EnCodec/Mimi: k = 2 s
    Case("audio_T5_k5_up3_replicate", (1, 5, 4), (5,), 3, dict(strides=3, padding_mode="replicate"),  # two tap counts
         fast=False),
    Case("audio_T4_k2_up4_groups2", (2, 4, 4), (2,), 4, dict(strides=4, feature_group_count=2), fast=False),  # k < s: empty phases
    Case("spec_T5_F6_k3x3_up2", (1, 5, 6, 2), (3, 3), 3, dict(strides=2, dilation=(1, 2)), fast=False),
    Case("video_T4_4x3_k333_up2", (1, 4, 4, 3, 2), (3, 3, 3), 3, dict(strides=2), small=False, fast=False),
]



def scale(x, k):
    return float(jnp.abs(x.astype(jnp.float32)).max() * jnp.abs(k.astype(jnp.float32)).max())


def bits(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def case_params(cases) -> list:
    """``cases`` as pytest params with readable ids, the ones not ``fast`` in the slow tier."""
    return [pytest.param(c, id=c.name, marks=() if c.fast else (pytest.mark.slow,)) for c in cases]
