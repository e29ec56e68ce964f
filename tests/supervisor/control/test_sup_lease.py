"""The evaluator lease: the store's lease functions on SQLite and Postgres,
the fence a deposed leader's decision meets, and the leadership of replicas on one store."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    OPERATOR,
    FakeClock,
    count_rows,
    crash,
    ingest,
    make_settings,
    register,
    step,
)
from tests.waiting import wait_for
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.control.leader import Leadership, LeaseConfig, LedEvaluator
from trainwarden.supervisor.control.observer import ObserverProcess
from trainwarden.supervisor.store import lease
from trainwarden.supervisor.store.db import Database, make_database

T0 = 1_000_000.0


# -- the store functions (explicit times: both backends) -------------------------------------


def _acquire(db: Database, holder: str, now: float, duration_s: float = 5.0
             ) -> lease.LeaseRow | None:
    with db.write() as conn:
        return lease.acquire(conn, holder=holder, now=now, duration_s=duration_s)


def test_the_first_acquire_takes_the_lease_at_epoch_1(db: Database) -> None:
    got = _acquire(db, "a", T0)
    assert got is not None
    assert (got["holder"], got["epoch"], got["expires_at"]) == ("a", 1, T0 + 5.0)


def test_a_live_lease_is_not_taken(db: Database) -> None:
    _acquire(db, "a", T0)
    assert _acquire(db, "b", T0 + 4.9) is None
    with db.read() as conn:
        held = lease.current(conn)
    assert held is not None and (held["holder"], held["epoch"]) == ("a", 1)


def test_renew_extends_the_holders_lease(db: Database) -> None:
    _acquire(db, "a", T0)
    with db.write() as conn:
        assert lease.renew(conn, holder="a", epoch=1, now=T0 + 4.0, duration_s=5.0)
    assert _acquire(db, "b", T0 + 8.0) is None  # 4 + 5 > 8: still a's
    with db.read() as conn:
        held = lease.current(conn)
    assert held is not None and held["expires_at"] == T0 + 9.0


def test_an_expired_lease_is_stolen_with_the_next_epoch(db: Database) -> None:
    _acquire(db, "a", T0)
    got = _acquire(db, "b", T0 + 5.0)
    assert got is not None and (got["holder"], got["epoch"]) == ("b", 2)


def test_the_deposed_holder_cannot_renew(db: Database) -> None:
    _acquire(db, "a", T0)
    _acquire(db, "b", T0 + 6.0)
    with db.write() as conn:
        assert not lease.renew(conn, holder="a", epoch=1, now=T0 + 6.1, duration_s=5.0)


def test_an_expired_lease_nobody_took_is_still_renewed(db: Database) -> None:
    _acquire(db, "a", T0)
    with db.write() as conn:
        assert lease.renew(conn, holder="a", epoch=1, now=T0 + 7.0, duration_s=5.0)


def test_release_hands_the_lease_over_at_once(db: Database) -> None:
    _acquire(db, "a", T0)
    with db.write() as conn:
        assert lease.release(conn, holder="a", epoch=1, now=T0 + 1.0)
    got = _acquire(db, "b", T0 + 1.0)
    assert got is not None and got["epoch"] == 2


def test_the_fence_passes_the_holders_epoch(db: Database) -> None:
    _acquire(db, "a", T0)
    with db.write() as conn:
        lease.check_epoch(conn, epoch=1)


def test_the_fence_refuses_an_old_epoch(db: Database) -> None:
    _acquire(db, "a", T0)
    _acquire(db, "b", T0 + 6.0)
    with pytest.raises(lease.Fenced, match="epoch 1 is no longer") as e, db.write() as conn:
        lease.check_epoch(conn, epoch=1)
    assert e.value.current is not None and e.value.current["holder"] == "b"


@pytest.mark.postgres
def test_a_steal_waits_for_the_fenced_write_in_flight(pg_tables_url: str) -> None:
    """The old leader's write transaction holds the lease row (the fence's FOR SHARE) until
    it ends: a standby's acquire waits for it, so the decision commits before the lease
    changes hands, never after."""
    db = make_database(pg_tables_url, pool_size=4)
    try:
        with db.write() as conn:
            conn.exec_driver_sql("DELETE FROM evaluator_lease")
        _acquire(db, "a", T0)
        got: list[Any] = []
        with db.write() as conn:
            lease.check_epoch(conn, epoch=1)
            thief = threading.Thread(target=lambda: got.append(_acquire(db, "b", T0 + 9.0)))
            thief.start()
            thief.join(0.5)
            assert thief.is_alive()  # blocked on the row lock of the write in flight
        thief.join(10)
        assert got and got[0] is not None and got[0]["epoch"] == 2
    finally:
        db.dispose()


@pytest.mark.postgres
def test_a_writer_paused_inside_its_transaction_does_not_hold_the_lease(
        pg_tables_url: str) -> None:
    """A leader paused mid-transaction (its session idle in it): the server ends that session
    after ``hold_s``, the standby's acquire goes through, and the paused decision is lost."""
    db = make_database(pg_tables_url, pool_size=4)
    try:
        with db.write() as conn:
            conn.exec_driver_sql("DELETE FROM evaluator_lease")
        _acquire(db, "a", T0)
        got: list[Any] = []
        ended = r"idle-in-transaction|terminat|closed"
        with pytest.raises(Exception, match=ended), db.write() as conn:
            lease.check_epoch(conn, epoch=1, hold_s=0.3)
            thief = threading.Thread(target=lambda: got.append(_acquire(db, "b", T0 + 9)))
            thief.start()
            thief.join(15)  # the paused writer: nothing sent in its transaction meanwhile
            assert not thief.is_alive()
            conn.exec_driver_sql("SELECT 1")
        assert got and got[0] is not None and got[0]["epoch"] == 2
    finally:
        db.dispose()


