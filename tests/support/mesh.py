"""The mesh checks' 8 CPU devices."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import jax
import pytest

__all__ = ["N_DEVICES", "HAS_MESH", "needs_mesh", "has_mesh_already", "run_on_forced_cpu_devices"]


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
    # setup.cfg's addopts name xdist's --dist; without xdist (the TPU machine) they are
    # replaced by their marker expression, which the child keeps.
    plain = [] if importlib.util.find_spec("xdist") else ["-o", 'addopts=-m "not slow"']
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-rs", *plain],
        env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"checks failed on {N_DEVICES} CPU devices:\n{proc.stdout}\n{proc.stderr}"
    # The child must have run the checks, not skipped them (it skips only the test that started it).
    skipped = re.findall(r"(\d+) skipped", proc.stdout)
    assert skipped == ["1"], proc.stdout
