"""Registration: before the sender starts (``register_now``), again when the supervisor
forgot the agent or refused its credential, or when a new checkpoint root was learned; the
reply's credential, sequence numbers and membership."""

from __future__ import annotations

import logging
import time

import httpx

from trainwarden.agent import protocol
from trainwarden.agent.uplink.base import _UNAVAILABLE, REGISTER_PATH, UplinkBase

log = logging.getLogger("trainwarden.agent.uplink")


class RegistrationMixin(UplinkBase):
    """Registers the agent with the supervisor."""

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
