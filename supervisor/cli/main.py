"""``trainwarden`` console script: ``supervisor``, ``db upgrade|current``, ``settings``,
``agent ...``, ``plan ...`` and the API clients (``runs``, ``incidents``, ...).

Imports are lazy: ``trainwarden agent`` runs on GPU nodes and must not pull in FastAPI or
SQLAlchemy; only the chosen subcommand imports what it needs.  Each role is an extra of the
package; a subcommand whose extra is not installed says which one to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

from trainwarden.agent.version import version

# What each role's subcommands import, by the extra that provides it.
EXTRA_MODULES = {
    "supervisor": ("fastapi", "uvicorn", "sqlalchemy", "alembic", "pydantic_settings",
                   "jinja2", "prometheus_client", "httpx"),
    "agent": ("psutil", "httpx"),
    "cli": ("httpx",),
}


def require_extra(extra: str, command: str) -> None:
    """Exit with the install line to run when ``extra``'s packages are missing."""
    missing = [m for m in EXTRA_MODULES[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"trainwarden {command}: needs the '{extra}' extra, which is not installed "
            f"(missing: {', '.join(missing)}); install it with: "
            f"pip install 'trainwarden[{extra}]'"
        )


def _add_setting_args(p: argparse.ArgumentParser, sections: tuple[str, ...] | None,
                      with_settings: bool) -> None:
    """``--config`` and a flag for every setting (of ``sections``).  The flags come from the
    settings model, which imports the server stack: only built for the subcommand that runs."""
    p.add_argument("--config", help="TOML or JSON config file (or TRAINWARDEN_CONFIG)")
    if with_settings:
        from trainwarden.supervisor.cli.settings_reference import describe
        from trainwarden.supervisor.config import add_flags

        add_flags(p, sections, describe)


def build_parser(with_settings: bool = False) -> argparse.ArgumentParser:
    """The parser; ``with_settings``: with a flag for every setting on ``supervisor`` and
    ``db`` (see ``_add_setting_args``)."""
    parser = argparse.ArgumentParser(
        prog="trainwarden", description="Fault-tolerant supervisor for distributed training."
    )
    parser.add_argument("--version", action="version", version=f"trainwarden {version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    sp = sub.add_parser("supervisor", help="run the central supervisor (HTTP API)")
    _add_setting_args(sp, None, with_settings)
    sp.add_argument("--port-file", help="write the bound port to this file once listening")

    dp = sub.add_parser("db", help="database schema")
    dsub = dp.add_subparsers(dest="db_cmd", required=True)
    for name, help_ in (("upgrade", "upgrade the schema to the newest revision"),
                        ("current", "print the database's revision")):
        _add_setting_args(dsub.add_parser(name, help=help_), ("db",), with_settings)

    rp = sub.add_parser("settings", help="print every supervisor setting: flag, environment "
                                         "variable, default, meaning")
    rp.add_argument("--markdown", action="store_true", default=True,
                    help="as a Markdown table (the only format)")

    from trainwarden.supervisor.cli import client

    client.add_parsers(sub)

    ap = sub.add_parser("agent", help="run the node agent (wraps torchrun)", add_help=False)
    ap.add_argument("agent_args", nargs=argparse.REMAINDER)
    pp = sub.add_parser("plan", help="capacity planner: memory, sync time, MFU, ETTR",
                        add_help=False)
    pp.add_argument("plan_args", nargs=argparse.REMAINDER)
    return parser


def _reasons(errors: Sequence[Any]) -> str:
    """pydantic's errors as one line.  A config's own refusal already names its setting
    (``hang.k must be > 0 (got -1.0); try 8``, ``trainwarden.agent.core.bounds``) and is
    shown as it is; pydantic's own (a wrong type, an unknown field) get the setting's name."""
    out = []
    for x in errors:
        if x["type"] == "value_error" and "error" in x.get("ctx", {}):
            out.append(str(x["ctx"]["error"]))
        else:
            out.append(f"{'.'.join(map(str, x['loc'])) or 'settings'}: {x['msg']}")
    return "; ".join(out)


def _settings(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from trainwarden.supervisor.config import flag_values, load_settings

    fields: dict[str, Any] = dict(flag_values(args))
    try:
        # The db commands never authenticate anyone: they need no tokens, and the tokens of
        # the environment a supervisor runs in are ignored rather than checked against that.
        if args.cmd == "db":
            return load_settings(args.config, auth={"insecure_no_auth": True,
                                                    "agent_token": None,
                                                    "operator_token": None}, **fields)
        return load_settings(args.config, **fields)
    except ValidationError as e:
        raise SystemExit(f"trainwarden: bad settings: {_reasons(e.errors())}") from None
    except ValueError as e:
        raise SystemExit(f"trainwarden: bad settings: {e}") from None


def _cmd_supervisor(args: argparse.Namespace) -> int:
    settings = _settings(args)
    from trainwarden.supervisor.server import serve

    return serve.serve(settings, port_file=args.port_file)


def _cmd_db(args: argparse.Namespace) -> int:
    settings = _settings(args)
    from trainwarden.supervisor.store import migrate
    from trainwarden.supervisor.store.db import open_error

    url = settings.db.database_url
    problem = open_error(url)
    if problem is not None:
        print(f"trainwarden: {problem}", file=sys.stderr)
        return 2
    if args.db_cmd == "upgrade":
        migrate.upgrade(url)
        print(f"schema at {migrate.current(url)} (head {migrate.head()})")
    else:
        cur = migrate.current(url)
        head = migrate.head()
        print(f"{cur or '(empty)'}{' (head)' if cur == head else f' (head is {head})'}")
    return 0


def _cmd_agent(argv: Sequence[str]) -> int:
    require_extra("agent", "agent")
    from trainwarden.agent import cli as agent_cli

    parser = argparse.ArgumentParser(prog="trainwarden agent",
                                     description="Node agent: wraps torchrun on one node.")
    agent_cli.add_arguments(parser)
    result: int = agent_cli.run(parser.parse_args(list(argv)))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The agent parses its own arguments (its own parser, its own --help).
    if argv and argv[0] == "agent":
        return _cmd_agent(argv[1:])
    if argv and argv[0] == "plan":  # standard library only: runs where only the agent is
        from trainwarden.supervisor.cli import plan as plan_cli

        return plan_cli.main(argv[1:])
    # The server's commands: their extra first (the flags come from its settings model).
    serving = argv[0] if argv and argv[0] in ("supervisor", "db", "settings") else None
    if serving is not None:
        require_extra("supervisor", serving)
    args = build_parser(with_settings=serving in ("supervisor", "db")).parse_args(argv)
    if args.cmd == "supervisor":
        return _cmd_supervisor(args)
    if args.cmd == "db":
        return _cmd_db(args)
    if args.cmd == "settings":
        from trainwarden.supervisor.cli.settings_reference import markdown

        print(markdown(), end="")
        return 0
    from trainwarden.supervisor.cli import client

    if args.cmd in client.COMMANDS:
        require_extra("cli", args.cmd)
        return client.run(args)
    raise AssertionError(args.cmd)


