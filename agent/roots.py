"""The node's checkpoint roots: where this node's checkpoints go, what the agent registers
with the supervisor, and where it may write pins.

``--checkpoint-root`` is the user's word: that directory only.  Without it, the roots are
the training command's ``--checkpoint-dir`` and the directories of the checkpoints the
workers reported (learned, newest last, kept in the agent's state).  The supervisor refuses a
checkpoint outside the roots the agent registered, so a new learned root means a new
registration before the batch that carries its checkpoint goes out.  Pins are written only
inside these roots (the user's directories, and the ones its own workers wrote in): never in
a path the network names.
"""

from __future__ import annotations

from pathlib import Path

# Checkpoint directories learned from the workers' reports, kept (newest last) for the pins.
MAX_LEARNED_ROOTS = 8
MAX_REGISTERED_ROOTS = 16  # what the supervisor accepts


def resolved(p: Path) -> Path:
    try:
        return p.resolve()
    except (OSError, RuntimeError):  # a symlink loop: the path as given only
        return p


class CheckpointRoots:
    def __init__(self, *, checkpoint_root: Path | None, command_checkpoint_dir: Path | None,
                 learned: object) -> None:
        self.given = checkpoint_root  # --checkpoint-root
        self.command_dir = command_checkpoint_dir  # the training command's --checkpoint-dir
        self.learned: list[str] = ([r for r in learned if isinstance(r, str)]
                                   if isinstance(learned, list) else [])
        # Where the checkpoints go, for the free-space reading: --checkpoint-root, else the
        # directory of the checkpoints the workers report, else (before any, or on a node
        # whose ranks save none of their own) the training command's --checkpoint-dir, else
        # the newest directory learned before: every node reads its disk.
        self.free_space_at: Path | None = (
            checkpoint_root if checkpoint_root is not None
            else command_checkpoint_dir if command_checkpoint_dir is not None
            else Path(self.learned[-1]) if self.learned else None)

    def pin_roots(self) -> list[Path]:
        """Where pins may be written: --checkpoint-root, else the training command's
        --checkpoint-dir (the user's word too: a spare promoted to a member pins its restart's
        checkpoint there before its workers report any) and the learned directories."""
        if self.given is not None:
            return [self.given]
        return [*([self.command_dir] if self.command_dir is not None else []),
                *(Path(r) for r in self.learned)]

    def learn(self, path: object) -> tuple[bool, bool]:
        """A checkpoint path a worker reported: (the learned roots changed, the registered
        roots changed)."""
        if not isinstance(path, str) or not path.startswith("/"):
            return False, False
        parent = Path(path).parent
        if self.given is None:
            self.free_space_at = parent
        if str(parent) in self.learned[-1:]:
            return False, False
        before = set(self.registered())
        self.learned = [r for r in self.learned if r != str(parent)]
        self.learned = [*self.learned, str(parent)][-MAX_LEARNED_ROOTS:]
        return True, set(self.registered()) != before

    def registered(self) -> list[str]:
        """The roots this agent registers: --checkpoint-root (that one only, as the pins),
        else the command's --checkpoint-dir and the learned directories.  Each as given and
        as resolved (a symlinked directory); only absolute directories below ``/``, which the
        supervisor accepts."""
        found: list[Path] = []
        if self.given is not None:
            found.append(self.given)
        else:
            if self.command_dir is not None:
                found.append(self.command_dir)
            found += [Path(r) for r in self.learned]
        out: list[str] = []
        for p in found:
            for q in (p, resolved(p)):
                text = str(q)
                if (q.is_absolute() and text != "/" and ".." not in q.parts
                        and text.isprintable() and text not in out):
                    out.append(text)
        return out[:MAX_REGISTERED_ROOTS]
