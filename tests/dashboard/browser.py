"""Reusable helpers for real-browser tests: Debian's Chromium driven by Playwright, the
supervisor as a real subprocess (or an app served in a thread), screenshots.

Never ``playwright install``: the tests use ``/usr/bin/chromium`` (``apt-get install -y
chromium``) and skip with the reason when it or the ``playwright`` package is missing."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.waiting import wait_for

CHROMIUM = os.environ.get("TRAINWARDEN_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"


def require_browser() -> None:
    """Skip the calling test unless Playwright and Debian's Chromium are both present."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install -c constraints.txt playwright)")
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)")


# Every Content-Security-Policy violation, as a console error the tests see (Chromium logs
# most of them itself; this also catches the ones it reports only to the page).
CSP_LISTENER = """document.addEventListener("securitypolicyviolation", function (e) {
  console.error("CSP violation: " + e.violatedDirective + " blocked " + e.blockedURI);
});"""


@contextlib.contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A fresh Chromium page (console errors and CSP violations collected in
    ``page.errors``)."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            context.add_init_script(CSP_LISTENER)
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.errors = errors  # type: ignore[attr-defined]
            yield page
        finally:
            browser.close()


def screenshot(page: Any, name: str, full_page: bool = True) -> Path:
    """A PNG under ``test-artifacts/`` (gitignored): the full page, or what the window
    shows (``full_page=False``: the docs' pictures)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


def login(page: Any, base_url: str, token: str, path: str = "/") -> None:
    """Log in through the dashboard's form (sets the HttpOnly read cookie)."""
    page.goto(f"{base_url}/login")
    page.fill("input[name=token]", token)
    page.click("form.login button[type=submit]")
    page.wait_for_load_state()
    if path != "/":
        page.goto(base_url + path)


def wait_for_charts(page: Any, timeout_ms: int = 15_000) -> None:
    """Until the run page's script drew its first data (the loss chart's canvas)."""
    page.wait_for_selector("#run[data-loaded='1']", timeout=timeout_ms)
    page.wait_for_selector("#chart-loss canvas", timeout=timeout_ms)




@dataclass
class Supervisor:
    base_url: str
    proc: subprocess.Popen[bytes]
    agent_token: str
    operator_token: str

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=10)


@contextlib.contextmanager
def supervisor_process(data_dir: Path, *, agent_token: str, operator_token: str,
                       extra_args: list[str] | None = None,
                       env: dict[str, str] | None = None) -> Iterator[Supervisor]:
    """``python -m trainwarden.supervisor.cli.main supervisor`` on a free port (read from its port
    file)."""
    port_file = data_dir / "port"
    full_env = {**os.environ, **(env or {}), "TRAINWARDEN_AGENT_TOKEN": agent_token,
                "TRAINWARDEN_OPERATOR_TOKEN": operator_token}
    log = open(data_dir / "supervisor.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor",
         "--data-dir", str(data_dir),
         "--port", "0", "--port-file", str(port_file), "--log-level", "warning",
         *(extra_args or [])],
        cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def port() -> int | None:
            if proc.poll() is not None:
                raise AssertionError(f"supervisor exited {proc.returncode}: "
                                     f"{(data_dir / 'supervisor.log').read_text()}")
            return int(port_file.read_text()) if port_file.exists() else None

        p = wait_for(port, 60, "the supervisor's port file")
        yield Supervisor(f"http://127.0.0.1:{p}", proc, agent_token, operator_token)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free loopback port; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        wait_for(lambda: server.started, 30, "uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(timeout=10)


def rollback_via_form(page: Any, *, checkpoint_step: int, operator_token: str, reason: str,
                      skip: str = "", lr_scale: float | None = None,
                      lr_scale_steps: int | None = None, lr_ramp_steps: int | None = None,
                      screenshot_name: str | None = None) -> None:
    """On an open run page: "roll back here" on the checkpoint of ``checkpoint_step``, fill
    the dialog (``skip`` as "FROM-TO, FROM-TO"), confirm.  Follow the action with
    ``wait_for_rollback``."""
    row = page.locator("#checkpoints tbody tr").filter(
        has=page.locator(f"form.rollback[data-step='{checkpoint_step}']"))
    row.locator("button", has_text="roll back here").first.click()
    page.locator("#rollback-dialog").wait_for(state="visible")
    fields = {"skip": skip, "reason": reason, "operator_token": operator_token,
              "lr_scale": lr_scale, "lr_scale_steps": lr_scale_steps,
              "lr_ramp_steps": lr_ramp_steps}
    for name, v in fields.items():
        if v is not None:
            page.fill(f"#rollback-form input[name={name}]", str(v))
    if screenshot_name:
        screenshot(page, screenshot_name)
    page.click("#rollback-confirm")


def wait_for_rollback(page: Any, status: str = "resumed", timeout_ms: int = 60_000) -> str:
    """Until the page's action progress box shows ``status``; returns its text."""
    page.wait_for_selector(f"#rollback-progress[data-status={status}]", timeout=timeout_ms)
    text: str = page.locator("#rollback-progress").inner_text()
    return text
