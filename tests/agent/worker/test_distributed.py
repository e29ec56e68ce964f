"""The process group's threads are gone before the interpreter shuts down."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainwarden.agent.worker import PhaseTimer, attach_compute_timer

REPO = Path(__file__).resolve().parents[3]

# Runs a training script as its own __main__ (one process, no torchrun: a one-rank gloo
# group).  The automatic collector is off, so a reference cycle left by the script stays
# alive unless something collects it on purpose.  The atexit hook registered first runs
# last, after trainwarden's: it counts the threads that the interpreter's own shutdown would
# meet.
WRAPPER = textwrap.dedent("""
    import atexit, gc, os, runpy, sys

    def threads():
        return len(os.listdir("/proc/self/task"))

    gc.disable()
    print(f"before: {threads()}", flush=True)
    atexit.register(lambda: print(f"at shutdown: {threads()}", flush=True))
    script = sys.argv[1]
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")
""")

# A script that starts its process group itself, not through init_distributed.
OWN_GROUP = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from trainwarden.agent.worker import Checkpointer

    def main():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = DDP(torch.nn.Linear(4, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = Checkpointer(sys.argv[1], model, optimizer, keep=1)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        ckpt.save(20)
        ckpt.close()
        dist.destroy_process_group()

    main()
""")


def _run(tmp_path: Path, script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINWARDEN_", "WORLD_SIZE", "RANK", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(wrapper), str(script), *args], env=env,
                          capture_output=True, text=True, timeout=120)


# DCP's state-dict helpers leave a reference cycle that held the DDP model and its gloo group
# (3 threads) past destroy_process_group; torn down during interpreter shutdown, a finished
# worker sometimes aborted (-6).
@pytest.mark.parametrize("how", ["example (init_distributed)", "own process group"])
def test_backend_threads_are_joined_before_interpreter_shutdown(tmp_path: Path,
                                                                 how: str) -> None:
    ck = tmp_path / "ck"
    if how.startswith("example"):
        proc = _run(tmp_path, REPO / "examples" / "train_ddp.py", "--steps", "20",
                    "--checkpoint-every-steps", "10", "--hidden", "32", "--keep", "2",
                    "--checkpoint-dir", str(ck))
    else:
        script = tmp_path / "own_group.py"
        script.write_text(OWN_GROUP)
        proc = _run(tmp_path, script, str(ck))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = dict(re.findall(r"^(before|at shutdown): (\d+)$", proc.stdout, re.M))
    assert set(counts) == {"before", "at shutdown"}, proc.stdout
    assert (ck / "step_20").is_dir(), proc.stderr
    assert counts["at shutdown"] == counts["before"], proc.stdout


def _one_step(model: torch.nn.Module, timer: PhaseTimer) -> PhaseTimer:
    timer.start()
    timer.data_ready()
    model(torch.randn(4, 8)).sum().backward()
    timer.stop()
    return timer


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_compute_timer_marks_compute_on_ddp_and_fsdp2(wrap: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model = (DistributedDataParallel(net) if wrap == "ddp"
             else fully_shard(net, mesh=init_device_mesh("cpu", (1,))))
    timer = PhaseTimer()
    attach_compute_timer(model, timer)
    _one_step(model, timer)
    assert timer.compute_s is not None
    assert timer.step_s is not None
    assert 0 <= timer.compute_s <= timer.step_s


def test_compute_timer_on_a_plain_module_says_what_to_do() -> None:
    with pytest.raises(TypeError, match=r"call timer\.compute_done\(\) yourself"):
        attach_compute_timer(torch.nn.Linear(2, 2), PhaseTimer())
