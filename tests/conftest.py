"""The suites' fixtures: ``conv``, the masked_conv implementation under test (every one its
registry holds that runs here), ``causal``, causal_conv's, and the hypothesis profiles.
Helpers live in :mod:`support`."""
from __future__ import annotations

import os

import jax
import pytest
from hypothesis import settings

# The mesh checks (tests/parallel) need 8 devices: on CPU the whole session gets them, so
# they run beside the other tests instead of in a child interpreter. A program on one
# device is lowered for one device whatever the process holds (kernel calls are batch-
# partitioned only where a module is lowered for several). Set before anything starts
# jax's backends; a GPU session keeps its devices and runs the mesh checks in a child.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", 8)
from support.causal import IMPLS, impl_params
from support.implementations import BACKENDS, Named, backend_params

# Hypothesis: a few examples per backend in the README's test command, more in the slow
# tier (.ci/run sets HYPOTHESIS_PROFILE=ci). Derandomized: a failure reproduces.
settings.register_profile("default", max_examples=5, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(params=backend_params())
def conv(request):
    return Named(request.param, BACKENDS[request.param])


@pytest.fixture(params=impl_params())
def causal(request):
    return IMPLS[request.param]
