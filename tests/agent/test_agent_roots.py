"""The agent registers its checkpoint roots whenever it can know them: --checkpoint-root, else
the training command's --checkpoint-dir and the directories its workers report checkpoints
in (learned at once, registered again before the checkpoint's batch goes out, remembered
across restarts).  Against the real supervisor, which refuses a checkpoint outside the roots,
every checkpoint of the default setup (no --checkpoint-root) is stored."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.agent.agent_fakes import FakeRun, FakeSupervisor
from tests.waiting import wait_for
from trainwarden.agent import protocol
from trainwarden.agent.config import AgentConfig
from trainwarden.agent.loop import Agent
from trainwarden.agent.uplink import Uplink
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.server.app import create_app

AGENT_TOKEN, OPERATOR_TOKEN = "agent-token", "operator-token"
HEARTBEAT = {"type": "heartbeat", "state": "running", "workers": []}


@pytest.mark.parametrize(("cmd", "want"), [
    (["torchrun", "train.py", "--checkpoint-dir", "/data/ck"], "/data/ck"),
    (["torchrun", "train.py", "--checkpoint_dir=/data/ck"], "/data/ck"),
    (["torchrun", "train.py", "--checkpoint-dir", "rel/ck"], "CWD/rel/ck"),
    (["torchrun", "train.py", "--checkpoint-dir"], None),
    (["torchrun", "train.py"], None),
])
def test_the_training_commands_checkpoint_dir(cmd: list[str], want: str | None,
                                             tmp_path: Path) -> None:
    cfg = AgentConfig(supervisor_url="http://s", run="r", command=cmd, state_dir=tmp_path)
    got = cfg.command_checkpoint_dir
    assert (None if got is None else str(got)) == (
        None if want is None else want.replace("CWD", str(Path.cwd())))


def make_agent(agents: list[Agent], cfg: AgentConfig, transport: httpx.BaseTransport
               ) -> Agent:
    agent = Agent(cfg, transport=transport, threaded_uplink=False, echo=False)
    agents.append(agent)
    return agent


def report_checkpoint(cfg: AgentConfig, path: Path, step: int) -> None:
    """What a worker's Checkpointer sends when a save is complete."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(protocol.encode_datagram({"type": "checkpoint", "rank": 0, "step": step,
                                           "path": str(path), "t": time.time(),
                                           "lineage": "a0"}), str(cfg.socket_path))


def test_registration_names_the_root_the_agent_knows(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent]) -> None:
    ck = fake_run.tmp_path / "ckpt"
    cmd_dir = fake_run.tmp_path / "from-command"
    cfg = fake_run.config("serve", "--checkpoint-dir", str(cmd_dir), checkpoint_root=None)
    agent = make_agent(agents, cfg, fake_supervisor.transport())
    assert agent.uplink.register_request["checkpoint_roots"] == [str(cmd_dir)]
    agent.close()
    agents.clear()
    cfg = fake_run.config("serve", "--checkpoint-dir", str(cmd_dir))  # --checkpoint-root ck
    agent = make_agent(agents, cfg, fake_supervisor.transport())
    assert agent.uplink.register_request["checkpoint_roots"] == [str(ck)]
    assert agent.uplink.register_request["checkpoint_root"] == str(ck)


def test_a_learned_root_is_registered_before_the_checkpoints_batch(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent]) -> None:
    ck = fake_run.tmp_path / "ckpt"
    (ck / "step_5").mkdir(parents=True)
    cfg = fake_run.config("serve", checkpoint_root=None)
    agent = make_agent(agents, cfg, fake_supervisor.transport())
    agent.start()
    wait_for(lambda: (agent.tick(), fake_supervisor.seqs())[1], what="a first batch")
    report_checkpoint(cfg, ck / "step_5", 5)
    wait_for(lambda: (agent.tick(), fake_supervisor.items("checkpoint"))[1],
             what="the checkpoint delivered")
    log = fake_supervisor.log
    seq = next(b["seq"] for b in fake_supervisor.batches.values()
               if any(i["type"] == "checkpoint" for i in b["items"]))
    assert log[0] == ("register", [])
    again = log.index(("register", [str(ck)]))
    assert again < log.index(("ingest", seq)), "registered again before the checkpoint"
    # A restarted agent registers the learned root at once.
    agent.launcher.stop()
    agent.close()
    agents.clear()
    agent = make_agent(agents, cfg, fake_supervisor.transport())
    assert agent.uplink.register_request["checkpoint_roots"] == [str(ck)]


