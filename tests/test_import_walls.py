"""The walls between the packages (the import-linter contracts in pyproject.toml): the agent
never imports the supervisor, the in-training library none of the service's packages, the
shared core and the detectors and policy nothing impure, the store and the HTTP contract
nothing above them, the control loop no request handling, only the store talks SQL, and the
supervisor's folders are layers (a lower one never imports a higher one: no cycle)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_the_code_keeps_every_wall(repo_root: Path) -> None:
    r = lint(repo_root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8 kept, 0 broken" in r.stdout


def test_every_folder_of_the_supervisor_has_its_layer(repo_root: Path) -> None:
    """A folder or module left out of the layers contract would be checked by none of it."""
    import tomllib

    contracts = tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"][
        "importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    named = {m.strip().removeprefix("trainwarden.supervisor.")
             for layer in layers for m in layer.split("|")}
    sup = repo_root / "supervisor"
    present = {p.name for p in sup.iterdir() if (p / "__init__.py").exists()} | {
        p.stem for p in sup.glob("*.py") if p.name != "__init__.py"}
    assert present - named == set()


# One forbidden import for each contract: file, the line added to it.
BREACHES = {
    "the agent never imports the supervisor": (
        "agent/watchdog.py", "import trainwarden.supervisor.contract.wire"),
    "the in-training library imports nothing of the service": (
        "agent/worker/report.py", "import httpx"),
    "the shared core is pure": ("agent/core/stats.py", "import socket"),
    "detectors and policy are pure": (
        "supervisor/detect/disk.py", "import trainwarden.supervisor.store.db"),
    "only the store talks SQL": ("supervisor/observability/metrics.py", "import sqlalchemy"),
    "the store and the HTTP contract import nothing above them": (
        "supervisor/store/tokens.py", "import trainwarden.supervisor.api.deps"),
    "the control loop serves no request": (
        "supervisor/control/leader.py", "import trainwarden.supervisor.server.app"),
    "the supervisor's folders are layers": (
        "supervisor/goodput/interval.py", "import trainwarden.supervisor.cli.tables"),
}


def test_each_wall_catches_a_forbidden_import(repo_root: Path, tmp_path: Path) -> None:
    """The same contracts over a copy of the code with one forbidden import per contract:
    every one of them is reported broken."""
    for pkg in ("agent", "supervisor"):
        shutil.copytree(repo_root / pkg, tmp_path / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "static", "templates"))
    shutil.copy(repo_root / "pyproject.toml", tmp_path)
    # The import root over the copies, as trainwarden/ lays it over the repository's folders.
    (tmp_path / "trainwarden").mkdir()
    shutil.copy(repo_root / "trainwarden" / "__init__.py", tmp_path / "trainwarden")
    for pkg in ("agent", "supervisor"):
        (tmp_path / "trainwarden" / pkg).symlink_to(Path("..") / pkg)
    for path, line in BREACHES.values():
        f = tmp_path / path
        f.write_text(f.read_text() + f"\n{line}  # noqa\n")
    r = lint(tmp_path)
    assert r.returncode != 0
    assert "0 kept, 8 broken" in r.stdout, r.stdout
    for name, (path, _line) in BREACHES.items():
        assert name in r.stdout
        assert path.removesuffix(".py").replace("/", ".") in r.stdout
