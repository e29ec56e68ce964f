"""The statuses and kinds are StrEnums stored as plain strings: every value fits the column
that holds it (Postgres refuses a longer one), and a value read back compares equal."""

from __future__ import annotations

import enum

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from tests.supervisor.sup_helpers import crash, ingest, register, step
from trainwarden.agent.core.states import AgentState, CommandKind, CommandStatus, ExitOutcome
from trainwarden.agent.protocol import AgentEventName, WorkerEventName
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.enums import (
    ActionKind,
    ActionStatus,
    Actor,
    EvidenceKind,
    HostActionKind,
    HostState,
    IncidentKind,
    IncidentStatus,
    PresenceEvent,
    RunStatus,
    SupervisorEvent,
    Verdict,
)
from trainwarden.supervisor.store import tables
from trainwarden.supervisor.store.db import Database

COLUMNS: list[tuple[type[enum.Enum], object]] = [
    (RunStatus, tables.runs.c.status),
    (AgentState, tables.agents.c.state),
    (ExitOutcome, tables.exits.c.outcome),
    (IncidentKind, tables.incidents.c.kind),
    (IncidentStatus, tables.incidents.c.status),
    (ActionKind, tables.actions.c.kind),
    (ActionStatus, tables.actions.c.status),
    (Actor, tables.actions.c.actor),
    (CommandKind, tables.commands.c.kind),
    (CommandStatus, tables.commands.c.status),
    (Verdict, tables.exits.c.verdict),
    (WorkerEventName, tables.events.c.name),
    (AgentEventName, tables.events.c.name),
    (PresenceEvent, tables.events.c.name),
    (SupervisorEvent, tables.events.c.name),
    (HostState, tables.hosts.c.state),
    (EvidenceKind, tables.host_evidence.c.kind),
    (HostActionKind, tables.host_actions.c.kind),
    (Actor, tables.host_actions.c.actor),
]


@pytest.mark.parametrize("kind, column", COLUMNS, ids=[k.__name__ for k, _ in COLUMNS])
def test_every_value_fits_its_column(kind: type[enum.Enum], column: object) -> None:
    width = column.type.length  # type: ignore[attr-defined]
    assert [m.value for m in kind if len(m.value) > width] == []


def test_what_the_policy_writes_reads_back_as_the_plain_strings(
        client: TestClient, evaluator: Evaluator, db: Database) -> None:
    aid = register(client)["agent_id"]
    ingest(client, aid, 0, [step(0, 1)])
    ingest(client, aid, 1, [crash()])
    evaluator.tick()
    with db.read() as c:
        run = c.execute(select(tables.runs.c.status)).scalar_one()
        action = c.execute(select(tables.actions.c.kind, tables.actions.c.status)).one()
        cmd = c.execute(select(tables.commands.c.kind, tables.commands.c.status)).one()
    assert (type(run), run) == (str, "restarting") and run == RunStatus.RESTARTING
    assert tuple(action) == ("restart", "queued")
    assert tuple(cmd) == ("restart", "pending")


def test_which_incidents_interrupt_training_is_said_once() -> None:
    from trainwarden.supervisor.control import policy
    from trainwarden.supervisor.enums import INTERRUPTING, NEVER_INTERRUPTING, ROLLED_BACK, WATCHED
    from trainwarden.supervisor.goodput.ettr import EttrConfig

    assert policy.RESTART_KINDS is INTERRUPTING and policy.ROLLBACK_KINDS is ROLLED_BACK
    assert not INTERRUPTING & WATCHED and ROLLED_BACK <= WATCHED
    # What the ETTR charges no detection for: incident kinds only (no stray "disk").
    assert EttrConfig().non_interrupting == NEVER_INTERRUPTING == {IncidentKind.STRAGGLER}
    assert not NEVER_INTERRUPTING & (INTERRUPTING | ROLLED_BACK)
