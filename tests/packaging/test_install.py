"""trainwarden installed the way a team installs it: the built wheel (no ``-e``, no source tree
on ``sys.path``) into fresh virtual environments, one per role.

- the ``supervisor`` extra, without torch: ``trainwarden supervisor`` starts from the wheel,
  migrates its schema (the migrations travel inside the wheel) and answers ``/healthz``;
- the ``agent`` extra, with the pinned torch: the agent and the in-training library import
  with the service's packages unimportable, and a real 2-worker torchrun run under the
  wheel-installed agent completes against the wheel-installed supervisor;
- each half refuses to start where its extra is missing, naming the extra to install.

The environments are built once per module (about a minute: pip takes the packages from its
cache, torch from the wheel on disk).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints.txt"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
AGENT_TOKEN = "install-agent-token"
OPERATOR_TOKEN = "install-operator-token"
# The service's third-party packages: none is installed with the agent extra (jinja2 is, as a
# dependency of torch, so it is only blocked on import).
SERVICE_PACKAGES = ["fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg",
                    "prometheus_client", "pydantic_settings"]
BLOCKED = [*SERVICE_PACKAGES, "jinja2", "trainwarden.supervisor"]


def _clean_env(**extra: str) -> dict[str, str]:
    """The user's environment: no TRAINWARDEN_* settings, nothing added to sys.path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINWARDEN_", "PYTHON", "VIRTUAL_ENV"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def _run(cmd: list[str | Path], cwd: Path, timeout: float = 600,
         **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=_clean_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def source_copy(dest: Path) -> Path:
    """The project's files as a fresh checkout has them (tracked and new, not ignored ones):
    a build in the working tree would reuse its ``build/`` folder, where files deleted from
    the source linger and would ship in the wheel."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / os.fsdecode(name)
        if src.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = source_copy(tmp_path_factory.mktemp("source"))
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, src], out)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("trainwarden-*.whl")
    assert whl.name.startswith(f"trainwarden-{VERSION}-")
    return whl


def _venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path, extra: str) -> Path:
    root = tmp_path_factory.mktemp(f"venv-{extra}")
    r = _run([sys.executable, "-m", "venv", root], root)
    assert r.returncode == 0, r.stderr
    started = time.monotonic()
    r = _run([root / "bin" / "python", "-m", "pip", "install", "-q", "-c", CONSTRAINTS,
              f"trainwarden[{extra}] @ {wheel.as_uri()}"], root)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"\n[{extra}] installed in {time.monotonic() - started:.0f} s")
    return root


@pytest.fixture(scope="module")
def supervisor_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    return _venv(tmp_path_factory, wheel, "supervisor")


@pytest.fixture(scope="module")
def agent_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    return _venv(tmp_path_factory, wheel, "agent")


def _importable(venv: Path, module: str, cwd: Path) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    r = _run([venv / "bin" / "python", "-c", probe], cwd)
    return r.returncode == 0


class _Supervisor:
    def __init__(self, venv: Path, data_dir: Path) -> None:
        port_file = data_dir / "port"
        self.log = data_dir / "supervisor.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(venv / "bin" / "trainwarden"), "supervisor", "--data-dir", str(data_dir),
                 "--port", "0", "--port-file", str(port_file), "--log-level", "warning"],
                cwd=data_dir, stdout=log, stderr=subprocess.STDOUT,
                env=_clean_env(TRAINWARDEN_AGENT_TOKEN=AGENT_TOKEN,
                               TRAINWARDEN_OPERATOR_TOKEN=OPERATOR_TOKEN))
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "supervisor did not start in 60 s"
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10,
                         headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def supervisor(supervisor_venv: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    sup = _Supervisor(supervisor_venv, tmp_path_factory.mktemp("sup-data"))
    yield sup
    sup.stop()


# --- the supervisor extra --------------------------------------------------------------------


def test_supervisor_extra_has_no_torch(supervisor_venv: Path, tmp_path: Path) -> None:
    assert not _importable(supervisor_venv, "torch", tmp_path)


def test_the_wheel_ships_its_type_hints(wheel: Path) -> None:
    """PEP 561: a user's type checker reads trainwarden's annotations (``py.typed``)."""
    import zipfile

    assert "trainwarden/py.typed" in zipfile.ZipFile(wheel).namelist()


def test_version_from_the_wheel(supervisor_venv: Path, tmp_path: Path) -> None:
    r = _run([supervisor_venv / "bin" / "trainwarden", "--version"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"trainwarden {VERSION}"


def test_supervisor_from_the_wheel_answers_healthz(supervisor: _Supervisor) -> None:
    r = httpx.get(supervisor.url + "/healthz", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_supervisor_from_the_wheel_migrated_its_schema(
    supervisor: _Supervisor, supervisor_venv: Path
) -> None:
    data_dir = supervisor.log.parent
    r = _run([supervisor_venv / "bin" / "trainwarden", "db", "current", "--data-dir", data_dir],
             data_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("(head)"), r.stdout
    assert supervisor.get("/api/v1/runs").json() == {"runs": []}  # the tables exist


def test_agent_command_names_its_extra_where_it_is_missing(
    supervisor_venv: Path, tmp_path: Path
) -> None:
    r = _run([supervisor_venv / "bin" / "trainwarden", "agent", "--supervisor",
              "http://127.0.0.1:1", "--run", "x", "--", "true"], tmp_path)
    assert r.returncode != 0
    assert "pip install 'trainwarden[agent]'" in r.stderr


# --- the agent extra -------------------------------------------------------------------------

_BLOCKED_IMPORTS = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or ".".join(name.split(".")[:2]) in BLOCKED:
            raise ImportError(f"{name} is a service package: the agent must not import it")
        return None
sys.meta_path.insert(0, Refuse())
import trainwarden.agent, trainwarden.agent.cli, trainwarden.agent.loop
import trainwarden.agent.worker, trainwarden.agent.worker.checkpoint
import trainwarden.agent.worker.data, trainwarden.agent.worker.distributed
print(trainwarden.agent.__file__)
"""