# -- leadership ------------------------------------------------------------------------------


def test_on_sqlite_the_lease_is_trivially_held(db: Database) -> None:
    if not db.is_sqlite:
        pytest.skip("the SQLite case")
    me = Leadership(db, LeaseConfig())
    assert me.step() is True
    assert me.status()["epoch"] == 0
    with db.read() as conn:
        assert count_rows(conn, "evaluator_lease") == 0  # no lease row, no extra query


def test_lease_config_needs_the_duration_above_two_renewals() -> None:
    with pytest.raises(ValueError,
                       match=r"^lease\.duration_s must be >= 2 x renew_s = 2 \(got 1\.5\); so"):
        LeaseConfig(duration_s=1.5, renew_s=1.0)


def test_the_lease_settings_are_validated() -> None:
    with pytest.raises(ValueError, match=r"lease\.renew_s must be > 0"):
        make_settings(lease={"renew_s": 0})


FAST = LeaseConfig(duration_s=0.6, renew_s=0.2)




@pytest.fixture
def pg_db(db: Database) -> Database:
    if db.is_sqlite:
        pytest.skip("replicas share a Postgres store")
    return db


def test_one_replica_leads_and_a_standby_takes_over_after_expiry(pg_db: Database) -> None:
    a, b = Leadership(pg_db, FAST, holder="a"), Leadership(pg_db, FAST, holder="b")
    assert a.step() is True
    assert b.step() is False
    # a stops renewing (killed): b leads once the lease has expired, under the next epoch.
    wait_for(b.step, 5, "the standby to take the expired lease")
    assert b.status()["epoch"] == 2


def test_a_clean_release_lets_the_standby_lead_on_its_next_try(pg_db: Database) -> None:
    a, b = Leadership(pg_db, FAST, holder="a"), Leadership(pg_db, FAST, holder="b")
    a.step()
    b.step()
    a.release()
    assert a.status()["leader"] is False
    b._next_try = float("-inf")  # its next try due now (not renew_s later)
    assert b.step() is True


def test_an_old_leader_coming_back_has_its_decision_refused(
        pg_db: Database, client: TestClient, settings: Any) -> None:
    """Replica a led, stopped renewing (paused), and b took the lease; a's tick then tries
    to decide on a crash: the store refuses it (nothing written, the exit still unhandled),
    and b handles the crash exactly once."""
    aid = register(client)["agent_id"]
    ingest(client, aid, 0, [step(r, s) for s in range(5) for r in (0, 1)])
    ingest(client, aid, 1, [crash()])
    evaluators = [Evaluator(pg_db, settings.policy_config(),
                            detection=settings.detection_config()) for _ in "ab"]
    la, lb = Leadership(pg_db, FAST, holder="a"), Leadership(pg_db, FAST, holder="b")
    led_a, led_b = LedEvaluator(evaluators[0], la, 0.5), LedEvaluator(evaluators[1], lb, 0.5)
    assert la.step() is True
    wait_for(lb.step, 5, "b to take the lease a stopped renewing")
    # a still believes it leads (its renewal is not due yet): its late tick is fenced.
    assert la.leading
    with pytest.raises(lease.Fenced):
        led_a.evaluator.tick()
    with pg_db.read() as conn:
        assert count_rows(conn, "incidents") == 0
        assert count_rows(conn, "actions") == 0
        assert count_rows(conn, "commands") == 0
    # Through its loop: the refusal is logged and counted, and a steps down.
    led_a.once(tick=True)  # its renewal is refused first: no tick at all
    assert la.leading is False
    assert led_b.once(tick=True) is not None
    assert led_b.once(tick=True) is not None  # a second tick decides nothing more
    with pg_db.read() as conn:
        assert count_rows(conn, "incidents") == 1
        assert count_rows(conn, "actions") == 1


