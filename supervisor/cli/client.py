"""``trainwarden runs | incidents RUN | checkpoints RUN | rollback RUN | hosts | cordon NODE |
uncordon NODE ...``: thin clients of the REST API that print readable tables.

Everything printed that came from the supervisor (node names, paths, reasons: text agents and
operators chose) goes through ``printable`` first, so a stored escape sequence cannot retitle,
clear or rewrite the operator's terminal."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:  # imported where a command runs: `trainwarden --help` needs no httpx
    import httpx

from trainwarden.agent.core.names import supervisor_urls
from trainwarden.supervisor.cli.tables import printable, table
from trainwarden.supervisor.enums import ActionStatus

ENV_URL = "TRAINWARDEN_URL"
ENV_TOKEN = "TRAINWARDEN_OPERATOR_TOKEN"
ENV_ADMIN_TOKEN = "TRAINWARDEN_ADMIN_TOKEN"  # the token commands' default
DEFAULT_URL = "http://127.0.0.1:8765"

def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--supervisor", default=os.environ.get(ENV_URL, DEFAULT_URL),
                   metavar="URL[,URL...]",
                   help=f"supervisor URL, or the comma-separated URLs of its replicas (the "
                        f"next is tried when one cannot be reached; default ${ENV_URL} or "
                        "local)")
    p.add_argument("--token", default=None, metavar="T",
                   help=f"operator token (default ${ENV_TOKEN})")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("runs", help="list runs")
    add_common(p)
    for name, help_ in (("incidents", "a run's incidents"),
                        ("checkpoints", "a run's checkpoints"),
                        ("actions", "a run's actions"),
                        ("nodes", "a run's nodes: members, spares, missing ranks")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("run")
        add_common(p)
    p = sub.add_parser("rollback", help="roll a run back to a checkpoint (operator)")
    p.add_argument("run")
    p.add_argument("--to", type=int, required=True, metavar="STEP",
                   help="the step of the checkpoint to roll back to")
    p.add_argument("--skip", action="append", default=[], type=_range, metavar="A-B",
                   help="global batch indices A..B (inclusive) never to train; repeatable")
    p.add_argument("--lr-scale", type=float, default=1.0, help="multiply the LR by this...")
    p.add_argument("--lr-steps", type=int, default=0, help="...for this many steps...")
    p.add_argument("--lr-ramp-steps", type=int, default=0, help="...then ramp back over these")
    p.add_argument("--reason", default="", help="why (kept in the audit trail)")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="follow the action's progress for up to S seconds")
    add_common(p)
    p = sub.add_parser("hosts", help="every known node: healthy, cordoned or on probation, "
                                     "with its evidence")
    add_common(p)
    for name, help_ in (("cordon", "cordon a node (operator): replaced at its run's next "
                                   "restart, never chosen as a member while cordoned"),
                        ("uncordon", "put a cordoned node on probation (operator): healthy "
                                     "again once it passes a preflight")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("node", help="the node's name as its agent registers it (--node)")
        p.add_argument("--reason", required=True, help="why (kept in the audit trail)")
        add_common(p)
    p = sub.add_parser("token", help="tokens with roles: create, list, revoke (admin token, "
                                     f"default ${ENV_ADMIN_TOKEN})")
    tsub = p.add_subparsers(dest="token_cmd", required=True)
    tp = tsub.add_parser("create", help="a new token (its secret is printed once)")
    tp.add_argument("name")
    tp.add_argument("--role", required=True, choices=("viewer", "agent", "operator", "admin"))
    tp.add_argument("--scope", default=None, metavar="RUN",
                    help="agent/operator tokens: one run, or a run-name prefix ending in '*'")
    tp.add_argument("--quiet", action="store_true",
                    help="print the secret only (for a script: TOKEN=$(trainwarden token "
                         "create ... --quiet))")
    add_common(tp)
    tp = tsub.add_parser("list", help="the tokens (never their secrets)")
    add_common(tp)
    tp = tsub.add_parser("revoke", help="revoke a token by name")
    tp.add_argument("name")
    add_common(tp)


def _range(text: str) -> list[int]:
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if not m or int(m.group(1)) > int(m.group(2)):
        raise argparse.ArgumentTypeError(
            f"--skip {text!r}: expected A-B with A <= B, e.g. 1200-1499")
    return [int(m.group(1)), int(m.group(2))]


def connect(supervisor: str, token: str | None) -> httpx.Client:
    """A client of the supervisor's API with the operator token (or ``$ENV_TOKEN``'s)."""
    import httpx

    token = token or os.environ.get(ENV_TOKEN)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=supervisor.rstrip("/") + "/api/v1", headers=headers,
                        timeout=10)


def run(args: argparse.Namespace) -> int:
    """Run the command against the first address that can be reached.  The next address is
    tried only while no request has reached a supervisor yet (a connection refused or timed
    out): a command is never sent twice (a rollback that went through and whose progress
    then failed to come is not repeated on another replica)."""
    import httpx

    token = args.token or (os.environ.get(ENV_ADMIN_TOKEN) if args.cmd == "token" else None)
    try:
        urls = supervisor_urls(str(args.supervisor).strip() or DEFAULT_URL)
    except ValueError as e:
        print(f"trainwarden {args.cmd}: {e}", file=sys.stderr)
        return 1
    answered: list[str] = []  # the addresses that answered a request of this command
    for i, url in enumerate(urls):
        with connect(url, token) as client:
            client.event_hooks["response"].append(lambda _r, u=url: answered.append(u))
            try:
                return _COMMANDS[args.cmd](client, args)
            except httpx.HTTPStatusError as e:
                print(f"trainwarden {args.cmd}: {e.response.status_code} "
                      f"{printable(_detail(e.response))}", file=sys.stderr)
                return 1
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if answered or i + 1 == len(urls):
                    print(f"trainwarden {args.cmd}: cannot reach {url}: {e}", file=sys.stderr)
                    return 1
                print(f"trainwarden {args.cmd}: cannot reach {url} ({e}): trying {urls[i + 1]}",
                      file=sys.stderr)
            except httpx.HTTPError as e:
                print(f"trainwarden {args.cmd}: cannot reach {url}: {e}", file=sys.stderr)
                return 1
    return 1


def _detail(r: httpx.Response) -> str:
    try:
        d = r.json().get("detail", r.text)
    except ValueError:
        return r.text
    return d if isinstance(d, str) else str(d)


def _get(client: httpx.Client, path: str) -> Any:
    r = client.get(path)
    r.raise_for_status()
    return r.json()


def _number(x: Any) -> float | None:
    """A finite number from a reply, else None (the API writes NaN/Infinity as strings, and a
    row may hold anything)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        v = float(x)
    except OverflowError:
        return None
    return v if math.isfinite(v) else None


