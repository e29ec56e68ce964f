"""What every part of the uplink shares: its defaults, the HTTP client and the addresses it
moves between, the state file (sequence numbers, drop counts, notices, the credential), and
the backoff."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from trainwarden.agent import deadletter, protocol
from trainwarden.agent.core.names import supervisor_urls
from trainwarden.agent.core.states import NodeRole
from trainwarden.agent.deadletter import DeadLetters
from trainwarden.agent.spool import Spool
from trainwarden.agent.statefile import load_json, save_json

log = logging.getLogger("trainwarden.agent.uplink")


MAX_ADVISED_INTERVAL_S = 60.0  # a supervisor's advice beyond this is capped


def advised_interval(value: Any) -> float | None:
    """The batch interval a reply asks for, if it is a sensible one (capped)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return min(v, MAX_ADVISED_INTERVAL_S) if math.isfinite(v) and v > 0 else None

REGISTER_PATH = "/api/v1/agents/register"
INGEST_PATH = "/api/v1/ingest"
_BACKOFF_MIN_S = 0.5
_BACKOFF_MAX_S = 10.0
_RETRY_4XX = {401, 403, 408, 429}
_UNAVAILABLE = {502, 503, 504}
# The uplink's defaults, written once (AgentConfig's are these): tries of a batch answered
# 5xx before it steps out of line; the spool's bounds (the oldest go first when it is full);
# items per batch (a burst of step reports is split); the HTTP timeout of one request.
MAX_5XX_TRIES = 5
SPOOL_MAX_BYTES = 256 * 1024 * 1024
SPOOL_MAX_BATCHES = 20_000
MAX_ITEMS_PER_BATCH = 5_000
HTTP_TIMEOUT_S = 3.0
# Announcements of batches set aside, waiting for the next batch; beyond this many the
# oldest go (each one carries the running count, so the total is never lost).
_MAX_NOTICES = 100


def _client(url: str, token: str | None, timeout_s: float,
            transport: httpx.BaseTransport | None) -> httpx.Client:
    """The HTTP client: short timeouts (the agent must never stall on a slow supervisor)."""
    headers = {"User-Agent": "trainwarden-agent"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=url, headers=headers,
                        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 2.0)),
                        transport=transport)