def test_a_late_tick_inside_the_loop_is_refused_logged_and_steps_down(
        pg_db: Database, client: TestClient, settings: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    aid = register(client)["agent_id"]
    ingest(client, aid, 0, [step(0, 0), crash()])
    ev = Evaluator(pg_db, settings.policy_config(), detection=settings.detection_config())
    la, lb = Leadership(pg_db, FAST, holder="a"), Leadership(pg_db, FAST, holder="b")
    led_a = LedEvaluator(ev, la, 0.5)
    la.step()
    wait_for(lb.step, 5, "b to take the lease")
    la._next_try = float("inf")  # a's renewal not due: it ticks as the leader it thinks it is
    led_a.once(tick=True)
    assert led_a.fenced == 1
    assert la.leading is False
    assert "evaluator decision refused by the store" in caplog.text
    with pg_db.read() as conn:
        assert count_rows(conn, "actions") == 0


def test_a_new_leader_observes_from_when_it_took_the_lease(pg_db: Database,
                                                           settings: Any) -> None:
    clock = FakeClock(T0)
    ev = Evaluator(pg_db, settings.policy_config(), detection=settings.detection_config(),
                   clock=clock)
    led = LedEvaluator(ev, Leadership(pg_db, FAST, holder="a"), 0.5)
    clock.advance(120.0)  # a standby for two minutes: then it takes the lease
    led.once(tick=False)
    assert ev.observing_since == T0 + 120.0


class _StartingObserver(ObserverProcess):
    """The detectors' process as the leader sees it while the child still starts up: the
    request is taken, and the answer comes only once ``answer`` is set (the real child takes
    a Python start and its imports, half a second on a fast day, seconds on a busy one: too
    variable to outlast a lease for sure).  The leader's side, waiting on the pipe with its
    keepalive, is the real one."""

    def __init__(self, *args: Any, answer: threading.Event, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answer = answer

    def _start(self) -> Any:
        parent, child = multiprocessing.Pipe()

        def child_side() -> None:
            child.recv()
            self.answer.wait(30)
            child.send({})  # (no run to observe)

        threading.Thread(target=child_side, daemon=True).start()
        self._conn = parent
        return parent


def test_a_leader_waiting_on_its_observer_process_keeps_the_lease(
        pg_db: Database, settings: Any) -> None:
    """The first tick waits on the detectors' process (starting up) for longer than twice
    this lease lasts (0.3 s); the leader renews while it waits, so a standby trying all along
    never takes the lease."""
    short = LeaseConfig(duration_s=0.3, renew_s=0.1)
    answer = threading.Event()
    ev = Evaluator(pg_db, settings.policy_config(), detection=settings.detection_config())
    ev.observer = _StartingObserver(pg_db.url, settings.detection_config(), answer=answer)
    la, lb = Leadership(pg_db, short, holder="a"), Leadership(pg_db, short, holder="b")
    led_a = LedEvaluator(ev, la, 0.5)
    stop, took = threading.Event(), []

    def standby() -> None:
        first = time.monotonic()
        while not stop.is_set():
            if lb.step():
                took.append(lb.epoch)
            if time.monotonic() - first > 3 * short.duration_s:
                answer.set()  # the standby has tried for three leases: the child answers
            stop.wait(0.02)

    th = threading.Thread(target=standby)
    try:
        assert la.step() is True
        th.start()
        t0 = time.monotonic()
        report = led_a.once(tick=True)
        waited = time.monotonic() - t0
    finally:
        stop.set()
        th.join()
        ev.observer.close()
    assert waited > 2 * short.duration_s  # (the case in question: a tick outlasting the lease)
    assert report is not None
    assert took == []
    assert la.leading and la.epoch == 1


# -- per-process caches across replicas ------------------------------------------------------


def test_a_takeover_on_one_replica_is_refused_by_another_within_the_refresh(
        pg_db: Database, clock: FakeClock, settings: Any) -> None:
    """Two replicas (two apps on one Postgres store): agent a's batches go to replica B,
    whose credential cache holds a's digest; an operator takes the node over on replica A.
    Within ``CREDENTIAL_REFRESH_S`` replica B refuses a's credential too."""
    from trainwarden.supervisor.api.deps import CREDENTIAL_REFRESH_S
    from trainwarden.supervisor.server.app import create_app

    apps = [create_app(settings, db=pg_db, clock=clock, upgrade_schema=False,
                       start_evaluator=False) for _ in "AB"]
    with TestClient(apps[0]) as on_a, TestClient(apps[1]) as on_b:
        aid = register(on_a)["agent_id"]
        on_b.__dict__["_tw_credentials"] = dict(on_a.__dict__["_tw_credentials"])
        ingest(on_b, aid, 0, [step(0, 0)])  # B caches a's digest
        r = on_a.post("/api/v1/runs/r1/nodes/n0/takeover", headers=OPERATOR)
        assert r.status_code == 200, r.text
        clock.advance(CREDENTIAL_REFRESH_S)
        body = ingest(on_b, aid, 1, [step(0, 1)], expect=403)
        assert "not agent" in body["detail"]


# -- what an operator sees -------------------------------------------------------------------


def test_the_api_and_metrics_show_which_replica_leads(pg_db: Database, clock: FakeClock,
                                                      settings: Any) -> None:
    from trainwarden.supervisor.server.app import create_app

    apps = [create_app(settings, db=pg_db, clock=clock, upgrade_schema=False,
                       start_evaluator=False) for _ in "AB"]
    lead, standby = (app.state.leadership for app in apps)
    assert lead.step() is True
    assert standby.step() is False
    with TestClient(apps[0]) as on_a, TestClient(apps[1]) as on_b:
        a = on_a.get("/api/v1/evaluator", headers=OPERATOR).json()
        b = on_b.get("/api/v1/evaluator", headers=OPERATOR).json()
        assert (a["leader"], a["epoch"]) == (True, 1)
        assert (b["leader"], b["epoch"]) == (False, None)
        assert b["lease"]["holder"] == a["replica"]
        assert 0 < b["lease"]["expires_in_s"] <= settings.lease.duration_s
        text_a = on_a.get("/metrics", headers=OPERATOR).text
        text_b = on_b.get("/metrics", headers=OPERATOR).text
    assert f'trainwarden_evaluator_leader{{replica="{a["replica"]}"}} 1.0' in text_a
    assert f'trainwarden_evaluator_leader{{replica="{b["replica"]}"}} 0.0' in text_b


def test_on_sqlite_the_one_process_always_leads(db: Database, client: TestClient) -> None:
    if not db.is_sqlite:
        pytest.skip("the SQLite case")
    body = client.get("/api/v1/evaluator", headers=OPERATOR).json()
    assert (body["leader"], body["epoch"], body["lease"]) == (True, 0, None)
    assert "trainwarden_evaluator_leader{" in client.get("/metrics", headers=OPERATOR).text


def test_every_write_path_of_a_fenced_database_is_checked(db: Database) -> None:
    refused = RuntimeError("fenced")

    def fence(_conn: Any) -> None:
        raise refused

    fenced = db.fenced(fence)
    with pytest.raises(RuntimeError), fenced.write():
        pass
    kept = fenced.kept()
    with pytest.raises(RuntimeError), kept.write():
        pass
    with fenced.read() as conn:  # reads are not fenced
        assert count_rows(conn, "runs") == 0


@pytest.mark.postgres
def test_a_session_idle_inside_a_transaction_is_ended_in_bounded_time(
        pg_tables_url: str) -> None:
    from trainwarden.supervisor.store.db import POSTGRES_IDLE_IN_TRANSACTION_S

    db = make_database(pg_tables_url, pool_size=1)
    try:
        with db.read() as conn:
            shown = conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar()
        assert shown == f"{POSTGRES_IDLE_IN_TRANSACTION_S}s"
    finally:
        db.dispose()
