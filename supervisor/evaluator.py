"""The evaluation loop: ``tick()`` reads the store, asks the policy, writes actions.

``tick`` is one write transaction; ``run`` is a thin loop around it (a daemon thread started
by the app).  The clock is injected so tests drive exactly one tick at a chosen time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from supervisor import actions, policy
from supervisor.store import repo
from supervisor.store.db import Database

log = logging.getLogger("trainwarden.evaluator")

Clock = Callable[[], float]


@dataclass
class TickReport:
    exits: int = 0
    decisions: int = 0
    advanced: int = 0


class Evaluator:
    def __init__(self, db: Database, cfg: policy.PolicyConfig, *, clock: Clock = time.time
                 ) -> None:
        self.db = db
        self.cfg = cfg
        self.clock = clock

    def tick(self) -> TickReport:
        now = self.clock()
        rep = TickReport()
        with self.db.write() as conn:
            for ex in repo.unhandled_exits(conn):
                rep.exits += 1
                # Fresh run state each time: an earlier exit in this tick may have moved it.
                run = repo.get_run(conn, run_id=ex["run_id"])
                agent_ids = frozenset(a["id"] for a in repo.run_agents(conn, run_id=run["id"]))
                ckpt = repo.newest_complete_checkpoint(conn, run_id=run["id"])
                decision = policy.on_exit(
                    actions.facts(run),
                    policy.ExitFacts(
                        id=ex["id"], agent_id=ex["agent_id"], node=ex["node"],
                        attempt=ex["attempt"], outcome=ex["outcome"],
                        exit_code=ex["exit_code"], signal=ex["signal"],
                        failed_ranks=list(ex["failed_ranks"] or []),
                    ),
                    agent_ids=agent_ids,
                    completed_agent_ids=frozenset(
                        repo.completed_agents(conn, run_id=run["id"], attempt=run["attempt"])
                    ),
                    checkpoint=ckpt["path"] if ckpt else None,
                    cfg=self.cfg,
                    now=now,
                )
                if not isinstance(decision, policy.Note):
                    rep.decisions += 1
                    log.info("run %s: %s", run["name"], decision)
                actions.apply(conn, run=run, decision=decision, now=now)
                verdict = decision.verdict if isinstance(decision, policy.Note) else (
                    "completed" if isinstance(decision, policy.Complete) else "failure"
                )
                repo.mark_exit(conn, exit_id=ex["id"], verdict=verdict)
            for action in repo.actions_in_progress(conn):
                if actions.advance(conn, action=action, now=now) != action["status"]:
                    rep.advanced += 1
        return rep

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Tick until ``stop`` is set; an error in one tick is logged, the loop goes on."""
        while not stop.wait(interval_s):
            try:
                self.tick()
            except Exception:
                log.exception("evaluator tick failed")

    def start(self, interval_s: float) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        th = threading.Thread(target=self.run, args=(stop, interval_s),
                              name="trainwarden-evaluator", daemon=True)
        th.start()
        return th, stop