class UplinkBase:
    """The uplink's state and what each of its parts uses."""

    def __init__(
        self,
        *,
        supervisor_url: str | Sequence[str],
        token: str | None,
        state_dir: Path,
        register_request: protocol.RegisterRequest,
        spool_max_bytes: int = SPOOL_MAX_BYTES,
        spool_max_batches: int = SPOOL_MAX_BATCHES,
        max_items_per_batch: int = MAX_ITEMS_PER_BATCH,
        max_5xx_tries: int = MAX_5XX_TRIES,
        dead_letter_max_bytes: int = deadletter.MAX_BYTES,
        dead_letter_max_batches: int = deadletter.MAX_BATCHES,
        http_timeout_s: float = HTTP_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # One address, or the replicas' (a comma-separated string or a list): see
        # ``_unavailable`` for how the sender moves between them.
        self.urls = supervisor_urls(
            supervisor_url if isinstance(supervisor_url, str) else ",".join(supervisor_url))
        self._url_i = 0
        self._moved = 0  # addresses moved on since the last answer (backoff after a round)
        self.client = _client(self.urls[0], token, http_timeout_s, transport)
        self.register_request = register_request
        self.clock = clock
        self.max_items = max_items_per_batch
        self.max_5xx_tries = max_5xx_tries
        # What is not sent yet (the spool) and what the supervisor refused (dead letters).
        self.state_path = state_dir / "uplink.json"
        self.dead = DeadLetters(state_dir / "dead-letter", max_bytes=dead_letter_max_bytes,
                                max_batches=dead_letter_max_batches)
        self.spool = Spool(state_dir / "spool", max_bytes=spool_max_bytes,
                           max_batches=spool_max_batches, dead_letters=self.dead)
        self._replies_start()
        self._sender_start()
        self._restore()

    def _replies_start(self) -> None:
        """What the supervisor's replies tell the agent, as known so far (nothing)."""
        self.commands: queue.Queue[protocol.Command] = queue.Queue()
        # The checkpoints the supervisor's newest reply says to protect (None: no reply yet).
        self.protect: list[str] | None = None
        # How often the supervisor's newest reply asks for a batch (None: our own interval):
        # a supervisor that is behind asks for fewer, larger batches.
        self.advised_interval_s: float | None = None
        # What the node is in the run, and the membership epoch, as the newest reply (or the
        # registration) says (None: not said yet, or an older supervisor).
        self.role: NodeRole | None = None
        self.epoch: int | None = None
        self.registration: protocol.RegisterReply | None = None
        # The agent's test of a registration reply: False when the reply is another run's
        # than the local state's (then ``foreign`` holds it and nothing is sent).
        self.check_identity: Callable[[protocol.RegisterReply], bool] | None = None
        self.foreign: protocol.RegisterReply | None = None
        self.refused: str | None = None  # the supervisor's why, when it refused (409)
        # A newer register request (a checkpoint root learned): registered again before the
        # next batch goes out.
        self._reregister = False
        self._register_status: int | None = None  # the last registration's HTTP status

    def _sender_start(self) -> None:
        """The sender thread's state: nothing sent, no failure, the shortest backoff."""
        self.sent = 0
        self.last_ok: float | None = None  # when the supervisor last answered
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_try = 0.0
        self._backoff = _BACKOFF_MIN_S
        # The head batch's 5xx answers in a row, and the batch that stepped out of line after
        # too many of them (with its last answer) until a newer batch's fate decides.
        self._fails: tuple[int, int] | None = None  # (seq, count)
        self._suspect: tuple[int, int, str] | None = None  # (seq, status, reply)
        self._suspect_due = False  # a newer batch was accepted: the suspect's last try

    def _restore(self) -> None:
        """What the uplink's state file kept: sequence numbers (never below a spooled
        batch's), drop counts, notices not sent yet, the credential."""
        state = self._load_state()
        self.next_seq: int = max(state.get("next_seq", 0), max(self.spool.seqs(), default=-1) + 1)
        self._dropped_before: int = int(state.get("dropped", 0))
        self.dead_lettered: int = int(state.get("dead_lettered", 0))
        self._dead_dropped_before: int = int(state.get("dead_letter_dropped", 0))
        notices = state.get("notices")
        self._notices: list[dict[str, Any]] = [n for n in notices if isinstance(n, dict)] \
            if isinstance(notices, list) else []
        cred = state.get("credential")
        # The secret the supervisor issued this agent (None: not registered yet).
        self.credential: str | None = cred if isinstance(cred, str) and cred else None

    def _load_state(self) -> dict[str, Any]:
        return load_json(self.state_path)

    def _save_state(self) -> None:
        save_json(self.state_path, {"next_seq": self.next_seq, "dropped": self.dropped,
                                    "dead_lettered": self.dead_lettered,
                                    "dead_letter_dropped": self.dead_letter_dropped,
                                    "notices": self._notices,
                                    "credential": self.credential})

    @property
    def dead_letter_dropped(self) -> int:
        """Entries the dead-letter store's bounds dropped, cumulative over agent restarts."""
        return self._dead_dropped_before + self.dead.dropped

    @property
    def dropped(self) -> int:
        """Items dropped because the spool was full, cumulative over agent restarts."""
        return self._dropped_before + self.spool.dropped_items

    @property
    def agent_id(self) -> int | None:
        return self.registration["agent_id"] if self.registration else None

    @property
    def pending(self) -> int:
        return len(self.spool)

    @property
    def supervisor_url(self) -> str:
        """The address the sender uses now."""
        return self.urls[self._url_i]

    def _fail(self, why: str) -> None:
        if why != self.last_error:
            log.warning("supervisor unreachable (%s): spooling, %d batch(es) waiting",
                        why, self.pending)
        self.last_error = why
        self._next_try = self.clock() + self._backoff
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)

    def _unavailable(self, why: str) -> None:
        """The supervisor at the current address is unreachable or unavailable: move to the
        next address, at once while some address has not been tried since the last answer,
        else with the backoff of ``_fail``."""
        if len(self.urls) == 1:
            self._fail(why)
            return
        old = self.supervisor_url
        self._url_i = (self._url_i + 1) % len(self.urls)
        self.client.base_url = httpx.URL(self.supervisor_url)
        self._moved += 1
        if self._moved < len(self.urls):
            log.warning("supervisor %s unavailable (%s): failing over to %s, %d batch(es) "
                        "waiting", old, why, self.supervisor_url, self.pending)
            self.last_error = why
            self._next_try = 0.0
            return
        self._moved = 0  # every address failed in a row: back off, then go round again
        self._fail(f"{why} (every supervisor address)")

    def _ok(self) -> None:
        self._moved = 0
        self.last_ok = self.clock()
        if self.last_error is not None:
            log.info("supervisor reachable again: replaying %d batch(es)", self.pending)
        self.last_error = None
        self._backoff = _BACKOFF_MIN_S

    def _credential_headers(self) -> dict[str, str]:
        return {protocol.CREDENTIAL_HEADER: self.credential} if self.credential else {}

    def _learn_role(self, role: Any, epoch: Any) -> None:
        try:
            self.role = NodeRole(role)
        except ValueError:
            return  # none (an older supervisor) or unknown: keep what we knew
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            self.epoch = epoch
