"""Run the torchrun command as a process tree the agent can always take down completely.

Why not just ``killpg``: torchrun starts each worker with ``start_new_session=True`` (checked
in torch 2.13 ``SubprocessHandler``), so the workers are *not* in torchrun's process group, and
a SIGKILLed torchrun leaves them reparented to init.  What every process of ours does share is
the environment the agent gave the tree (``TRAINWARDEN_RUN``/``NODE``/``AGENT_SOCKET``, which
torchrun copies into the workers).  So "the group" here is: torchrun's process group, every
descendant of torchrun, the process groups those descendants lead, and every process that
carries our environment marks.  Stop signals all of them, SIGKILLs what is left after the grace
period, and then verifies that nothing is left.  It never waits on torchrun's own shutdown
(after a collective timeout torchrun SIGTERMs a stopped worker and waits a hard-coded 30 s,
ignoring --shutdown-timeout, before it SIGKILLs).

torchrun's stdout/stderr go to files in the state dir, not pipes, so a dead agent can never
block or SIGPIPE the training; the agent tails the files to echo them and to parse torchrun's
failure summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from trainwarden.agent import protocol
from trainwarden.agent.core import rootcause
from trainwarden.agent.core import text as untrusted
from trainwarden.agent.statefile import load_json, save_json

log = logging.getLogger(__name__)

# The signal on which the in-training library's faulthandler dumps every thread's stack
# (trainwarden.agent.worker.distributed.STACK_DUMP_SIGNAL; not imported from there: it imports
# torch).
STACK_DUMP_SIGNAL = signal.SIGUSR1

# How much of torchrun's output is kept for parsing the failure summary at exit.
_TAIL_BYTES = 256 * 1024
# How much of this attempt's stderr is read for the workers' tracebacks, and the most of an
# error file read.
_STDERR_TAIL_BYTES = 512 * 1024
_ERROR_FILE_MAX_BYTES = 1024 * 1024
# A process that survives SIGKILL this long is stuck in the kernel (D state): give up waiting.
_KILL_VERIFY_S = 10.0


# --------------------------------------------------------------------------------------------
# torchrun failure summary


_RANK_RE = re.compile(r"^\s*rank\s*:\s*(-?\d+)\s*\(local_rank:\s*(-?\d+)\)")
_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(-?\d+)\)")
_TRACE_RE = re.compile(r"^\s*traceback\s*:\s?(.*)$")
_FIELD_RE = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:")
_ENTRY_RE = re.compile(r"^\[\d+\]:\s*$")


def parse_failure_summary(text: str) -> list[dict[str, Any]]:
    """The failed ranks listed by torchrun's ``ChildFailedError`` summary (the last one in
    ``text``): ``{rank, local_rank, exit_code, signal, pid, message}`` each, root cause first.

    The format is torch's ``_FAILURE_FORMAT_TEMPLATE``; a summary we cannot read yields ``[]``
    rather than an error, since the exit code is still reported."""
    lines = text.splitlines()
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].strip() == "Failures:":
            start = i
            break
    if start is None:
        return []
    root: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    target = others
    cur: dict[str, Any] | None = None
    in_trace = False
    for line in lines[start + 1 :]:
        if line.startswith("Root Cause"):
            target = root
            in_trace = False
            continue
        if _ENTRY_RE.match(line):
            cur = {"rank": None, "local_rank": None, "exit_code": None, "signal": None,
                   "pid": None, "message": ""}
            target.append(cur)
            in_trace = False
            continue
        if cur is None:
            continue
        if m := _RANK_RE.match(line):
            cur["rank"], cur["local_rank"] = int(m.group(1)), int(m.group(2))
        elif m := _EXIT_RE.match(line):
            code = int(m.group(1))
            cur["exit_code"], cur["pid"] = code, int(m.group(2))
            cur["signal"] = -code if code < 0 else None
        elif m := _TRACE_RE.match(line):
            cur["message"] = m.group(1).strip()
            in_trace = True
        elif in_trace and line.startswith("  ") and not _FIELD_RE.match(line):
            # A Python traceback continues indented; its last line is the exception.
            if line.strip():
                cur["_last"] = line.strip()
        elif line.startswith("="):
            in_trace = False
    out = []
    for f in root + others:
        last = f.pop("_last", None)
        if last and f["message"].startswith("Traceback"):
            f["message"] = last
        if f["message"].startswith(rootcause.TORCHRUN_HINT):
            f["message"] = ""  # torchrun's hint says nothing about the failure
        if f["rank"] is not None:
            out.append(f)
    return out


# --------------------------------------------------------------------------------------------
# The root cause of each failed rank (``trainwarden.agent.core.rootcause``)

# torchrun's error files: <log dir>/<run id>/attempt_<n>/<local rank>/error.json.  A path read
# from the summary is only followed when it has this shape (the summary is in the same stream
# the workers write to).
_ERROR_FILE_RE = re.compile(r"/attempt_\d+/\d+/error\.json$")


def read_error_file(path: str) -> rootcause.RootCause | None:
    """The root cause in torchrun's error file at ``path`` (None when it is not one)."""
    if not (os.path.isabs(path) and _ERROR_FILE_RE.search(path)):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _ERROR_FILE_MAX_BYTES:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = json.loads(f.read(_ERROR_FILE_MAX_BYTES).decode(errors="replace"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return rootcause.from_error_file(data)


def attach_root_causes(failed: list[dict[str, Any]], output: str, stderr: str) -> None:
    """Give each failed rank its ``root_cause`` (``RootCause.as_dict``, cleaned), from
    torchrun's error file, else its failure summary, else its traceback in the node's stderr,
    else (it left no traceback: ``os._exit``, argparse's usage error) its last lines of
    stderr; its ``message`` becomes the exception line, or the last line of stderr
    ("To enable traceback see ..." says nothing).  A rank killed by a signal (torchrun's
    stop of the survivors, the OOM killer) is not given the node's last lines: they are
    another rank's."""
    details = rootcause.summary_details(output)
    coded = [f for f in failed if isinstance(f.get("exit_code"), int) and f["exit_code"] > 0]
    for f in failed:
        rank = f.get("rank")
        if not isinstance(rank, int):
            continue
        d = details.get(rank, {})
        rc = read_error_file(d["error_file"]) if "error_file" in d else None
        if rc is None and "traceback" in d:
            rc = rootcause.from_summary(d["traceback"])
        if rc is None and stderr:
            rc = rootcause.from_stderr(stderr, rank=rank,
                                       sole_failure=len(coded) == 1 and f is coded[0])
        if rc is None and stderr and f in coded:
            rc = rootcause.from_stderr_tail(stderr, rank=rank)
        if rc is None:
            continue
        f.update(_cause_fields(dataclasses.replace(rc, rank=rank,
                                                   host=d.get("host") or socket.gethostname())))


def _cause_fields(rc: rootcause.RootCause) -> dict[str, Any]:
    """A failed-rank entry's ``root_cause`` (cleaned) and ``message`` (the exception line)."""
    line = (f"{rc.exc_type}: {rc.message}" if rc.message else rc.exc_type) \
        if rootcause.has_traceback(rc) else rc.message
    return {"root_cause": untrusted.clean_json(rc.as_dict()),
            "message": untrusted.clean(line)}


def launcher_failure(exit_code: int, stderr: str) -> dict[str, Any] | None:
    """The failed-rank entry for torchrun itself, when it exited with an error and named no
    failed worker (its rendezvous failed before any worker ran, say): ``rank`` None,
    ``launcher`` true, its own traceback as the root cause; None when it left none."""
    rc = rootcause.from_launcher(stderr) if exit_code > 0 else None
    if rc is None:
        return None
    return {"rank": None, "exit_code": exit_code, "launcher": True,
            **_cause_fields(dataclasses.replace(rc, host=socket.gethostname()))}


# --------------------------------------------------------------------------------------------


@dataclass
class ExitInfo:
    """How the local torchrun ended."""

    t: float
    attempt: int
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    failed_ranks: list[dict[str, Any]] = field(default_factory=list)
    stop_requested: bool = False


PopenFactory = Callable[..., "subprocess.Popen[bytes]"]


class Launcher:
    """One torchrun at a time, started, observed and stopped as a whole tree."""

    def __init__(
        self,
        command: list[str],
        *,
        run: str,
        node: str,
        state_dir: Path,
        socket_path: Path,
        stop_grace_s: float = 5.0,
        worker_env: Mapping[str, str] | None = None,
        echo: bool = True,
        popen: PopenFactory = subprocess.Popen,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.command = list(command)
        self.run, self.node = run, node
        self.state_dir = state_dir
        self.socket_path = socket_path
        self.stop_grace_s = stop_grace_s
        self.worker_env = dict(worker_env or {})  # the agent's options for the workers
        self.echo = echo
        self._popen = popen
        self._clock = clock
        self.log_dir = state_dir / "logs"
        self.record_path = state_dir / "group.json"
        self.proc: subprocess.Popen[bytes] | None = None
        self.attempt = 0
        self._outputs: list[tuple[Path, int, IO[bytes]]] = []  # path, offset, echo stream
        self._stderr_start: tuple[Path, int] | None = None  # this attempt's part of the log
        self._tail = bytearray()
        self._exit: ExitInfo | None = None
        self._stop_started: float | None = None
        self._killed_at: float | None = None
        self._stop_requested = False
        self._last_scan = 0.0
        self._targets: dict[int, psutil.Process] = {}

    # -- identity ----------------------------------------------------------------------------

    def marks(self) -> dict[str, str]:
        """Environment entries every process of ours carries (inherited through torchrun)."""
        return {
            protocol.ENV_RUN: self.run,
            protocol.ENV_NODE: self.node,
            protocol.ENV_AGENT_SOCKET: str(self.socket_path),
        }

    def is_ours(self, proc: psutil.Process) -> bool:
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            return False
        return all(env.get(k) == v for k, v in self.marks().items())

    def find_ours(self) -> list[psutil.Process]:
        """Every live process carrying our marks, wherever it was reparented."""
        me = os.getpid()
        out = []
        for p in psutil.process_iter():
            if p.pid == me:
                continue
            if self.is_ours(p) and _alive(p):
                out.append(p)
        return out

    # -- start -------------------------------------------------------------------------------

    def kill_leftovers(self) -> list[int]:
        """Kill what a previous incarnation of this agent left running (same run, node and
        state dir), so a restarted agent never leaves two copies of the workers.

        Candidates come from the recorded group and from an environment scan; each is
        verified with psutil to carry our marks before it is signalled (pids get reused)."""
        record = load_json(self.record_path)
        found: dict[int, psutil.Process] = {p.pid: p for p in self.find_ours()}
        pid = record.get("pid")
        if isinstance(pid, int) and pid not in found:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if self.is_ours(p):
                    found[pid] = p
        if not found:
            self.record_path.unlink(missing_ok=True)
            return []
        pids = sorted(found)
        log.warning("killing %d leftover process(es) of a previous agent: %s", len(pids), pids)
        self._targets = dict(found)
        self._signal_targets(signal.SIGKILL)
        deadline = time.monotonic() + _KILL_VERIFY_S
        while time.monotonic() < deadline:
            self._refresh_targets(full_scan=True)
            if not self._targets:
                break
            self._signal_targets(signal.SIGKILL)
            time.sleep(0.02)
        if self._targets:
            log.error("leftover processes survive SIGKILL: %s", sorted(self._targets))
        self.record_path.unlink(missing_ok=True)
        return pids

    def start(self, attempt: int, plan_path: Path | None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("torchrun is already running: stop it first")
        self.attempt = attempt
        self._exit = None
        self._stop_started = self._killed_at = None
        self._stop_requested = False
        self._targets = {}
        self._tail.clear()
        env = dict(os.environ)
        env.update(self.worker_env)
        env.update(self.marks())
        env[protocol.ENV_ATTEMPT] = str(attempt)
        if plan_path is not None:
            env[protocol.ENV_RESUME_PLAN] = str(plan_path)
        else:
            env.pop(protocol.ENV_RESUME_PLAN, None)  # never inherit a stale plan
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out_path = self.log_dir / f"attempt-{attempt}.stdout.log"
        err_path = self.log_dir / f"attempt-{attempt}.stderr.log"
        with open(out_path, "ab") as out, open(err_path, "ab") as err:
            offsets = (out.tell(), err.tell())
            self.proc = self._popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own group: the agent's terminal signals skip it
            )
        self._stderr_start = (err_path, offsets[1])
        self._outputs = [
            (out_path, offsets[0], sys.stdout.buffer),
            (err_path, offsets[1], sys.stderr.buffer),
        ]
        self._write_record()
        log.info("started torchrun attempt %d (pid %d): %s", attempt, self.proc.pid,
                 " ".join(self.command))

    def _write_record(self) -> None:
        assert self.proc is not None
        try:
            ct = psutil.Process(self.proc.pid).create_time()
        except psutil.Error:
            ct = None
        rec = {"pid": self.proc.pid, "pgid": self.proc.pid, "create_time": ct,
               "attempt": self.attempt, **self.marks()}
        save_json(self.record_path, rec)

    # -- observe -----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self._exit is None and self.proc.poll() is None

    def pump_output(self) -> None:
        """Echo what torchrun wrote since the last call and keep a tail for parsing."""
        new: list[tuple[Path, int, IO[bytes]]] = []
        for path, offset, stream in self._outputs:
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                data = b""
            if data:
                offset += len(data)
                self._tail += data
                if len(self._tail) > _TAIL_BYTES:
                    del self._tail[: len(self._tail) - _TAIL_BYTES]
                if self.echo:
                    try:
                        stream.write(data)
                        stream.flush()
                    except (OSError, ValueError):
                        pass  # our own stdout is gone: keep the log file, skip the echo
            new.append((path, offset, stream))
        self._outputs = new

    def poll(self) -> ExitInfo | None:
        """The exit of torchrun once it happened (the same object on every later call)."""
        if self._exit is not None:
            return self._exit
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            return None
        self.pump_output()  # the summary is the last thing torchrun wrote
        tail = self._tail.decode(errors="replace")
        failed = parse_failure_summary(tail)
        stderr = self._attempt_stderr()
        attach_root_causes(failed, tail, stderr)
        if not failed and not self._stop_requested:
            own = launcher_failure(rc, stderr)
            failed += [own] if own is not None else []
        self._exit = ExitInfo(
            t=self._clock(),
            attempt=self.attempt,
            exit_code=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            failed_ranks=failed,
            stop_requested=self._stop_requested,
        )
        log.info("torchrun attempt %d exited: code=%s signal=%s failed=%s", self.attempt,
                 self._exit.exit_code, self._exit.signal, failed)
        return self._exit

    def _attempt_stderr(self) -> str:
        """The end of what this attempt's torchrun and workers wrote to stderr."""
        if self._stderr_start is None:
            return ""
        path, start = self._stderr_start
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(start, size - _STDERR_TAIL_BYTES))
                return f.read(_STDERR_TAIL_BYTES).decode(errors="replace")
        except OSError:
            return ""

    # -- evidence ----------------------------------------------------------------------------

    def workers(self) -> dict[int, psutil.Process]:
        """rank -> live worker process of ours (a process whose environment has a RANK)."""
        out: dict[int, psutil.Process] = {}
        for p in self.find_ours():
            try:
                rank = p.environ().get("RANK")
            except (psutil.Error, OSError):
                continue
            if rank is not None and rank.isdigit():
                out[int(rank)] = p
        return out

    def dump_stacks(self, *, per_worker_s: float = 1.5, quiet_s: float = 0.25,
                    max_bytes: int = 32_000) -> dict[int, str]:
        """Every worker's Python stacks, rank by rank.

        The in-training library registers faulthandler on ``STACK_DUMP_SIGNAL`` (SIGUSR1): the
        worker writes every thread's stack to its stderr, which torchrun passes through to
        our log files.  Workers are signalled one at a time, waiting until the output goes
        quiet, so each dump is read apart from the others and attributed to its rank."""
        stacks: dict[int, str] = {}
        for rank, proc in sorted(self.workers().items()):
            self.pump_output()
            marks = [(path, path.stat().st_size if path.exists() else 0)
                     for path, _, _ in self._outputs]
            try:
                proc.send_signal(STACK_DUMP_SIGNAL)
            except psutil.Error:
                continue
            deadline = time.monotonic() + per_worker_s
            sizes = [m for _, m in marks]
            last_change = time.monotonic()
            while time.monotonic() < deadline:
                time.sleep(0.05)
                now_sizes = [p.stat().st_size if p.exists() else 0 for p, _ in marks]
                if now_sizes != sizes:
                    sizes, last_change = now_sizes, time.monotonic()
                elif now_sizes != [m for _, m in marks] and \
                        time.monotonic() - last_change >= quiet_s:
                    break
            text = b""
            for path, start in marks:
                with contextlib.suppress(OSError), open(path, "rb") as f:
                    f.seek(start)
                    text += f.read(max_bytes)
            stacks[rank] = text.decode(errors="replace")[:max_bytes]
        self.pump_output()  # echo the dumps too
        return stacks

    # -- stop --------------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop_started is not None

    def begin_stop(self, *, immediate: bool = False) -> None:
        """SIGTERM every process of the tree; later ``stop_step`` calls escalate.

        ``immediate``: SIGKILL the whole tree at once.  For a hung run: a SIGTERMed worker
        stuck in a collective does not exit, and torchrun waits a hard-coded 30 s before it
        SIGKILLs, whatever --shutdown-timeout says."""
        self._stop_requested = True
        if self._stop_started is not None:
            if immediate and self._killed_at is None:
                self._killed_at = time.monotonic()
                self._signal_targets(signal.SIGKILL)
            return
        self._stop_started = time.monotonic()
        self._killed_at = None
        self._targets = {}
        self._refresh_targets(full_scan=True)
        if immediate:
            self._killed_at = self._stop_started
            self._signal_targets(signal.SIGKILL)
        else:
            self._signal_targets(signal.SIGTERM)

    def stop_step(self) -> bool:
        """Advance a stop; True once no process of ours is left (or a stop was not begun)."""
        if self._stop_started is None:
            return True
        if self.proc is not None:
            self.proc.poll()  # reap torchrun so it does not linger as a zombie
        now = time.monotonic()
        full = now - self._last_scan >= 0.1
        self._refresh_targets(full_scan=full)
        if not self._targets:
            self._finish_stop()
            return True
        if self._killed_at is None and now - self._stop_started >= self.stop_grace_s:
            log.warning("stop grace over, SIGKILL %d process(es): %s", len(self._targets),
                        sorted(self._targets))
            self._killed_at = now
        if self._killed_at is not None:
            self._signal_targets(signal.SIGKILL)  # again each step: catches late forks
            if now - self._killed_at > _KILL_VERIFY_S:
                log.error("processes survive SIGKILL (stuck in the kernel?): %s",
                          sorted(self._targets))
                self._finish_stop()
                return True
        return False

    def stop(self) -> None:
        """Blocking stop: SIGTERM, SIGKILL after the grace, verified; never waits on torchrun."""
        self.begin_stop()
        while not self.stop_step():
            time.sleep(0.02)

    def _finish_stop(self) -> None:
        self._stop_started = None
        if self.proc is not None:
            self.proc.poll()
        self.record_path.unlink(missing_ok=True)

    def _refresh_targets(self, *, full_scan: bool) -> None:
        """Update the set of live processes to take down.

        A full scan adds torchrun's group, its descendants, the groups they lead and every
        process with our marks; otherwise only already known targets are re-checked and their
        new children added."""
        alive = {pid: p for pid, p in self._targets.items() if _alive(p)}
        roots = list(alive.values())
        if full_scan:
            self._last_scan = time.monotonic()
            if self.proc is not None and self.proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    roots.append(psutil.Process(self.proc.pid))
            roots.extend(self.find_ours())
        for p in roots:
            alive.setdefault(p.pid, p)
            try:
                for c in p.children(recursive=True):
                    if _alive(c):
                        alive.setdefault(c.pid, c)
            except psutil.Error:
                pass
        if full_scan:
            pgids = {self.proc.pid} if self.proc is not None else set()
            pgids |= {g for p in alive.values() if (g := _pgid(p)) is not None}
            pgids.discard(os.getpgid(0))  # never our own group
            if pgids:
                for p in psutil.process_iter():
                    if _pgid(p) in pgids and _alive(p):
                        alive.setdefault(p.pid, p)
        alive.pop(os.getpid(), None)
        self._targets = alive

    def _signal_targets(self, sig: signal.Signals) -> None:
        own_group = os.getpgid(0)
        groups: set[int] = set()
        for p in list(self._targets.values()):
            g = _pgid(p)  # before the signal: a dead process has no group to look up
            if g is not None and g != own_group:
                groups.add(g)
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)  # psutil checks the pid was not reused
        for g in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, sig)


def _alive(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, PermissionError, OSError):
        return None


def pids_alive(pids: Iterable[int]) -> list[int]:
    """Which of ``pids`` are live (non-zombie) processes; for tests and diagnostics."""
    out = []
    for pid in pids:
        try:
            if _alive(psutil.Process(pid)):
                out.append(pid)
        except psutil.Error:
            pass
    return out
