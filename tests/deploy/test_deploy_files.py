"""The deployment examples are checked, not only written: each file is read by the tool that
will read it in production (systemd, the Kubernetes schema, bash), and every trainwarden command
line in them is parsed by the real command-line parser, so a renamed flag breaks this test
instead of a user's cluster.

``systemd-analyze`` comes with systemd (`.ci/run` installs it where it is missing); the schema
check uses the ``kubernetes-validate`` package's bundled schemas (offline).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainwarden.agent import cli as agent_cli
from trainwarden.supervisor.cli import main as supervisor_cli
from trainwarden.supervisor.config import flag_values
from trainwarden.supervisor.fleet import RUN_COMMENT_PREFIX

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNIT_BINARY = "/opt/trainwarden/.venv/bin/trainwarden"
# The installed console script of the environment running the tests.
TRAINWARDEN = Path(sys.executable).with_name("trainwarden")

# Placeholders for the shell and systemd variables the command lines use.
VARIABLES = {
    "TRAINWARDEN_SUPERVISOR": "http://supervisor-host:8765",
    "TRAINWARDEN_BIN": str(TRAINWARDEN),
    "CHECKPOINT_ROOT": "/shared/ckpt/my-run",
    "CKPT_ROOT": "/shared/ckpt/my-run",
    "RUN": "my-run",
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "4",
    "GPUS_PER_NODE": "8",
    "RDZV_HOST": "node0",
    "RDZV_PORT": "29400",
    "TRAIN_COMMAND": "torchrun --nproc_per_node=8 train.py",
    "SLURMD_NODENAME": "node0",
    "WORLD": "3",
    "nproc": "8",
}


def _substitute(text: str) -> str:
    def var(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in VARIABLES:
            raise AssertionError(f"no placeholder for ${name} in {text!r}")
        return VARIABLES[name]

    text = re.sub(r"\$\{(\w+)\}|\$(\w+)", var, text)
    text = text.replace("%i", "my-run")
    return re.sub(r"\$\(hostname -s\)", "node0", text)


def _agent_config(argv: list[str]) -> Any:
    """Parse an agent command line exactly as `trainwarden agent` does, and build its config
    (which runs every cross-field check)."""
    parser = argparse.ArgumentParser(prog="trainwarden agent", exit_on_error=False)
    agent_cli.add_arguments(parser)
    return agent_cli.config_from_args(parser.parse_args(argv))


def _supervisor_args(argv: list[str]) -> argparse.Namespace:
    parser = supervisor_cli.build_parser(with_settings=True)  # as `trainwarden supervisor` does
    parser.exit_on_error = False
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for sub in action.choices.values():  # type: ignore[union-attr]
            sub.exit_on_error = False
    return parser.parse_args(argv)


def _exec_start(unit: Path) -> str:
    for line in unit.read_text().splitlines():
        if line.startswith("ExecStart="):
            return line.removeprefix("ExecStart=")
    raise AssertionError(f"{unit} has no ExecStart")


# --- systemd ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return exe


@pytest.mark.parametrize("unit", ["trainwarden-supervisor.service",
                                  "trainwarden-agent@.service"])
def test_systemd_unit_verifies_against_the_installed_command(
    unit: str, systemd_analyze: str, tmp_path: Path
) -> None:
    assert TRAINWARDEN.is_file(), f"no installed trainwarden command at {TRAINWARDEN}"
    text = (DEPLOY / "systemd" / unit).read_text()
    assert UNIT_BINARY in text, f"{unit} no longer starts {UNIT_BINARY}"
    name = unit.replace("@.", "@my-run.")  # a template is verified as one of its instances
    (tmp_path / name).write_text(text.replace(UNIT_BINARY, str(TRAINWARDEN)))
    r = subprocess.run([systemd_analyze, "verify", str(tmp_path / name)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trainwarden" not in r.stderr, r.stderr  # no warning about our own lines


def test_systemd_verify_catches_a_missing_command(systemd_analyze: str, tmp_path: Path) -> None:
    """The check above can fail: the same unit with a command that does not exist."""
    text = (DEPLOY / "systemd" / "trainwarden-supervisor.service").read_text()
    (tmp_path / "broken.service").write_text(text.replace(UNIT_BINARY, "/nonexistent/tw"))
    r = subprocess.run([systemd_analyze, "verify", str(tmp_path / "broken.service")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "/nonexistent/tw" in r.stderr


def test_systemd_supervisor_command_line_parses() -> None:
    argv = shlex.split(_exec_start(DEPLOY / "systemd" / "trainwarden-supervisor.service"))
    assert argv[0] == UNIT_BINARY
    args = _supervisor_args(argv[1:])
    assert args.cmd == "supervisor"
    assert flag_values(args)["server"]["host"] == "0.0.0.0"


def test_systemd_agent_command_line_parses() -> None:
    # systemd splits an unbraced $TRAIN_COMMAND at white space, as shlex does after the
    # substitution.
    argv = shlex.split(_substitute(_exec_start(DEPLOY / "systemd" / "trainwarden-agent@.service")))
    assert argv[:2] == [UNIT_BINARY, "agent"]
    cfg = _agent_config(argv[2:])
    assert cfg.run == "my-run"
    assert cfg.command[0] == "torchrun"
    assert str(cfg.checkpoint_root) == VARIABLES["CHECKPOINT_ROOT"]


# --- Slurm -----------------------------------------------------------------------------------

SBATCH = DEPLOY / "slurm" / "train.sbatch"


def test_slurm_script_is_valid_bash() -> None:
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_slurm_agent_command_line_parses() -> None:
    text = SBATCH.read_text()
    m = re.search(r'\n +"\$TRAINWARDEN_BIN" agent(.*?) 1>&2\n', text, re.S)
    assert m, "the sbatch script no longer runs `$TRAINWARDEN_BIN agent ... 1>&2`"
    body = m.group(1).replace("\\\n", " ")
    # A member (no --spare), its training command the script's arguments.
    body = body.replace('"${role[@]}"', "").replace('"$@"', "train.py")
    cfg = _agent_config(shlex.split(_substitute(body)))
    assert cfg.run == "my-run"
    assert cfg.node == "node0"
    assert cfg.command[0] == "torchrun"
    assert "--rdzv-backend=c10d" in cfg.command
    assert "--nnodes=3" in cfg.command and "train.py" in cfg.command


def test_slurm_script_names_its_run_in_its_job_s_comment() -> None:
    # The supervisor requeues a job only for the run its comment names (run_comment).
    text = SBATCH.read_text()
    line = f'scontrol update JobId="$SLURM_JOB_ID" Comment="{RUN_COMMENT_PREFIX}$RUN"'
    assert line in text, "the sbatch script no longer sets its job's comment to name its run"
    assert text.index('export RUN="') < text.index(line) < text.index("\nsrun ")


# --- Docker and compose ----------------------------------------------------------------------

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"


def test_dockerfile_installs_the_wheel_with_the_supervisor_extra() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^RUN pip wheel --no-deps --wheel-dir /wheels \.$", text, re.M)
    assert "trainwarden[supervisor] @ file://" in text
    # Everything the build stage copies exists (a missing one fails `docker build`).
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for name in src.split():
            assert (REPO / name).exists(), f"Dockerfile copies {name}, which does not exist"
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert cmd
    args = _supervisor_args(yaml.safe_load(cmd.group(1)))
    assert args.cmd == "supervisor"


def test_compose_file_is_consistent() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert set(services) == {"postgres", "supervisor", "prometheus"}
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for secret in svc.get("secrets", []):
            assert secret in doc["secrets"], f"{name} uses undeclared secret {secret}"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./") and not src.startswith("./secrets/"):
                assert (DEPLOY / src).exists(), f"{name} mounts {src}, which does not exist"
            elif not src.startswith(("./", "/")):
                assert src in doc["volumes"], f"{name} uses undeclared volume {src}"
    build = services["supervisor"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    script = services["supervisor"]["command"][0]
    line = next(ln for ln in script.splitlines() if "exec trainwarden" in ln)
    args = _supervisor_args(shlex.split(line.split("exec trainwarden", 1)[1]))
    assert args.cmd == "supervisor"


# --- Kubernetes ------------------------------------------------------------------------------


def test_kubernetes_manifests_match_the_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "supervisor.yaml").read_text())
            if d]
    assert {d["kind"] for d in docs} >= {"Deployment", "Service"}
    version = kv.latest_version()
    for d in docs:
        kv.validate(d, version, strict=True)  # raises ValidationError naming the field
    container = next(d for d in docs if d["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]
    args = _supervisor_args(container["args"])
    assert args.cmd == "supervisor"


def test_kubernetes_schema_check_can_fail() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    doc = yaml.safe_load_all((DEPLOY / "kubernetes" / "supervisor.yaml").read_text())
    deployment = next(d for d in doc if d and d["kind"] == "Deployment")
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, kv.latest_version(), strict=True)