def test_agent_extra_installs_none_of_the_service_packages(
    agent_venv: Path, tmp_path: Path
) -> None:
    present = [m for m in SERVICE_PACKAGES if _importable(agent_venv, m, tmp_path)]
    assert present == []


def test_agent_and_library_import_with_the_service_packages_blocked(
    agent_venv: Path, tmp_path: Path
) -> None:
    r = _run([agent_venv / "bin" / "python", "-c", _BLOCKED_IMPORTS,
              ",".join(BLOCKED)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(agent_venv)), r.stdout  # the wheel, not the tree


def test_supervisor_command_names_its_extra_where_it_is_missing(
    agent_venv: Path, tmp_path: Path
) -> None:
    r = _run([agent_venv / "bin" / "trainwarden", "supervisor", "--insecure-no-auth"], tmp_path)
    assert r.returncode != 0
    assert "pip install 'trainwarden[supervisor]'" in r.stderr


def test_wheel_agent_runs_a_real_torchrun_against_the_wheel_supervisor(
    agent_venv: Path, supervisor: _Supervisor, tmp_path: Path
) -> None:
    summary = tmp_path / "summary.json"
    r = _run([agent_venv / "bin" / "trainwarden", "agent", "--supervisor", supervisor.url,
              "--run", "from-the-wheel", "--node", "n0", "--state-dir", tmp_path / "state",
              "--", agent_venv / "bin" / "torchrun", "--nproc_per_node=2", "--standalone",
              "--monitor-interval=0.1", REPO / "examples" / "train_ddp.py", "--steps", "30",
              "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every-steps", "10",
              "--summary-json", summary],
             tmp_path, timeout=180, TRAINWARDEN_AGENT_TOKEN=AGENT_TOKEN)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(summary.read_text())["final_step"] == 30
    # The agent delivered its exit before it ended; the evaluator's next tick completes the run.
    deadline = time.monotonic() + 30
    while (run := supervisor.get("/api/v1/runs/from-the-wheel").json())["status"] == "running":
        assert time.monotonic() < deadline, f"run still running 30 s after the agent ended: {run}"
        time.sleep(0.2)
    assert run["status"] == "completed"
    assert run["step"] == 29


# --- one import root: beside supervisord and a user's own ``agent`` package -----------------


def test_the_wheel_lives_beside_supervisord_in_one_environment(
        supervisor_venv: Path, tmp_path: Path) -> None:
    """supervisord's import name is ``supervisor``: both install into one environment and
    both run (the wheel's only top-level package is ``trainwarden``)."""
    r = _run([supervisor_venv / "bin" / "python", "-m", "pip", "install", "-q", "supervisor"],
             tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    probe = ("import supervisor.supervisord, supervisor.options, "
             "trainwarden.supervisor.server.app, "
             "trainwarden.supervisor.cli.main; print(supervisor.__file__)")
    r = _run([supervisor_venv / "bin" / "python", "-c", probe], tmp_path)
    # (supervisord's own package, not anything of trainwarden's)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("site-packages/supervisor/__init__.py"), r.stdout
    r = _run([supervisor_venv / "bin" / "supervisord", "--version"], tmp_path)
    assert r.returncode == 0 and r.stdout.strip(), r.stdout + r.stderr
    r = _run([supervisor_venv / "bin" / "trainwarden", "--version"], tmp_path)
    assert r.returncode == 0 and VERSION in r.stdout, r.stdout + r.stderr


def test_the_in_training_library_lives_beside_a_users_own_agent_package(
        agent_venv: Path, tmp_path: Path) -> None:
    """A training repository with an ``agent`` package of its own (every RL codebase) imports
    both: its own ``agent`` first on sys.path, and trainwarden's in-training library."""
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "__init__.py").write_text("MINE = True\n")
    probe = ("import agent, trainwarden.agent.worker as tw; assert agent.MINE; "
             "assert tw.report_step and tw.Checkpointer; print(agent.__file__)")
    r = _run([agent_venv / "bin" / "python", "-c", probe], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == str(tmp_path / "agent" / "__init__.py")
