"""Nodes in network namespaces of their own, on one bridge, so that the network between two of
them can be cut while each still reaches the supervisor (a network partition).

``Fabric`` makes a bridge in the root namespace holding the first address of a small subnet
(the supervisor listens there), and one namespace per node with a veth pair into the bridge.
``cut(a, b)`` adds ``unreachable`` routes in both namespaces for the other's address: the
packets of the established connections between the two (gloo's, the rendezvous store's) are
dropped, and a new connection between them fails (``No route to host``), as across a failed
switch; each node still reaches the bridge (the supervisor).  ``heal(a, b)`` removes them.

Names carry the test process's pid, and the subnet (a /28 of 10.231.0.0/24) is chosen under a
file lock among those no interface of this machine holds, so two test processes never collide.
``close()`` removes everything it made, whatever state it is in.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

SUPERNET = ipaddress.ip_network("10.231.0.0/24")
LOCK = Path("/tmp/twp-netns.lock")
# The node's interface, the same name in every namespace: the workers' gloo binds to it
# (``GLOO_SOCKET_IFNAME``, as on a cluster; else gloo picks the host name's address,
# loopback in a namespace, and the nodes' workers cannot meet).
IFNAME = "twp0"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"twp-{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> None:
    """Remove what a test process that was killed before its cleanup left (names carry its
    pid; it is no longer running), and the processes still running in its namespaces."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for ns in (line.split()[0] for line in names.splitlines() if line.startswith("twp-")):
        tag = ns.split("-")[1]
        if tag.isdigit() and not _alive(int(tag)):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if name.startswith("twp-b") and name[5:].isdigit() and not _alive(int(name[5:])):
            subprocess.run(["ip", "link", "del", name], capture_output=True)


def _held_addresses() -> set[str]:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                         text=True).stdout
    return {line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3}


class Fabric:
    """A bridge and one namespace per node of ``nodes``: ``address(node)``, ``wrap(node)``
    (the command prefix that runs a process in the node's namespace), ``host`` (the bridge's
    address, for the supervisor)."""

    def __init__(self, nodes: Sequence[str]) -> None:
        self.tag = str(os.getpid())
        self.bridge = f"twp-b{self.tag}"
        self.made_links: list[str] = []
        self.made_ns: list[str] = []
        self.nodes = list(nodes)
        self.cuts: set[tuple[str, str]] = set()
        self.subnet: ipaddress.IPv4Network | None = None
        self.ns = {n: f"twp-{self.tag}-{i}" for i, n in enumerate(self.nodes)}
        self.addr: dict[str, str] = {}
        self.host = ""

    def open(self) -> Fabric:
        LOCK.touch(exist_ok=True)
        with open(LOCK) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep()
            held = _held_addresses()
            for sub in SUPERNET.subnets(new_prefix=28):
                hosts = [str(h) for h in sub.hosts()]
                if hosts[0] not in held and len(hosts) > len(self.nodes):
                    self.subnet = sub
                    break
            else:
                raise RuntimeError(f"no free /28 left in {SUPERNET}")
            hosts = [str(h) for h in self.subnet.hosts()]
            self.host = hosts[0]
            _ip("link", "add", self.bridge, "type", "bridge")
            self.made_links.append(self.bridge)
            _ip("addr", "add", f"{self.host}/28", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for i, node in enumerate(self.nodes):
            ns, outer, inner = self.ns[node], f"twp-{self.tag}h{i}", f"twp-{self.tag}n{i}"
            _ip("netns", "add", ns)
            self.made_ns.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self.made_links.append(outer)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", inner, "name", IFNAME, ns=ns)
            self.addr[node] = hosts[i + 1]
            _ip("addr", "add", f"{hosts[i + 1]}/28", "dev", IFNAME, ns=ns)
            _ip("link", "set", IFNAME, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        return self

    @staticmethod
    def env() -> dict[str, str]:
        """What every node's agent needs in its environment (its workers' gloo interface)."""
        return {"GLOO_SOCKET_IFNAME": IFNAME}

    def wrap(self, node: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[node]]

    def address(self, node: str) -> str:
        return self.addr[node]

    def cut(self, a: str, b: str) -> None:
        """No packet between ``a`` and ``b`` any more, either way."""
        _ip("route", "add", "unreachable", f"{self.addr[b]}/32", ns=self.ns[a])
        _ip("route", "add", "unreachable", f"{self.addr[a]}/32", ns=self.ns[b])
        self.cuts.add((a, b))

    def heal(self, a: str, b: str) -> None:
        _ip("route", "del", "unreachable", f"{self.addr[b]}/32", ns=self.ns[a])
        _ip("route", "del", "unreachable", f"{self.addr[a]}/32", ns=self.ns[b])
        self.cuts.discard((a, b))

    def close(self) -> None:
        """Remove the namespaces (killing what still runs in them) and the links."""
        for ns in self.made_ns:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)
        for link in reversed(self.made_links):
            with contextlib.suppress(Exception):
                _ip("link", "del", link)
        self.made_ns, self.made_links = [], []


@contextlib.contextmanager
def fabric(nodes: Sequence[str]) -> Iterator[Fabric]:
    f = Fabric(nodes)
    try:
        yield f.open()
    finally:
        f.close()
