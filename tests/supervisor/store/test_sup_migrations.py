"""Alembic migrations agree with the models, on SQLite and Postgres; the db CLI works."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, text

from tests.supervisor.sup_helpers import schema_url
from trainwarden.supervisor.cli import main as cli
from trainwarden.supervisor.store import migrate
from trainwarden.supervisor.store.models import metadata


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'm.db'}"
        return
    base = request.getfixturevalue("postgres_url")
    name = f"tw_mig_{uuid.uuid4().hex[:10]}"
    eng = create_engine(base, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f"CREATE SCHEMA {name}"))
    try:
        yield schema_url(base, name)
    finally:
        with eng.connect() as c:
            c.execute(text(f"DROP SCHEMA {name} CASCADE"))
        eng.dispose()


def test_migrations_match_models(empty_url: str) -> None:
    assert migrate.current(empty_url) is None
    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()
    eng = create_engine(empty_url)
    try:
        with eng.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, metadata)
    finally:
        eng.dispose()
    assert diff == []
    migrate.upgrade(empty_url)  # idempotent


def test_migrations_dir_is_found() -> None:
    d = migrate.migrations_dir()
    assert (d / "env.py").is_file() and (d / "versions").is_dir()


def test_db_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    assert cli.main(["db", "current", "--db", url]) == 0
    assert "(empty)" in capsys.readouterr().out
    assert cli.main(["db", "upgrade", "--db", url]) == 0
    assert cli.main(["db", "current", "--db", url]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{migrate.head()} (head)")


def test_db_cli_runs_in_the_supervisors_environment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`trainwarden db` where the supervisor's tokens are set (its unit, its container): the
    tokens are not needed and do not stand in the way."""
    monkeypatch.setenv("TRAINWARDEN_AGENT_TOKEN", "a")
    monkeypatch.setenv("TRAINWARDEN_AUTH_OPERATOR_TOKEN", "o")
    url = f"sqlite:///{tmp_path / 'c.db'}"
    assert cli.main(["db", "upgrade", "--db", url]) == 0
    assert cli.main(["db", "current", "--db", url]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{migrate.head()} (head)")


@pytest.mark.postgres
def test_replicas_upgrading_together_take_turns(postgres_url: str) -> None:
    """Supervisor replicas starting at once on an empty Postgres (processes: Alembic's
    context is one per process): one upgrades, the others wait for its advisory lock and
    find the schema at head."""
    import os
    import subprocess
    import sys

    name = f"tw_mig_{uuid.uuid4().hex[:10]}"
    eng = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f"CREATE SCHEMA {name}"))
    url = schema_url(postgres_url, name)
    code = ("import sys; from trainwarden.supervisor.store import migrate; "
            "migrate.upgrade(sys.argv[1])")
    try:
        procs = [subprocess.Popen([sys.executable, "-c", code, url], env=dict(os.environ),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(3)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], outs
        assert migrate.current(url) == migrate.head()
    finally:
        with eng.connect() as c:
            c.execute(text(f"DROP SCHEMA {name} CASCADE"))
        eng.dispose()
