"""A bounded schemathesis run over the supervisor's own ``/openapi.json``, in process (ASGI, a
store on a temp SQLite): every API operation, called with the agent token (register, ingest),
the admin token (the token routes) or the operator token (everything else), answers no 5xx,
and every answer matches the schema the document declares for its status (the 422 bodies
included).  (What only Postgres refuses, a NUL in a path parameter say, is tried on both
stores in test_sup_trust.py.)

Bounded to stay cheap in ``make test``: a few derandomised examples per operation (the same
inputs every run, not flaky), no shrinking phase, no deadline."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.supervisor.sup_helpers import (  # (conftest: on sys.path)
    AGENT,
    OPERATOR,
    make_settings,
    run_with_checkpoints,
)
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import make_database
from trainwarden.supervisor.store.models import metadata

EXAMPLES = 12  # per operation


def _app() -> Any:
    """The app on a store in a temp dir, with a run that has steps and checkpoints (so some
    reads find one).  Built when the module is collected: schemathesis' lazy loading
    (``from_fixture``) does not work with pytest 9."""
    database = make_database(f"sqlite:///{_DIR.name}/fuzz.db")
    metadata.create_all(database.engine)
    app = create_app(make_settings(admin_token=ADMIN["Authorization"].split()[1]), db=database,
                     upgrade_schema=False, start_evaluator=False)
    with TestClient(app) as c:
        run_with_checkpoints(c)
    return app


ADMIN = {"Authorization": "Bearer fuzz-admin-secret"}
_DIR = tempfile.TemporaryDirectory(prefix="tw-fuzz-")
APP = _app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    APP.state.db.dispose()
    _DIR.cleanup()


@schema.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_the_api_keeps_its_openapi_promises(case: Any) -> None:
    agent_route = case.path in ("/api/v1/agents/register", "/api/v1/ingest")
    headers = AGENT if agent_route else (
        ADMIN if case.path.startswith("/api/v1/tokens") else OPERATOR)
    case.call_and_validate(headers=headers,
                           checks=[not_a_server_error, response_schema_conformance])
