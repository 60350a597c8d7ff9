"""The leak report, the README's quick start and its snippets stay true."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from maskconv_kernels import report

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_leak_report_measures_exactness_and_prints_a_table(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "maskconv_kernels", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=True,
    )
    assert "| gradient leak (seed 1) |" in proc.stdout
    assert "| PixelCNN 7x7 type A" in proc.stdout
    # Progress on stderr: a first line before any measurement, then a line per stage with its time.
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("maskconv-kernels leak report: measuring")
    stages = [line for line in lines if re.match(r"  \S.* \.\.\. \d+\.\d s$", line)]
    assert len(stages) == 2 * len(report.EXACTNESS_CHECKS) + 2 * len(report.TIMING_SHAPES), proc.stderr
    assert re.match(r"done in \d+ s", lines[-1])
    result = json.loads(out.read_text())
    ours = result["exactness"]["masked_conv"]
    assert all(v == 0 for v in ours.values()), ours
    # On every platform, inf in the future poisons the leaky baseline's past outputs.
    assert result["exactness"]["lax.conv(kernel*mask)"]["non-finite outputs, inf in the future"] > 0
    # The model-level rows come from the causality audit: it sees the same poisoning in the stack.
    assert result["exactness"]["lax.conv(kernel*mask)"]["6-layer stack pixels changed by NaN in the future (audit)"] > 0
    assert all(np.isfinite(v).all() for row in result["timings"] for k, v in row.items() if k != "shape")


def test_gradient_leak_detects_a_leak():
    # The measurement itself can fail: a conv that reads the masked row leaks.
    unmasked = lambda x, k, m, **kw: report.leaky_masked_conv(x, k, np.ones_like(m), **kw)
    assert report.gradient_leak(unmasked, channels=4) > 0
    assert report.nan_isolation(unmasked, channels=4) > 0


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = re.search(r"TEST_COMMAND='(.*)'", ci).group(1)
    report_command = re.search(r"REPORT_COMMAND='(.*)'", ci).group(1)
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^(pip install .*)$", quick_start, re.M)
    assert commands == [report_command, test_command]
    assert report_command == "pip install . && python -m maskconv_kernels"


def test_json_path_is_checked_before_measuring(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "maskconv_kernels", "--json", str(tmp_path / "missing" / "report.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "--json: can't open" in proc.stderr
    assert "exactness" not in proc.stderr  # nothing was measured


def test_help_says_what_is_measured_and_how_long():
    proc = subprocess.run([sys.executable, "-m", "maskconv_kernels", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "``" not in proc.stdout  # plain text, not reST
    for words in ("gradient", "non-finite", "6-layer", "median milliseconds", "on a 2-core CPU", "--quick"):
        assert words in proc.stdout, words


def _readme_snippets():
    """Every ```python block of the README, unless an HTML comment just above says it is not run."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.finditer(r"(<!--[^\n]*-->\n)?```python\n(.*?)```", readme, re.S)
    return [(readme[: m.start()].count("\n") + 1, m.group(2)) for m in blocks if not m.group(1)]


@pytest.mark.slow
@pytest.mark.parametrize("line, code", _readme_snippets(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_readme_snippet_runs_as_written(line, code, tmp_path):
    # Each block on its own, in a fresh interpreter with 8 CPU devices (the mesh examples).
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"README.md line {line}:\n{code}\n{proc.stderr[-3000:]}"


def test_readme_has_snippets_to_run():
    assert len(_readme_snippets()) >= 4
