"""The CLI's tables (``trainwarden runs | incidents | checkpoints | actions``) against a real
supervisor (uvicorn, SQLite, live evaluator) holding hostile text: terminal escape sequences
in a crash message (stored through the API), and in a node name, a checkpoint path and a
reason (the API refuses control characters there: written into the store directly, as an
older supervisor may have stored them)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import update

from tests.dashboard.browser import serve_in_thread
from tests.waiting import wait_for
from trainwarden.supervisor.cli import main as cli
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store import tables

AGENT_TOKEN, OPERATOR_TOKEN = "agent-secret", "operator-secret"
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
# Retitle the terminal (OSC), clear the screen (CSI), the same with the 8-bit CSI, a bell,
# a backspace, a newline and a right-to-left override.
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x08\n\u202etxt.exe"
FRAME = {"file": "/home/u/train.py", "line": 57, "function": "collate"}
ROOT_CAUSE = {"exc_type": "KeyError", "message": "'label'", "frame": FRAME, "user_frame": FRAME,
              "traceback": 'Traceback (most recent call last):\n  File "/home/u/train.py", '
                           'line 57, in collate\n    ' + HOSTILE + "\nKeyError: 'label'",
              "source": "stderr", "rank": 0, "host": "h"}
RAW = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data = tmp_path_factory.mktemp("sup")
    settings = SupervisorSettings(agent_token=AGENT_TOKEN, operator_token=OPERATOR_TOKEN,
                                  data_dir=data, restart_backoff_s=0.0,
                                  restart_backoff_max_s=0.0)
    app = create_app(settings)
    with serve_in_thread(app) as base:
        feed(base)
        with app.state.db.write() as conn:
            conn.execute(update(tables.agents).values(node="node" + HOSTILE, hostname=HOSTILE))
            conn.execute(update(tables.checkpoints).values(path=tables.checkpoints.c.path
                                                           + HOSTILE))
            conn.execute(update(tables.actions)
                         .where(tables.actions.c.reason == "operator says ")
                         .values(reason="operator says " + HOSTILE))
        yield base


def feed(base: str) -> None:
    with httpx.Client(base_url=base + "/api/v1", timeout=10) as c:
        a = c.post("/agents/register", headers=AGENT,
                   json={"run": "evil", "node": "node", "hostname": "h",
                         "checkpoint_roots": ["/ck"]}).json()
        items = [{"type": "step", "rank": 0, "world_size": 1, "step": s, "t": time.time(),
                  "loss": 1.0} for s in range(12)]
        items.append({"type": "checkpoint", "step": 10, "path": "/ck/step_10",
                      "bytes": 5, "t": time.time(), "lineage": "a0"})
        items.append({"type": "exit", "attempt": 0, "exit_code": 1, "outcome": "crashed",
                      "failed_ranks": [{"rank": 0, "exit_code": 1, "message": HOSTILE,
                                        "root_cause": ROOT_CAUSE}]})
        body = json.dumps({"agent_id": a["agent_id"], "seq": 0, "items": items})
        r = c.post("/ingest", content=body,
                   headers={**AGENT, "content-type": "application/json",
                            "X-Trainwarden-Agent-Credential": a["credential"]})
        assert r.status_code == 200, r.text
        wait_for(lambda: c.get("/runs/evil/actions", headers=OPERATOR).json()["actions"],
                 20, "the live evaluator's restart")
        r = c.post("/runs/evil/rollback", headers=OPERATOR,
                   json={"step": 10, "reason": "operator says "})
        assert r.status_code == 202, r.text


@pytest.mark.parametrize("argv", [["runs"], ["incidents", "evil"], ["checkpoints", "evil"],
                                  ["actions", "evil"], ["nodes", "evil"]])
def test_tables_print_no_terminal_control_characters(
        supervisor: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*argv, "--supervisor", supervisor, "--token", OPERATOR_TOKEN]) == 0
    out = capsys.readouterr().out
    assert RAW.findall(out) == [], "a control character reached the terminal"
    if argv[0] != "runs":  # every table but the runs list shows the hostile text, escaped
        # (a worker's last words are kept escaped from ingest on, so the incidents table's
        # cut cause shows their start)
        assert "\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m" in out
    assert len(out.splitlines()) >= 3  # header, rule and at least one row: one line each



def test_a_list_of_addresses_goes_on_to_the_next_when_one_cannot_be_reached(
        supervisor: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.e2e.system import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert cli.main(["runs", "--supervisor", f"{dead},{supervisor}",
                     "--token", OPERATOR_TOKEN]) == 0
    out = capsys.readouterr()
    assert "evil" in out.out
    assert f"cannot reach {dead}" in out.err


def test_incidents_print_the_root_cause_and_the_traceback(
        supervisor: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["incidents", "evil", "--supervisor", supervisor,
                     "--token", OPERATOR_TOKEN]) == 0
    out = capsys.readouterr().out
    assert "user_code" in out.splitlines()[2]  # the FAULT column
    assert "KeyError: 'label' at train.py:57 in collate (rank 0, host h)" in out
    assert "fault: the training script" in out
    assert "  | KeyError: 'label'" in out and '  |   File "/home/u/train.py", line 57' in out
    assert RAW.findall(out) == []


def test_nodes_and_runs_show_each_nodes_role_and_the_world(
        supervisor: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["nodes", "evil", "--supervisor", supervisor,
                     "--token", OPERATOR_TOKEN]) == 0
    out = capsys.readouterr().out
    header, _, row, *rest = out.splitlines()
    assert header.split()[:3] == ["NODE", "ROLE", "RANK"]
    assert " member " in row and " 0 " in row, out
    # (its command declares no world: not a torchrun launch)
    assert rest[-2].startswith("world -, membership epoch 0, free spares 0"), out
    # Which node hosts the rendezvous (its name, escaped: it holds control characters).
    assert rest[-1].startswith("rendezvous hosted by node") and rest[-1].endswith(
        "(node rank 0)"), out
    assert cli.main(["runs", "--supervisor", supervisor, "--token", OPERATOR_TOKEN]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[-1] == "NODES" and out.splitlines()[2].endswith(" 1")
