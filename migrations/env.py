"""Alembic environment.  The URL comes from the Alembic config the code builds
(``trainwarden.supervisor.store.migrate.alembic_config``) or, when alembic is run by hand, from the
supervisor's
settings (``TRAINWARDEN_DB_URL`` / config file)."""

from __future__ import annotations

from alembic import context

from trainwarden.supervisor.store.db import make_engine
from trainwarden.supervisor.store.models import metadata

config = context.config
_UPGRADE_LOCK = 0x7477_0001  # the advisory lock key of a schema upgrade ("tw", 1)
target_metadata = metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from trainwarden.supervisor.config import load_settings

    return load_settings(insecure_no_auth=True).db.database_url


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url(), pool_size=1)
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    # Replicas starting together on one database upgrade one at a time: the
                    # others wait here, then find the schema at head (the revision is read
                    # after the lock).
                    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_UPGRADE_LOCK})")
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
