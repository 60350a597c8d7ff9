"""The leak report and the README's quick start stay true."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import numpy as np

from maskconv_kernels import report

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_leak_report_measures_exactness_and_prints_a_table(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "maskconv_kernels", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=True,
    )
    assert "| gradient leak (seed 1) |" in proc.stdout
    assert "| PixelCNN 7x7 type A" in proc.stdout
    result = json.loads(out.read_text())
    ours = result["exactness"]["masked_conv"]
    assert all(v == 0 for v in ours.values()), ours
    # On every platform, inf in the future poisons the leaky baseline's past outputs.
    assert result["exactness"]["lax.conv(kernel*mask)"]["non-finite outputs, inf in the future"] > 0
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
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^(pip install .*)$", quick_start, re.M)
    assert commands == ['pip install . && python -m maskconv_kernels', test_command]
