"""Delivery of one spooled batch: what each answer means (delivered and its reply's commands
queued, retried, failed over, set aside in the dead-letter store), and the batch that
steps out of line after too many 5xx."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx

from trainwarden.agent import protocol
from trainwarden.agent.uplink.base import (
    _MAX_NOTICES,
    _RETRY_4XX,
    _UNAVAILABLE,
    INGEST_PATH,
    UplinkBase,
    advised_interval,
)

log = logging.getLogger("trainwarden.agent.uplink")


class DeliveryMixin(UplinkBase):
    """Posts spooled batches and reads what each answer means."""

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