def test_a_refused_reregistration_does_not_stop_the_batches(
        tmp_path: Path, fake_supervisor: FakeSupervisor) -> None:
    up = Uplink(supervisor_url="http://s", token="agent-token", state_dir=tmp_path,
                register_request={"run": "r", "node": "n"},
                transport=fake_supervisor.transport())
    up.enqueue([{"type": "step", "rank": 0, "step": 0}], HEARTBEAT, attempt=0)
    up.pump()
    assert fake_supervisor.seqs() == [0]
    fake_supervisor.register_status = 422
    up.update_registration({"run": "r", "node": "n", "checkpoint_roots": ["/"]})
    up.enqueue([{"type": "step", "rank": 0, "step": 1}], HEARTBEAT, attempt=0)
    up.pump()
    assert fake_supervisor.seqs() == [0, 1]
    assert [k for k, _ in fake_supervisor.log] == ["register", "ingest", "register", "ingest"]
    up.close()


class AppTransport(httpx.BaseTransport):
    """The real supervisor app, in process, as the agent's HTTP transport."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.client.request(request.method, request.url.path, content=request.read(),
                                headers=dict(request.headers))
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)


def test_against_the_real_supervisor_every_checkpoint_of_the_default_setup_is_stored(
        fake_run: FakeRun, agents: list[Agent], tmp_path: Path) -> None:
    settings = SupervisorSettings(agent_token=AGENT_TOKEN, operator_token=OPERATOR_TOKEN,
                                  data_dir=tmp_path / "sup")
    (tmp_path / "sup").mkdir()
    ck = fake_run.tmp_path / "ckpt"
    (ck / "step_5").mkdir(parents=True)
    with TestClient(create_app(settings, start_evaluator=False)) as client:
        cfg = fake_run.config("serve", checkpoint_root=None)
        agent = make_agent(agents, cfg, AppTransport(client))
        agent.start()
        report_checkpoint(cfg, ck / "step_5", 5)
        report_checkpoint(cfg, ck / "step_6", 6)

        def stored() -> list[Any]:
            agent.tick()
            r = client.get("/api/v1/runs/run1/checkpoints",
                           headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
            return r.json()["checkpoints"] if r.status_code == 200 else []

        cps = wait_for(lambda: len(stored()) == 2 and stored(), what="both checkpoints")
        assert sorted(c["path"] for c in cps) == [str(ck / "step_5"), str(ck / "step_6")]
        assert agent.uplink.dead_lettered == 0


if sys.platform != "linux":  # pragma: no cover (the agent is Linux-only)
    pytestmark = pytest.mark.skip("the agent runs on Linux")


def test_every_node_reads_its_disk_before_and_without_checkpoints_of_its_own(
        tmp_path: Path) -> None:
    """A node whose ranks save no checkpoint of their own (DCP's rank 0 writes the metadata;
    a data-parallel run may save from rank 0 only) still reads the free space where the
    command saves them: free disk is never "n/a" on it."""
    from trainwarden.agent.monitor import disk_usage
    from trainwarden.agent.roots import CheckpointRoots

    ck = tmp_path / "ck"  # (not made yet: its nearest existing parent is read)
    roots = CheckpointRoots(checkpoint_root=None, command_checkpoint_dir=ck, learned=None)
    assert roots.free_space_at == ck and disk_usage(roots.free_space_at) is not None
    roots.learn(str(tmp_path / "other" / "step_10"))
    assert roots.free_space_at == tmp_path / "other"
    given = CheckpointRoots(checkpoint_root=tmp_path / "root", command_checkpoint_dir=ck,
                            learned=None)
    assert given.free_space_at == tmp_path / "root"
    known = CheckpointRoots(checkpoint_root=None, command_checkpoint_dir=None,
                            learned=[str(tmp_path / "old")])
    assert known.free_space_at == tmp_path / "old"
