"""The supervisor as a real subprocess, and the CLI's lazy imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TypeVar

import httpx

from tests.waiting import wait_for

T = TypeVar("T")




def test_supervisor_subprocess_answers_healthz(tmp_path: Path, repo_root: Path) -> None:
    port_file = tmp_path / "port"
    env = {**os.environ, "TRAINWARDEN_AGENT_TOKEN": "a", "TRAINWARDEN_OPERATOR_TOKEN": "o"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor", "--port", "0",
         "--data-dir", str(tmp_path / "data"), "--port-file", str(port_file),
         "--log-level", "warning"],
        cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        def port() -> int | None:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                raise AssertionError(f"supervisor exited {proc.returncode}: {out}")
            return int(port_file.read_text()) if port_file.exists() else None

        p = wait_for(port, 30, "the supervisor's port file")
        r = httpx.get(f"http://127.0.0.1:{p}/healthz", timeout=5)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = httpx.get(f"http://127.0.0.1:{p}/api/v1/runs", timeout=5,
                      headers={"Authorization": "Bearer o"})
        assert r.status_code == 200 and r.json() == {"runs": []}
        assert (tmp_path / "data" / "trainwarden.db").exists()  # schema upgraded on start
        crash_gets_a_restart_from_the_live_evaluator(f"http://127.0.0.1:{p}")
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_supervisor_refuses_to_start_without_tokens(tmp_path: Path, repo_root: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")}
    r = subprocess.run(
        [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor",
         "--data-dir", str(tmp_path)],
        cwd=repo_root, env=env, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode != 0 and "--insecure-no-auth" in r.stderr


def test_agent_subcommand_imports_no_server_stack(repo_root: Path) -> None:
    code = (
        "import sys\n"
        "import trainwarden.supervisor.cli.main as c\n"
        "c.build_parser()\n"
        "bad = [m for m in ('fastapi', 'sqlalchemy', 'uvicorn', 'pydantic_settings') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_agent_subcommand_delegates(monkeypatch: object) -> None:
    import argparse
    import types

    from trainwarden.supervisor.cli import main as cli

    seen: dict[str, object] = {}
    fake = types.ModuleType("trainwarden.agent.cli")

    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--run")

    def run(args: argparse.Namespace) -> int:
        seen["run"] = args.run
        return 3

    fake.add_arguments = add_arguments  # type: ignore[attr-defined]
    fake.run = run  # type: ignore[attr-defined]
    from trainwarden import agent
    old_mod, old_attr = sys.modules.get("trainwarden.agent.cli"), getattr(agent, "cli", None)
    sys.modules["trainwarden.agent.cli"] = fake
    agent.cli = fake  # type: ignore[attr-defined]
    try:
        assert cli.main(["agent", "--run", "x"]) == 3 and seen == {"run": "x"}
    finally:
        if old_mod is None:
            sys.modules.pop("trainwarden.agent.cli", None)
        else:
            sys.modules["trainwarden.agent.cli"] = old_mod
        if old_attr is None:
            delattr(agent, "cli")
        else:
            agent.cli = old_attr  # type: ignore[attr-defined]


def crash_gets_a_restart_from_the_live_evaluator(base: str) -> None:
    """The evaluator thread started by the app turns a crash report into restart commands."""
    with httpx.Client(base_url=base, headers={"Authorization": "Bearer a"}, timeout=5) as c:
        regs = [c.post("/api/v1/agents/register", json={"run": "live", "node": n}).json()
                for n in ("n0", "n1")]
        ids = [r["agent_id"] for r in regs]
        cred = [{"X-Trainwarden-Agent-Credential": r["credential"]} for r in regs]
        crash = {"type": "exit", "attempt": 0, "exit_code": 1, "outcome": "crashed",
                 "failed_ranks": [{"rank": 0, "exit_code": 1}]}
        r = c.post("/api/v1/ingest", json={"agent_id": ids[0], "seq": 0, "items": [crash]},
                   headers=cred[0])
        assert r.status_code == 200, r.text
        seq = iter(range(1, 1000))

        def restart_sent() -> list[dict[str, object]] | None:
            reply = c.post("/api/v1/ingest", headers=cred[1],
                           json={"agent_id": ids[1], "seq": next(seq), "items": []}).json()
            cmds: list[dict[str, object]] = reply["commands"]
            return cmds or None

        cmds = wait_for(restart_sent, 20, "a restart command")
        assert cmds[0]["kind"] == "restart" and cmds[0]["attempt"] == 1
