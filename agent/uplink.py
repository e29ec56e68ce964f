"""Batches to the supervisor: sequence numbers, spool, in-order replay, commands back.

The main loop calls ``enqueue`` (cheap: a file write) and never touches the network.  A sender
thread (or, in tests, explicit ``pump`` calls) registers, then posts the spooled batches oldest
first.  Outcomes per batch:

- 2xx: delivered; the reply's commands are queued for the executor.
- connection error, timeout, 502/503/504 (the supervisor or its proxy is down or full),
  401/403 (token trouble is not the batch's fault), 408, 429: the batch stays first in line
  and the sender backs off (0.5 s doubling to 10 s).  Nothing is set aside for these: a wrong
  token or an outage must not throw away the run's data.  With several supervisor addresses
  (the replicas of one supervisor on a shared Postgres), a connection error, timeout or
  502/503/504 moves the sender to the next address at once, the same batch first in line
  (registration, the credential and the sequence numbers are the shared store's, so nothing
  else changes); the backoff applies once every address failed in a row.  A batch an
  address stored but whose reply was lost is sent again to the next: the supervisor answers
  it as a duplicate of its (agent, seq), so delivery stays at-least-once, stored once.
- 404: the supervisor does not know this agent (its database was reset): register again.
- 403 with ``X-Trainwarden-Credential: invalid``: the supervisor no longer takes this
  agent's credential (a newer registration of the node, an operator's takeover): register
  again, presenting it (the batch stays first in line).
- registration answered 409 with ``Retry-After``: another agent holds the node and was
  heard from recently (say, this agent's state dir was lost and its previous incarnation
  is still alive): retried with backoff until the supervisor calls that one lost.
- registration answered 409 otherwise: the run has ended (completed, failed, stopped), or
  an operator took the node over; nothing is sent any more (``refused`` says why) and the
  agent ends.

Every request carries the agent's credential (``X-Trainwarden-Agent-Credential``, the
secret the registration returned, kept in ``uplink.json`` beside the sequence numbers): it
is what tells the supervisor a batch is this agent's, and re-registering with it keeps the
node through an agent restart.
- a registration whose run uuid is not the local state's (``check_identity``): nothing is
  sent (``foreign`` holds the reply) until the agent has archived that state and built a new
  uplink on a fresh one; another run's spooled batches never reach this run.
- any other 4xx: final, the batch itself is bad.  It is set aside in the dead-letter store
  (``dead-letter/``, with the reply) and the queue moves on.  So is a 409, the supervisor's
  answer to a seq it already stored with different content: resending cannot store it under
  that seq, and it is not renumbered on a guess (a second agent posting under our id, or our
  numbering gone back, is for a human to see in the dead-letter store and the event).
- any other 5xx: retried with backoff.  After ``max_5xx_tries`` tries in a row the batch
  steps out of line and the newer batches go on.  If a newer batch is accepted, the suspect
  gets one last try and, failing again, is set aside like a 4xx; if the newer batches fail
  too, the server is at fault, not the batch, and it goes back to the head of the line.  So a
  batch that breaks the supervisor never blocks the batches (and heartbeats) behind it, and an
  outage never dead-letters anything.

The supervisor checks every checkpoint path against the roots of the agent's newest
registration: when the agent learns a new root (its workers report a checkpoint elsewhere),
``update_registration`` has the sender register again before the next batch.  Refused (4xx),
the registration held stands and sending goes on.

Every batch set aside is announced to the supervisor by a ``batch_dead_lettered`` event in
the next batch spooled (seq, status, reason, and the count so far), so it shows there.

Sequence numbers are per agent and persisted in ``uplink.json`` before the batch is written,
so they only ever grow across agent restarts; registration raises them to the supervisor's
``next_seq`` when our state was lost.  The supervisor stores batches in any order, so a batch
that stepped out of line can still be delivered later.
"""

from __future__ import annotations

import json
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

log = logging.getLogger(__name__)

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


