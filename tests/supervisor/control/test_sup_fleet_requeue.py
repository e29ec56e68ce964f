"""A run with no spare left is requeued in its scheduler (``fleet.requeue``): the policy's rule,
the Slurm commands (a fake ``scontrol`` and ``squeue`` on PATH; the real ones:
tests/e2e/test_slurm_requeue.py), and the fleet's round over the store and the evaluator: the
job the agents name is their claim, requeued only when Slurm runs it on the run's nodes and
its comment (which only the job's owner may set) names the run; the
waiting node is cordoned (shared and drained when its agent was trusted for the host, in the
run only otherwise) and excluded from the job's next allocation, once, and that allocation
goes on as the same run (a new attempt, the loss counted once)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    ADMIN,
    ADMIN_TOKEN,
    OPERATOR,
    FakeClock,
    ingest,
    make_settings,
    register,
    step,
)
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.control.fleet_sync import FleetConfig, FleetSync
from trainwarden.supervisor.enums import Verdict
from trainwarden.supervisor.fleet import FleetJob, FleetNode, FleetNodeState, FleetResult
from trainwarden.supervisor.fleet.slurm import SlurmFleet
from trainwarden.supervisor.store import hosts
from trainwarden.supervisor.store.db import Database

WAITING = {"n1": "lost"}
JOB77 = FleetJob("77", "RUNNING", True, frozenset({"n0", "n1"}), comment="trainwarden-run=r1")


@pytest.fixture
def settings() -> SupervisorSettings:
    """The conftest's app with an admin token (run-scoped agent tokens are minted)."""
    return make_settings(admin_token=ADMIN_TOKEN)


def scoped_agent_token(client: TestClient, scope: str) -> dict[str, str]:
    r = client.post("/api/v1/tokens", headers=ADMIN,
                    json={"name": "team-agents", "role": "agent", "scope": scope})
    assert r.status_code in (200, 201), r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def test_the_rule_requeues_a_waiting_attempt_once_and_only_when_asked() -> None:
    d = policy.requeue_when_no_spare(enabled=True, attempt=1, waiting=WAITING, job="77",
                                     requeued_for=None)
    assert isinstance(d, policy.RequeueWanted)
    assert (d.job, d.attempt, d.waiting) == ("77", 1, (("n1", "lost"),))
    assert d.reason == ("no spare is free and the run may not shrink: job 77 is requeued "
                        "without n1 (lost)")
    # Once per waiting attempt; a later attempt that waits again is requeued again.
    again = policy.requeue_when_no_spare(enabled=True, attempt=1, waiting=WAITING, job="77",
                                         requeued_for=1)
    assert isinstance(again, policy.Note) and again.verdict == Verdict.ONGOING
    assert isinstance(policy.requeue_when_no_spare(enabled=True, attempt=3, waiting=WAITING,
                                                   job="77", requeued_for=1),
                      policy.RequeueWanted)
    # Off, outside a scheduler job, or nothing waited for: the run stands by as before.
    for kw in ({"enabled": False}, {"job": ""}, {"waiting": {}}):
        args: dict[str, Any] = {"enabled": True, "attempt": 1, "waiting": WAITING, "job": "77",
                                "requeued_for": None, **kw}
        n = policy.requeue_when_no_spare(**args)
        assert isinstance(n, policy.Note), kw


def _wanted() -> policy.RequeueWanted:
    d = policy.requeue_when_no_spare(enabled=True, attempt=1, waiting=WAITING, job="77",
                                     requeued_for=None)
    assert isinstance(d, policy.RequeueWanted)
    return d


def test_a_trusted_run_s_job_is_requeued_off_its_waiting_node_which_is_drained() -> None:
    d = policy.requeue_checked(_wanted(), run_id=5, run="r1", scheduled=JOB77, said="",
                               members={"n0", "n1"}, trusted={"n0": True, "n1": True})
    assert isinstance(d, policy.Requeue)
    assert (d.job, d.attempt, d.exclude) == ("77", 1, ("n1",))
    assert d.drain == (("n1", "trainwarden: lost; the run's job 77 is requeued without it"),)
    (c,) = d.cordons
    assert (c.node, c.run_id, c.in_run_only) == ("n1", 5, False)


