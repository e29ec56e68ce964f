"""A supervisor that falls behind never makes its backlog the run's fault: the real
supervisor process is frozen (SIGSTOP) for longer than its node-lost deadline while two
nodes of a healthy run keep sending, then thawed.  Judged on when their batches arrived,
both nodes were silent past the deadline; judged as the supervisor does, it was behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.waiting import wait_for

AGENT, OPERATOR = "agent-token", "operator-token"
NODE_LOST_S = 4.0
FROZEN_S = 9.0  # > NODE_LOST_S: every node looks lost on the supervisor's own clock


def test_a_frozen_supervisor_restarts_nothing_and_says_it_was_overloaded(
        tmp_path: Path, repo_root: Path) -> None:
    port_file = tmp_path / "port"
    env = {**os.environ, "TRAINWARDEN_AGENT_TOKEN": AGENT,
           "TRAINWARDEN_OPERATOR_TOKEN": OPERATOR, "TRAINWARDEN_NODE_LOST_S": str(NODE_LOST_S)}
    log = (tmp_path / "supervisor.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor", "--port", "0",
         "--data-dir", str(tmp_path / "data"), "--port-file", str(port_file)],
        cwd=repo_root, env=env, stdout=log, stderr=subprocess.STDOUT)
    stop = threading.Event()
    advised: list[float] = []  # the batch intervals the supervisor's replies asked for
    senders: list[threading.Thread] = []
    errors: list[BaseException] = []
    try:
        port = wait_for(lambda: proc.poll() is None and port_file.exists()
                        and port_file.read_text().strip(), 30, "the supervisor's port file")
        url = f"http://127.0.0.1:{port}/api/v1"
        op = {"Authorization": f"Bearer {OPERATOR}"}

        def node(name: str, rank: int) -> None:
            try:
                with httpx.Client(base_url=url, timeout=60,
                                  headers={"Authorization": f"Bearer {AGENT}"}) as c:
                    reg = c.post("/agents/register", json={
                        "run": "healthy", "node": name, "hostname": name, "pid": 1,
                        "command": ["torchrun", "--nnodes=8"], "nproc_per_node": 1}).json()
                    cred = {"X-Trainwarden-Agent-Credential": reg["credential"]}
                    seq, step = reg["next_seq"], 0
                    while not stop.is_set():  # like the agent: a batch every half second
                        now = time.time()
                        items = [{"type": "step", "attempt": 0, "rank": rank,
                                  "local_rank": 0, "world_size": 2, "step": step, "t": now,
                                  "loss": 2.0, "samples": 8, "data_s": 0.01,
                                  "compute_s": 0.2, "step_s": 0.5, "batch_index": step},
                                 {"type": "heartbeat", "t": now, "attempt": 0,
                                  "state": "running"}]
                        while True:  # like the agent's uplink: the same batch again
                            try:
                                r = c.post("/ingest", headers=cred, content=json.dumps(
                                    {"agent_id": reg["agent_id"], "seq": seq,
                                     "sent_at": time.time(), "attempt": 0, "items": items}))
                                break
                            except httpx.TransportError:  # the frozen server's timeouts
                                stop.wait(0.5)
                        assert r.status_code == 200, r.text
                        seq, step = seq + 1, step + 1
                        every = r.json().get("batch_interval_s")  # backpressure, as the agent
                        if every is not None:
                            advised.append(every)
                        stop.wait(every or 0.5)
            except BaseException as e:  # reported by the test thread
                errors.append(e)

        senders = [threading.Thread(target=node, args=(f"n{r}", r), daemon=True)
                   for r in (0, 1)]
        for t in senders:
            t.start()

        def steps() -> int:
            assert not errors, errors  # a node that stopped sending fails the test now
            r = httpx.get(f"{url}/runs/healthy", headers=op, timeout=10)
            return int(r.json().get("step") or 0) if r.status_code == 200 else 0

        wait_for(lambda: steps() >= 10, 60, "10 steps of the healthy run")
        proc.send_signal(signal.SIGSTOP)
        time.sleep(FROZEN_S)  # the fault: a supervisor that cannot keep up for 9 s
        proc.send_signal(signal.SIGCONT)
        thawed_at = steps()

        def events() -> list[str]:
            r = httpx.get(f"{url}/runs/healthy/events", headers=op, timeout=10)
            return [e["name"] for e in r.json()["events"]]

        wait_for(lambda: "supervisor_overload_ended" in events(), 60,
                 "the supervisor to keep up again")
        # and twice the node-lost deadline after it recovered (the longer one for the
        # longer batch interval it asked for: 3 batches), still healthy
        assert advised and max(advised) == 4.0, advised
        wait_for(lambda: steps() >= thawed_at + 6, 90, "six batches more of each node")
        assert not errors, errors
        incidents = httpx.get(f"{url}/runs/healthy/incidents", headers=op).json()["incidents"]
        assert incidents == []
        actions = httpx.get(f"{url}/runs/healthy/actions", headers=op).json()["actions"]
        assert actions == []
        assert "supervisor_overloaded" in events()
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=op).text
        assert "trainwarden_supervisor_overloaded 0.0" in metrics
    finally:
        stop.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(timeout=15)
        for t in senders:
            t.join(timeout=10)
        log.close()
