"""The suites' fixtures: ``conv``, the masked_conv implementation under test (every one its
registry holds that runs here), ``causal``, causal_conv's, and the hypothesis profiles.
Helpers live in :mod:`support`."""
from __future__ import annotations

import importlib.util
import os
import zlib

# The suites compile a few thousand small programs, most of their time on XLA:CPU: at LLVM's
# -O0 (XLA's default is -O3) they compile about 20% faster (docs/development.md, Measured
# test times). Only in xdist's workers (the README's test command, .ci/run) on a host
# without a GPU plugin: a run without -n keeps XLA's default, as test_speed.py's timed
# check needs, and so do the README's first command (the leak report) and the benchmarks.
# Set before jax reads XLA_FLAGS (when its first backend starts).
if ("PYTEST_XDIST_WORKER" in os.environ and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
        and not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402
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
from support.implementations import BACKENDS, backend_params

# Hypothesis: a few examples per backend in the README's test command, more in the slow
# tier (.ci/run sets HYPOTHESIS_PROFILE=ci). Derandomized: a failure reproduces.
settings.register_profile("default", max_examples=3, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(params=backend_params())
def conv(request):
    return BACKENDS[request.param]


@pytest.fixture(params=impl_params())
def causal(request):
    return IMPLS[request.param]


def pytest_collection_modifyitems(config, items):
    """``MASKCONV_SLOW_SHARD=k/n``: of the slow tier, only the tests whose node id hashes to
    ``k`` modulo ``n`` (crc32: the same split in every process and every xdist worker);
    ``MASKCONV_SHARD=k/n``: the same for every test selected.

    .ci/run cannot run the whole slow tier on two cores within its budget; it runs one
    quarter, chosen by the commit count, so consecutive commits cover all of it and a
    failure reproduces with the shard it prints. ``python -m pytest -m slow`` runs it all.
    A TPU machine runs the fast tier in one process, in parts under its 10 minutes a
    command: ``MASKCONV_SHARD`` splits it (``benchmarks/tpu_check.sh``, ``PYTEST_SHARD``).
    """
    for variable, slow_only in (("MASKCONV_SLOW_SHARD", True), ("MASKCONV_SHARD", False)):
        shard = os.environ.get(variable)
        if not shard:
            continue
        k, n = (int(part) for part in shard.split("/"))
        dropped = [item for item in items if (item.get_closest_marker("slow") or not slow_only)
                   and zlib.crc32(item.nodeid.encode()) % n != k]
        if dropped:
            ids = {id(item) for item in dropped}
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if id(item) not in ids]
