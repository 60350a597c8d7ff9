"""The backend is chosen when a function is lowered, per platform: ahead-of-time export from any host.

On a CPU-only host: a GPU backend named explicitly exports for cuda with its kernels in
the artifact; ``implementation=None`` exported for ``("cpu", "cuda")`` is one artifact
that runs on CPU (the ``xla`` path) and whose cuda branch holds the GPU kernels; a GPU
backend lowered for CPU says what to do instead.
"""
from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lowering import cuda_lowering
from support.numerics import assert_close, random
from jax import export

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import backends, implementation_for
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference
from maskconv_kernels.ops.masked_conv.spec import make_spec

MASK = mk.pixelcnn_mask((3, 3), "B")
PALLAS_KERNELS = ("maskconv_fwd", "maskconv_bwd_input", "maskconv_bwd_weight")
# XLA's Triton custom call: its target has no compatibility guarantee across jax versions,
# so jax.export asks for the check to be lifted by name (an artifact is for one jax).
TRITON_CALL = "__gpu$xla.gpu.triton"


def _export(f, platforms, *args):
    with cuda_lowering():
        return export.export(
            jax.jit(f), platforms=platforms,
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
        )(*args)


def _value_and_grad(implementation, **kw):
    loss = lambda x, k: mk.masked_conv(x, k, MASK, implementation=implementation, **kw).astype(jnp.float32).sum()
    return jax.value_and_grad(loss, argnums=(0, 1))


def _xk(dtype=jnp.float32):
    return random(0, (2, 8, 9, 16), dtype), random(1, (3, 3, 16, 16), dtype, scale=0.1)


def test_pallas_triton_exports_for_cuda_from_any_host_with_its_three_kernels():
    x, k = _xk(jnp.bfloat16)
    text = _export(_value_and_grad("pallas_triton"), ("cuda",), x, k).mlir_module()
    assert len(re.findall(re.escape(f"@{TRITON_CALL}("), text)) == 3
    for name in PALLAS_KERNELS:
        assert f'name = "{name}"' in text, name
    assert "stablehlo.convolution" not in text


def test_triton_exports_for_cuda_where_jax_triton_imports_and_says_why_not_elsewhere():
    x, k = _xk()
    spec = make_spec(x, k, MASK)
    reason = backends.get("triton").unsupported(spec, "cuda")
    if reason is None:
        text = _export(_value_and_grad("triton"), ("cuda",), x, k).mlir_module()
        assert text.count("triton_kernel_call") >= 3
        assert "stablehlo.convolution" not in text
        return
    assert "jax-triton" in reason
    if importlib.util.find_spec("triton") is None:
        # Without the triton extra the call itself is refused, naming the extra.
        expected = r'implementation="triton"\) does not support this problem: the triton package is not installed'
    else:
        # jax-triton needs a jaxlib with CUDA support on the host that lowers.
        expected = r'implementation="triton"\) cannot be lowered for platform "cuda"'
    with pytest.raises(NotImplementedError, match=expected):
        _export(_value_and_grad("triton"), ("cuda",), x, k)


def test_one_artifact_for_cpu_and_cuda_runs_on_cpu_and_holds_the_kernels_for_cuda():
    x, k = _xk()
    exported = _export(_value_and_grad(None), ("cpu", "cuda"), x, k)
    text = exported.mlir_module()
    assert exported.platforms == ("cpu", "cuda")
    # The cuda branch: the Pallas kernels; the cpu branch: xla's convolutions over blocks
    # of pixels (forward, input gradient) and GEMMs (weight gradient).
    for name in PALLAS_KERNELS:
        assert f'name = "{name}"' in text, name
    assert "stablehlo.convolution" in text and "stablehlo.dot_general" in text
    assert "stablehlo.case" in text
    if jax.default_backend() == "cpu":
        value, (dx, dk) = exported.call(x, k)
        _, (rdx, rdk) = _value_and_grad("xla")(x, k)
        # The loss sums every output: a float32 sum of all active products, against float64.
        y64 = masked_conv_reference(x, k, MASK)
        assert_close(value, y64.sum(), np.float32, y64.size * int(MASK.sum()) * 16, float(jnp.abs(x).max() * jnp.abs(k).max()))
        assert_close(dx, rdx, np.float32, 8 * 16, float(jnp.abs(k).max()))
        assert_close(dk, rdk, np.float32, 2 * 8 * 9, float(jnp.abs(x).max()))


def test_a_gpu_backend_lowered_for_cpu_names_the_platform_and_the_interpret_hint():
    x, k = _xk()
    f = jax.jit(_value_and_grad("pallas_triton"))
    with pytest.raises(NotImplementedError, match=r'"pallas_triton"\) cannot be lowered for platform "cpu".*interpret=True'):
        f.trace(x, k).lower(lowering_platforms=("cpu",))
    # interpret=True lowers for every platform: the same kernels, interpreted.
    text = jax.jit(_value_and_grad("pallas_triton", interpret=True)).trace(x, k).lower(
        lowering_platforms=("cpu",)).as_text()
    assert "stablehlo.convolution" not in text


def test_implementation_for_names_the_choice_per_platform():
    x, k = _xk()
    spec = make_spec(x, k, MASK)
    assert implementation_for(spec, "cpu") == "xla"
    assert implementation_for(spec, "cuda") == "pallas_triton"
    assert implementation_for(spec, "tpu") == "pallas_mosaic_tpu"