def test_an_untrusted_node_is_cordoned_in_the_run_only_and_kept_off_this_job_not_drained(
        ) -> None:
    # The lost node's agent registered with a run-scoped token: what it said of its host
    # moves neither the shared ledger nor the scheduler's node; the job still avoids it.
    d = policy.requeue_checked(_wanted(), run_id=5, run="r1", scheduled=JOB77, said="",
                               members={"n0", "n1"}, trusted={"n0": True, "n1": False})
    assert isinstance(d, policy.Requeue)
    assert d.drain == () and d.exclude == ("n1",)
    (c,) = d.cordons
    assert (c.node, c.run_id, c.in_run_only) == ("n1", 5, True)
    assert "in this run only" in c.reason


@pytest.mark.parametrize(("scheduled", "named_by", "why"), [
    (None, (), "job 77 is not requeued: the scheduler has no such job or could not say "
               "(Slurm lists no job 77)"),
    (FleetJob("77", "RUNNING", True, frozenset({"tw0", "tw1"})), (),
     "job 77 is not requeued: its allocation (tw0, tw1) does not hold the run's n0, n1: it "
     "is not the run's job"),
    (FleetJob("77", "RUNNING", True, frozenset({"n0", "n2"})), (),
     "job 77 is not requeued: its allocation (n0, n2) does not hold the run's n1: it is not "
     "the run's job"),
    (FleetJob("77", "PENDING", False, frozenset()), (),
     "job 77 is not requeued: the scheduler has it PENDING, not running"),
    (JOB77, ("other",), "job 77 is not requeued: the agents of other named it too: whose "
                        "job it is cannot be told"),
])
def test_a_job_the_scheduler_does_not_run_on_the_run_s_nodes_is_not_requeued(
        scheduled: FleetJob | None, named_by: tuple[str, ...], why: str) -> None:
    n = policy.requeue_checked(_wanted(), run_id=5, run="r1", scheduled=scheduled,
                               said="Slurm lists no job 77", members={"n0", "n1"},
                               trusted={"n0": True, "n1": True}, named_by=named_by)
    assert isinstance(n, policy.Note) and n.verdict == Verdict.WAIT
    assert n.why == why


@pytest.mark.parametrize(("comment", "has"), [
    ("", "none"),
    ("trainwarden-run=r2", "'trainwarden-run=r2'"),
    ("trainwarden-run=r10", "'trainwarden-run=r10'"),
    ("trainwarden-run=r1 ", "'trainwarden-run=r1 '"),
    ("r1", "'r1'"),
])
def test_a_job_whose_comment_does_not_name_the_run_is_not_requeued(comment: str,
                                                                   has: str) -> None:
    # Slurm runs job 77 on the run's nodes, but only the job's owner sets its comment: a job
    # is the run's only when the comment names exactly that run.
    job = FleetJob("77", "RUNNING", True, frozenset({"n0", "n1"}), comment=comment)
    n = policy.requeue_checked(_wanted(), run_id=5, run="r1", scheduled=job, said="",
                               members={"n0", "n1"}, trusted={"n0": True, "n1": True})
    assert isinstance(n, policy.Note) and n.verdict == Verdict.WAIT
    assert n.why == (f"job 77 is not requeued: its comment ({has}) does not name run r1: set "
                     "it with `scontrol update JobId=77 Comment=trainwarden-run=r1` in the job "
                     "(deploy/slurm/train.sbatch does) or `sbatch --comment`")
    # A run name the shell would split is quoted in the advice.
    other = policy.requeue_checked(_wanted(), run_id=5, run="my run", scheduled=JOB77, said="",
                                   members={"n0", "n1"}, trusted={})
    assert isinstance(other, policy.Note)
    assert "Comment='trainwarden-run=my run'" in other.why, other.why


