"""The uplink: the main loop's side (``enqueue``, ``take_commands``: never the network), and
the sender's (a thread, or ``pump`` in tests) that registers and posts the spool oldest
first."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from trainwarden.agent import protocol
from trainwarden.agent.uplink.delivery import DeliveryMixin
from trainwarden.agent.uplink.registration import RegistrationMixin

log = logging.getLogger("trainwarden.agent.uplink")


class Uplink(RegistrationMixin, DeliveryMixin):
    """Batches to the supervisor, commands back (see the package's docstring)."""

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
