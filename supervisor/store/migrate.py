"""Alembic, driven from code: locate the migrations, upgrade, report the current revision.

The migrations are the repository's top-level ``migrations/`` folder.  The wheel ships it as
the ``trainwarden.supervisor.migrations`` package (see ``setup.py``), found through package
resources; an
editable install or a source checkout finds it next to the ``supervisor`` package instead.
``TRAINWARDEN_MIGRATIONS_DIR`` overrides both.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

ENV_MIGRATIONS_DIR = "TRAINWARDEN_MIGRATIONS_DIR"
PACKAGE = "trainwarden.supervisor.migrations"


def _packaged() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def migrations_dir() -> Path:
    """The one place that knows where the migrations are."""
    env = os.environ.get(ENV_MIGRATIONS_DIR)
    candidates = [Path(env)] if env else []
    packaged = _packaged()
    if packaged is not None:
        candidates.append(packaged)
    candidates.append(Path(__file__).resolve().parents[2] / "migrations")
    for c in candidates:
        if (c / "env.py").is_file():
            return c
    raise RuntimeError(
        f"Alembic migrations not found (looked in {', '.join(map(str, candidates))}); "
        f"reinstall trainwarden[supervisor], or set {ENV_MIGRATIONS_DIR} to the directory "
        "holding migrations/env.py"
    )


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # Percent signs in URLs (escaped passwords, options=-c...%3D...) would be read as
    # ConfigParser interpolation.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def head() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current(url: str) -> str | None:
    """The database's revision (None for an empty database)."""
    from trainwarden.supervisor.store.db import make_engine

    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
