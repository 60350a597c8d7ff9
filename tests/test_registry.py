"""The implementations tables: a preference per lowering platform, the platforms each record
lowers for (checked once, for every backend), one resolution of ``implementation``,
``interpret`` and ``config`` for every op, and the TPU facts the kernels size against."""
from __future__ import annotations

import numpy as np
import pytest

from maskconv_kernels._core import hardware
from maskconv_kernels.ops.causal_conv import backends as causal_conv
from maskconv_kernels.ops.causal_conv1d import backends as causal_conv1d
from maskconv_kernels.ops.causal_conv1d.checks import make_problem as short_conv_problem
from maskconv_kernels.ops.masked_conv import backends as masked_conv
from maskconv_kernels.ops.masked_conv import implementation_for
from maskconv_kernels.ops.masked_conv.spec import make_spec

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
REGISTRIES = {"masked_conv": masked_conv.REGISTRY, "causal_conv": causal_conv.REGISTRY,
              "causal_conv1d": causal_conv1d.REGISTRY}


def _conv_spec():
    return make_spec(np.zeros((1, 6, 6, 4), np.float32), np.zeros((3, 3, 4, 4), np.float32), np.ones((3, 3)))


def _short_conv_problem():
    x, w = np.zeros((1, 8, 4), np.float32), np.zeros((3, 4), np.float32)
    return short_conv_problem(x, w)[0]


def _problem(name):
    return _short_conv_problem() if name == "causal_conv1d" else _conv_spec()


@pytest.mark.parametrize("name", sorted(REGISTRIES))
def test_each_platform_prefers_only_what_lowers_for_it_and_ends_with_xla(name):
    registry = REGISTRIES[name]
    assert set(registry.preference) == set(PLATFORMS)
    for platform in PLATFORMS:
        names = registry.preference_for(platform)
        assert names[-1] == "xla", (platform, names)
        assert all(registry.by_name[n].lowers_for(platform) for n in names), (platform, names)
    # jax's "gpu" is cuda; a platform no table names (a plugin's) runs what lowers everywhere.
    assert registry.preference_for("gpu") == registry.preference_for("cuda")
    assert registry.preference_for("METAL") == ("xla",)


@pytest.mark.parametrize("name", sorted(REGISTRIES))
@pytest.mark.parametrize("platform", PLATFORMS)
def test_interpret_never_brings_another_platforms_kernels(name, platform):
    registry = REGISTRIES[name]
    chosen = registry.choose(_problem(name), platform, interpret=True)
    assert chosen.name in registry.preference_for(platform)
    assert chosen.lowers_for(platform)


def test_implementation_for_on_a_tpu_is_never_a_gpu_kernel():
    spec = _conv_spec()
    assert implementation_for(spec, "tpu", interpret=True) == "pallas_mosaic_tpu"
    assert implementation_for(spec, "cuda", interpret=True) == "pallas_triton"
    assert implementation_for(spec, "cpu", interpret=True) == "xla"


@pytest.mark.parametrize("name", ["pallas_triton", "triton", "pallas_mosaic_gpu"])
def test_a_gpu_record_refuses_other_platforms_once_for_every_backend(name):
    record = masked_conv.REGISTRY.get(name)
    spec = make_spec(np.zeros((1, 6, 6, 16), np.float16), np.zeros((3, 3, 16, 16), np.float16), np.ones((3, 3)))
    for platform in ("cpu", "rocm", "tpu"):
        reason = record.unsupported(spec, platform)
        assert reason.startswith(f'platform "{platform}": its kernels lower for NVIDIA GPUs (cuda) only'), reason
        assert "interpret=True" in reason
    assert record.lowers_for("gpu") and record.lowers_for("cuda") and not record.lowers_for("tpu")


def test_resolve_checks_once_in_the_callers_words():
    registry, spec = masked_conv.REGISTRY, _conv_spec()
    with pytest.raises(TypeError, match="^causal_conv: interpret must be True or False, got 1$"):
        registry.resolve(spec, None, 1, None, op="causal_conv")
    with pytest.raises(ValueError, match="^masked_conv: config= is the config of one implementation"):
        registry.resolve(spec, None, False, object())
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        registry.resolve(spec, "winograd", False, None)
    assert registry.resolve(spec, None, True, None) == (None, True)  # kernels run interpreted where preferred
    with pytest.warns(UserWarning, match="interpret=True has no effect"):
        record, interpret = registry.resolve(spec, "xla", True, None)
    assert (record.name, interpret) == ("xla", False)


def test_the_tpu_target_is_the_v5e_without_a_chip():
    info = hardware.tpu_info()
    assert hardware.TPU_CHIP == "v5e"
    assert info.generation == 5
    assert info.vmem_capacity_bytes == 128 * 2**20
    assert (info.mxu_column_size, info.num_mxus) == (128, 4)
    assert info.bf16_ops_per_second == 197e12
