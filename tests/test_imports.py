"""The package's import graph has no circle (lazy imports inside functions included)."""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import maskconv_kernels

ROOT = Path(maskconv_kernels.__file__).parent
PACKAGE = "maskconv_kernels"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import sub" imports the submodule when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    done, stack = set(), []

    def visit(name):
        if name in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(name):] + [name]))
        if name in done:
            return
        stack.append(name)
        for target in sorted(graph[name]):
            visit(target)
        stack.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_api_and_sharding_do_not_import_each_other():
    modules = _modules()
    api, partitioning = f"{PACKAGE}.ops.masked_conv.api", f"{PACKAGE}._core.partitioning"
    assert partitioning not in _imports(api, modules[api], modules)
    assert api not in _imports(partitioning, modules[partitioning], modules)


def test_choosing_a_backend_on_cpu_imports_no_mosaic_gpu_module():
    """implementation=None on CPU asks every GPU backend whether it runs; the Mosaic GPU
    backend answers without importing its kernels or jax's Mosaic GPU (jax 0.10's needs
    absl-py, which a plain install lacks), and the Triton one without triton."""
    code = (
        "import sys, numpy as np, jax.numpy as jnp, maskconv_kernels as mk\n"
        "for dtype in (np.float32, jnp.bfloat16):\n"
        "    mk.masked_conv(np.ones((1, 5, 5, 2), dtype), np.ones((3, 3, 2, 2), dtype), np.ones((3, 3)))\n"
        "prefixes = ('jax.experimental.mosaic', 'maskconv_kernels.mosaic_gpu.kernels', 'triton', 'jax_triton')\n"
        "print(sorted(m for m in sys.modules if m.startswith(prefixes)))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]", out.stdout


def test_old_module_paths_name_the_moved_modules():
    # Every module path of the flat layout still imports, as a module and as an attribute,
    # and is the moved module itself (one object: its functions are the new ones).
    import maskconv_kernels as mk
    from maskconv_kernels._moved import MOVED

    for old, new in MOVED.items():
        module = importlib.import_module(f"maskconv_kernels.{old}")
        assert module is importlib.import_module(f"maskconv_kernels.{new}"), old
        if "." not in old:
            assert getattr(mk, old) is module, old
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        mk.nothing  # noqa: B018


def test_the_documented_names_import():
    import maskconv_kernels as mk

    for name in ("masked_conv", "causal_conv1d", "causal_conv1d_update", "causal_conv", "causal_conv_stream",
                 "pixelcnn_mask", "audit_causal", "assert_causal", "gpu_target"):
        assert callable(getattr(mk, name)), name
    assert callable(mk.spatial.sequence_sharded_causal_conv1d) and callable(mk.spatial.spatially_sharded_masked_conv)
    assert callable(mk.decode.make_decode_spec) and callable(mk.short_conv.causal_conv1d_update)
    from maskconv_kernels.compat.causal_conv1d import causal_conv1d_fn, causal_conv1d_update  # noqa: F401
    from maskconv_kernels.equinox import CausalConv, Conv2d  # noqa: F401
    from maskconv_kernels.flax import MaskedConv, ShortConv  # noqa: F401
    from maskconv_kernels.flax.linen import CausalConv as LinenCausalConv, Conv  # noqa: F401
    from maskconv_kernels.flax.nnx import CausalConv as NnxCausalConv, ShortConv as NnxShortConv  # noqa: F401
