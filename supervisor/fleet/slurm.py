"""The Slurm backend: ``scontrol`` and ``sinfo`` run as the supervisor's user, each with a
deadline (``SLURM_CONF`` and ``PATH`` from the supervisor's environment)."""

from __future__ import annotations

import getpass
import re
import shlex
import subprocess

from trainwarden.supervisor.fleet import REASON_PREFIX, FleetNode, FleetNodeState, FleetResult

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

    def requeue(self, job: str) -> FleetResult:
        """``scontrol requeue``: the job must be requeueable (``sbatch --requeue``, or the
        cluster's ``JobRequeue=1``); the batch script runs again with the same job id and
        ``SLURM_RESTART_COUNT`` one higher, on nodes that are not drained."""
        return self._run("scontrol", "requeue", job)
