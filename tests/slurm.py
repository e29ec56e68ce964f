"""A real Slurm cluster on this machine: munged, slurmctld and three slurmd (``slurmd -N
tw0..tw2``, one port each, all ``NodeHostname=localhost``), with their own configuration, state
and spool in a temporary directory; Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and
``munge`` packages (``.ci/run`` installs them).  Slurm's daemons run as root."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.waiting import wait_for

NODES = ("tw0", "tw1", "tw2")
CPUS = 2  # per node: this machine's cores, oversubscribed by the partition
# Fixed ports, below the kernel's ephemeral range (32768 and up), away from torchrun's 29400.
CTLD_PORT = 42100
SLURMD_PORTS = {n: 42101 + i for i, n in enumerate(NODES)}
SRUN_PORTS = "42150-42199"
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sinfo", "sbatch", "srun",
            "scontrol", "squeue", "scancel")


def missing() -> str | None:
    """Why a Slurm cluster cannot run here, or None."""
    absent = [b for b in BINARIES if shutil.which(b) is None
              and not Path("/usr/sbin", b).exists()]
    if absent:
        return ("Slurm is not installed (missing: " + ", ".join(absent) + "); install "
                "slurmctld slurmd slurm-client munge (.ci/run does)")
    if os.geteuid() != 0:
        return "the local Slurm cluster's daemons run as root (SlurmUser=root); not root"
    return None


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def config(d: Path) -> str:
    """The cluster's slurm.conf, every path under ``d``."""
    nodes = "\n".join(f"NodeName={n} NodeHostname=localhost Port={SLURMD_PORTS[n]} "
                      f"CPUs={CPUS} State=UNKNOWN" for n in NODES)
    return f"""\
ClusterName=tw
SlurmctldHost=localhost
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORTS[NODES[0]]}
SrunPortRange={SRUN_PORTS}
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdTimeout=30
{nodes}
PartitionName=tw Nodes={NODES[0]},{NODES[1]},{NODES[2]} Default=YES MaxTime=INFINITE \
State=UP OverSubscribe=FORCE:4
"""


class SlurmCluster:
    """The running cluster; ``env`` is what a Slurm command needs (``SLURM_CONF``)."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.conf = d / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> SlurmCluster:
        d = self.dir
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)  # munged checks the key's directory
        self.conf.write_text(config(d))
        subprocess.run([_bin("mungekey"), "--create", "--force", "--keyfile",
                        str(d / "munge.key")], check=True, capture_output=True)
        self._daemon([_bin("munged"), "--foreground", "--force", f"--socket={d}/munge.socket",
                      f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid",
                      f"--log-file={d}/log/munged.log", f"--seed-file={d}/munged.seed"],
                     "munged")
        wait_for(lambda: (d / "munge.socket").exists(), 30, "munged's socket", interval=0.1)
        self._daemon([_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for n in NODES:
            self._daemon([_bin("slurmd"), "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}")
        wait_for(lambda: self.states() == dict.fromkeys(NODES, "idle"), 60,
                 f"sinfo to show {', '.join(NODES)} idle", interval=0.5)
        return self

    def _daemon(self, argv: list[str], name: str) -> None:
        out = open(self.dir / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the daemon's)
        self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True))
        out.close()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--partition=tw")
            wait_for(lambda: not self.run("squeue", "-h", "-o", "%i").stdout.strip(), 60,
                     "every job to end", interval=0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)

    def run(self, *argv: str, timeout: float = 30, check: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([_bin(argv[0]), *argv[1:]], capture_output=True, text=True,
                              timeout=timeout, check=check, env={**self.env, **(env or {})})

    def states(self) -> dict[str, str]:
        """sinfo's state of each node (``idle``, ``alloc``, ``mix``, ``drain``, ``down``...,
        the flag characters dropped)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return {n: re.sub(r"[*~#!%$@^-]+$", "", s) for n, s in
                (line.split() for line in out.splitlines() if line.strip())}

    def node(self, name: str) -> dict[str, str]:
        return parse_record(self.run("scontrol", "-o", "show", "node", name).stdout)

    def job(self, job_id: str) -> dict[str, str]:
        return parse_record(self.run("scontrol", "-o", "show", "job", job_id).stdout)

    def sbatch(self, *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None
               ) -> str:
        """Submits a batch job; its id."""
        r = subprocess.run([_bin("sbatch"), "--parsable", *argv], capture_output=True,
                           text=True, timeout=30, env={**self.env, **(env or {})}, cwd=cwd)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout.strip().split(";")[0]

    def tail(self, n: int = 3000) -> str:
        log = self.dir / "log" / "slurmctld.log"
        return log.read_text(errors="replace")[-n:] if log.exists() else ""


def parse_record(text: str) -> dict[str, str]:
    """One ``scontrol -o show`` record as key -> value (a value may hold spaces: Reason=)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(\w[\w:/]*)=(.*?)(?= \w[\w:/]*=|$)", text.strip()):
        out[m.group(1)] = m.group(2)
    return out


@contextlib.contextmanager
def cluster(d: Path) -> Iterator[SlurmCluster]:
    c = SlurmCluster(d)
    try:
        yield c.start()
    finally:
        c.stop()
