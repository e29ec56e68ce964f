"""The agent's stop of a real Lightning run (torchrun, 2 workers, gloo): the workers exit on
the agent's SIGTERM, not after the grace period's SIGKILL.  Lightning's own SIGTERM handler
only sets a flag and broadcasts it from inside the handler, so each of the several SIGTERMs a
worker gets (the agent signals every process and group of the tree, torchrun forwards its
own) would start another collective and the workers would wait for the SIGKILL."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.torchrun import torchrun_cmd, worker_env
from tests.waiting import wait_for
from tests.wire import Receiver
from trainwarden.agent.config import AgentConfig
from trainwarden.agent.launcher import Launcher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

GRACE_S = AgentConfig.stop_grace_s  # the agent's default grace before SIGKILL


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(tmp_path / "agent.sock")
    yield r
    r.close()


def test_a_lightning_run_stops_on_the_agents_sigterm_well_within_the_grace(
        tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    for k, v in worker_env().items():
        monkeypatch.setenv(k, v)
    cmd = torchrun_cmd("lightning_module.py", "--steps", "100000", "--hidden", "32",
                       "--step-sleep", "0.01", "--checkpoint-every-steps", "20",
                       "--checkpoint-dir", str(tmp_path / "ck"))
    launcher = Launcher(cmd, run="stop", node="node0", state_dir=tmp_path / "state",
                        socket_path=Path(receiver.path), stop_grace_s=GRACE_S, echo=False)
    launcher.start(0, None)
    try:
        # Well into training on both ranks, past a checkpoint save.
        wait_for(lambda: {m["rank"] for m in receiver.of("step") if m["step"] >= 30} == {0, 1},
                 timeout=90, what="step 30 on both ranks", interval=0.1)
        workers = launcher.workers()
        assert sorted(workers) == [0, 1]
        caplog.set_level(logging.WARNING, logger="trainwarden.agent.launcher")
        exited: dict[int, float] = {}
        started = time.monotonic()
        launcher.begin_stop()
        while not launcher.stop_step():
            exited.update({r: time.monotonic() - started for r, w in workers.items()
                           if r not in exited and not _alive(w)})
            time.sleep(0.02)  # the agent's pace between two stop steps
        stop_s = time.monotonic() - started
    finally:
        if launcher.running or launcher.stopping:
            launcher.begin_stop(immediate=True)
            while not launcher.stop_step():
                time.sleep(0.02)
    print(f"\nstop of a Lightning run under the agent: {stop_s:.3f}s, workers gone after "
          f"{exited} (grace {GRACE_S}s)")
    # The workers ended on the SIGTERM, well within the grace; none of them was SIGKILLed.
    # (torchrun itself, its workers gone, may take longer to exit on a loaded machine: the
    # grace's SIGKILL then ends it, which is what the grace is for.)
    assert not any(_alive(w) for w in workers.values())
    assert sorted(exited) == sorted(workers) and max(exited.values()) < GRACE_S / 2, exited
    killed = {pid for r in caplog.records if "SIGKILL" in r.getMessage()
              for pid in (r.args[-1] if isinstance(r.args, tuple) and r.args else [])}
    assert not killed & {w.pid for w in workers.values()}, caplog.text
    # The workers ended on the SIGTERM itself: Lightning's handler never ran (it logs each
    # SIGTERM it gets, then at best ends the workers a few seconds later, at a batch's end).
    output = "".join(f.read_text() for f in sorted(launcher.log_dir.glob("attempt-0.*.log")))
    assert "Received SIGTERM" not in output, output[-3000:]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
