"""Run the app under uvicorn (the ``trainwarden supervisor`` command's body)."""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import uvicorn

from trainwarden.supervisor import heap
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.server.httpguard import guarded_protocol
from trainwarden.supervisor.store.db import open_error

log = logging.getLogger("trainwarden.supervisor")

# File descriptors kept free beyond the connection cap (database, logs, static files).
_FD_MARGIN = 256


def uvicorn_config(app: Any, settings: SupervisorSettings) -> uvicorn.Config:
    """The server's configuration: the read deadlines, keep-alive and connection cap of the
    settings (used by ``serve`` and by the tests that drive a real server)."""
    server, http = settings.server, settings.http
    return uvicorn.Config(
        app, host=server.host, port=server.port, log_level=server.log_level,
        access_log=False,
        http=guarded_protocol(header_timeout_s=http.header_timeout_s,
                              body_timeout_s=http.body_timeout_s),
        timeout_keep_alive=http.keep_alive_s,
        # uvicorn counts the connection asking too, and answers 503 at >= its limit.
        limit_concurrency=http.max_connections + 1,
    )


def raise_fd_limit(connections: int) -> None:
    """Lift the soft open-file limit towards what the connection cap needs (a cap above the
    limit would fail accepts with EMFILE instead of answering 503)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + _FD_MARGIN
    if soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError) as e:
        new = soft
        log.warning("cannot raise the open-file limit (%s)", e)
    if new < want:
        log.warning("open-file limit %d is below the %d that http.max_connections=%d needs: "
                    "raise it (ulimit -n, LimitNOFILE=) or lower the cap", new, want,
                    connections)


def serve(settings: SupervisorSettings, *, port_file: str | None = None) -> int:
    """Run until stopped; 0 once served, 1 if the server did not start, 2 when the store
    cannot be opened (said in one line on stderr)."""
    problem = open_error(settings.db.database_url)
    if problem is not None:
        print(f"trainwarden: {problem}", file=sys.stderr)
        return 2
    server_cfg = settings.server
    logging.basicConfig(level=server_cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_fd_limit(settings.http.max_connections)
    server = uvicorn.Server(uvicorn_config(create_app(settings), settings))

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            log.info("trainwarden supervisor on http://%s:%s (db %s)", server_cfg.host, port,
                     settings.db.database_url.split("@")[-1])
            log.info("heap settled: %d objects of the startup frozen", heap.settle())
            if port_file:
                tmp = Path(port_file + ".tmp")
                tmp.write_text(str(port))
                tmp.replace(port_file)  # atomic: a reader never sees a half-written file
        await task

    asyncio.run(main())
    return 0 if server.started else 1
