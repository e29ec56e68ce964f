"""What a training command declares about its world, read the way torchrun reads it, and the
command rewritten for the membership the supervisor decides.

The supervisor admits as members only as many nodes as the members' torchrun command
declares (``--nnodes N``); a node beyond them becomes a spare.  Only torchrun's own options
count (those before the training script); the script's arguments are the script's.

Each attempt's membership (which node is node rank k, where the rendezvous is) is the
supervisor's: the agent rewrites torchrun's rendezvous options for it (``rewrite``) into a
static rendezvous, the one torchrun rendezvous whose node ranks are fixed by the caller:

* removed: ``--nnodes``, ``--node-rank``, ``--rdzv-backend``, ``--rdzv-endpoint``,
  ``--rdzv-id``, ``--rdzv-conf``, ``--master-addr``, ``--master-port``, ``--standalone``,
  ``--max-restarts`` (a restart is the supervisor's: a fresh torchrun each time);
* added: ``--nnodes=N --node-rank=K --rdzv-backend=static --rdzv-endpoint=HOST:PORT
  --max-restarts=0``, where HOST is the address of the member holding node rank 0 (it hosts
  the store) and PORT the command's rendezvous port (``--rdzv-endpoint``'s, else
  ``--master-port``, else 29500) plus the membership epoch (modulo 100): a node that was
  replaced and still holds the old port, frozen, never blocks the next rendezvous.

Everything else (the script, its arguments, ``--nproc-per-node``, ``--log-dir``...) is kept.
A one-node world (``--nnodes=1``, ``--standalone``) has no rendezvous across nodes: its
command runs as it is, whichever node runs it.
A command that cannot be rewritten safely is refused at registration (``unrewritable``).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

# torchrun's options that take no value (every other option takes one, given as
# ``--opt value`` or ``--opt=value``).
_FLAGS = frozenset({"--standalone", "-m", "--module", "--no-python", "--no_python",
                    "--run-path", "--run_path", "--virtual-local-rank",
                    "--virtual_local_rank"})
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def launcher_args(command: Sequence[str]) -> list[str] | None:
    """The arguments torchrun itself reads (up to the training script), or None when the
    command is not a torchrun launch (``torchrun ...`` or ``python -m torch.distributed.run
    ...``)."""
    if not command:
        return None
    if posixpath.basename(command[0]) == "torchrun":
        rest = list(command[1:])
    else:
        try:
            i = list(command).index("-m")
        except ValueError:
            return None
        if i + 1 >= len(command) or command[i + 1] not in _LAUNCHER_MODULES:
            return None
        rest = list(command[i + 2:])
    out: list[str] = []
    it = iter(rest)
    for arg in it:
        if not arg.startswith("-") or arg == "-":
            break  # the training script: what follows is its own
        out.append(arg)
        if "=" not in arg and arg not in _FLAGS:
            value = next(it, None)
            if value is not None:
                out.append(value)
    return out


def declared_nnodes(command: Sequence[str]) -> int | None:
    """The largest number of nodes the command's torchrun admits: ``--nnodes N`` is N,
    ``--nnodes MIN:MAX`` is MAX, no ``--nnodes`` is 1 (torchrun's default); None when the
    command is not a torchrun launch or the value cannot be read."""
    args = launcher_args(command)
    if args is None:
        return None
    value = "1"
    for i, arg in enumerate(args):
        if arg == "--nnodes" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
    try:
        return max(int(v) for v in value.split(":", 1))
    except ValueError:
        return None


# The largest world a run may declare (``--nnodes``).  The supervisor's work is bounded by the
# nodes that registered, never by the declared world; this bound keeps every figure derived
# from the declared world (a rank, a count, a database integer) small and exact.
MAX_NNODES = 65_536

DEFAULT_PORT = 29500  # torchrun's --master-port default
EPOCH_PORTS = 100  # the rendezvous port moves with the membership epoch, modulo this
# How long a node's torchrun waits for the static rendezvous to form (the rank-0 host for
# every node to join, the others to reach the host), in seconds; torchrun's own default is
# 600.  The agents of a run relaunch together on the supervisor's command, so a rendezvous
# that has not formed in this time will not: a member that cannot reach the host (a network
# partition) fails with the host's address in its error, and the supervisor replaces it.
RENDEZVOUS_TIMEOUT_S = 120

# torchrun's rendezvous options (either spelling), replaced by the membership's.
_RENDEZVOUS = frozenset({
    "--nnodes", "--node-rank", "--node_rank", "--rdzv-backend", "--rdzv_backend",
    "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf",
    "--rdzv_conf", "--master-addr", "--master_addr", "--master-port", "--master_port",
    "--max-restarts", "--max_restarts", "--standalone"})
_SUPPORTED_BACKENDS = frozenset({"c10d", "static"})


@dataclass(frozen=True)
class Membership:
    """One node's place in one attempt, as the supervisor decided it."""

    epoch: int
    nnodes: int  # the attempt's world (fewer than ``declared`` while the run is shrunk)
    node_rank: int
    endpoint: str  # HOST:PORT of the static rendezvous (node rank 0 hosts it)
    declared: int | None = None  # the run's declared world (None: ``nnodes``)

    @property
    def full(self) -> int:
        return self.declared if self.declared is not None else self.nnodes


def _split(command: Sequence[str]) -> tuple[list[str], list[str], list[str]] | None:
    """(the launcher's prefix: ``torchrun`` or ``python -m torch.distributed.run``, its
    options, the training script and its arguments); None when not a torchrun launch."""
    opts = launcher_args(command)
    if opts is None:
        return None
    cmd = list(command)
    start = 1 if posixpath.basename(cmd[0]) == "torchrun" else cmd.index("-m") + 2
    return cmd[:start], opts, cmd[start + len(opts):]


def _options(opts: Sequence[str]) -> list[tuple[str, str | None]]:
    """torchrun's options as (name, value) pairs (``--opt=v`` and ``--opt v`` alike)."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(opts):
        arg = opts[i]
        if "=" in arg:
            name, value = arg.split("=", 1)
            out.append((name, value))
            i += 1
        elif arg in _FLAGS:
            out.append((arg, None))
            i += 1
        else:
            out.append((arg, opts[i + 1] if i + 1 < len(opts) else None))
            i += 2
    return out


def _value(opts: Sequence[str], *names: str) -> str | None:
    found = None
    for name, value in _options(opts):
        if name in names:
            found = value
    return found


def rendezvous_port(command: Sequence[str]) -> int:
    """The port the command's rendezvous uses: ``--rdzv-endpoint``'s, else ``--master-port``,
    else torchrun's default (29500)."""
    parts = _split(command)
    if parts is None:
        return DEFAULT_PORT
    opts = parts[1]
    endpoint = _value(opts, "--rdzv-endpoint", "--rdzv_endpoint")
    if endpoint and ":" in endpoint:
        port = endpoint.rsplit(":", 1)[1]
        if port.isdigit():
            return int(port)
    master = _value(opts, "--master-port", "--master_port")
    if master and master.isdigit():
        return int(master)
    return DEFAULT_PORT


def unrewritable(command: Sequence[str]) -> str | None:
    """Why the agent cannot rewrite ``command`` for a membership the supervisor decides (a
    message that names the fix); None when it can.  A command that is not a torchrun launch
    runs one node as it is: there is nothing to rewrite."""
    parts = _split(command)
    if parts is None:
        return None
    opts = parts[1]
    nnodes = _value(opts, "--nnodes")
    if nnodes is not None and ":" in nnodes:
        low, _, high = nnodes.partition(":")
        if low != high:
            return (f"torchrun --nnodes={nnodes}: an elastic range cannot be rewritten for the "
                    "members the supervisor chooses; give the full world, for example "
                    f"--nnodes={high}, and start spares with trainwarden agent --spare")
    declared = declared_nnodes(command)
    if nnodes is not None and declared is None:
        return f"torchrun --nnodes={nnodes}: not a number of nodes; give one, e.g. --nnodes=2"
    if declared is not None and not 1 <= declared <= MAX_NNODES:
        return (f"torchrun --nnodes={nnodes}: give a number of nodes from 1 to {MAX_NNODES} "
                "(the largest world trainwarden supervises)")
    backend = _value(opts, "--rdzv-backend", "--rdzv_backend")
    if backend is not None and backend not in _SUPPORTED_BACKENDS:
        return (f"torchrun --rdzv-backend={backend}: the agent rewrites only the c10d and "
                "static rendezvous (the supervisor decides each attempt's members and its "
                "endpoint); use --rdzv-backend=c10d")
    port = rendezvous_port(command)
    if not 1 <= port <= 65535 - EPOCH_PORTS:
        return (f"rendezvous port {port}: the agent moves the port with the membership epoch "
                f"(up to +{EPOCH_PORTS - 1}); use a port between 1 and {65535 - EPOCH_PORTS}")
    return None


def rewrite(command: Sequence[str], m: Membership, *,
            rendezvous_timeout_s: int = RENDEZVOUS_TIMEOUT_S) -> list[str]:
    """``command`` with torchrun's rendezvous options replaced by ``m``'s (the module
    docstring lists them).  A command that is not a torchrun launch, and a one-node world
    the command itself declares (no rendezvous across nodes), are returned as they are; a
    larger world shrunk to one node runs ``--nnodes=1 --standalone`` (a free port of its
    own: no other node takes part).  ``rendezvous_timeout_s``: the static rendezvous's
    ``--rdzv-conf=timeout``."""
    parts = _split(command)
    if parts is None or (m.nnodes <= 1 and (declared_nnodes(command) or 1) <= 1):
        return list(command)
    prefix, opts, script = parts
    kept: list[str] = []
    for name, value in _options(opts):
        if name in _RENDEZVOUS:
            continue
        kept.append(name if value is None else f"{name}={value}")
    if m.nnodes <= 1:
        ours = ["--nnodes=1", "--standalone", "--max-restarts=0"]
    else:
        ours = [f"--nnodes={m.nnodes}", f"--node-rank={m.node_rank}", "--rdzv-backend=static",
                f"--rdzv-endpoint={m.endpoint}",
                f"--rdzv-conf=timeout={int(rendezvous_timeout_s)}", "--max-restarts=0"]
    return [*prefix, *ours, *kept, *script]


def nproc_per_node(command: Sequence[str]) -> int | None:
    """The workers per node the command's torchrun starts (``--nproc-per-node``; 1 when not
    given, torchrun's default); None when not a torchrun launch or not a number (``gpu``,
    ``auto``: torchrun counts the devices)."""
    parts = _split(command)
    if parts is None:
        return None
    value = _value(parts[1], "--nproc-per-node", "--nproc_per_node")
    if value is None:
        return 1
    return int(value) if value.isdigit() and int(value) > 0 else None


def declared_world_size(command: Sequence[str], m: Membership) -> int | None:
    """The ranks of the run's declared world (its global batch is defined on them): the
    declared nodes times the command's workers per node; None when unknown."""
    nproc = nproc_per_node(command)
    return None if nproc is None else m.full * nproc


def min_nodes_refused(min_nodes: int | None, command: Sequence[str]) -> str | None:
    """Why ``--min-nodes`` cannot hold for ``command`` (a message that names the fix); None
    when it can (or is not given)."""
    if min_nodes is None:
        return None
    declared = declared_nnodes(command)
    if declared is None:
        return (f"--min-nodes {min_nodes}: the run can only shrink a torchrun launch that "
                "declares its nodes (torchrun --nnodes=N ...); drop --min-nodes or launch "
                "with torchrun")
    if not 1 <= min_nodes <= declared:
        return (f"--min-nodes {min_nodes}: the torchrun command declares {declared} "
                f"node(s) (--nnodes); give a number from 1 to {declared} "
                f"({declared}: never shrink)")
    return None


def endpoint(host: str, base_port: int, epoch: int) -> str:
    """The static rendezvous endpoint of an epoch: ``host`` (the node rank 0 member's
    address) at the command's port moved by the epoch."""
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{h}:{base_port + epoch % EPOCH_PORTS}"
