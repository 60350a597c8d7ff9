"""The documentation site stays true: every page reachable, every link resolving, every
```python block running as written, and the site building without a warning."""
from __future__ import annotations

import collections
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from support.snippets import python_blocks, run_block

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)

_FENCE = re.compile(r"^(```+|~~~+)(.*?)$.*?^\1\s*$", re.S | re.M)
_TOCTREE = re.compile(r"^```\{toctree\}[^\n]*\n(.*?)^```\s*$", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_ROLE_PATH = re.compile(r"\{download\}`[^`<]*<([^>]+)>`")
_INCLUDE = re.compile(r"^```\{include\}\s+(\S+)", re.M)
_HEADING = re.compile(r"^(#{1,3})\s+(.*?)\s*#*\s*$", re.M)


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(DOCS))


def _prose(text: str) -> str:
    """The page without its fenced blocks (code, directives), where a link is a link."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _slug(title: str) -> str:
    """MyST's heading anchor (GitHub's slug) of a heading's text, its inline markup removed."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\u4e00-\u9fff\- ]", "", text.lower().replace(" ", "-"))


def _anchors(page: pathlib.Path) -> set[str]:
    """The anchors MyST gives the page's headings of levels 1-3 (``myst_heading_anchors = 3``)."""
    seen, anchors = collections.Counter(), set()
    for _, title in _HEADING.findall(_prose(page.read_text())):
        slug = _slug(title)
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


def _toctree_entries(page: pathlib.Path) -> list[pathlib.Path]:
    entries = []
    for block in _TOCTREE.findall(page.read_text()):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith(":"):
                entries.append((page.parent / line).with_suffix(".md").resolve())
    return entries


def test_the_site_has_its_pages():
    names = {_name(p) for p in PAGES}
    for name in ("index.md", "getting_started.md", "masked_conv.md", "backends.md", "modules.md",
                 "generation.md", "sequence_models.md", "many_devices.md", "audit.md", "performance.md",
                 "development.md", "api.md", "design/index.md", "compat.md", "causal_conv.md", "serving.md",
                 "porting.md"):
        assert name in names, name


def test_every_page_is_in_a_toctree():
    listed = {}
    for page in PAGES:
        for entry in _toctree_entries(page):
            assert entry.exists(), f"{_name(page)}: the toctree names {entry.relative_to(DOCS)}, which does not exist"
            listed[entry] = page
    missing = [_name(p) for p in PAGES if p != DOCS / "index.md" and p.resolve() not in listed]
    assert not missing, f"pages in no toctree (Sphinx warns of each): {missing}"


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        text = page.read_text()
        prose = _prose(text)
        links = [(t, True) for t in _LINK.findall(prose)]
        files = [(t, False) for t in _ROLE_PATH.findall(prose) + _INCLUDE.findall(text)]  # copied or included
        for target, is_link in links + files:
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{_name(page)}: {target} (no such file)")
            elif is_link and path.endswith(".md") and DOCS not in file.parents:
                broken.append(f"{_name(page)}: {target} (a markdown file outside docs/ is no page: use {{download}})")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{_name(page)}: {target} (no heading with that anchor in {file.name})")
    assert not broken, "\n".join(broken)


def _snippets():
    return [(_name(page), line, code) for page in PAGES for line, code in python_blocks(page)]


def test_pages_have_snippets_to_run():
    pages = {name for name, _, _ in _snippets()}
    assert len(_snippets()) >= 20 and {"masked_conv.md", "sequence_models.md", "serving.md", "many_devices.md",
                                           "porting.md"} <= pages


@pytest.mark.slow
@pytest.mark.parametrize("page, line, code", _snippets(), ids=lambda v: f"line{v}" if isinstance(v, int) else (v if "\n" not in v else ""))
def test_docs_snippet_runs_as_written(page, line, code, tmp_path):
    # Each block on its own, in a fresh interpreter with 8 CPU devices (the mesh examples).
    proc = run_block(code, tmp_path)
    assert proc.returncode == 0, f"docs/{page} line {line}:\n{code}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_site_builds_without_warnings(tmp_path):
    missing = [m for m in ("sphinx", "myst_parser", "sphinx_book_theme") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)} missing): pip install '.[docs]' to build the site")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