def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``squeue`` and ``scontrol`` on PATH, each call written to ``calls``: job 77 runs on
    n[0-1] (tw9 excluded by its submitter, its comment naming run r1), 78 pends (no
    comment), 80 runs with a comment that holds "|", 79 is not known, and asking for 13
    fails; scontrol expands n[0-1], anything it is asked of job 13 fails, and so does an
    update of job 66."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "squeue").write_text(
        f'#!/bin/bash\necho "squeue $*" >> {calls}\n'
        'case "$3" in\n'
        '  77) echo "77|RUNNING|n[0-1]|tw9|trainwarden-run=r1";;\n'
        '  78) echo "78|PENDING|||(null)";;\n'
        "  80) echo '80|RUNNING|n[0-1]||trainwarden-run=a|b|(null)';;\n"
        '  13) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;\n'
        'esac\n')
    (fake / "scontrol").write_text(
        f'#!/bin/bash\necho "scontrol $*" >> {calls}\n'
        'if [ "$1 $2" = "show hostnames" ]; then echo n0; echo n1; exit 0; fi\n'
        'if [ "$2" = 13 ]; then echo "Invalid job id" >&2; exit 1; fi\n'
        'if [ "$2" = JobId=66 ]; then echo "Job is no longer pending execution" >&2; exit 1; fi\n')
    for f in ("squeue", "scontrol"):
        (fake / f).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_slurm_says_what_a_job_is_its_state_and_its_nodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_slurm(tmp_path, monkeypatch)
    job, r = SlurmFleet().job("77")
    assert r.ok and r.command == "squeue -h -j 77 -o '%i|%T|%N|%x|%k'", r
    assert job == FleetJob("77", "RUNNING", True, frozenset({"n0", "n1"}), excluded="tw9",
                           comment="trainwarden-run=r1")
    pending, _ = SlurmFleet().job("78")
    assert pending == FleetJob("78", "PENDING", False, frozenset())
    # The comment is its owner's free text, read whole: a "|" in it shifts no other field.
    piped, _ = SlurmFleet().job("80")
    assert piped == FleetJob("80", "RUNNING", True, frozenset({"n0", "n1"}),
                             comment="trainwarden-run=a|b|(null)")
    gone, r = SlurmFleet().job("79")
    assert gone is None and r.ok and r.output == "Slurm lists no job 79", r
    failed, r = SlurmFleet().job("13")
    assert failed is None and not r.ok and "Invalid job id specified" in r.output, r
    # The agents' word never reaches a command line unless it is a job id.
    for claim in ("all", "-u root", "77 78", "77;scancel 1"):
        nothing, r = SlurmFleet().job(claim)
        assert nothing is None and not r.ok and "not a Slurm job id" in r.output, claim
    assert calls.read_text().splitlines() == [
        "squeue -h -j 77 -o %i|%T|%N|%x|%k", "scontrol show hostnames n[0-1]",
        "squeue -h -j 78 -o %i|%T|%N|%x|%k", "squeue -h -j 80 -o %i|%T|%N|%x|%k",
        "scontrol show hostnames n[0-1]", "squeue -h -j 79 -o %i|%T|%N|%x|%k",
        "squeue -h -j 13 -o %i|%T|%N|%x|%k"]


def test_the_slurm_requeue_holds_the_job_excludes_the_nodes_for_it_and_releases_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_slurm(tmp_path, monkeypatch)
    job, _ = SlurmFleet().job("77")
    assert job is not None
    calls.write_text("")
    done = SlurmFleet().requeue(job, ["n1"])
    assert [(r.command, r.ok) for r in done] == [
        ("scontrol requeuehold 77", True),
        ("scontrol update JobId=77 ExcNodeList=tw9,n1", True),  # its submitter's kept
        ("scontrol release 77", True)]
    # Nothing to exclude: a plain requeue.  A requeue that fails stops there.
    (plain,) = SlurmFleet().requeue(FleetJob("77", "RUNNING", True, frozenset()), [])
    assert plain.ok and plain.command == "scontrol requeue 77"
    (bad,) = SlurmFleet().requeue(FleetJob("13", "RUNNING", True, frozenset()), ["n1"])
    assert not bad.ok and "Invalid job id" in bad.output and "exit 1" in bad.output
    # A held job is released even when its exclusion could not be set (and that says so).
    held = SlurmFleet().requeue(FleetJob("66", "RUNNING", True, frozenset()), ["n1"])
    assert [(r.command, r.ok) for r in held] == [
        ("scontrol requeuehold 66", True),
        ("scontrol update JobId=66 ExcNodeList=n1", False),
        ("scontrol release 66", True)]
    assert "no longer pending" in held[1].output
    assert calls.read_text().splitlines() == [
        "scontrol requeuehold 77", "scontrol update JobId=77 ExcNodeList=tw9,n1",
        "scontrol release 77", "scontrol requeue 77", "scontrol requeuehold 13",
        "scontrol requeuehold 66", "scontrol update JobId=66 ExcNodeList=n1",
        "scontrol release 66"]


