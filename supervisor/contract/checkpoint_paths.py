"""Checkpoint paths an agent reports, checked against the checkpoint roots it registered.

A path goes into resume plans and into every ingest reply's ``protect`` list, and the node
agents pin what those name: so the supervisor stores only paths strictly inside one of the
reporting agent's registered roots.  Lexical rules (the supervisor cannot see the node's
file system; the agent and the worker also resolve symlinks on the node before they pin or
load anything):

* a root is absolute, not ``/`` itself nor a directory as broad (``/home``, ``/tmp``...),
  not a system directory or inside one (``/etc``, ``/usr``, ``/proc``...), holds no ``..``
  component and no control character; it is kept normalised (``//a/./b/`` is ``/a/b``);
  a supervisor may confine roots further to the directories of ``auth.checkpoint_roots_allowed``;
* a checkpoint path holds no ``..`` component and no NUL; a relative one is resolved
  against the agent's first root; normalised, it must lie strictly below a root (the root
  itself is not a checkpoint).
"""

from __future__ import annotations

import posixpath
import re

MAX_ROOTS = 16  # per agent
# The system's own trees: never a checkpoint root, nor anything inside them (the workers'
# retention writes a PINNED file into every checkpoint it keeps, and a resume loads from it).
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32",
                "/proc", "/run", "/sbin", "/sys", "/usr", "/var/log", "/var/run")
# Directories too broad to be a root themselves (a root admits every path below it); a
# directory inside one is a root like any other.
TOO_BROAD = ("/root", "/home", "/var", "/tmp", "/mnt", "/srv", "/opt", "/media")
MAX_PATH = 4096  # characters (Linux's PATH_MAX)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _normal(path: str) -> str:
    """``path`` (absolute, without ``..``) with empty and ``.`` components dropped."""
    return "/" + "/".join(_parts(path))


def normalize_root(root: str) -> str:
    """The root as stored; raises ``ValueError`` saying what is wrong with it."""
    if not root.startswith("/"):
        raise ValueError(f"checkpoint root {root!r} is not an absolute path")
    if _CONTROL.search(root):
        raise ValueError(f"checkpoint root {root!r} holds a control character")
    if ".." in _parts(root):
        raise ValueError(f"checkpoint root {root!r} holds a '..' component")
    out = _normal(root)
    if out == "/" or out in TOO_BROAD:
        raise ValueError(f"checkpoint root {out!r} would admit any path below it: name the "
                         "directory the checkpoints are saved in")
    for tree in SYSTEM_TREES:
        if out == tree or out.startswith(tree + "/"):
            raise ValueError(f"checkpoint root {out!r} is a system directory ({tree}): save "
                             "checkpoints in a directory of the run's own")
    return out


def allowed_prefixes(setting: str) -> list[str]:
    """The ``auth.checkpoint_roots_allowed`` setting (directories separated by ':', as in
    PATH), normalised; empty: any root but the system's."""
    return [_normal(p) for p in setting.split(":") if p.strip()]


def outside_allowed(roots: list[str], allowed: list[str]) -> str | None:
    """The first root not inside (or equal to) one of ``allowed``; None when all are."""
    if not allowed:
        return None
    for root in roots:
        if not any(root == a or root.startswith(a.rstrip("/") + "/") for a in allowed):
            return root
    return None


def normalize_roots(roots: list[str]) -> list[str]:
    """Normalised, in order, without repeats; raises ``ValueError`` for a bad one."""
    return list(dict.fromkeys(normalize_root(r) for r in roots))


class OutsideRoots(ValueError):
    """A checkpoint path the agent may not report (the message names the path and roots)."""


def resolve(path: str, roots: list[str]) -> str:
    """The normalised checkpoint path, strictly inside one of ``roots``; raises
    ``OutsideRoots`` naming the path and the roots otherwise."""
    if not roots:
        raise OutsideRoots(
            f"checkpoint {path!r} refused: this agent registered no checkpoint root.  The "
            "agent registers the directory its workers save into (--checkpoint-root DIR, "
            "the training command's --checkpoint-dir, or the directory of the checkpoints "
            "its workers reported); a client of the API sends checkpoint_roots when it "
            "registers")
    where = ", ".join(repr(r) for r in roots)
    if "\x00" in path:
        raise OutsideRoots(f"checkpoint {path!r} refused: a path holds no NUL character")
    if ".." in path.split("/"):
        raise OutsideRoots(f"checkpoint {path!r} refused: '..' is not allowed in a "
                           f"checkpoint path (registered root(s): {where})")
    full = _normal(path if path.startswith("/") else posixpath.join(roots[0], path))
    for root in roots:
        if full.startswith(root + "/"):
            return full
    raise OutsideRoots(f"checkpoint {path!r} refused: it is not inside the agent's "
                       f"registered checkpoint root(s) {where}")
