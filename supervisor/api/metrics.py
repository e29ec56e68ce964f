"""``GET /metrics``: the Prometheus exposition of the registry
``trainwarden.supervisor.observability.metrics.install`` built (store gauges read at scrape
time, request counters, overload and leadership)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response, status
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from trainwarden.supervisor.api.deps import ReadAuth, reads_are_public

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, include_in_schema=True)
def metrics(request: Request, auth: ReadAuth) -> Response:
    """Prometheus text exposition (store gauges read at scrape time).  Every run is in
    it: a token scoped to some runs is refused (403) unless reads are public."""
    if auth.scope is not None and not reads_are_public(request):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"token {auth.token!r} is scoped to {auth.scope!r}: /metrics holds every "
            "run; scrape it with an unscoped viewer token")
    registry: CollectorRegistry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