def _age(t: Any) -> str:
    v = _number(t)
    if v is None:
        return "-" if t is None else "?"
    s = max(0.0, time.time() - v)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def run_path(run: str, rest: str = "") -> str:
    """``/runs/RUN/rest`` with the name quoted (whatever it holds, it stays one segment)."""
    return f"/runs/{quote(run, safe='')}{rest}"


def _runs(client: httpx.Client, args: argparse.Namespace) -> int:
    runs = _get(client, "/runs")
    runs = runs.get("runs", runs) if isinstance(runs, dict) else runs
    rows = []
    for r in runs:
        ck = r.get("checkpoint") or {}
        tp = _number((r.get("throughput") or {}).get("samples_per_s"))
        rows.append([r["name"], r["status"], r["attempt"], r.get("restarts"), r.get("step"),
                     f"{tp:.0f}" if tp else None, ck.get("step"), _age(ck.get("t")),
                     _nodes_cell(r)])
    print(table(rows, ["RUN", "STATUS", "ATTEMPT", "RESTARTS", "STEP", "SAMPLES/S",
                       "CHECKPOINT", "AGE", "NODES"]))
    return 0


def _nodes_cell(run: dict[str, Any]) -> str:
    """``2/2 +1 spare`` (members up / world, free spares), ``1/2 WAITING`` while a rank waits
    for a node, ``1/2 SHRUNK`` while the run runs on fewer nodes than it declares."""
    m = run.get("membership") or {}
    world = m.get("nnodes")
    members = [a for a in run.get("agents") or [] if a.get("role") == "member"]
    up = len(members) - len(m.get("missing") or [])
    cell = f"{up}/{world}" if world else str(len(members))
    if m.get("missing"):
        cell += " WAITING"
    elif world and m.get("world") is not None and m["world"] < world:
        cell += " SHRUNK"
    if m.get("spares"):
        cell += f" +{m['spares']} spare"
    return cell


