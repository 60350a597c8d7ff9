"""The optional modules say which extra installs what they need.

Each case runs in a fresh interpreter with the package blocked (``sys.modules[name] =
None``, which makes its import fail as a missing package's does), so this suite's own
imports of flax and equinox are untouched.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys
results = {}
for blocked, module in [("flax", "maskconv_kernels.flax"), ("flax", "maskconv_kernels.flax.nnx"),
                        ("equinox", "maskconv_kernels.equinox"), ("flax.linen", "maskconv_kernels.flax")]:
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith(("maskconv_kernels.flax",
                                                                                          "maskconv_kernels.equinox"))}
    sys.modules[blocked] = None
    try:
        __import__(module)
        results[f"{blocked}:{module}"] = "imported"
    except ImportError as e:
        results[f"{blocked}:{module}"] = f"{type(e).__name__}: {e}"
    finally:
        del sys.modules[blocked]
import maskconv_kernels
results["core"] = maskconv_kernels.__file__
print(json.dumps(results))
"""


def test_missing_flax_and_equinox_name_their_extras():
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    flax_message = ("ImportError: maskconv_kernels.flax needs flax, which is not installed: "
                    "pip install 'maskconv-kernels[flax]' (or pip install flax)")
    assert results["flax:maskconv_kernels.flax"] == flax_message
    assert results["flax:maskconv_kernels.flax.nnx"] == flax_message
    assert results["equinox:maskconv_kernels.equinox"] == (
        "ImportError: maskconv_kernels.equinox needs equinox, which is not installed: "
        "pip install 'maskconv-kernels[equinox]' (or pip install equinox)")
    # flax present but broken inside: its own error, not the advice to install it.
    assert results["flax.linen:maskconv_kernels.flax"].startswith("ModuleNotFoundError: import of flax.linen halted")
    assert results["core"].startswith(str(ROOT))  # the checkout under test, not another install
