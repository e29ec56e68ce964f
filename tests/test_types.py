"""The code is type-checked strictly (``mypy --strict``, the ``[tool.mypy]`` section of
pyproject.toml), and every ``type: ignore`` says why: on its line, or in the comment just
above it (or above the run of ignored lines it belongs to)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

IGNORE = re.compile(r"#\s*type:\s*ignore(\[[^\]]*\])?(?P<after>.*)$")


def unexplained_ignores(root: Path) -> list[str]:
    out = []
    for f in sorted([*(root / "agent").rglob("*.py"), *(root / "supervisor").rglob("*.py")]):
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            m = IGNORE.search(line)
            if m is None or re.match(r"\s*#\s*\S", m.group("after")):
                continue
            j = i - 1  # up over the run of ignored lines to the comment that explains them
            while j >= 0 and IGNORE.search(lines[j]) and not lines[j].lstrip().startswith("#"):
                j -= 1
            if j < 0 or not lines[j].lstrip().startswith("#"):
                out.append(f"{f.relative_to(root)}:{i + 1}: {line.strip()}")
    return out


def test_every_type_ignore_says_why(repo_root: Path) -> None:
    assert unexplained_ignores(repo_root) == []


def test_the_check_sees_an_ignore_without_a_reason(tmp_path: Path) -> None:
    (tmp_path / "agent").mkdir()
    (tmp_path / "supervisor").mkdir()
    (tmp_path / "agent" / "a.py").write_text(
        "x = f()  # type: ignore[no-untyped-call]  # f is a C extension's\n"
        "# (the same: a C extension's)\n"
        "y = f()  # type: ignore[no-untyped-call]\n"
        "z = f()  # type: ignore[no-untyped-call]\n"
        "w = 1\n"
        "v = f()  # type: ignore\n")
    assert unexplained_ignores(tmp_path) == ["agent/a.py:6: v = f()  # type: ignore"]


def test_mypy_strict_is_clean(repo_root: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "trainwarden"], cwd=repo_root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
