"""A network partition, end to end: three agents (two members and a spare), each in a network
namespace of its own on one bridge, the supervisor listening on the bridge; the network
between the two members is cut while training (``tests.e2e.netns``), every agent still heard
by the supervisor.  Real torchrun, real gloo over the namespaces' interfaces, a 10 s
collective timeout (the example's ``--timeout``) and a 15 s rendezvous timeout (the agent's
``--rendezvous-timeout``) to keep it short."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.netns import Fabric, fabric, unavailable
from tests.e2e.nodes import KILL_AT, STEPS, TRAIN, Nodes, cli, ended, summary
from tests.e2e.system import OPERATOR_TOKEN, Supervisor, wait_until
from tests.e2e.torchrun import RunResult

pytestmark = pytest.mark.e2e

NODES = ("node0", "node1", "spare0")
AGENT = ("--rendezvous-timeout", "15")
TRAIN_SHORT_TIMEOUT = ("--steps", str(STEPS), *TRAIN, "--timeout", "10")


@pytest.fixture
def net() -> Iterator[Fabric]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"a partition needs network namespaces: {why}")
    with fabric(NODES) as f:  # removed on teardown, whatever the test did
        yield f


@pytest.fixture
def supervisor(tmp_path: Path, net: Fabric) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "supervisor", host=net.host).start()
    yield sup
    sup.stop()


def _members_and_a_spare(sup: Supervisor, net: Fabric, tmp_path: Path, run: str
                         ) -> tuple[Nodes, str, str]:
    """The nodes, started; (the rendezvous host: node rank 0's node, the other member)."""
    nodes = Nodes(sup, run, tmp_path / "run", train=TRAIN_SHORT_TIMEOUT, fabric=net)
    nodes.start("node0", *AGENT)
    nodes.start("node1", *AGENT)
    wait_until(lambda: nodes.step() >= 1, 120, "training to start on the two members")
    nodes.start("spare0", "--spare", *AGENT)
    wait_until(lambda: any(a["node"] == "spare0" for a in sup.get(f"/runs/{run}")["agents"]),
               60, "the spare to register")
    (host,) = [n for n in ("node0", "node1") if nodes.member(n)["node_rank"] == 0]
    (other,) = [n for n in ("node0", "node1") if n != host]
    return nodes, host, other


def _incidents(sup: Supervisor, run: str) -> list[dict[str, Any]]:
    return sorted(sup.get(f"/runs/{run}/incidents")["incidents"], key=lambda i: i["id"])


def _story(sup: Supervisor, run: str) -> str:
    """The run's incidents and actions, one line each (a failed assertion's message: the
    dicts' own repr is cut short)."""
    lines = [f"incident {i['id']} {i['kind']} attempt {i['attempt']} {i['node']} {i['status']}"
             f" consequence_of={(i['details'] or {}).get('consequence_of')}: {i['cause'][:200]}"
             for i in _incidents(sup, run)]
    lines += [f"action {a['id']} {a['cause']} attempt {a['attempt']} {a['status']}: "
              f"{a['reason'][:200]}" for a in sorted(
                  sup.get(f"/runs/{run}/actions")["actions"], key=lambda a: a["id"])]
    return "\n".join(lines)


def test_a_member_cut_off_from_the_rendezvous_host_is_replaced_once_and_named(
        supervisor: Supervisor, net: Fabric, clean: RunResult, tmp_path: Path) -> None:
    """The cut hangs the gradient all-reduce until the collective timeout; the restart's
    rendezvous cannot form (the member cannot reach the host's store), and that names the
    partition: one incident, the member cut off replaced by the spare, no restart loop, the
    clean run's weights."""
    run = "partition"
    nodes, host, victim = _members_and_a_spare(supervisor, net, tmp_path, run)
    try:
        wait_until(lambda: nodes.step() >= KILL_AT, 120, f"step {KILL_AT}")
        net.cut(host, victim)
        finished = wait_until(lambda: ended(supervisor, run), 300, "the run to end")
        assert finished["status"] == "completed", finished
        for node, a in nodes.agents.items():
            assert a.wait(60) == 0, (node, a.tail())
    finally:
        nodes.stop()
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    incidents = _incidents(supervisor, run)
    part = [i for i in incidents if i["kind"] == "partition"]
    assert len(part) == 1, _story(supervisor, run)
    assert part[0]["node"] == victim, _story(supervisor, run)
    assert (f"network partition: {victim} cannot reach {host} (the rendezvous host, "
            f"{net.address(host)}:") in part[0]["cause"], part
    assert part[0]["details"]["partition"]["cut_off"] == victim, part
    # The collective timeout it caused is its consequence, never a failure of its own.
    first = [i for i in incidents if i["id"] < part[0]["id"]
             and i["kind"] in ("collective_timeout", "hang", "crash")]
    assert first and all(i["details"].get("consequence_of") == part[0]["id"] for i in first), \
        _story(supervisor, run)
    assert not [i for i in incidents if i["kind"] in ("crash", "node_lost")], \
        _story(supervisor, run)
    # The timeout's restart (counted once), then the partition's (counted against no budget)
    # that replaces the member: no loop on a rendezvous that cannot form.
    actions = sorted(supervisor.get(f"/runs/{run}/actions")["actions"], key=lambda a: a["id"])
    assert [a["cause"] for a in actions] == ["hang", "partition"], actions
    assert actions[-1]["status"] == "resumed", actions
    assert f"spare0 takes node rank 1 of {victim} (cut off)" in actions[-1]["reason"], actions
    assert actions[-1]["plan"]["membership"]["members"]["spare0"] == 1, actions
    counted = {k: v for k, v in finished["restarts_by_cause"].items() if v}
    assert counted == {"hang": 1, "partition": 1}, finished
    assert nodes.member("spare0")["role"] == "member"
    assert nodes.member(victim)["role"] == "spare"
    out = cli(supervisor, "incidents", run)
    assert f"{victim} cannot reach {host}" in out, out
    page = httpx.get(f"{supervisor.url}/runs/{run}", timeout=10,
                     headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}).text
    why = page.split('id="failure"', 1)[1].split("</section>", 1)[0]
    assert f"network partition: {victim} cannot reach {host}" in why, why


def test_a_partition_that_heals_before_the_restart_replaces_nothing(
        supervisor: Supervisor, net: Fabric, clean: RunResult, tmp_path: Path) -> None:
    run = "healed"
    nodes, host, other = _members_and_a_spare(supervisor, net, tmp_path, run)
    try:
        wait_until(lambda: nodes.step() >= KILL_AT, 120, f"step {KILL_AT}")
        net.cut(host, other)
        wait_until(lambda: [i for i in _incidents(supervisor, run)
                            if i["kind"] in ("collective_timeout", "hang", "crash")], 60,
                   "the collective timeout")
        net.heal(host, other)
        finished = wait_until(lambda: ended(supervisor, run), 300, "the run to end")
        assert finished["status"] == "completed", finished
        for node, a in nodes.agents.items():
            assert a.wait(60) == 0, (node, a.tail())
    finally:
        nodes.stop()
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    actions = supervisor.get(f"/runs/{run}/actions")["actions"]
    assert [a["cause"] for a in actions] == ["hang"], actions
    assert "membership" not in actions[0]["plan"] or \
        actions[0]["plan"]["membership"]["members"] == {host: 0, other: 1}, actions
    assert not [i for i in _incidents(supervisor, run) if i["kind"] == "partition"]
    assert nodes.member("spare0")["role"] == "spare"
    assert {nodes.member(n)["node_rank"] for n in (host, other)} == {0, 1}
