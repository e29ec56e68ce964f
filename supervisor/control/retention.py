"""Retention of the per-rank rows: ``rank_steps`` holds every rank's timings of every step
(16,384 ranks at a step a second are 1.4 billion rows a day), so only the newest
``keep_steps`` steps of each run's newest attempt are kept; older rows, and every row of an
attempt the run has left, are rolled up into per-rank summaries of ``bucket_steps`` steps
(``rank_rollups``: count, sums, maxima of the phase times, the loss's too) and deleted.
Rank 0's batch index of each rolled-up step is kept (``step_batches``): a rollback reads it
at a checkpoint's step, however old.  The per-step aggregates (``step_aggregates``) are
never rolled up.  The keys of stored batches (``ingested_batches``, one per agent per second:
what answers an agent's replay as a duplicate) are kept for each agent's newest
``batch_keys_kept`` sequence numbers: an agent replays only the batches it has no answer for,
the newest ones.

``Retention.tick`` does a bounded amount of that work (at most ``chunks_per_tick`` slices
of at most ``chunk_rows`` rows, each its own short write transaction, so an agent's ingest
waits behind one slice at most, not behind the whole backlog); the evaluator calls it
at the end of each tick, so on Postgres only the replica that leads does it, under the
lease's fence.

The kept window serves every reader of per-rank rows, which ``required_steps`` names: the
straggler detector's table, the dashboard's phase-time chart.  The live goodput reads the
rows after its cursor, seconds behind ingest; after a supervisor restart it starts over
from the kept rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

from trainwarden.agent.core.bounds import bounded, cross_check
from trainwarden.agent.core.bounds import check as check_bounds
from trainwarden.supervisor.control.detection import RANK_CHART_MAX_STEPS, DetectionConfig
from trainwarden.supervisor.store import goodput as goodput_store
from trainwarden.supervisor.store import retention as store
from trainwarden.supervisor.store import windows
from trainwarden.supervisor.store.db import Connection, Database

log = logging.getLogger("trainwarden.retention")


@dataclass(frozen=True)
class RetentionConfig:
    SECTION: ClassVar[str] = "retention"

    enabled: bool = True  # roll up and delete per-rank rows beyond the kept window
    # newest steps of per-rank rows kept (each run's newest attempt)
    keep_steps: int = bounded(1000, ge=1, integer=True)
    # steps summarised by one per-rank rollup row
    bucket_steps: int = bounded(1000, ge=1, integer=True)
    # per-rank rows deleted by one write transaction, at most
    chunk_rows: int = bounded(2000, ge=1, integer=True)
    # write transactions of rollup work per evaluator tick, at most
    chunks_per_tick: int = bounded(8, ge=1, integer=True)
    # newest stored-batch keys kept per agent (replay detection)
    batch_keys_kept: int = bounded(1000, ge=1, integer=True)
    # agents whose older batch keys one tick deletes, at most (each a statement in the tick's
    # write transaction, which ingest waits behind: 2,048 agents are gone through in a minute)
    agents_per_tick: int = bounded(16, ge=1, integer=True)

    def __post_init__(self) -> None:
        check_bounds(self)


def required_steps(detection: DetectionConfig) -> dict[str, int]:
    """The newest steps of per-rank rows each reader needs, by the setting that says so."""
    return {
        "detection.straggler_table_steps": detection.straggler_table_steps,
        "straggler.window_steps": detection.straggler.window_steps,
        "straggler.hold_steps": detection.straggler.hold_steps,
        "the dashboard's per-rank chart": RANK_CHART_MAX_STEPS,
    }


def check(cfg: RetentionConfig, detection: DetectionConfig) -> None:
    """Raise ValueError when the kept window is shorter than a reader needs."""
    if not cfg.enabled:
        return
    need = required_steps(detection)
    name, steps = max(need.items(), key=lambda kv: kv[1])
    cross_check(cfg.keep_steps >= steps, cfg, "keep_steps",
                f">= {steps}, the newest steps of per-rank rows that {name} reads",
                got=cfg.keep_steps,
                hint=f"raise retention.keep_steps (--retention-keep-steps) to {steps} or more")


class Retention:
    def __init__(self, cfg: RetentionConfig | None = None,
                 detection: DetectionConfig | None = None) -> None:
        self.cfg = cfg or RetentionConfig()
        check(self.cfg, detection or DetectionConfig())
        self.rolled_rows = 0  # rows rolled up by this process (the benchmark reads it)
        self._agent_cursor = 0  # batch keys are pruned agent by agent, round robin

    def tick(self, db: Database) -> int:
        """At most ``chunks_per_tick`` slices of rollup work over the runs; rows rolled up.
        Each slice is planned in a read transaction and done in its own write transaction
        (the plan stays right meanwhile: rows only grow older)."""
        if not self.cfg.enabled:
            return 0
        with db.read() as conn:
            run_ids = store.run_ids(conn)
        done = chunks = 0
        for run_id in run_ids:
            while chunks < self.cfg.chunks_per_tick:
                with db.read() as conn:
                    plan = self._plan(conn, run_id)
                if plan is None:
                    break
                attempt, first, upto, rank_from, rank_last = plan
                with db.write() as conn:
                    done += store.roll_up(conn, run_id=run_id, attempt=attempt,
                                          step_from=first, step_to=upto, rank_from=rank_from,
                                          rank_last=rank_last,
                                          bucket_steps=self.cfg.bucket_steps)
                chunks += 1
        self.rolled_rows += done
        self._prune_batch_keys(db)
        return done

    def _prune_batch_keys(self, db: Database) -> None:
        with db.read() as conn:
            ids = store.agents_after(conn, after_id=self._agent_cursor,
                                     limit=self.cfg.agents_per_tick)
        self._agent_cursor = ids[-1] if len(ids) == self.cfg.agents_per_tick else 0
        if ids:
            with db.write() as conn:
                store.prune_batch_keys(conn, agent_ids=ids, keep=self.cfg.batch_keys_kept)

    def _plan(self, conn: Connection, run_id: int
              ) -> tuple[int, int, int, int, int] | None:
        """(attempt, first step, step after the last, first rank, last rank) of
        the next slice of the run's rows to roll up: its oldest rows, at most ``chunk_rows``
        of them (whole steps, or part of one step's ranks in a run of more ranks than that),
        none of the kept window."""
        oldest = store.oldest_rows(conn, run_id=run_id)
        if oldest is None:
            return None
        attempt, first = oldest
        world = max(1, goodput_store.rank_count(conn, run_id=run_id))
        upto = first + max(1, self.cfg.chunk_rows // world)
        ranks = (0, 2**31 - 1)
        if world > self.cfg.chunk_rows:  # one step is more than a slice: split it by rank
            low = store.lowest_rank(conn, run_id=run_id, attempt=attempt, step=first)
            if low is not None:
                ranks = (low, low + self.cfg.chunk_rows - 1)
        newest_attempt = store.newest_attempt(conn, run_id=run_id)
        if newest_attempt is None or attempt >= newest_attempt:
            span = windows.step_range(conn, run_id=run_id, attempt=attempt)
            if span is None:
                return None
            cut = span[1] - self.cfg.keep_steps + 1  # the oldest step kept
            if first >= cut:
                return None
            upto = min(upto, cut)
        # else an attempt the run has left (the pages show the newest): all of it goes
        return attempt, first, upto, *ranks