def _nodes(client: httpx.Client, args: argparse.Namespace) -> int:
    run = _get(client, run_path(args.run))
    m = run.get("membership") or {}
    rows = [[a["node"], a.get("role"), a.get("node_rank"), a.get("state"), a.get("attempt"),
             _age(a.get("last_seen_at")), a.get("nproc_per_node"), a.get("devices"),
             a.get("address")] for a in run.get("agents") or []]
    print(table(rows, ["NODE", "ROLE", "RANK", "STATE", "ATTEMPT", "SEEN", "NPROC", "GPUS",
                       "ADDRESS"]))
    world, declared = m.get("world"), m.get("nnodes")
    shrunk = world is not None and declared is not None and world < declared
    print(f"world {world if shrunk else declared or '-'}"
          + (f" of {declared} declared (shrunk; --min-nodes {m.get('min_nodes')})"
             if shrunk else "")
          + f", membership epoch {m.get('epoch')}, free spares {m.get('spares')}"
          + (f"; node ranks waiting for a node: {m['missing']}" if m.get("missing") else ""))
    host = [a["node"] for a in run.get("agents") or []
            if a.get("role") == "member" and a.get("node_rank") == 0]
    if host:
        print(f"rendezvous hosted by {printable(str(host[0]))} (node rank 0)")
    cond = run.get("condition")
    if isinstance(cond, dict) and cond.get("summary"):
        print(printable(str(cond["summary"])))
    return 0


def _incidents(client: httpx.Client, args: argparse.Namespace) -> int:
    incs = _get(client, run_path(args.run, "/incidents"))["incidents"]
    rows = [[i["id"], i["kind"], i["status"], i["attempt"], i.get("step"), i.get("node"),
             i.get("rank"), i.get("failure_class"), _age(i["opened_at"]), _short(i["cause"])]
            for i in incs]
    print(table(rows, ["ID", "KIND", "STATUS", "ATTEMPT", "STEP", "NODE", "RANK", "FAULT",
                       "OPENED", "CAUSE"]))
    for i in incs:
        print(_root_cause_block(i), end="")
    return 0


ROOT_CAUSE_LINES = 15  # of a traceback, under the incidents table


def _root_cause_block(incident: dict[str, Any]) -> str:
    """An incident's root cause under the table: its cause whole, whose fault, the end of
    the traceback (every line printable: the worker wrote it)."""
    rc = incident.get("root_cause")
    if not isinstance(rc, dict):
        return ""
    fault = {"user_code": "the training script", "machine": "the machine"}.get(
        str(incident.get("failure_class")), "unknown")
    out = [f"\nincident {incident['id']}: {printable(incident['cause'])}",
           f"  fault: {fault}"]
    tb = str(rc.get("traceback") or "").splitlines()[-ROOT_CAUSE_LINES:]
    out += [f"  | {printable(ln)}" for ln in tb]
    return "\n".join(out) + "\n"


def _checkpoints(client: httpx.Client, args: argparse.Namespace) -> int:
    cps = _get(client, run_path(args.run, "/checkpoints"))["checkpoints"]
    protected = set(_get(client, run_path(args.run)).get("protected") or [])

    def state(c: dict[str, Any]) -> str:
        text = "abandoned" if c.get("abandoned") else (
            "complete" if c["complete"] else "incomplete")
        return text + (", protected" if c["path"] in protected else "")

    rows = [[c["id"], c["step"], c["attempt"], state(c), c.get("bytes"), _age(c["t"]),
             c["path"]] for c in cps]
    print(table(rows, ["ID", "STEP", "ATTEMPT", "STATE", "BYTES", "AGE", "PATH"]))
    return 0


def _actions(client: httpx.Client, args: argparse.Namespace) -> int:
    acts = _get(client, run_path(args.run, "/actions"))["actions"]
    rows = [[a["id"], a["kind"], a["actor"], a["status"], a["attempt"], a.get("resumed_step"),
             _age(a["created_at"]), _short(a["reason"])] for a in acts]
    print(table(rows, ["ID", "KIND", "ACTOR", "STATUS", "ATTEMPT", "RESUMED AT", "AGE",
                       "REASON"]))
    return 0


