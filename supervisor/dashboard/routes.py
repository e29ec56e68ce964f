"""Dashboard routes: server-rendered pages (usable without JavaScript) and the small JSON
feeds of the live charts.  Reads follow the supervisor's read rule (``TokenCheck("read")``),
with the browser's token in an HttpOnly cookie (see ``auth``)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from trainwarden.supervisor.api.deps import (
    DB,
    ClockDep,
    Principal,
    ReadAuth,
    Settings,
    Straggler,
    reads_are_public,
)
from trainwarden.supervisor.api.responses import RunSeries, RunState, documented
from trainwarden.supervisor.dashboard import auth, etag, views
from trainwarden.supervisor.detect.straggler import StragglerConfig
from trainwarden.supervisor.observability import efficiency
from trainwarden.supervisor.store import hosts, reads, registry
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import RunRow

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(include_in_schema=False)
POLL_MS = 2000


# ---------------------------------------------------------------------------------------------
# template filters


# The filters take anything a row may hold (None, a string, an undefined key, a time no
# clock could give): what is not a finite number reads "n/a", never an error.


def _real(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        v = float(x)
    except OverflowError:  # an int beyond any float
        return math.copysign(math.inf, x)
    return v if math.isfinite(v) else None


def fmt_age(seconds: float | None) -> str:
    s = _real(seconds)
    if s is None:
        return "n/a"
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def fmt_ts(t: float | None) -> str:
    """A unix time as UTC; a time no calendar holds (non-finite, before year 1 or after
    9999: a broken clock) as "invalid time", never an error."""
    if t is None:
        return ""
    try:
        return dt.datetime.fromtimestamp(float(t), dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, ValueError, OSError, TypeError):
        return "invalid time"


def fmt_bytes(n: float | None) -> str:
    x = _real(n)
    if x is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} PiB"


def fmt_num(x: float | None, digits: int = 3) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)
    if not isinstance(x, float):
        return "n/a"
    return f"{x:.{digits}g}"


def fmt_pct(x: float | None, digits: int = 1) -> str:
    """A ratio as a percentage (0.42 -> "42.0 %"); not a finite number: "n/a"."""
    v = _real(x)
    return "n/a" if v is None else f"{v * 100:.{digits}f} %"


def fmt_json(x: Any) -> str:
    return json.dumps(x, indent=2, sort_keys=True, default=str)


templates.env.filters.update(age=fmt_age, ts=fmt_ts, bytes=fmt_bytes, num=fmt_num,
                             pct=fmt_pct, pretty=fmt_json)


# ---------------------------------------------------------------------------------------------
# auth for pages


def _login_page(request: Request, error: str = "", code: int = 401) -> HTMLResponse:
    nxt = request.url.path if request.url.path != "/login" else "/"
    return templates.TemplateResponse(
        request, "login.html", {"error": error, "next": nxt, "principal": None},
        status_code=code)


async def _page_auth(request: Request) -> Response | Principal:
    """The principal, or the response to send instead (login page, or the redirect that
    drops a ``?token=`` from the address after storing it in the cookie)."""
    token = request.query_params.get("token")
    if token is not None:
        if not auth.valid_token_text(token) or await auth.check(request, token) is None:
            return _login_page(request, "invalid token")
        rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
        url = request.url.path + (f"?{urlencode(rest)}" if rest else "")
        resp = RedirectResponse(url, status.HTTP_303_SEE_OTHER)
        auth.set_cookie(resp, request, token)
        return resp
    principal = await auth.check(request)
    if principal is None:
        return _login_page(request)
    return principal


def _safe_next(nxt: str) -> str:
    return nxt if nxt.startswith("/") and not nxt.startswith("//") and "\\" not in nxt else "/"


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request) -> HTMLResponse:
    return _login_page(request, code=200)


@router.post("/login")
async def login(request: Request) -> Response:
    if not auth.same_origin(request):
        # A cross-site form would sign this browser in with the forger's token (login CSRF).
        return _login_page(request, auth.CROSS_SITE, status.HTTP_403_FORBIDDEN)
    token = await auth.form_token(request)
    nxt = _safe_next(request.query_params.get("next", "/"))
    if not auth.valid_token_text(token) or await auth.check(request, token) is None:
        return _login_page(request, "invalid token")
    resp = RedirectResponse(nxt, status.HTTP_303_SEE_OTHER)
    auth.set_cookie(resp, request, token)
    return resp


@router.post("/logout")
async def logout(request: Request) -> Response:
    if not auth.same_origin(request):
        return _login_page(request, auth.CROSS_SITE, status.HTTP_403_FORBIDDEN)
    resp = RedirectResponse("/login", status.HTTP_303_SEE_OTHER)
    auth.clear_cookie(resp)
    return resp


@router.get("/docs", response_class=HTMLResponse)
def api_docs(request: Request) -> Response:
    """Swagger UI over ``/openapi.json``, from the vendored assets (no CDN, no inline
    script)."""
    return templates.TemplateResponse(request, "docs.html",
                                      {"openapi_url": request.app.openapi_url})


# ---------------------------------------------------------------------------------------------
# pages


def _run_or_404(conn: Connection, name: str) -> RunRow:
    run = registry.get_run_by_name(conn, name=name)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown run {name!r}")
    return run


def _run_context(db: Any, name: str, now: float, straggler: StragglerConfig, live_s: float
                 ) -> dict[str, Any]:
    with db.read() as conn:
        r = _run_or_404(conn, name)
        return {"run": views.run_row(conn, r, now),
                **views.run_tables(conn, r, now, straggler, live_s)}


@router.get("/", response_class=HTMLResponse)
async def runs_page(request: Request, db: DB, clock: ClockDep) -> Response:
    who = await _page_auth(request)
    if isinstance(who, Response):
        return who
    now = clock()

    def read() -> list[dict[str, Any]]:
        with db.read() as conn:
            return views.runs_overview(
                conn, now, lambda name: auth.readable(request, who, name))

    rows = await run_in_threadpool(read)
    return templates.TemplateResponse(
        request, "runs.html", {"runs": rows, "now": now, "principal": who.role})


@router.get("/hosts", response_class=HTMLResponse)
async def hosts_page(request: Request, db: DB, clock: ClockDep, settings: Settings) -> Response:
    """The health ledger's nodes, with cordon and uncordon for a signed-in operator (the
    dialog sends the operator token itself, as the rollback form does)."""
    who = await _page_auth(request)
    if isinstance(who, Response):
        return who
    if who.scope is not None and not reads_are_public(request):
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"token {who.token!r} is scoped to {who.scope!r}: hosts serve "
                            "every run; sign in with a token without a run scope")
    now = clock()
    window = settings.cordon.window_s

    def read() -> list[Any]:
        with db.read() as conn:
            return list(hosts.host_summaries(conn, since=now - window))

    rows = await run_in_threadpool(read)
    return templates.TemplateResponse(
        request, "hosts.html",
        {"hosts": rows, "now": now, "window_s": window, "principal": who.role,
         "can_act": who.role in ("operator", "admin") and who.scope is None})


@router.get("/runs/{run}", response_class=HTMLResponse)
async def run_page(run: str, request: Request, db: DB, clock: ClockDep,
                   straggler: Straggler, settings: Settings) -> Response:
    who = await _page_auth(request)
    if isinstance(who, Response):
        return who
    auth.require_run(request, who, run)
    now = clock()
    ctx = await run_in_threadpool(_run_context, db, run, now, straggler,
                                  settings.node_lost.deadline_s)
    return templates.TemplateResponse(
        request, "run.html", {**ctx, "now": now, "principal": who.role, "poll_ms": POLL_MS})


@router.get("/runs/{run}/tables", response_class=HTMLResponse)
def run_tables(run: str, request: Request, db: DB, clock: ClockDep, straggler: Straggler,
               _auth: ReadAuth, settings: Settings) -> Response:
    """The run page's tables alone (the page's script swaps them in when the run changed)."""
    now = clock()
    ctx = _run_context(db, run, now, straggler, settings.node_lost.deadline_s)
    return templates.TemplateResponse(request, "_run_tables.html", {**ctx, "now": now})


# ---------------------------------------------------------------------------------------------
# JSON feeds of the page's script


@router.get("/dashboard/api/runs/{run}/state", responses=documented(RunState))
def run_state(run: str, request: Request, db: DB, clock: ClockDep, _auth: ReadAuth,
              settings: Settings) -> Response:
    """A cheap fingerprint of the run: the script polls this with If-None-Match and
    refetches charts and tables only when it changed (304 otherwise, before any other
    query).  A node falling silent past the node-lost deadline changes it (it reads lost)."""
    with db.read() as conn:
        r = _run_or_404(conn, run)
        fp = reads.run_fingerprint(conn, run_id=r["id"],
                                   live_since=clock() - settings.node_lost.deadline_s)
        restarts = efficiency.restart_counts(conn, int(r["id"])).total
    tag = '"' + hashlib.sha256(repr(fp).encode()).hexdigest()[:32] + '"'
    headers = {"ETag": tag, "Cache-Control": "private, no-cache", "Vary": "Authorization, Cookie"}
    if etag.matches(request.headers.get("if-none-match"), tag):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    body = {"run": run, "status": r["status"], "attempt": r["attempt"],
            "restarts": restarts, "version": tag.strip('"'), "now": clock()}
    return JSONResponse(body, headers=headers)


@router.get("/dashboard/api/runs/{run}/series", responses=documented(RunSeries))
def run_series(run: str, db: DB, straggler: Straggler, request: Request,
               _auth: ReadAuth) -> dict[str, Any]:
    """Chart extras: spike/rollback markers, per-rank phase times, the factor that turns
    throughput into MFU (null until the run declares FLOPs and the hardware peak), and the
    live goodput (as on ``GET /api/v1/runs/{run}``)."""
    with db.read() as conn:
        r = _run_or_404(conn, run)
        out = {"run": run, "markers": views.markers(conn, r["id"]),
               "ranks": views.rank_series(conn, r["id"], straggler),
               "mfu": views.mfu_feed(conn, r["id"])}
    evaluator = getattr(request.app.state, "evaluator", None)
    out["goodput"] = evaluator.goodput(int(r["id"])) if evaluator is not None else None
    return out
