"""The fleet's pure parts: Slurm's node records read, and the policy's decisions over them and
the health ledger (the commands against a real Slurm: tests/e2e/test_slurm_fleet.py)."""

from __future__ import annotations

from trainwarden.supervisor.control import policy
from trainwarden.supervisor.detect import NodeLostConfig
from trainwarden.supervisor.detect.node_lost import detect_lost_nodes
from trainwarden.supervisor.enums import Actor, HostState
from trainwarden.supervisor.fleet import DOWN_REASON_PREFIX, FleetNode, FleetNodeState
from trainwarden.supervisor.fleet.slurm import node_state, parse_nodes

RECORDS = (
    "NodeName=tw0 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 State=IDLE ThreadsPerCore=1 "
    "Partitions=tw\n"
    "NodeName=tw1 Arch=x86_64 State=IDLE+DRAIN Partitions=tw "
    "Reason=trainwarden: fans failing (host action 3) [root@2026-12-06T05:30:00]\n"
    "NodeName=tw2 Arch=x86_64 State=DOWN* Partitions=tw Reason=Not responding "
    "[slurm@2026-12-06T05:31:00]\n"
    "NodeName=tw3 State=MIXED+DRAIN Reason=maintenance [root@2026-12-06T05:32:00]\n")


def test_slurm_records_are_read_with_their_state_and_reason() -> None:
    nodes = parse_nodes(RECORDS)
    assert {n: (v.state, v.ours) for n, v in nodes.items()} == {
        "tw0": (FleetNodeState.AVAILABLE, False),
        "tw1": (FleetNodeState.DRAINED, True),
        "tw2": (FleetNodeState.DOWN, False),
        "tw3": (FleetNodeState.DRAINED, False)}
    assert nodes["tw3"].reason == "maintenance [root@2026-12-06T05:32:00]"
    assert nodes["tw1"].raw_state == "IDLE+DRAIN"


def test_node_states() -> None:
    assert node_state("ALLOCATED") == FleetNodeState.AVAILABLE
    assert node_state("IDLE*") == FleetNodeState.DOWN  # not responding
    assert node_state("DOWN+DRAIN") == FleetNodeState.DOWN
    assert node_state("FAIL") == FleetNodeState.DOWN
    assert node_state("ALLOCATED+DRAIN") == FleetNodeState.DRAINED


def _n(name: str, state: FleetNodeState, reason: str = "") -> FleetNode:
    return FleetNode(name, state, reason, state.upper())


def test_a_cordon_drains_and_an_uncordon_resumes_only_trainwardens_drain() -> None:
    ledger = {"a": (HostState.CORDONED, "operator", "fans failing"),
              "b": (HostState.PROBATION, "operator", "fans replaced"),
              "c": (HostState.PROBATION, "operator", "lifted")}
    nodes = {"a": _n("a", FleetNodeState.AVAILABLE),
             "b": _n("b", FleetNodeState.DRAINED, "trainwarden: fans failing"),
             "c": _n("c", FleetNodeState.DRAINED, "maintenance [root@t]")}
    plan = policy.fleet_decisions(ledger, nodes)
    assert plan.drain == [("a", "trainwarden: fans failing")]
    assert plan.resume == ["b"]  # never c: an administrator's drain
    # c reads cordoned again, with Slurm's reason
    assert [(d.node, d.actor) for d in plan.ledger] == [("c", Actor.FLEET)]
    assert "maintenance" in plan.ledger[0].reason


def test_the_schedulers_drain_and_down_read_cordoned_and_its_return_lifts_only_its_own() -> None:
    nodes = {"d": _n("d", FleetNodeState.DOWN, "Not responding"),
             "e": _n("e", FleetNodeState.DRAINED, "maintenance"),
             "f": _n("f", FleetNodeState.AVAILABLE), "g": _n("g", FleetNodeState.AVAILABLE)}
    ledger = {"f": (HostState.CORDONED, Actor.FLEET, "slurm: down"),
              "g": (HostState.CORDONED, Actor.POLICY, "cordon.infra_failures: ...")}
    plan = policy.fleet_decisions(ledger, nodes)
    assert [(type(d).__name__, d.node) for d in plan.ledger] == [
        ("Cordon", "d"), ("Cordon", "e"), ("Uncordon", "f")]
    assert plan.ledger[0].reason == "slurm: down in Slurm (DOWN): Not responding"
    assert plan.ledger[0].reason.startswith(DOWN_REASON_PREFIX)  # what the detector reads
    assert plan.drain == [("g", "trainwarden: cordon.infra_failures: ...")]
    assert plan.resume == []
    # Nothing to do once both agree; a node Slurm does not know is not the fleet's.
    settled = {"d": (HostState.CORDONED, Actor.FLEET, ""), "e": (HostState.CORDONED,
               Actor.FLEET, ""), "g": (HostState.CORDONED, Actor.POLICY, ""),
               "zz": (HostState.CORDONED, Actor.OPERATOR, "")}
    nodes["g"] = _n("g", FleetNodeState.DRAINED, "trainwarden: cordon.infra_failures")
    del nodes["f"]
    assert policy.fleet_decisions(settled, nodes) == policy.FleetPlan()


def test_a_silent_node_its_scheduler_says_is_down_is_lost_at_the_confirmation() -> None:
    cfg = NodeLostConfig()  # deadline 30 s, confirm 5 s
    beats = {"a": 100.0, "b": 100.0}
    down = {"a": "slurm: down in Slurm (DOWN): psu failed"}
    (f,) = detect_lost_nodes(beats, 106.0, cfg, down=down)
    assert f.node == "a" and f.details["confirmed_by"] == "scheduler", f
    assert "psu failed" in f.message
    assert detect_lost_nodes(beats, 104.0, cfg, down=down) == []  # not silent long enough
    assert detect_lost_nodes({"a": 105.5}, 106.0, cfg, down=down) == []  # heard from
    # Without the scheduler's word, silence alone waits for the deadline.
    assert detect_lost_nodes(beats, 106.0, cfg) == []
    assert [f.node for f in detect_lost_nodes(beats, 131.0, cfg, down=down)] == ["a", "b"]
