"""``trainwarden plan`` as a user runs it: the real command, its JSON, its tables, without the
supervisor's packages, and ``--check`` against a real supervisor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.system import AGENT_TOKEN, OPERATOR_TOKEN, Supervisor

REPO = Path(__file__).resolve().parents[3]
SEVEN_B = ["--params", "7B", "--devices", "8"]


def plan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainwarden.supervisor.cli", "plan", *args],
                          cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_json_known_answers() -> None:
    out = plan(*SEVEN_B, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["bytes_per_param"]["total"] == 16
    # GiB, as nvidia-smi counts: 7B x 16 bytes = 112e9 bytes = 104.3 GiB on every device
    states = {r["strategy"]: round(r["states_gib"], 1) for r in doc["memory"]}
    assert states == {"ddp": 104.3, "zero1": 35.9, "zero2": 24.4, "zero3": 13.0}
    assert doc["device_memory_gib"] == 80 and doc["usable_memory_gib"] == 72.0
    # A card's size as its label gives it, under either spelling of the flag.
    for flag in ("--device-memory-gib", "--device-memory-gb"):
        out = plan(*SEVEN_B, flag, "40", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["usable_memory_gib"] == 36.0
    assert doc["assumptions"]["interconnect_gb_per_s"]["100gbe"] == 12.5


def test_terminal_tables() -> None:
    out = plan(*SEVEN_B, "--layers", "32", "--hidden", "4096", "--heads", "32",
               "--seq-len", "4096", "--vocab", "32000")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for heading in ("Bytes per parameter", "Memory per device", "Gradient sync per step",
                    "expected MFU", "Reliability", "EXPECTED ETTR"):
        assert heading in text, text
    assert "Memory per device (GiB; 72.0 usable of 80 after a 10% reserve" in text, text
    # STRATEGY (" *" marks the one chosen), MODEL STATES, ACTIVATIONS, TOTAL, FITS
    rows = {w[0]: [x for x in w[1:] if x != "*"] for line in text.splitlines()
            if (w := line.split())[:1] and w[0] in ("ddp", "zero1", "zero2", "zero3")}
    assert [rows[s][0] for s in ("ddp", "zero1", "zero2", "zero3")] == [
        "104.3", "35.9", "24.4", "13.0"], rows
    assert rows["ddp"][-1] == "no"
    assert any(line.startswith("10gbe") for line in text.splitlines())


def test_runs_without_the_supervisor_packages() -> None:
    # What a machine with only the agent has: importing the server stack fails.
    code = (
        "import sys, importlib.abc\n"
        "BLOCKED = ('fastapi', 'sqlalchemy', 'uvicorn', 'pydantic', 'pydantic_settings',\n"
        "           'httpx', 'prometheus_client', 'jinja2', 'alembic')\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(f'{name} is not installed here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import trainwarden.supervisor.cli.main as c\n"
        "raise SystemExit(c.main(['plan', '--params', '7B', '--seq-len', '2048']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Memory per device" in r.stdout


def test_bad_input_is_a_clear_error() -> None:
    out = plan("--devices", "8")
    assert out.returncode == 2
    assert "--params" in out.stderr
    out = plan("--params", "seven")
    assert out.returncode == 2 and "parameter count" in out.stderr


def test_listed_in_the_main_help() -> None:
    out = subprocess.run([sys.executable, "-m", "trainwarden.supervisor.cli", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert "plan" in out.stdout


def _feed_run(url: str, run: str) -> None:
    """One agent, two ranks: 40 steps at 4 steps/s with 4096 tokens per rank, and a heartbeat
    with an NVML reading of 30 and 31 GB in use."""
    agent = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    reg = httpx.post(f"{url}/api/v1/agents/register", headers=agent, timeout=10,
                     json={"run": run, "node": "n0", "hostname": "h0", "nproc_per_node": 2})
    reg.raise_for_status()
    t0 = time.time() - 20
    items: list[dict[str, Any]] = [
        {"type": "step", "attempt": 0, "rank": r, "local_rank": r, "world_size": 2, "step": s,
         "t": t0 + 0.25 * s, "loss": 1.0, "samples": 2, "tokens": 4096, "data_s": 0.01,
         "compute_s": 0.15, "step_s": 0.25} for s in range(40) for r in range(2)]
    items.append({"type": "heartbeat", "t": t0 + 10, "attempt": 0, "state": "running",
                  "workers": [], "gpus": {"available": True, "devices": [
                      {"index": 0, "name": "H100", "mem_used_bytes": 30_000_000_000,
                       "mem_total_bytes": 80_000_000_000},
                      {"index": 1, "name": "H100", "mem_used_bytes": 31_000_000_000,
                       "mem_total_bytes": 80_000_000_000}]}})
    batch = {"agent_id": reg.json()["agent_id"], "seq": reg.json()["next_seq"],
             "sent_at": t0, "attempt": 0, "items": items}
    agent["X-Trainwarden-Agent-Credential"] = reg.json()["credential"]
    httpx.post(f"{url}/api/v1/ingest", headers=agent, json=batch, timeout=10).raise_for_status()


def test_check_against_a_live_run(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "sup").start()
    try:
        _feed_run(sup.url, "planned")
        # The documented defaults: the URL and the token from the environment.
        out = plan("--params", "1B", "--devices", "2", "--seq-len", "2048", "--json",
                   "--check", "planned",
                   env={"TRAINWARDEN_URL": sup.url, "TRAINWARDEN_OPERATOR_TOKEN": OPERATOR_TOKEN})
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        rows = {r["quantity"].split(" (")[0]: r for r in doc["check"]["rows"]}
        assert abs(rows["step time s"]["measured"] - 0.25) < 0.01
        # 31e9 bytes in use, in GiB as nvidia-smi would show it
        assert abs(rows["memory per device GiB"]["measured"] - 31e9 / 2**30) < 1e-9
        assert rows["ranks"]["measured"] == 2.0
        tokens_per_s = 2 * 4096 * 4.0
        assert abs(rows["MFU"]["measured"]
                   - tokens_per_s * doc["flops_per_token"] / (2 * doc["peak_flops"])) < 1e-3
        text = plan("--params", "1B", "--devices", "2", "--check", "planned",
                    "--supervisor", sup.url, "--token", OPERATOR_TOKEN)
        assert text.returncode == 0, text.stderr
        assert "Plan against run planned" in text.stdout
        missing = plan("--params", "1B", "--check", "nope", "--supervisor", sup.url,
                       "--token", OPERATOR_TOKEN)
        assert missing.returncode != 0 and "404" in missing.stderr
    finally:
        sup.stop()