class Uplink:
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

    # -- state -------------------------------------------------------------------------------

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

    # -- main-loop side ----------------------------------------------------------------------

    def enqueue(self, items: list[dict[str, Any]], heartbeat: dict[str, Any],
                attempt: int) -> list[int]:
        """Spool one batch (several when ``items`` is large), each with the heartbeat; returns
        their sequence numbers.  Never touches the network."""
        with self._lock:
            notices = list(self._notices)
        items = [*notices, *items]
        chunks = [items[i : i + self.max_items] for i in range(0, len(items), self.max_items)]
        seqs = []
        for chunk in chunks or [[]]:
            # One lock over numbering and writing, so a renumbering at registration (sender
            # thread) sees either none or all of this batch.
            with self._lock:
                seq = self.next_seq
                self.next_seq += 1
                self._save_state()  # before the batch exists: a seq is never handed out twice
                self.spool.add({"seq": seq, "attempt": attempt, "items": [*chunk, heartbeat]})
            seqs.append(seq)
        if notices:
            # Cleared only once a batch holds them: an agent dying in between sends them
            # twice rather than never.
            with self._lock:
                self._notices = self._notices[len(notices):]
                self._save_state()
        if self.spool.dropped_items:
            with self._lock:
                self._save_state()
        self._wake.set()
        return seqs

    def take_commands(self) -> list[protocol.Command]:
        out = []
        while True:
            try:
                out.append(self.commands.get_nowait())
            except queue.Empty:
                return out

    # -- sender side -------------------------------------------------------------------------

    def start(self) -> None:
        """Send from a daemon thread (production); tests call ``pump`` themselves instead."""
        self._thread = threading.Thread(target=self._run, name="trainwarden-uplink", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the pass: a batch spooled during it wakes the next
            try:
                self.pump()
            except Exception:  # the sender must survive anything; the spool keeps the data
                log.exception("uplink sender error")
                self._fail("internal error")
            self._wake.wait(max(0.05, min(1.0, self._next_try - self.clock())))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.client.close()

    def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) until every spooled batch is delivered; False if some are left."""
        deadline = time.monotonic() + timeout_s
        self._next_try = 0.0  # a final flush tries at once, whatever the backoff said
        while time.monotonic() < deadline:
            if self._thread is None:
                self.pump()
            if not self.pending:
                return True
            self._wake.set()
            time.sleep(0.05)
        return not self.pending

    def pump(self) -> None:
        """One sending pass: register if needed, then post batches until the spool is empty
        or a send fails (then back off)."""
        if self.clock() < self._next_try or self.refused or self.foreign:
            return
        if self.registration is None and not self._register():
            return
        while not self._stop.is_set():
            # Checked before every batch: one spooled after update_registration goes out
            # under the new registration.
            if self._reregister and not self._register_again():
                return
            if self._suspect is not None and self._suspect_due:
                entry = self.spool.get(self._suspect[0])
                if entry is None:  # dropped by the spool's bound meanwhile
                    self._suspect, self._suspect_due = None, False
                    continue
            else:
                entry = self.spool.oldest(skip=self._suspect[0] if self._suspect else None)
            if entry is None:
                return
            seq, batch = entry
            if not self._send(seq, batch):
                return

    def _fail(self, why: str) -> None:
        if why != self.last_error:
            log.warning("supervisor unreachable (%s): spooling, %d batch(es) waiting",
                        why, self.pending)
        self.last_error = why
        self._next_try = self.clock() + self._backoff
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)

    @property
    def supervisor_url(self) -> str:
        """The address the sender uses now."""
        return self.urls[self._url_i]

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

    def register_now(self, timeout_s: float) -> protocol.RegisterReply | None:
        """Register from the calling thread (before the sender starts), trying until
        ``timeout_s`` has passed.  Returns the reply (also when it is another run's than the
        local state's: ``foreign`` is set then), or None when the supervisor did not answer
        in time or refused (``refused``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._register():
                return self.registration
            left = deadline - time.monotonic()
            if self.refused or self.foreign or left <= 0:
                return self.foreign
            time.sleep(min(max(0.0, self._next_try - self.clock()), left))

    def _register_again(self) -> bool:
        """The re-registration ``update_registration`` asked for; whether to go on sending."""
        self._reregister = False
        if self._register():
            return True
        if self._register_status is not None and 400 <= self._register_status < 500:
            # Refused: the registration we hold stands and the batches go on (one naming a
            # checkpoint the supervisor then refuses is set aside alone).
            self._next_try = 0.0
            return True
        self._reregister = True  # unreachable: again before any batch
        return False

    def update_registration(self, request: protocol.RegisterRequest) -> None:
        """Register again with ``request`` before the next batch is sent (the supervisor
        checks every checkpoint path against the roots of the newest registration)."""
        self.register_request = request
        self._reregister = True
        self._wake.set()
    def _credential_headers(self) -> dict[str, str]:
        return {protocol.CREDENTIAL_HEADER: self.credential} if self.credential else {}

    def adopt_credential(self, reply: protocol.RegisterReply) -> None:
        """Keep the credential of a registration answered before this uplink existed (the
        reply that showed the old state to be another run's)."""
        cred = reply.get("credential")
        if isinstance(cred, str) and cred:
            with self._lock:
                self.credential = cred
                self._save_state()

    def _register(self) -> bool:
        self._register_status = None
        try:
            r = self.client.post(REGISTER_PATH, json=self.register_request,
                                 headers=self._credential_headers())
        except httpx.HTTPError as e:
            self._unavailable(f"register: {type(e).__name__}: {e}")
            return False
        self._register_status = r.status_code
        if r.status_code in _UNAVAILABLE:
            self._unavailable(f"register: HTTP {r.status_code}")
            return False
        if r.status_code == 409 and "retry-after" in r.headers:
            # Another agent holds the node and was heard from recently: wait it out.
            log.error("registration refused for now: %s", r.text[:1000])
            self._fail("register: HTTP 409 (the node is held by a live agent)")
            return False
        if r.status_code == 409:  # the run has ended: final, say why and send nothing more
            try:
                why = str(r.json().get("detail") or r.text)
            except (ValueError, AttributeError):
                why = r.text
            self.refused = why[:2000] or f"HTTP {r.status_code}"
            log.error("registration refused: %s", self.refused)
            return False
        if r.status_code >= 300:
            level = logging.ERROR if 400 <= r.status_code < 500 else logging.WARNING
            log.log(level, "registration refused: HTTP %d %s", r.status_code, r.text[:500])
            self._fail(f"register: HTTP {r.status_code}")
            return False
        try:
            reply = r.json()
            agent_id, next_seq = int(reply["agent_id"]), int(reply["next_seq"])
        except (ValueError, KeyError, TypeError) as e:
            log.error("registration reply unreadable (%s): %s", e, r.text[:500])
            self._fail("register: bad reply")
            return False
        if self.check_identity is not None and not self.check_identity(reply):
            self.foreign = reply  # the agent archives the local state and starts afresh
            return False
        with self._lock:
            cred = reply.get("credential")
            if isinstance(cred, str) and cred and cred != self.credential:
                self.credential = cred
                self._save_state()  # before anything is sent with it
            if self.next_seq < next_seq:
                # Our state is behind the supervisor's (state dir lost): what we hold is new.
                shift = self.spool.renumber(next_seq)
                self.next_seq = max(next_seq, self.next_seq + shift)
                self._fails, self._suspect, self._suspect_due = None, None, False
                self._save_state()
                log.warning("sequence raised to the supervisor's next_seq %d", next_seq)
        self.registration = reply
        membership = reply.get("membership")
        if isinstance(membership, dict):
            self._learn_role(membership.get("role"), membership.get("epoch"))
        log.info("registered as agent %d (run %s, attempt %s, next_seq %d)", agent_id,
                 reply.get("run_id"), reply.get("attempt"), next_seq)
        self._ok()
        return True

    def _learn_role(self, role: Any, epoch: Any) -> None:
        try:
            self.role = NodeRole(role)
        except ValueError:
            return  # none (an older supervisor) or unknown: keep what we knew
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            self.epoch = epoch

    def _send(self, seq: int, batch: dict[str, Any]) -> bool:
        assert self.registration is not None
        batch["agent_id"] = self.registration["agent_id"]
        batch["sent_at"] = self.clock()
        batch["dropped"] = self.dropped
        try:
            # Python's json, not httpx's json=: the wire carries NaN/Infinity tokens (a NaN
            # loss is the signal), which httpx's strict encoder refuses.
            r = self.client.post(INGEST_PATH, content=json.dumps(batch).encode(),
                                 headers={"content-type": "application/json",
                                          **self._credential_headers()})
        except httpx.HTTPError as e:
            self.spool.release(seq)
            self._unavailable(f"{type(e).__name__}: {e}")
            return False
        code = r.status_code
        if code < 300:
            self._delivered(seq, r)
            return True
        if code == 403 and r.headers.get("x-trainwarden-credential") == "invalid":
            self.spool.release(seq)
            log.warning("supervisor refuses agent %s's credential (%s): registering again",
                        self.agent_id, r.text[:300])
            self.registration = None
            self._fail("HTTP 403 (credential)")
            return False
        if code in _UNAVAILABLE:
            self.spool.release(seq)
            self._unavailable(f"HTTP {code}")
            return False
        if code in _RETRY_4XX:
            self.spool.release(seq)
            if code in (401, 403):
                log.error("supervisor refuses our token (HTTP %d): check --token / %s; "
                          "batches stay spooled", code, "TRAINWARDEN_AGENT_TOKEN")
            self._fail(f"HTTP {code}")
            return False
        if code == 404:
            self.spool.release(seq)
            log.warning("supervisor does not know agent %s (HTTP 404): registering again",
                        self.agent_id)
            self.registration = None
            return False
        n_items = len(batch.get("items", ()))
        if code >= 500:
            return self._server_error(seq, code, r.text, n_items)
        self._set_aside(seq, code, r.text, n_items)
        return True

    def _delivered(self, seq: int, r: httpx.Response) -> None:
        try:
            reply = r.json()
            commands = reply.get("commands") or []
            protect = reply.get("protect")
            if isinstance(protect, list):
                self.protect = [p for p in protect if isinstance(p, str)]
            self.advised_interval_s = advised_interval(reply.get("batch_interval_s"))
            self._learn_role(reply.get("role"), reply.get("epoch"))
        except (ValueError, AttributeError):
            commands = []
            log.error("ingest reply for seq %d unreadable: %s", seq, r.text[:500])
        self.spool.remove(seq)
        self.sent += 1
        self._fails = None
        if self._suspect is not None:
            if self._suspect[0] == seq:  # its last try went through after all
                self._suspect, self._suspect_due = None, False
            else:  # the supervisor takes newer batches: the suspect's last try decides
                self._suspect_due = True
        for c in commands:
            if isinstance(c, dict):
                # (a command as the supervisor sent it: the executor checks each field it reads)
                self.commands.put(c)  # type: ignore[arg-type]
        self._ok()

    def _server_error(self, seq: int, code: int, text: str, n_items: int) -> bool:
        """A 5xx that may be this batch's fault; returns whether to go on sending now."""
        self.spool.release(seq)
        if self._suspect is not None and self._suspect[0] == seq and self._suspect_due:
            # Failed again right after a newer batch was accepted: the batch is at fault.
            self._suspect, self._suspect_due = None, False
            self._set_aside(seq, code, text, n_items)
            return True
        if self._suspect is not None and self._suspect[0] != seq:
            # A newer batch fails too: the supervisor is at fault, not the suspect, which
            # goes back to the head of the line.
            log.warning("HTTP %d for seq %d too: the supervisor is failing, seq %d is back "
                        "in line", code, seq, self._suspect[0])
            self._suspect, self._suspect_due, self._fails = None, False, None
            self._fail(f"HTTP {code}")
            return False
        n = self._fails[1] + 1 if self._fails and self._fails[0] == seq else 1
        self._fails = (seq, n)
        if n < self.max_5xx_tries:
            self._fail(f"HTTP {code}")
            return False
        log.error("batch seq=%d failed %d times (HTTP %d: %s): trying newer batches",
                  seq, n, code, text[:500])
        self._suspect, self._suspect_due, self._fails = (seq, code, text), False, None
        return True

    def _set_aside(self, seq: int, code: int, text: str, n_items: int) -> None:
        """The batch can never be delivered: into the dead-letter store, announced in the
        next batch."""
        dest = self.spool.set_aside(seq, f"HTTP {code}\n{text}")
        with self._lock:
            self.dead_lettered += 1
            reason = text[:500]
            self._notices.append({
                "type": "event", "t": self.clock(), "name": protocol.EVENT_BATCH_DEAD_LETTERED,
                "message": f"batch seq {seq} set aside by the agent after HTTP {code}: "
                           f"{reason[:200]}",
                "details": {"seq": seq, "status": code, "reason": reason, "items": n_items,
                            "count": self.dead_lettered, "dropped": self.dead_letter_dropped,
                            "path": str(dest) if dest else None}})
            del self._notices[:-_MAX_NOTICES]
            self._save_state()
        self._wake.set()
        log.error("SUPERVISOR REFUSED BATCH seq=%d (HTTP %d): %s; kept in %s, moving on",
                  seq, code, text[:1000], dest)
