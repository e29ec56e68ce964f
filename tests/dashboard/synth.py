"""A synthetic training run fed through the real HTTP API (TestClient or a live server):
steps of several ranks on several nodes, an optional loss spike and slow rank, checkpoints,
heartbeats with free disk.  Shared by the dashboard, metrics and browser tests."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import httpx

AGENT_TOKEN = "agent-secret"
OPERATOR_TOKEN = "operator-secret"
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


@dataclass
class SynthRun:
    """Agents of one run and their next batch sequence numbers."""

    client: httpx.Client
    name: str
    nodes: int = 2
    ranks_per_node: int = 2
    agents: dict[int, int] = field(default_factory=dict)  # node index -> agent id
    seq: dict[int, int] = field(default_factory=dict)
    credentials: dict[int, str] = field(default_factory=dict)  # node index -> its secret

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def register(self, checkpoint_root: str = "/ckpt") -> SynthRun:
        for n in range(self.nodes):
            r = self.client.post("/api/v1/agents/register", headers=AGENT, json={
                "run": self.name, "node": f"n{n}", "hostname": f"host-{n}", "pid": 100 + n,
                "command": ["torchrun", f"--nnodes={self.nodes}", "train.py"],
                "nproc_per_node": self.ranks_per_node,
                "checkpoint_root": checkpoint_root})
            assert r.status_code == 200, r.text
            self.agents[n] = int(r.json()["agent_id"])
            self.seq[n] = int(r.json()["next_seq"])
            self.credentials[n] = str(r.json()["credential"])
        return self

    def send(self, node: int, items: list[dict[str, Any]], attempt: int = 0) -> dict[str, Any]:
        # json.dumps, not httpx's json=: the wire carries NaN tokens, which httpx refuses.
        body = json.dumps({"agent_id": self.agents[node], "seq": self.seq[node],
                           "attempt": attempt, "items": items})
        self.seq[node] += 1
        r = self.client.post("/api/v1/ingest", content=body,
                             headers={**AGENT, "content-type": "application/json",
                                      "X-Trainwarden-Agent-Credential": self.credentials[node]})
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def train(self, steps: range, *, t0: float, attempt: int = 0, dt: float = 1.0,
              spike: tuple[int, int] | None = None, spike_to: float | None = None,
              nan_at: int | None = None, slow_rank: int | None = None, checkpoint_every: int = 0,
              disk_free: int = 50 * 2**30, disk_total: int | None = 100 * 2**30,
              gpus: dict[str, Any] | None = None, nodes: range | None = None,
              clock: Any = None) -> None:
        """Report ``steps`` from every rank of ``nodes`` (all of them unless given; one batch
        per node per 10 steps).  ``spike_to``: the loss inside ``spike`` (default: 6 above
        the curve).  ``clock`` (a ``FakeClock``): each batch is received when its heartbeat
        was made (the clock moves forward to it), as a live agent's are."""
        for chunk_start in range(steps.start, steps.stop, 10):
            chunk = range(chunk_start, min(chunk_start + 10, steps.stop))
            for n in nodes if nodes is not None else range(self.nodes):
                items: list[dict[str, Any]] = []
                for s in chunk:
                    for lr in range(self.ranks_per_node):
                        rank = n * self.ranks_per_node + lr
                        items.append(step_item(rank, s, t=t0 + s * dt, attempt=attempt,
                                               local_rank=lr, world=self.world,
                                               loss=loss_at(s, rank, spike, nan_at, spike_to),
                                               slow=rank == slow_rank))
                    if n == 0 and checkpoint_every and s and s % checkpoint_every == 0:
                        items.append({"type": "checkpoint", "attempt": attempt, "rank": 0,
                                      "t": t0 + s * dt, "step": s,
                                      "path": f"/ckpt/{self.name}/step-{s:06d}",
                                      "bytes": 123_456_789, "save_s": 1.5,
                                      "lineage": f"a{attempt}"})
                beat = {"type": "heartbeat", "t": t0 + chunk[-1] * dt,
                        "attempt": attempt, "state": "running",
                        "disk_free_bytes": disk_free, "disk_total_bytes": disk_total,
                        "workers": [{"rank": n * self.ranks_per_node + lr,
                                     "pid": 1000 + n * self.ranks_per_node + lr,
                                     "cpu_percent": 99.0, "rss_bytes": 2**30}
                                    for lr in range(self.ranks_per_node)]}
                if gpus is not None:
                    beat["gpus"] = gpus
                items.append(beat)
                if clock is not None:
                    clock.now = max(clock.now, beat["t"])
                self.send(n, items, attempt=attempt)

    def declare_flops(self, *, flops_per_sample: float, peak_flops_per_rank: float,
                      baseline_per_device: float | None = None) -> None:
        """What ``trainwarden.agent.worker.declare_flops`` sends (rank 0's event)."""
        self.send(0, [{"type": "event", "rank": 0, "name": "flops_declared",
                       "details": {"flops_per_sample": flops_per_sample,
                                   "flops_per_token": None,
                                   "peak_flops_per_rank": peak_flops_per_rank,
                                   "baseline_per_device": baseline_per_device}}])

    def event(self, node: int, name: str, *, t: float, attempt: int, rank: int | None = None,
              step: int | None = None, details: dict[str, Any] | None = None) -> None:
        """One event as a worker (``rank``) or the node's agent (no rank) sends it."""
        item: dict[str, Any] = {"type": "event", "name": name, "t": t, "attempt": attempt,
                                "message": name, "details": details or {}}
        if rank is not None:
            item["rank"] = rank
        if step is not None:
            item["step"] = step
        self.send(node, [item], attempt=attempt)

    def restart_milestones(self, *, attempt: int, t_launch: float, t_rendezvous: float,
                           t_preflight: float, t_resumed: float, resume_step: int) -> None:
        """What a restart's new attempt sends before its first step: each agent's
        ``torchrun_started`` (node n at ``t_launch + 0.5 n``), each rank's
        ``worker_started`` (rank r at ``t_rendezvous - 0.25 (world - 1 - r)``: the last at
        ``t_rendezvous``) and ``preflight`` (likewise, the last at ``t_preflight``), and
        rank 0's ``resumed``."""
        for n in range(self.nodes):
            self.event(n, "torchrun_started", t=t_launch + 0.5 * n, attempt=attempt,
                       details={"pid": 4000 + n})
        for r in range(self.world):
            self.event(r // self.ranks_per_node, "worker_started", attempt=attempt, rank=r,
                       t=t_rendezvous - 0.25 * (self.world - 1 - r))
        for r in range(self.world):
            self.event(r // self.ranks_per_node, "preflight", attempt=attempt, rank=r,
                       t=t_preflight - 0.25 * (self.world - 1 - r),
                       details={"passed": True, "checks": [], "seconds": 0.5,
                                "failed": None, "node": f"node{r // self.ranks_per_node}"})
        self.event(0, "resumed", t=t_resumed, attempt=attempt, rank=0, step=resume_step,
                   details={"step": resume_step})

    def stopped(self, node: int, attempt: int, t: float) -> None:
        """The node's exit report after the supervisor stopped its workers (SIGTERM)."""
        self.send(node, [{"type": "exit", "attempt": attempt, "t": t, "exit_code": None,
                          "signal": 15, "outcome": "stopped", "failed_ranks": []}],
                  attempt=attempt)

    def crash(self, node: int = 0, attempt: int = 0, rank: int = 0, t: float = 0.0) -> None:
        self.send(node, [{"type": "exit", "attempt": attempt, "t": t, "exit_code": 1,
                          "signal": None, "outcome": "crashed",
                          "failed_ranks": [{"rank": rank, "local_rank": 0, "exit_code": 1,
                                            "signal": None, "pid": 10,
                                            "message": "RuntimeError: boom"}]}],
                  attempt=attempt)


