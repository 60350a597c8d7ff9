"""One suite for every backend: tests take the ``conv`` fixture, the function under test.

Each entry of ``BACKENDS`` has the signature of :func:`maskconv_kernels.masked_conv`
(without ``implementation``), one per backend of the registry
(:mod:`maskconv_kernels.backends`) that can run here; slow ones (interpreters) are in
``SLOW_BACKENDS`` so that heavy cases can skip them with a reason.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings

import maskconv_kernels as mk
from maskconv_kernels import backends
from maskconv_kernels.hardware import gpu_target
from maskconv_kernels.spec import make_spec
from maskconv_kernels.xla import XlaConfig

ON_GPU = jax.default_backend() == "gpu"
PLATFORM = backends.lowering_platform()

# Hypothesis: a few examples per backend in the README's test command, more in the slow
# tier (.ci/run sets HYPOTHESIS_PROFILE=ci). Derandomized: a failure reproduces.
settings.register_profile("default", max_examples=10, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@dataclasses.dataclass(frozen=True)
class Backend:
    """How the suite calls one backend: ``masked_conv``'s signature, without ``implementation``."""

    implementation: str
    interpret: bool = False
    config: object = None  # the backend's config, e.g. XlaConfig("matmul")
    dtype: np.dtype = np.dtype("float32")  # what the shared suites run it in (suite_dtype)

    def unsupported(self, x, kernel, mask, **kw) -> str | None:
        spec = make_spec(x, kernel, mask, **kw)
        return backends.get(self.implementation).unsupported(spec, PLATFORM, self.interpret)

    def __call__(self, x, kernel, mask, **kw):
        if ON_GPU and kw.get("precision") is None:
            # Float32 dots on GPUs default to TF32 (10-bit mantissa), which the float32
            # TOLERANCE does not cover: the suite asks for IEEE products. TF32 is what
            # the benchmarks time.
            kw["precision"] = "highest"
        reason = self.unsupported(x, kernel, mask, **kw)
        if reason is not None:
            # Explicit implementation= raising NotImplementedError for these is tested in
            # the backend's own tests; here the shared cases would only repeat that.
            pytest.skip(f'implementation="{self.implementation}" does not support this case: {reason}')
        return mk.masked_conv(
            x, kernel, mask, implementation=self.implementation, interpret=self.interpret, config=self.config, **kw
        )


def suite_dtype(record, interpret: bool = not ON_GPU) -> np.dtype | None:
    """The dtype the shared suites run a backend in: float32 where it takes it, else
    bfloat16 (the Mosaic GPU kernels: wgmma's float32 mode is TF32 on K-major operands);
    ``None`` where it runs neither here. Tests draw their inputs in ``conv.dtype`` and
    bound errors by its TOLERANCE."""
    for dtype in (np.dtype("float32"), np.dtype(jnp.bfloat16)):
        probe = make_spec(np.zeros((1, 4, 4, 2), dtype), np.zeros((3, 3, 2, 2), dtype), np.ones((3, 3)))
        if record.unsupported(probe, PLATFORM, interpret) is None:
            return dtype
    return None


def _backends() -> dict[str, Backend]:
    """Every registered backend that can run here: kernel backends compiled on GPUs, in
    their interpreters elsewhere (what CI checks on CPU); one whose package is missing
    here (triton without the extra), or that needs a newer jax (pallas_mosaic_gpu on jax
    0.10), is left out, and its own tests say so."""
    found = {
        "xla": Backend("xla"),  # per map, what this platform runs (on CPU: fwd "conv", dx and dw "gemm")
        "xla_conv": Backend("xla", config=XlaConfig("conv")),  # per-box convolutions and their transposes
        "xla_gemm": Backend("xla", config=XlaConfig("gemm")),  # blocked im2col GEMMs, every map
        "xla_conv_blocks": Backend("xla", config=XlaConfig("conv_blocks")),  # blocked convolutions per box
        "xla_matmul": Backend("xla", config=XlaConfig("matmul")),  # what GPUs run, on CPU
    }
    for name, record in backends.BACKENDS.items():
        if "kernel_problem" not in record.traits:
            continue
        dtype = suite_dtype(record)
        if dtype is None:
            continue
        found[name if ON_GPU else f"{name}_interpret"] = Backend(name, interpret=not ON_GPU, dtype=dtype)
    return found


