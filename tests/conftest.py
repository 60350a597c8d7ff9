"""The suites' fixtures: ``conv``, the masked_conv implementation under test (every one its
registry holds that runs here), ``causal``, causal_conv's, and the hypothesis profiles.
Helpers live in :mod:`support`."""
from __future__ import annotations

import os

import pytest
from hypothesis import settings
from support.causal import IMPLS, impl_params
from support.implementations import BACKENDS, Named, backend_params

# Hypothesis: a few examples per backend in the README's test command, more in the slow
# tier (.ci/run sets HYPOTHESIS_PROFILE=ci). Derandomized: a failure reproduces.
settings.register_profile("default", max_examples=10, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(params=backend_params())
def conv(request):
    return Named(request.param, BACKENDS[request.param])


@pytest.fixture(params=impl_params())
def causal(request):
    return IMPLS[request.param]