def efficiency_script(client: httpx.Client, clock: Any, evaluator: Any, *,
           milestones: bool = True, baseline: float | None = 8.0) -> SynthRun:
    """The restart history of ``tests/supervisor/test_sup_efficiency.py``'s docstring
    (seconds after ``clock.now``): a crash at 64, a restart decided at 66 whose milestones
    are 67.5, 68.5, 71, 72, 73 and 75 (the first step), read at 120; FLOPs declared with a
    one-device baseline of ``baseline`` samples/s (None: none)."""
    t0 = clock.now
    run = SynthRun(client, "alpha").register()
    run.declare_flops(flops_per_sample=2e9, peak_flops_per_rank=1e12,
                      baseline_per_device=baseline)
    run.train(range(30), t0=t0 + 5, dt=2.0, slow_rank=3, checkpoint_every=10)
    run.crash(node=1, rank=3, t=t0 + 64)
    clock.now = t0 + 66
    evaluator.tick()  # the exit: an incident and a restart to attempt 1
    run.stopped(node=0, attempt=0, t=t0 + 67.5)
    clock.now = t0 + 70
    if milestones:
        run.restart_milestones(attempt=1, t_launch=t0 + 68, t_rendezvous=t0 + 71,
                               t_preflight=t0 + 72, t_resumed=t0 + 73, resume_step=20)
    evaluator.tick()
    run.train(range(20, 40), t0=t0 + 35, dt=2.0, attempt=1, slow_rank=3, checkpoint_every=10)
    clock.now = t0 + 120.0
    evaluator.tick()
    return run


def loss_at(step: int, rank: int, spike: tuple[int, int] | None, nan_at: int | None,
            spike_to: float | None = None) -> float:
    if nan_at is not None and step == nan_at:
        return math.nan
    base = 4.0 * math.exp(-step / 40.0) + 1.0 + 0.01 * rank + 0.02 * math.sin(step)
    if spike is not None and spike[0] <= step <= spike[1]:
        return base + 6.0 if spike_to is None else spike_to
    return base


def step_item(rank: int, step: int, *, t: float, attempt: int = 0, local_rank: int = 0,
              world: int = 4, loss: float = 2.0, slow: bool = False) -> dict[str, Any]:
    return {"type": "step", "attempt": attempt, "rank": rank, "local_rank": local_rank,
            "world_size": world, "pid": 1000 + rank, "step": step, "t": t, "loss": loss,
            "samples": 8, "tokens": 1024, "lr": 1e-3, "grad_norm": 1.0,
            "data_s": 0.02 if not slow else 0.3, "compute_s": 0.2 if not slow else 0.35,
            "step_s": 0.25 if not slow else 0.7, "batch_index": step * world + rank}
