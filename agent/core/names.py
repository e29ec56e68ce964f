"""The rules both sides apply to what an operator types: a run's name and the supervisor's
address(es).  The agent checks them at once (a bad name fails at start, not as a registration
refused forever); the supervisor's API and its command-line client apply the same ones.

Standard library only (``trainwarden.agent.core``).
"""

from __future__ import annotations

import re

# A run's name: what registration accepts (and what a token's run scope names).
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
RUN_NAME_MAX = 200
RUN_NAME_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit"
# A token's run scope: one run's name, or a prefix of run names ending in '*'.
RUN_SCOPE_PATTERN = RUN_NAME_PATTERN.removesuffix("$") + r"\*?$"

_RUN_NAME = re.compile(RUN_NAME_PATTERN)


def is_run_name(name: str) -> bool:
    """Whether registration accepts ``name`` as a run's name."""
    return len(name) <= RUN_NAME_MAX and _RUN_NAME.match(name) is not None


def supervisor_urls(text: str) -> list[str]:
    """``--supervisor``'s value as its addresses, in order: one URL, or the comma-separated
    URLs of the replicas of one supervisor (on a shared Postgres), each stripped of spaces
    and of a trailing slash.

    Raises ``ValueError`` saying what is wrong: no address at all, or one that is not an
    http:// or https:// URL (named)."""
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls:
        raise ValueError("--supervisor must name at least one http:// or https:// URL")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"--supervisor must be an http:// or https:// URL (or a comma-separated "
                f"list of them, the replicas of one supervisor), got {url!r}")
    return urls
