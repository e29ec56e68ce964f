"""The Slurm backend: ``scontrol`` and ``sinfo`` run as the supervisor's user, each with a
deadline (``SLURM_CONF`` and ``PATH`` from the supervisor's environment)."""

from __future__ import annotations

import getpass
import re
import shlex
import subprocess
from collections.abc import Sequence

from trainwarden.supervisor.fleet import (
    REASON_PREFIX,
    FleetJob,
    FleetNode,
    FleetNodeState,
    FleetResult,
)

_DOWN = ("DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "POWERED_DOWN", "POWER_DOWN")
_DRAIN = ("DRAIN", "DRAINED", "DRAINING")


def node_state(raw: str) -> FleetNodeState:
    """``scontrol show node``'s ``State=`` (``IDLE+DRAIN``, ``DOWN*+DRAIN``, ``MIXED``...)."""
    parts = [p.rstrip("*~#!%$@^-") for p in raw.upper().split("+")]
    if any(p in _DOWN for p in parts) or raw.endswith("*"):
        return FleetNodeState.DOWN
    if any(p in _DRAIN for p in parts):
        return FleetNodeState.DRAINED
    return FleetNodeState.AVAILABLE


# A Slurm job id (an array job's task: 123_4), as the agents name it; nothing else reaches
# a command line.
_JOB_ID = re.compile(r"[0-9]{1,20}(_[0-9]{1,10})?")
# squeue's fields for one job: none but the comment (its owner's free text, last) holds a "|"
_JOB_FORMAT = "%i|%T|%N|%x|%k"


def parse_job(text: str) -> tuple[str, str, str, str, str] | None:
    """``squeue -h -j JOB -o '%i|%T|%N|%x|%k'``: (id, state, node list, excluded nodes,
    comment); None when it lists no job.  The comment comes last and whole, whatever it
    holds."""
    for line in text.splitlines():
        parts = line.strip().split("|", 4)
        if len(parts) == 5 and parts[0]:
            return parts[0], parts[1], parts[2], parts[3], parts[4]
    return None


def parse_nodes(text: str) -> dict[str, FleetNode]:
    """``scontrol -o show node``: one node a line, ``Key=value`` pairs (a value may hold
    spaces: ``Reason=``, which comes with ``[user@time]``)."""
    out: dict[str, FleetNode] = {}
    for line in text.splitlines():
        rec = {m.group(1): m.group(2) for m in
               re.finditer(r"(\w[\w:/]*)=(.*?)(?= \w[\w:/]*=|$)", line.strip())}
        name = rec.get("NodeName")
        if not name:
            continue
        raw = rec.get("State", "")
        reason = rec.get("Reason", "")
        reason = "" if reason in ("(null)", "None") else reason
        out[name] = FleetNode(name, node_state(raw), reason, raw)
    return out


class SlurmFleet:
    name = "slurm"

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s

    def _run(self, *argv: str) -> FleetResult:
        cmd = shlex.join(argv)
        try:
            p = subprocess.run(list(argv), capture_output=True, text=True,
                               timeout=self.timeout_s, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            return FleetResult(cmd, False, f"{type(exc).__name__}: {exc}")
        out = (p.stdout + p.stderr).strip()
        if p.returncode != 0:
            out = f"exit {p.returncode}" + (f": {out}" if out else "")
        return FleetResult(cmd, p.returncode == 0, out)

    def check(self) -> FleetResult:
        """``scontrol show config`` answers, and the supervisor's user is root or the
        SlurmUser (who may drain; an operator or administrator level in the accounting
        database may too, which only an attempt shows)."""
        r = self._run("scontrol", "show", "config")
        if not r.ok:
            return r
        m = re.search(r"^SlurmUser\s*=\s*(\S+?)(\(\d+\))?\s*$", r.output, re.M)
        user = getpass.getuser()
        slurm_user = m.group(1) if m else "root"
        if user not in ("root", slurm_user):
            return FleetResult(r.command, False,
                               f"the supervisor runs as {user}, neither root nor the "
                               f"SlurmUser ({slurm_user}): it may not drain nodes unless "
                               "Slurm's accounting gives it the Operator admin level")
        return FleetResult(r.command, True, f"the supervisor runs as {user}, who may drain")

    def node_states(self) -> tuple[dict[str, FleetNode], FleetResult]:
        r = self._run("scontrol", "-o", "show", "node")
        return (parse_nodes(r.output) if r.ok else {}), r

    def cordon(self, node: str, reason: str) -> FleetResult:
        text = reason if reason.startswith(REASON_PREFIX) else f"{REASON_PREFIX} {reason}"
        return self._run("scontrol", "update", f"NodeName={node}", "State=DRAIN",
                         f"Reason={text[:400]}")

    def uncordon(self, node: str) -> FleetResult:
        return self._run("scontrol", "update", f"NodeName={node}", "State=RESUME")

    def job(self, job: str) -> tuple[FleetJob | None, FleetResult]:
        """``squeue`` for the job's state, node list and comment, the node list expanded by
        ``scontrol show hostnames``; a name that is not a Slurm job id is asked nothing."""
        if not _JOB_ID.fullmatch(job):
            return None, FleetResult(f"squeue -j {shlex.quote(job)}", False,
                                     "not a Slurm job id: not asked")
        r = self._run("squeue", "-h", "-j", job, "-o", _JOB_FORMAT)
        if not r.ok:
            return None, r
        found = parse_job(r.output)
        if found is None or found[0] != job:
            return None, FleetResult(r.command, True, f"Slurm lists no job {job}")
        _, state, nodelist, excluded, comment = found
        nodes: frozenset[str] = frozenset()
        if nodelist and nodelist != "(null)":
            names = self._run("scontrol", "show", "hostnames", nodelist)
            if not names.ok:
                return None, names
            nodes = frozenset(n.strip() for n in names.output.splitlines() if n.strip())
        return FleetJob(job=job, state=state, running=state == "RUNNING", nodes=nodes,
                        excluded="" if excluded in ("", "(null)") else excluded,
                        comment="" if comment == "(null)" else comment), r

    def requeue(self, job: FleetJob, exclude: Sequence[str]) -> list[FleetResult]:
        """``scontrol requeue``: the job must be requeueable (``sbatch --requeue``, or the
        cluster's ``JobRequeue=1``); the batch script runs again with the same job id and
        ``SLURM_RESTART_COUNT`` one higher, on nodes that are not drained.  With nodes to
        ``exclude``: ``scontrol requeuehold``, then the job's ``ExcNodeList`` gains them
        (a pending job's only), then ``scontrol release``."""
        if not exclude:
            return [self._run("scontrol", "requeue", job.job)]
        hold = self._run("scontrol", "requeuehold", job.job)
        if not hold.ok:
            return [hold]
        nodes = ",".join([*([job.excluded] if job.excluded else []), *exclude])
        update = self._run("scontrol", "update", f"JobId={job.job}", f"ExcNodeList={nodes}")
        return [hold, update, self._run("scontrol", "release", job.job)]
