"""``trainwarden hosts | cordon NODE | uncordon NODE`` against a real supervisor (uvicorn,
SQLite): the operator token from the flag or ``$TRAINWARDEN_OPERATOR_TOKEN``, refusals
printed with their status and reason, nothing changed by a refused command."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.dashboard.browser import serve_in_thread
from trainwarden.supervisor.cli import main as cli
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.server.app import create_app

AGENT_TOKEN, OPERATOR_TOKEN = "agent-secret", "operator-secret"


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[str]:
    settings = SupervisorSettings(agent_token=AGENT_TOKEN, operator_token=OPERATOR_TOKEN,
                                  data_dir=tmp_path)
    app = create_app(settings, start_evaluator=False)
    with serve_in_thread(app) as base:
        r = httpx.post(base + "/api/v1/agents/register",
                       headers={"Authorization": f"Bearer {AGENT_TOKEN}"},
                       json={"run": "llm", "node": "rack1/n0", "hostname": "h",
                             "checkpoint_roots": ["/ck"]})
        assert r.status_code == 200, r.text
        yield base


def run(argv: list[str], supervisor: str, token: str | None = OPERATOR_TOKEN) -> int:
    return cli.main([*argv, "--supervisor", supervisor,
                     *(["--token", token] if token else [])])


def test_cordon_list_and_uncordon(supervisor: str, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert run(["cordon", "rack1/n0", "--reason", "fans failing"], supervisor) == 0
    out = capsys.readouterr().out
    assert out.startswith("node rack1/n0 is cordoned: never chosen as a member until "
                          "uncordoned (host action ")
    assert run(["hosts"], supervisor) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["NODE", "STATE", "SINCE", "BY"]
    (row,) = [ln for ln in lines if ln.startswith("rack1/n0")]
    assert row.split()[1] == "cordoned" and "fans failing" in row and "operator" in row

    monkeypatch.setenv("TRAINWARDEN_OPERATOR_TOKEN", OPERATOR_TOKEN)  # the default token
    assert run(["uncordon", "rack1/n0", "--reason", "fans replaced"], supervisor,
               token=None) == 0
    assert "is probation: healthy again once it passes a preflight" in \
        capsys.readouterr().out
    detail = httpx.get(supervisor + "/api/v1/hosts/rack1/n0",
                       headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}).json()
    assert [(a["kind"], a["reason"]) for a in detail["actions"]] == [
        ("uncordon", "fans replaced"), ("cordon", "fans failing")]


def test_refusals_are_printed_and_change_nothing(supervisor: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["uncordon", "rack1/n0", "--reason", "x"], supervisor) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("trainwarden uncordon: 409 nothing done: node rack1/n0 is healthy, "
                           "not cordoned: nothing to uncordon")
    assert run(["cordon", "rack1/n0", "--reason", "x"], supervisor, token=None) == 1
    assert "401 missing bearer token" in capsys.readouterr().err
    assert run(["cordon", "rack1/n0", "--reason", "x"], supervisor, token=AGENT_TOKEN) == 1
    assert "403 this route needs an operator token" in capsys.readouterr().err
    assert run(["cordon", "rack1/n0", "--reason", " "], supervisor) == 1
    assert "422 invalid request: body.reason" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the reason is required
        run(["cordon", "rack1/n0"], supervisor)
    assert e.value.code == 2
    assert "--reason" in capsys.readouterr().err
    assert run(["hosts"], supervisor) == 0
    (row,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("rack1/n0")]
    assert row.split()[1] == "healthy"
