"""What a training command declares about its world, read the way torchrun reads it.

The supervisor admits into a run only as many nodes as its members' torchrun command
declares (``--nnodes N`` or ``--nnodes MIN:MAX``): a node beyond them is not a member and
steers nothing.  Only torchrun's own options count (those before the training script); the
script's arguments are the script's.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

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
