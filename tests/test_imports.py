"""The package's import graph has no circle (lazy imports inside functions included)."""
from __future__ import annotations

import ast
from pathlib import Path

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
    assert f"{PACKAGE}.sharding" not in _imports(f"{PACKAGE}.api", modules[f"{PACKAGE}.api"], modules)
    assert f"{PACKAGE}.api" not in _imports(f"{PACKAGE}.sharding", modules[f"{PACKAGE}.sharding"], modules)
