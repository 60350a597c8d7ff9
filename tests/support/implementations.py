"""``masked_conv``'s implementations as its shared suites call them (:mod:`support.harness`).

Each entry of ``BACKENDS`` has the signature of :func:`maskconv_kernels.masked_conv`
(without ``implementation``): every kernel backend of its registry that runs here, and
``"xla"`` under each of its strategies; slow ones (interpreters) are in ``SLOW_BACKENDS``
so that heavy cases can skip them with a reason.
"""
from __future__ import annotations

import numpy as np
from support import harness
from support.harness import Implementation, Op

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import backends, xla
from maskconv_kernels.ops.masked_conv.spec import make_spec

__all__ = ["MASKED_CONV", "suite_dtype", "BACKENDS", "MISSING", "SLOW_BACKENDS", "SLOW_TIER_BACKENDS", "backend_params"]


def _probe(dtype):
    return make_spec(np.zeros((1, 4, 4, 2), dtype), np.zeros((3, 3, 2, 2), dtype), np.ones((3, 3)))


MASKED_CONV = Op(mk.masked_conv, backends.REGISTRY, make_spec, _probe)


def suite_dtype(record, interpret: bool = not harness.ON_GPU) -> np.dtype | None:
    """:func:`support.harness.suite_dtype` for one of ``masked_conv``'s records."""
    return harness.suite_dtype(MASKED_CONV, record, interpret)


_STRATEGIES = [
    # Per map, what this platform runs is "xla" (on CPU: fwd "conv", dx and dw "gemm").
    Implementation(MASKED_CONV, "xla_conv", "xla", config=xla.Config("conv")),  # per-box convolutions and transposes
    Implementation(MASKED_CONV, "xla_gemm", "xla", config=xla.Config("gemm")),  # blocked im2col GEMMs, every map
    Implementation(MASKED_CONV, "xla_conv_blocks", "xla", config=xla.Config("conv_blocks")),  # blocked convolutions
    Implementation(MASKED_CONV, "xla_matmul", "xla", config=xla.Config("matmul")),  # what GPUs run, on CPU
]
BACKENDS, MISSING = harness.implementations(MASKED_CONV, _STRATEGIES)
# Backends too slow for large or many cases (interpret mode).
SLOW_BACKENDS: set[str] = {name for name, b in BACKENDS.items() if b.slow}
# The backends whose shared suites run in the slow tier (.ci/run runs it after the
# README's command): the interpreted kernels, and the xla strategies this platform's
# default does not run at the suites' sizes ("xla" on CPU runs "conv" below 128 x 128
# channels; "gemm" and "conv_blocks" are chosen by hand or for large channel counts;
# "matmul" is what GPUs run, so on a GPU the "xla" entry runs it in the fast tier).
# test_agreement.py's smoke test keeps one case of each in the README's command, and
# test_xla.py's block tests keep "gemm" and "conv_blocks" there.
SLOW_TIER_BACKENDS: set[str] = SLOW_BACKENDS | {s.name for s in _STRATEGIES}


def backend_params() -> list:
    """Every backend's test id (:func:`support.harness.params`), the strategies and interpreters slow."""
    return harness.params(BACKENDS, slow=lambda b: b.name in SLOW_TIER_BACKENDS)
