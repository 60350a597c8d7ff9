"""The registry of backends and the public config path: ``masked_conv(..., config=...)``."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from support.implementations import BACKENDS
from support.numerics import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import backends, pallas_triton, xla
from maskconv_kernels.ops.masked_conv import triton as mk_triton
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference
from maskconv_kernels.ops.masked_conv.spec import make_spec
from maskconv_kernels.ops.masked_conv.triton.config import Launch

MASK = mk.pixelcnn_mask((3, 3), "B")


def _assert_matches_reference(y, x, k, precision=None):
    """Against the float64 reference under the suite's float32 bound (taps x C_in sums) at ``y``'s precision."""
    scale = float(np.abs(x).max() * np.abs(k).max())
    assert_close(y, masked_conv_reference(x, k, MASK), np.float32, int(MASK.sum()) * x.shape[-1], scale, precision)


def test_every_record_names_its_lowering_module_and_frozen_config():
    assert set(backends.IMPLEMENTATIONS) == {"xla", "pallas_triton", "triton", "pallas_mosaic_gpu", "pallas_mosaic_tpu"}
    for platform in ("cpu", "cuda", "rocm", "tpu"):
        assert backends.PREFERENCE[platform][-1] == "xla", platform  # supports everything: the fallback
    for record in backends.BACKENDS.values():
        cls = record.config_class()
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, record.name
        assert record.spmd in (backends.NATIVE, backends.BATCH)


def test_the_shared_suite_runs_every_backend_the_registry_has_here():
    ran = {b.implementation for b in BACKENDS.values()}
    assert "xla" in ran and "pallas_triton" in ran


@pytest.mark.parametrize(
    "implementation, config, expected",
    [("xla", pallas_triton.Config(), "xla.conv.Config"), ("pallas_triton", xla.Config(), "pallas_triton.config.Config"),
     ("triton", pallas_triton.Config(), "triton.config.Config")],
)
def test_a_config_of_another_backend_is_refused_naming_the_right_type(implementation, config, expected):
    x, k = random(0, (1, 4, 4, 2)), random(1, (3, 3, 2, 2))
    with pytest.raises(TypeError, match=rf'masked_conv\(implementation="{implementation}"\) takes config=\S*{expected}'):
        mk.masked_conv(x, k, MASK, implementation=implementation, interpret=True, config=config)


def test_configs_are_validated_when_built():
    with pytest.raises(ValueError, match="strategy"):
        xla.Config("winograd")
    with pytest.raises(TypeError, match="Config.fwd must be a Launch"):
        mk_triton.Config(fwd=(64, 64, 32))


def test_xla_strategies_agree():
    x, k = random(0, (2, 6, 7, 3)), random(1, (3, 3, 3, 4))
    conv = lambda s: mk.masked_conv(x, k, MASK, implementation="xla", config=xla.Config(s), precision="highest")
    for strategy in ("conv", "matmul"):
        _assert_matches_reference(conv(strategy), x, k, "highest")


def test_a_pallas_tile_config_reaches_the_kernels():
    x, k = random(0, (1, 5, 6, 20)), random(1, (3, 3, 20, 20))
    f = lambda blocks: jax.jit(
        lambda x, k: mk.masked_conv(x, k, MASK, implementation="pallas_triton", interpret=True, config=blocks)
    )
    small = pallas_triton.Config(16, 16, 16, 16)
    default = pallas_triton.Config.get_default(make_spec(x, k, MASK), x.dtype)
    assert small != default
    assert f(small).lower(x, k).as_text() != f(default).lower(x, k).as_text()
    for blocks in (small, default):
        _assert_matches_reference(f(blocks)(x, k), x, k)


@pytest.mark.skipif("triton_interpret" not in BACKENDS, reason="needs the triton package (pip install '.[triton]')")
def test_a_triton_config_reaches_its_kernel(monkeypatch):
    from maskconv_kernels.ops.masked_conv.triton import ops

    launched = []
    kernel_args = ops.kernel_args
    monkeypatch.setattr(ops, "kernel_args", lambda p, kind, c: launched.append((kind, c)) or kernel_args(p, kind, c))
    x, k = random(0, (1, 5, 6, 20)), random(1, (3, 3, 20, 20))
    conv = lambda c: mk.masked_conv(x, k, MASK, implementation="triton", interpret=True, config=c)
    mine = Launch(16, 16, 16, num_warps=2)
    y = conv(mk_triton.Config(fwd=mine))
    assert ("fwd", mine) in launched
    _assert_matches_reference(y, x, k)
    _assert_matches_reference(conv(None), x, k)
