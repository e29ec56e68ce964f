"""Replays on SQLite and Postgres: the same (agent_id, seq) with the same content is a
duplicate; with different content it is refused with 409, logged, and stores nothing."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from tests.supervisor.sup_helpers import as_agent, ingest, register, step, store_snapshot
from trainwarden.supervisor.contract import wire
from trainwarden.supervisor.store import tables
from trainwarden.supervisor.store.db import Database
from trainwarden.supervisor.store.ingest import IngestResult, SeqConflict, ingest_batches


def post(client: TestClient, body: dict[str, Any]) -> Any:
    return client.post("/api/v1/ingest", content=json.dumps(body),
                       headers={**as_agent(client, body["agent_id"]),
                                "content-type": "application/json"})


def test_a_replay_sent_later_is_a_duplicate(client: TestClient, db: Database) -> None:
    """What only says when the batch was sent (sent_at, dropped) may differ; so may the
    spelling of a number or a field given at its default."""
    aid = register(client)["agent_id"]
    items = [step(0, 1, loss=float("nan")), step(1, 1)]
    ingest(client, aid, 4, items)
    before = store_snapshot(db)
    again = [dict(items[0], t=items[0]["t"] + 0.0, attempt=0), items[1]]
    r = post(client, {"agent_id": aid, "seq": 4, "sent_at": 99.0, "dropped": 3, "attempt": 0,
                      "items": again})
    assert r.status_code == 200, r.text
    assert r.json()["duplicate"] is True
    assert store_snapshot(db) == before


@pytest.mark.parametrize("change", [
    {"loss": 2.5},  # another value
    {"loss": None},  # NaN is not "no loss"
    {"step": 2},
])
def test_a_replay_with_other_content_is_409_and_stores_nothing(
        client: TestClient, db: Database, caplog: pytest.LogCaptureFixture,
        change: dict[str, Any]) -> None:
    aid = register(client)["agent_id"]
    ingest(client, aid, 0, [step(0, 0)])
    ingest(client, aid, 4, [step(0, 1, loss=float("nan"))])
    before = store_snapshot(db)
    with caplog.at_level(logging.WARNING, logger="trainwarden.ingest"):
        r = post(client, {"agent_id": aid, "seq": 4, "sent_at": 1.0,
                          "items": [step(0, 1, **{"loss": float("nan"), **change})]})
    assert r.status_code == 409, r.text
    assert "seq 4" in r.json()["detail"]
    assert "already used for different content" in r.json()["detail"]
    assert r.json()["next_seq"] == 5
    assert store_snapshot(db) == before
    assert any("already used for different content" in m for m in caplog.messages)


def test_two_copies_in_one_group_are_told_apart(client: TestClient, db: Database) -> None:
    """The ingest writer's group commit (Postgres) stores several batches at once: a second
    copy of a key in the same group is a duplicate or a conflict by its content."""
    aid = register(client)["agent_id"]

    def batch(loss: float) -> wire.IngestBatch:
        return wire.IngestBatch.model_validate(
            {"agent_id": aid, "seq": 0, "items": [step(0, 0, loss=loss)]})

    with db.write() as conn:
        first, same, other = ingest_batches(conn, batches=[batch(1.0), batch(1.0), batch(2.0)],
                                            now=5.0)
    assert isinstance(first, IngestResult) and first.duplicate is False
    assert isinstance(same, IngestResult) and same.duplicate is True
    assert isinstance(other, SeqConflict) and other.next_seq == 1


def test_a_batch_stored_before_digests_replays_as_a_duplicate(client: TestClient,
                                                              db: Database) -> None:
    aid = register(client)["agent_id"]
    ingest(client, aid, 0, [step(0, 0)])
    with db.write() as conn:  # as the 0006 migration leaves the rows it finds
        conn.execute(update(tables.ingested_batches).values(digest=None))
    assert ingest(client, aid, 0, [step(0, 7)])["duplicate"] is True