class FakeFleet:
    name = "slurm"

    def __init__(self, nodes: list[str], jobs: dict[str, FleetJob] | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.drained: dict[str, str] = {}
        self.nodes = nodes
        self.jobs = {"77": JOB77} if jobs is None else jobs

    def check(self) -> FleetResult:
        return FleetResult("check", True, "")

    def node_states(self) -> tuple[dict[str, FleetNode], FleetResult]:
        return ({n: FleetNode(n, FleetNodeState.DRAINED if n in self.drained
                              else FleetNodeState.AVAILABLE, self.drained.get(n, ""))
                 for n in self.nodes}, FleetResult("show", True, ""))

    def cordon(self, node: str, reason: str) -> FleetResult:
        self.calls.append(("drain", node))
        self.drained[node] = reason
        return FleetResult(f"drain {node}", True, "")

    def uncordon(self, node: str) -> FleetResult:
        self.calls.append(("resume", node))
        self.drained.pop(node, None)
        return FleetResult(f"resume {node}", True, "")

    def job(self, job: str) -> tuple[FleetJob | None, FleetResult]:
        self.calls.append(("job", job))
        found = self.jobs.get(job)
        return found, FleetResult(f"squeue -j {job}", True,
                                  "" if found else f"Slurm lists no job {job}")

    def requeue(self, job: FleetJob, exclude: list[str]) -> list[FleetResult]:
        self.calls.append(("requeue", job.job, *exclude))
        return [FleetResult(f"scontrol requeuehold {job.job}", True, "")]


def get(client: TestClient, path: str) -> Any:
    r = client.get(f"/api/v1{path}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


def _waiting_run(client: TestClient, evaluator: Evaluator, clock: FakeClock, run: str = "r1",
                 headers: dict[str, str] | None = None, nodes: tuple[str, str] = ("n0", "n1"),
                 job: str = "77") -> dict[str, int]:
    """A two-node run of job 77 whose member n1 went silent: no spare, it stands by."""
    ids = {n: register(client, run=run, node=n, headers=headers,
                       scheduler_job=job)["agent_id"] for n in nodes}
    first, second = nodes
    ingest(client, ids[first], 0, [step(0, 0), {"type": "checkpoint", "step": 1, "path": "/ck/1",
                                                "bytes": 5, "t": 10.0, "lineage": "a0"}])
    ingest(client, ids[second], 0, [step(1, 0)])
    evaluator.tick()
    clock.advance(40)  # past the node-lost deadline
    ingest(client, ids[first], 1, [])
    evaluator.tick()
    (act,) = get(client, f"/runs/{run}/actions")["actions"]
    assert act["plan"]["membership"]["waiting"] == [1], act
    return ids


def test_a_waiting_run_is_requeued_once_without_its_lost_node_and_goes_on_as_the_same_run(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    _waiting_run(client, evaluator, clock)
    run = get(client, "/runs/r1")
    fleet = FakeFleet(["n0", "n1", "n2"])
    sync = FleetSync(db, fleet, FleetConfig(backend="slurm", requeue=True), clock=clock)
    sync.round()
    # Slurm runs job 77 on the run's nodes; the lost node (its agent trusted for the host)
    # is cordoned and drained before the job is requeued without it.
    assert fleet.calls == [("job", "77"), ("drain", "n1"), ("requeue", "77", "n1")]
    assert fleet.drained["n1"].startswith("trainwarden: lost")
    host = get(client, "/hosts/n1")
    assert host["state"] == "cordoned" and "requeued" in host["reason"], host
    (ev,) = [e for e in get(client, "/runs/r1/events")["events"] if e["name"] == "requeued"]
    assert ev["details"]["job"] == "77" and ev["details"]["ok"] is True
    assert ev["details"]["drained"] == ["n1"] and ev["details"]["attempt"] == run["attempt"]
    assert ev["details"]["excluded"] == ["n1"] and ev["details"]["in_run_only"] == []
    assert "job 77 is requeued without n1 (lost)" in ev["message"]
    # The run's condition says so: it waits for the job's new allocation.
    cond = get(client, "/runs/r1")["condition"]
    assert cond["state"] == "waiting" and "job 77 was requeued without n1" in cond["summary"], \
        cond
    # Once: later rounds neither requeue again nor lift the drain.
    sync.round()
    clock.advance(60)
    sync.round()
    assert fleet.calls == [("job", "77"), ("drain", "n1"), ("requeue", "77", "n1")]

    # The job's new allocation (n0 again, and n2) registers to the same run: the gang
    # restarts on it, from the newest checkpoint, counted against no budget.
    register(client, node="n0", scheduler_job="77")
    register(client, node="n2", scheduler_job="77")
    evaluator.tick()
    after = get(client, "/runs/r1")
    assert after["uuid"] == run["uuid"]
    assert after["attempt"] == run["attempt"] + 1
    assert after["restarts_by_cause"]["node_lost"] == 1
    new = max(get(client, "/runs/r1/actions")["actions"], key=lambda a: a["id"])
    assert new["cause"] == "replace" and new["plan"]["checkpoint"] == "/ck/1"
    assert new["plan"]["membership"]["members"] == {"n0": 0, "n2": 1}


def test_without_fleet_requeue_or_a_job_the_run_stands_by(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    _waiting_run(client, evaluator, clock)
    fleet = FakeFleet(["n0", "n1", "n2"])
    FleetSync(db, fleet, FleetConfig(backend="slurm"), clock=clock).round()
    assert fleet.calls == []
    assert [e for e in get(client, "/runs/r1/events")["events"] if e["name"] == "requeued"] == []


def test_fleet_requeue_needs_a_fleet() -> None:
    with pytest.raises(ValueError, match=r"fleet\.requeue needs a fleet backend"):
        FleetConfig(requeue=True)


def _events(client: TestClient, run: str, name: str) -> list[dict[str, Any]]:
    return [e for e in get(client, f"/runs/{run}/events")["events"] if e["name"] == name]


def test_a_run_scoped_agents_job_claim_cannot_get_another_job_requeued(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    # Run team-b-1's agents (a token scoped to team-b-*) name job 77, which Slurm runs on
    # someone else's nodes: nothing is requeued, drained nor cordoned, and the run says why.
    _waiting_run(client, evaluator, clock, run="team-b-1",
                 headers=scoped_agent_token(client, "team-b-*"))
    fleet = FakeFleet(["n0", "n1", "tw0", "tw1"],
                      jobs={"77": FleetJob("77", "RUNNING", True, frozenset({"tw0", "tw1"}))})
    sync = FleetSync(db, fleet, FleetConfig(backend="slurm", requeue=True), clock=clock)
    sync.round()
    assert fleet.calls == [("job", "77")]
    (ev,) = _events(client, "team-b-1", "requeue_refused")
    assert ev["message"] == ("job 77 is not requeued: its allocation (tw0, tw1) does not hold "
                             "the run's n0, n1: it is not the run's job"), ev
    assert ev["details"]["job"] == "77"
    assert _events(client, "team-b-1", "requeued") == []
    with db.read() as conn:
        assert hosts.cordoned_nodes(conn) == set()
    # Asked again after fleet.retry_s, recorded once.
    sync.round()
    clock.advance(31)
    sync.round()
    assert fleet.calls == [("job", "77"), ("job", "77")]
    assert len(_events(client, "team-b-1", "requeue_refused")) == 1


def test_a_run_scoped_agent_naming_another_runs_job_and_nodes_gets_nothing_requeued(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    # Run r1's trusted agents run in job 77 on n0 and n1.  Run team-b-1's agents (scoped)
    # claim the same job and the same node names, and one goes silent: the job is not theirs
    # to requeue (two runs name it), and r1 runs on.
    for n in ("n0", "n1"):
        register(client, run="r1", node=n, scheduler_job="77")
    _waiting_run(client, evaluator, clock, run="team-b-1",
                 headers=scoped_agent_token(client, "team-b-*"))
    fleet = FakeFleet(["n0", "n1"])
    FleetSync(db, fleet, FleetConfig(backend="slurm", requeue=True), clock=clock).round()
    assert ("requeue", "77", "n1") not in fleet.calls and ("drain", "n1") not in fleet.calls
    (ev,) = _events(client, "team-b-1", "requeue_refused")
    assert "the agents of r1 named it too" in ev["message"], ev
    with db.read() as conn:
        assert hosts.cordoned_nodes(conn) == set()


def test_a_run_scoped_runs_lost_node_is_kept_off_its_job_in_the_run_only_never_drained(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    _waiting_run(client, evaluator, clock, run="team-b-1",
                 headers=scoped_agent_token(client, "team-b-*"))
    run_id = get(client, "/runs/team-b-1")["id"]
    fleet = FakeFleet(["n0", "n1", "n2"], jobs={"77": FleetJob(
        "77", "RUNNING", True, frozenset({"n0", "n1"}), comment="trainwarden-run=team-b-1")})
    FleetSync(db, fleet, FleetConfig(backend="slurm", requeue=True), clock=clock).round()
    # Its own job, on its own nodes: requeued off n1 for this job only; Slurm's node is not
    # drained, and the shared ledger does not cordon it (another run may use n1).
    assert fleet.calls == [("job", "77"), ("requeue", "77", "n1")]
    (ev,) = _events(client, "team-b-1", "requeued")
    assert ev["details"]["drained"] == [] and ev["details"]["excluded"] == ["n1"]
    assert ev["details"]["in_run_only"] == ["n1"]
    with db.read() as conn:
        assert hosts.cordoned_nodes(conn) == set()
        assert set(hosts.run_cordons(conn, run_id=run_id)) == {"n1"}
    cond = get(client, "/runs/team-b-1")["condition"]
    assert "job 77 was requeued without n1" in cond["summary"], cond


def test_a_scoped_run_s_claimed_job_is_requeued_only_when_its_comment_names_the_run(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    # Run team-b-1's agents (scoped) name job 77 and the node names Slurm runs it on, and no
    # other run of this supervisor names it: the claims check out, but the job's comment
    # (set by its owner) names run r1, so the job is not team-b-1's to requeue.
    _waiting_run(client, evaluator, clock, run="team-b-1",
                 headers=scoped_agent_token(client, "team-b-*"))
    fleet = FakeFleet(["n0", "n1", "n2"])
    sync = FleetSync(db, fleet, FleetConfig(backend="slurm", requeue=True), clock=clock)
    sync.round()
    assert fleet.calls == [("job", "77")]
    (ev,) = _events(client, "team-b-1", "requeue_refused")
    assert ev["message"].startswith("job 77 is not requeued: its comment "
                                    "('trainwarden-run=r1') does not name run team-b-1: set "
                                    "it with `scontrol update JobId=77 "
                                    "Comment=trainwarden-run=team-b-1`"), ev
    assert _events(client, "team-b-1", "requeued") == []
    with db.read() as conn:
        assert hosts.cordoned_nodes(conn) == set()
    # The job's owner names the run in its comment: the next check requeues it.
    fleet.jobs["77"] = FleetJob("77", "RUNNING", True, frozenset({"n0", "n1"}),
                                comment="trainwarden-run=team-b-1")
    clock.advance(31)
    sync.round()
    assert fleet.calls[-2:] == [("job", "77"), ("requeue", "77", "n1")]
    assert len(_events(client, "team-b-1", "requeued")) == 1
