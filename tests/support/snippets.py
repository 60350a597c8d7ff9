"""The ```python blocks of a markdown file (the README, the docs pages), run as a reader would.

A block preceded by an HTML comment line (``<!-- snippet not run by the tests: REASON -->``)
is skipped by :func:`python_blocks`; every other block must run as written, on its own.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

__all__ = ["python_blocks", "run_block"]

_BLOCK = re.compile(r"(<!--[^\n]*-->\n)?```python\n(.*?)```", re.S)


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, code)`` for every ```python block of ``path`` unless an HTML comment just above says it is not run."""
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(2)) for m in _BLOCK.finditer(text) if not m.group(1)]


def run_block(code: str, cwd: pathlib.Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter on CPU with 8 forced devices (the mesh examples need them)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
