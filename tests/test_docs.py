"""The documentation site builds with ``mkdocs build --strict`` (a broken link or anchor, or a
page left out of the navigation, fails it), the README's relative links point at files that
exist, and the training loop the docs show is the README's."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# [text](target) and ![alt](target), the target up to a space or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _strip_code(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(text: str) -> list[str]:
    out = []
    for target in LINK.findall(_strip_code(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:, ...) or an anchor on the same page
        out.append(target)
    return out


def test_relative_links_are_found_in_markdown() -> None:
    text = ("[a](docs/a.md) [b](https://x.org) [c](#here) ![d](img/d.png) `[e](no.md)`\n"
            "```\n[f](no.md)\n```\n[g](docs/g.md#part)\n")
    assert relative_links(text) == ["docs/a.md", "img/d.png", "docs/g.md#part"]


def test_every_relative_link_in_the_readme_points_at_a_file_that_exists() -> None:
    links = relative_links(README.read_text())
    assert links, "the README links to no file"
    missing = [t for t in links
               if not (REPO / t.split("#", 1)[0].split("?", 1)[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_docs_show_the_readme_training_loop() -> None:
    """The PyTorch integration page's loop is the README's, line for line (the README's is the
    one `tests/e2e/readme_train.py` runs)."""
    def first_python_block(text: str, after: str) -> str:
        section = text[text.index(after):]
        block = section[section.index("```python\n") + len("```python\n"):]
        return block[:block.index("```")]

    readme = first_python_block(README.read_text(), "### 3. Add a few lines to train.py")
    page = (REPO / "docs" / "integrations" / "pytorch.md").read_text()
    assert first_python_block(page, "# PyTorch") == readme


def _nav_pages(node: object) -> list[str]:
    """Every page file the mkdocs navigation names."""
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    if isinstance(node, list):
        return [p for v in node for p in _nav_pages(v)]
    return []


def _mkdocs_nav() -> list[str]:
    import yaml

    return _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])


def test_the_docs_index_links_every_page_of_the_navigation() -> None:
    """The docs' index is the one list of pages (the README links to it): none left out."""
    linked = {t.split("#")[0] for t in relative_links((REPO / "docs" / "index.md").read_text())}
    missing = [p for p in _mkdocs_nav() if p != "index.md" and p not in linked]
    assert missing == []


def test_the_benchmarks_page_lists_every_result_file() -> None:
    """Dated results are reached from the benchmarks page, not from the navigation."""
    page = REPO / "docs" / "benchmarks" / "index.md"
    linked = {t.split("#")[0] for t in relative_links(page.read_text())}
    results = sorted(f"results/{f.name}" for f in (REPO / "benchmarks" / "results").glob("*.md"))
    assert [r for r in results if r not in linked] == []
    assert not [p for p in _mkdocs_nav() if p.startswith("benchmarks/results/")]


def test_the_readme_keeps_no_page_list_of_its_own() -> None:
    """The README points at the docs' index; a page list of its own would fall behind."""
    docs_links = {t.split("#")[0] for t in relative_links(README.read_text())
                  if t.startswith("docs/")}
    section = README.read_text().split("## Documentation", 1)[1].split("\n## ", 1)[0]
    assert [t for t in relative_links(section) if t != "docs/index.md"] == []
    assert "docs/index.md" in docs_links


def test_the_docs_build_strict(tmp_path: Path) -> None:
    """Without ``--quiet``: mkdocs counts for ``--strict`` only the warnings it logs."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec(
            "material") is None:
        pytest.skip("mkdocs / mkdocs-material are not installed (pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    assert (tmp_path / "site" / "index.html").exists()


def _layout_block() -> str:
    page = (REPO / "docs" / "development.md").read_text()
    section = page.split("## Repository layout", 1)[1]
    return section.split("```", 2)[1]


def test_the_development_pages_folder_map_matches_the_tree() -> None:
    """Every module and folder the map names under agent/ and supervisor/ exists, and every
    one that exists is named: the map is what ``ls`` shows.  A folder's line may name its own
    modules (``control/  ...: detection.py, observer.py``): then it names all of them."""
    named: dict[str, set[str]] = {"agent": set(), "supervisor": set()}
    listed: dict[str, set[str]] = {}  # a folder whose line names its modules: all of them
    top = ""
    for line in _layout_block().splitlines():
        if line and not line.startswith(" "):
            top = line.split()[0].rstrip("/")
            continue
        if top not in named or not line.strip():
            continue
        words = re.findall(r"[\w./]+", line)
        sub = words[0] if words[0].endswith("/") else ""
        for word in words:
            if "/" in word.rstrip("/"):
                continue  # a path in the description (store/ingest.py), not an entry
            if (word.endswith("/") and word == words[0]) or (word.endswith(".py") and not sub):
                named[top].add(word)
            elif word.endswith(".py"):
                listed.setdefault(f"{top}/{sub}", set()).add(word)
    for top, names in named.items():
        folder = REPO / top
        present = {p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                   if p.name not in {"__init__.py", "__pycache__", "__main__.py"}
                   and (p.is_dir() or p.suffix == ".py")}
        assert names - present == set(), f"{top}/: the map names what is not there"
        assert present - names == set(), f"{top}/: not in the development page's map"
    for sub, modules in listed.items():
        present = {p.name for p in (REPO / sub).glob("*.py")} - {"__init__.py", "__main__.py"}
        assert modules == present, f"{sub}: the map's modules are not what is there"
