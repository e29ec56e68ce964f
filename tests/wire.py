"""A stand-in for the agent's datagram socket, for tests of what workers send."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from trainwarden.agent.protocol import decode_datagrams


class Receiver:
    """Stands in for the agent's datagram socket and keeps every message it receives."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(70_000)
            except (TimeoutError, OSError):
                continue
            self.messages.extend(decode_datagrams(data)[0])

    def of(self, kind: str, name: str | None = None) -> list[dict]:
        return [m for m in self.messages
                if m["type"] == kind and (name is None or m.get("name") == name)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


