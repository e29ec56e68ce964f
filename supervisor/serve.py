"""Run the app under uvicorn (the ``trainwarden supervisor`` command's body)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import uvicorn

from supervisor.app import create_app
from supervisor.config import SupervisorSettings

log = logging.getLogger("trainwarden.supervisor")


def serve(settings: SupervisorSettings, *, port_file: str | None = None) -> int:
    server_cfg = settings.server
    logging.basicConfig(level=server_cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port,
                            log_level=server_cfg.log_level, access_log=False)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            log.info("trainwarden supervisor on http://%s:%s (db %s)", server_cfg.host, port,
                     settings.db.database_url.split("@")[-1])
            if port_file:
                tmp = Path(port_file + ".tmp")
                tmp.write_text(str(port))
                tmp.replace(port_file)  # atomic: a reader never sees a half-written file
        await task

    asyncio.run(main())
    return 0 if server.started else 1
