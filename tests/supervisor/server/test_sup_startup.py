"""The supervisor that cannot open its database says why in one line, with the fix, and
exits non-zero at once: no server is started and no traceback buries the cause."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy.engine import make_url

ENV = {**os.environ, "TRAINWARDEN_AGENT_TOKEN": "agent-secret-for-tests",
       "TRAINWARDEN_OPERATOR_TOKEN": "operator-secret-for-tests"}


def start(db: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor", "--db", db,
         "--port", "0", "--data-dir", str(tmp_path / "data")],
        env=ENV, capture_output=True, text=True, timeout=60)


def test_a_postgres_database_that_does_not_exist_is_named_in_one_line(
        postgres_url: str, tmp_path: Path) -> None:
    url = make_url(postgres_url).set(database="trainwarden_no_such_db").render_as_string(
        hide_password=False)
    r = start(url, tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    assert 'database "trainwarden_no_such_db" does not exist' in lines[0]
    assert "createdb trainwarden_no_such_db" in lines[0]


def test_a_postgres_server_that_does_not_answer_is_named_in_one_line(tmp_path: Path) -> None:
    # A port nothing listens on (the discard port: closed on this machine).
    r = start("postgresql+psycopg://postgres@127.0.0.1:9/test", tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    assert "127.0.0.1:9" in lines[0] and "running" in lines[0]


def test_an_sqlite_file_that_cannot_be_created_is_named_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = start(f"sqlite:///{blocker}/sub/trainwarden.db", tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    assert "cannot open the database" in lines[0]


def test_db_upgrade_names_a_missing_database_in_one_line(postgres_url: str) -> None:
    url = make_url(postgres_url).set(database="trainwarden_no_such_db").render_as_string(
        hide_password=False)
    r = subprocess.run([sys.executable, "-m", "trainwarden.supervisor.cli", "db", "upgrade",
                        "--db", url], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert 'database "trainwarden_no_such_db" does not exist' in r.stderr
