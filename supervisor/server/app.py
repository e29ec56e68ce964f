"""``create_app``: the FastAPI application of the supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from fastapi import FastAPI, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi

from trainwarden.supervisor import dashboard
from trainwarden.supervisor.api import agents, hosts, rollback, runs, tokens
from trainwarden.supervisor.api import metrics as api_metrics
from trainwarden.supervisor.api.deps import (
    CREDENTIAL_REFRESH_S,
    DB,
    AgentCredentials,
    ReadAuth,
    StoredTokens,
)
from trainwarden.supervisor.api.errors import SafeJSONResponse, validation_error_response
from trainwarden.supervisor.api.json_bodies import JsonApiBodies
from trainwarden.supervisor.api.responses import EvaluatorStatus, Health, documented
from trainwarden.supervisor.clock import Clock
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.contract import wire
from trainwarden.supervisor.contract.limits import BodySizeLimit
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.control.fleet_sync import FleetSync, make_fleet
from trainwarden.supervisor.control.leader import Leadership, LedEvaluator
from trainwarden.supervisor.control.observer import ObserverProcess, can_run_apart
from trainwarden.supervisor.ingest.delivery import DeliveryMonitor
from trainwarden.supervisor.ingest.writer import IngestWriter
from trainwarden.supervisor.observability import metrics
from trainwarden.supervisor.server.headers import SecurityHeaders
from trainwarden.supervisor.server.ingest_path import IngestPath
from trainwarden.supervisor.store import lease as lease_store
from trainwarden.supervisor.store import reads
from trainwarden.supervisor.store.db import Database, make_database
from trainwarden.supervisor.store.registry import RunTransitionRefused

log = logging.getLogger("trainwarden.supervisor")

API_PREFIX = "/api/v1"


def _still() -> float:
    """A monotonic clock that does not move (see ``create_app``)."""
    return 0.0


async def _validation_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return validation_error_response(exc.errors())


async def _transition_refused(_request: Request, exc: Exception) -> Response:
    """A route's run status change that another writer's commit (the evaluator, another
    replica) made impossible between the route's read and its write: its transaction was
    rolled back, so nothing was done."""
    assert isinstance(exc, RunTransitionRefused)
    return SafeJSONResponse(status_code=status.HTTP_409_CONFLICT,
                            content={"detail": f"nothing done: {exc}"})


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The generated document plus what the lean routes do not declare themselves: the
    bearer scheme, and the ingest body's schema."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description=app.description)
    comps = schema.setdefault("components", {})
    comps.setdefault("securitySchemes", {})["bearer"] = {
        "type": "http", "scheme": "bearer",
        "description": "agent token (register, ingest, reads) or operator token (all)",
    }
    schema["security"] = [{"bearer": []}]
    batch = wire.IngestBatch.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas = comps.setdefault("schemas", {})
    for name, d in batch.pop("$defs", {}).items():
        schemas.setdefault(name, d)
    schemas["IngestBatch"] = batch
    app.openapi_schema = schema
    return schema


class SupervisorApp(FastAPI):
    """FastAPI with a ``front``: an ASGI app that every request meets first, ahead of
    FastAPI's own layers (error pages, telemetry, its body limit), and that passes on what
    it does not answer itself to the app as usual."""

    front: Any = None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any
                       ) -> None:
        if self.front is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self  # (what Starlette sets: the front's requests reach app.state)
        await self.front(scope, receive, send)


def create_app(
    settings: SupervisorSettings,
    *,
    db: Database | None = None,
    clock: Clock = time.time,
    upgrade_schema: bool = True,
    start_evaluator: bool = True,
) -> FastAPI:
    """Build the app.  Start-up (the lifespan) upgrades the schema and starts the evaluator
    thread when asked; tests pass their own ``db``/``clock`` and drive ``Evaluator.tick``.

    The supervisor watches its own timing (its event loop's lag, the gap between ticks) on
    the real monotonic clock when it runs on the real wall clock.  A caller that drives a
    clock of its own drives time: the real machine's stalls are not that world's, so its
    own timing is measured on a clock that stands still (never an overload)."""
    database = db if db is not None else make_database(settings.db.database_url)
    detection = settings.detection_config()
    delivery = DeliveryMonitor(
        detection.overload, monotonic=time.monotonic if clock is time.time else _still)
    evaluator = Evaluator(database, settings.policy_config(), clock=clock,
                          detection=detection, delivery=delivery,
                          retention=settings.retention, cordon=settings.cordon)

    writer = IngestWriter(database, clock, cfg=settings.ingest)
    # On Postgres, replicas share the store and one of them (the lease's holder) evaluates.
    leadership = Leadership(database, settings.lease, clock=clock)
    fleet = make_fleet(settings.fleet)
    fleet_sync = (FleetSync(database, fleet, settings.fleet, clock=clock,
                            leading=lambda: not leadership.shared or leadership.leading)
                  if fleet is not None else None)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if upgrade_schema:
            from trainwarden.supervisor.store import migrate

            migrate.upgrade(database.engine.url.render_as_string(hide_password=False))
        stop = th = None
        if start_evaluator:
            if settings.evaluator.observer == "process" and can_run_apart(database.url):
                evaluator.observer = ObserverProcess(database.url, detection)
            if leadership.shared:
                th, stop = LedEvaluator(evaluator, leadership,
                                        settings.evaluator.interval_s).start()
            else:
                th, stop = evaluator.start(settings.evaluator.interval_s)
        fleet_th = fleet_stop = None
        if fleet_sync is not None and start_evaluator:
            fleet_th, fleet_stop = fleet_sync.start()
        beat = asyncio.create_task(delivery.beat_forever())  # the event loop's lag
        try:
            yield
        finally:
            beat.cancel()
            if fleet_stop is not None and fleet_th is not None:
                fleet_stop.set()
                fleet_th.join(timeout=10)
            if stop is not None and th is not None:
                stop.set()
                # its last tick, the observer process stopped, and on Postgres the lease
                # released on the way out: a standby leads at once
                th.join(timeout=10)
            writer.stop()
            if db is None:
                database.dispose()

    app = SupervisorApp(
        title="trainwarden supervisor",
        version="1",
        # /docs is the dashboard's own page (vendored Swagger UI, see dashboard.routes);
        # FastAPI's pages would load Swagger UI and ReDoc from a CDN through inline scripts.
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        default_response_class=SafeJSONResponse,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.db = database
    app.state.clock = clock
    app.state.evaluator = evaluator
    app.state.delivery = delivery
    app.state.leadership = leadership
    app.state.ingest_writer = writer
    # Replicas on one Postgres: a credential another replica replaced or revoked is
    # refused here within CREDENTIAL_REFRESH_S.
    creds = app.state.agent_credentials = AgentCredentials(
        refresh_s=None if database.is_sqlite else CREDENTIAL_REFRESH_S, clock=clock)
    evaluator.on_revoked = creds.forget_agents  # an ended run's, at once in this process
    app.state.stored_tokens = StoredTokens()
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(RunTransitionRefused, _transition_refused)
    # (FastAPI's documented way to customise the OpenAPI document)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.include_router(agents.router, prefix=API_PREFIX)
    app.include_router(runs.router, prefix=API_PREFIX)
    app.include_router(rollback.router, prefix=API_PREFIX)
    app.include_router(tokens.router, prefix=API_PREFIX)
    app.include_router(hosts.router, prefix=API_PREFIX)

    # response_model=None: rendered as every API answer is (SafeJSONResponse), declared by
    # ``responses=`` (``trainwarden.supervisor.api.responses``).
    @app.get("/healthz", tags=["health"], response_model=None, responses=documented(Health))
    @app.get(API_PREFIX + "/healthz", tags=["health"], include_in_schema=False,
             response_model=None, responses=documented(Health))
    def healthz(db: DB) -> dict[str, str]:
        """Liveness plus a database round trip; no token needed."""
        with db.read() as conn:
            reads.ping(conn)
        return {"status": "ok"}

    @app.get(API_PREFIX + "/evaluator", tags=["health"], response_model=None,
             responses=documented(EvaluatorStatus))
    def evaluator_status(db: DB, _auth: ReadAuth) -> dict[str, Any]:
        """Which replica runs the evaluator: this replica's id and whether it leads (with
        the lease epoch it leads under), and the lease as the store holds it (``lease``:
        null on SQLite, where the one process always leads)."""
        out: dict[str, Any] = dict(leadership.status())
        out["lease"] = None
        if leadership.shared:
            with db.read() as conn:
                held = lease_store.current(conn)
                now = lease_store.database_time(conn)
            if held is not None and now is not None:
                out["lease"] = {"holder": held["holder"], "epoch": int(held["epoch"]),
                                "acquired_at": held["acquired_at"],
                                "expires_in_s": round(held["expires_at"] - now, 3)}
        return out

    app.add_middleware(JsonApiBodies)  # curl -d's default form type carries JSON too
    # Outside it: oversized bodies are refused before anything parses them.
    app.add_middleware(BodySizeLimit, max_bytes=settings.server.max_body_bytes)
    # Dashboard pages and static files; /metrics and its request metrics (outermost).
    dashboard.mount(app)
    metrics.install(app, db=database, clock=clock, policy_cfg=evaluator.cfg,
                    straggler=evaluator.detection.straggler, goodput=evaluator.goodput,
                    judge_failures=evaluator.run_failures, overload=evaluator.overload_state,
                    leader=leadership.status, live_s=settings.node_lost.deadline_s,
                    fleet=(lambda: fleet_sync.status) if fleet_sync is not None else None)
    app.include_router(api_metrics.router)
    app.add_middleware(SecurityHeaders)  # on every response, 413s and /metrics too
    # Ahead of everything, FastAPI's own layers too: the ingest route, answered without the
    # stack (it does what the stack's layers would do for it itself).
    app.front = IngestPath(functools.partial(FastAPI.__call__, app),
                           max_bytes=settings.server.max_body_bytes,
                           counters=app.state.request_counters)
    return app