BACKENDS = _backends()
# Backends too slow for large or many cases (interpret mode).
SLOW_BACKENDS: set[str] = {name for name, b in BACKENDS.items() if b.interpret}
# The backends whose shared suites run in the slow tier (.ci/run runs it after the
# README's command): the interpreted kernels (test_agreement.py's smoke test keeps one
# case of each in the README's command), and the xla strategies no platform's default
# runs at the suites' sizes ("conv" is what "xla" runs on CPU below 128 x 128 channels;
# "conv_blocks" is only chosen by hand, and test_xla.py's block tests keep it in the
# README's command).
SLOW_TIER_BACKENDS: set[str] = SLOW_BACKENDS | ({"xla_conv", "xla_conv_blocks"} & set(BACKENDS))


def backend_params() -> list:
    """Every backend's name, marked slow where :data:`SLOW_TIER_BACKENDS` says (and
    ``interpreted`` where it runs in an interpreter)."""

    def marks(name):
        return [pytest.mark.slow, *([pytest.mark.interpreted] if name in SLOW_BACKENDS else [])]

    return [pytest.param(n, marks=marks(n)) if n in SLOW_TIER_BACKENDS else n for n in sorted(BACKENDS)]


@pytest.fixture(params=backend_params())
def conv(request):
    return _Named(request.param, BACKENDS[request.param])


class _Named:
    """The function under test, with its backend's name for skips and ids."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn
        self.slow = name in SLOW_BACKENDS
        self.dtype = fn.dtype

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


# Error bound per unit of sqrt(reduction length) * max|x| * max|kernel|. The reference
# is float64 on the same (rounded) inputs, so what remains is the accumulation in
# float32 (a few ulps, 2^-23 each) and, for 16-bit outputs, the final rounding of the
# output (half an ulp: 2^-9 for bfloat16, 2^-11 for float16), doubled for margin.
# TF32 products (GPU default precision) would need 2^-10; CPU dots are IEEE.
TOLERANCE = {
    np.dtype("float64"): 2.0**-49,  # jax_enable_x64, xla backend: float64 throughout, the same few ulps (2^-52 each)
    np.dtype("float32"): 2.0**-20,
    np.dtype(jax.numpy.bfloat16): 2.0**-7,
    np.dtype("float16"): 2.0**-9,
}

DTYPES = [np.dtype("float32"), np.dtype(jax.numpy.bfloat16), np.dtype("float16")]


def random(key, shape, dtype=np.float32, scale=1.0):
    """Standard normal values, drawn in float32 by NumPy and cast (never zeros).

    NumPy, not jax.random, which compiles once per shape: a second or more per case.
    """
    values = np.random.default_rng(key).standard_normal(shape).astype(np.float32) * np.float32(scale)
    return jnp.asarray(values.astype(dtype))  # cast by NumPy (ml_dtypes): no convert to compile either


def assert_close(actual, expected, dtype, reduction: int, scale: float):
    """``|actual - expected| <= TOLERANCE[dtype] * sqrt(reduction) * scale`` everywhere, no NaN."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.isfinite(actual).all(), "non-finite values in the result"
    bound = TOLERANCE[np.dtype(dtype)] * np.sqrt(max(reduction, 1)) * scale
    err = np.abs(actual - expected).max(initial=0.0)
    assert err <= bound, f"max error {err:.3g} exceeds {bound:.3g} (reduction {reduction}, scale {scale:.3g})"


def second_order(conv, x, k, mask):
    """``d/dk sum(tanh(d/dx sum(conv(x, k)^2)))``: reverse over reverse through ``conv``."""
    inner = lambda k: jax.grad(lambda x: (conv(x, k, mask) ** 2).sum())(x)
    return jax.grad(lambda k: jnp.tanh(inner(k)).sum())(k)