def _rollback(client: httpx.Client, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"step": args.to, "skip": args.skip, "reason": args.reason}
    if args.lr_scale != 1.0:
        body.update(lr_scale=args.lr_scale, lr_scale_steps=args.lr_steps,
                    lr_ramp_steps=args.lr_ramp_steps)
    r = client.post(run_path(args.run, "/rollback"), json=body)
    r.raise_for_status()
    action_id = r.json()["action_id"]
    print(f"rollback of {args.run} to step {args.to} queued: action {action_id}")
    deadline = time.monotonic() + args.wait
    last = None
    while time.monotonic() < deadline:
        a = _get(client, f"/actions/{action_id}")
        if a["status"] != last:
            last = a["status"]
            extra = f" at step {a['resumed_step']}" if a.get("resumed_step") is not None else ""
            print(f"  action {action_id}: {printable(last)}{extra}")
        if last in (ActionStatus.RESUMED, ActionStatus.FAILED, ActionStatus.SUPERSEDED):
            return 0 if last == ActionStatus.RESUMED else 1
        time.sleep(0.5)
    return 0


def host_path(node: str, rest: str = "") -> str:
    """``/hosts/NODE/rest``; a node's name may hold slashes (``rack1/n0``), which the route
    takes as they are: the rest is quoted."""
    return f"/hosts/{quote(node, safe='/')}{rest}"


def _hosts(client: httpx.Client, args: argparse.Namespace) -> int:
    body = _get(client, "/hosts")
    window = _number(body.get("window_s")) or 0.0
    rows = []
    for h in body["hosts"]:
        last = h.get("latest_evidence") or {}
        latest = (f"{_short(str((last.get('detail') or {}).get('what') or last.get('kind')), 40)}"
                  f", {_age(last.get('t'))} ago") if last else None
        rows.append([h["node"], h["state"], f"{_age(h['since'])} ago", h.get("actor") or None,
                     h.get("evidence_count"), latest, _short(h.get("reason") or "", 60)])
    print(table(rows, ["NODE", "STATE", "SINCE", "BY", f"EVIDENCE IN {window / 3600:g}H",
                       "LATEST EVIDENCE", "REASON"]))
    return 0


def _host_change(client: httpx.Client, args: argparse.Namespace) -> int:
    r = client.post(host_path(args.node, f"/{args.cmd}"), json={"reason": args.reason})
    r.raise_for_status()
    out = r.json()
    then = {"cordoned": "never chosen as a member until uncordoned",
            "probation": "healthy again once it passes a preflight"}.get(str(out["state"]), "")
    print(f"node {printable(out['node'])} is {printable(out['state'])}"
          f"{': ' + then if then else ''} (host action {out['action_id']})")
    return 0


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _token(client: httpx.Client, args: argparse.Namespace) -> int:
    if args.token_cmd == "create":
        body = {"name": args.name, "role": args.role, "scope": args.scope}
        r = client.post("/tokens", json=body)
        r.raise_for_status()
        t = r.json()
        scope = f", scope {printable(t['scope'])}" if t.get("scope") else ""
        if args.quiet:
            print(t["token"])
            return 0
        print(f"token {printable(t['name'])} ({t['role']}{scope}) created; its secret, shown "
              "only this once:")
        print(t["token"])
        return 0
    if args.token_cmd == "revoke":
        r = client.delete(f"/tokens/{args.name}")
        r.raise_for_status()
        print(f"token {printable(args.name)} revoked")
        return 0
    rows = [[t["name"], t["role"], t.get("scope") or "*", _age(t["created_at"]),
             _age(t.get("last_used_at"))] for t in _get(client, "/tokens")["tokens"]]
    print(table(rows, ["NAME", "ROLE", "SCOPE", "CREATED", "LAST USED"]))
    return 0


_COMMANDS = {"runs": _runs, "incidents": _incidents, "checkpoints": _checkpoints,
             "actions": _actions, "nodes": _nodes, "rollback": _rollback, "token": _token,
             "hosts": _hosts, "cordon": _host_change, "uncordon": _host_change}
COMMANDS = tuple(_COMMANDS)
