"""The launcher on the real torchrun, where what it reports depends on torchrun's own output."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from tests.waiting import wait_for
from trainwarden.agent.core import rootcause
from trainwarden.agent.launcher import Launcher

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def test_a_taken_rendezvous_port_is_reported_as_torchruns_own_failure(tmp_path: Path) -> None:
    """The node holding node rank 0 of a static rendezvous cannot listen on the endpoint's
    port (another process holds it): torchrun fails before any worker starts, and the exit
    carries its own root cause, naming the taken port."""
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        state = tmp_path / "state"
        state.mkdir()
        launcher = Launcher([TORCHRUN, "--nnodes=2", "--node-rank=0", "--rdzv-backend=static",
                             f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0",
                             "--nproc-per-node=1", str(script)],
                            run="r", node="node0", state_dir=state,
                            socket_path=tmp_path / "s.sock", echo=False)
        launcher.start(0, None)
        info = wait_for(launcher.poll, timeout=60, what="torchrun to exit")
    assert info.exit_code == 1
    (entry,) = info.failed_ranks
    assert entry["launcher"] is True and entry["rank"] is None
    rc = rootcause.from_dict(entry["root_cause"])
    assert rc is not None and rootcause.port_in_use(rc), entry
    assert f"port: {port}" in rc.message