def assert_second_order_close(actual, x, k, mask, dtype=np.float32, **conv_args):
    """``actual`` against :func:`second_order` of the leaky baseline in float64.

    Bound: the roundings (in ``dtype``) of three chained sums (the output over active taps x
    C_in, the input gradient over active taps x C_out, the kernel gradient over pixels)
    add up, each relative to the sum of |terms|. That sum is bounded by the same
    computation on |x|, |k| with tanh' (at most 1) replaced by 1: every product then
    adds with the sign it has in absolute value.
    """
    bits = np.asarray(mask, bool)
    leaky = lambda x, k, m: mk.leaky_masked_conv(x, k, m, precision="highest", **conv_args)
    with jax.enable_x64(True):
        x64, k64 = jnp.asarray(x, jnp.float64), jnp.asarray(k, jnp.float64)
        expected = second_order(leaky, x64, k64, mask)
        inner = lambda k: jax.grad(lambda x: (leaky(x, k, mask) ** 2).sum())(jnp.abs(x64))
        magnitude = jax.grad(lambda k: inner(k).sum())(jnp.abs(k64))
        expected, magnitude = np.asarray(expected), np.asarray(magnitude)
    taps = int(bits.sum()) if bits.ndim == k.ndim - 2 else int(bits.any(axis=(-2, -1)).sum())
    pixels = int(np.prod(x.shape[:-1]))
    reduction = taps * k.shape[-2] + taps * k.shape[-1] + pixels
    assert_close(actual, expected, dtype, reduction, float(magnitude.max()))


@contextlib.contextmanager
def cuda_lowering():
    """Lowering for an NVIDIA GPU on a machine without one (:func:`hardware.gpu_target`).

    The Pallas Triton backend's deprecation warning (jax >= 0.11) is the package's to
    filter, while it lowers; here it is an error, so none escapes.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)
        with gpu_target():
            yield


# Mesh checks (test_sharding.py, test_context_parallel.py) need 8 devices, and XLA fixes
# the number of CPU devices when jax starts, before a test module is imported. So in an
# ordinary run each such file has a test that runs the file again in a fresh interpreter
# with XLA_FLAGS=--xla_force_host_platform_device_count=8 (run_on_forced_cpu_devices);
# the checks themselves are marked to run only where 8 devices exist (that child, or a
# CI job that sets the flag for the whole run).
N_DEVICES = 8
HAS_MESH = jax.default_backend() == "cpu" and jax.device_count() >= N_DEVICES
needs_mesh = pytest.mark.skipif(
    not HAS_MESH, reason=f"needs {N_DEVICES} CPU devices: run in a subprocess by test_on_8_forced_cpu_devices"
)
has_mesh_already = pytest.mark.skipif(HAS_MESH, reason=f"this process has {N_DEVICES} devices: the checks run here directly")


def run_on_forced_cpu_devices(test_file: str) -> None:
    """Runs ``test_file`` with pytest in a fresh interpreter on 8 CPU devices; fails with its output if a check fails."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={N_DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-rs"],
        env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"checks failed on {N_DEVICES} CPU devices:\n{proc.stdout}\n{proc.stderr}"
    # The child must have run the checks, not skipped them (it skips only the test that started it).
    skipped = re.findall(r"(\d+) skipped", proc.stdout)
    assert skipped == ["1"], proc.stdout


def with_ttir_passes(backend=None, stages=None, options=None, language=None, capability=None):
    """A stages hook: the TTGIR stage first runs the TTIR stage's passes (a .ttir file skips them).

    Called without arguments, Triton asks for the hook's part of the cache key.
    """
    if backend is None:
        return "-ttir-passes-first", "ttir-passes-first"
    to_ttgir = stages["ttgir"]
    stages["ttgir"] = lambda src, metadata: to_ttgir(backend.make_ttir(src, metadata, options, capability), metadata)
