"""``trainwarden agent`` command line.

The ``trainwarden`` console script (supervisor/cli/main.py) delegates its ``agent`` sub-command
here through ``add_arguments`` and ``run``; ``python -m trainwarden.agent.cli ...`` works on its
own.

    trainwarden agent --supervisor URL --run NAME [--node NAME] [--token T]
                      [--state-dir DIR] [--checkpoint-root DIR] [--stop-grace S]
                      [--no-preflight] [--preflight-timeout S]
                      -- torchrun --nproc_per_node=2 train.py ...
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from trainwarden.agent.config import ENV_AGENT_TOKEN, AgentConfig
from trainwarden.agent.core.hang import HangConfig
from trainwarden.agent.core.launch import RENDEZVOUS_TIMEOUT_S
from trainwarden.agent.core.states import AgentExit
from trainwarden.agent.protocol import PREFLIGHT_TIMEOUT_S

_HANG = HangConfig()  # the defaults of the local watchdog: the supervisor's

# What ``--help`` says of the exit codes (``AgentExit``), for whoever wraps the agent in a job.
EXIT_CODES = f"""exit codes (how the run ended, for the job that wraps the agent, Slurm or k8s):
  {AgentExit.COMPLETED:<3}  the run completed
  {AgentExit.FAILED:<3}  the run failed (a restart budget spent, a bug in the training script)
  {AgentExit.STOPPED:<3}  the run was stopped (an operator's stop)
  {AgentExit.REFUSED:<3}  refused: the run had already ended, or the node was taken over;
       nothing was launched
  {AgentExit.USAGE:<3}  a bad flag or setting, or another agent holds the state dir
  {AgentExit.ERROR:<3}  the agent itself failed (its traceback is logged)
  {AgentExit.NOT_FOUND:<3}  the training command cannot be run
  SIGTERM or SIGINT to the agent: it stops the workers, delivers what it spooled, exits 0"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_CODES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--supervisor", required=True, metavar="URL[,URL...]",
                        help="supervisor base URL, e.g. http://head:8080; or the "
                             "comma-separated URLs of its replicas on one Postgres "
                             "(http://a:8080,http://b:8080): the agent fails over to the "
                             "next on a connection error or a 502/503/504")
    parser.add_argument("--run", required=True, metavar="NAME", help="training run name")
    parser.add_argument("--node", default=None, metavar="NAME",
                        help="this node's name in the run (default: host name)")
    parser.add_argument("--token", default=None, metavar="T",
                        help=f"agent token (default: ${ENV_AGENT_TOKEN})")
    parser.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                        help="spool, logs, plans and ids (default: "
                             "~/.local/state/trainwarden/RUN/NODE)")
    parser.add_argument("--checkpoint-root", type=Path, default=None, metavar="DIR",
                        help="the directory the workers save checkpoints in: registered "
                             "with the supervisor, which refuses a checkpoint reported "
                             "anywhere else; pins stay inside it; its free space is reported "
                             "(default: the training command's --checkpoint-dir and the "
                             "directories of the checkpoints the workers report)")
    parser.add_argument("--stop-grace", type=float, default=5.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL of the workers (default 5)")
    parser.add_argument("--hang-floor", type=float, default=_HANG.floor_s, metavar="S",
                        help="local hang watchdog: shortest deadline without step progress "
                             "(acts only while the supervisor is unreachable; default "
                             f"{_HANG.floor_s:g})")
    parser.add_argument("--hang-startup", type=float, default=_HANG.startup_s, metavar="S",
                        help="local hang watchdog: allowance from launch to the first step "
                             f"(default {_HANG.startup_s:g})")
    parser.add_argument("--spare", action="store_true",
                        help="a spare node: register and heartbeat, run nothing until the "
                             "supervisor gives this node the rank of a lost or cordoned "
                             "member (the command is the members' command)")
    parser.add_argument("--min-nodes", type=int, default=None, metavar="N",
                        help="the smallest world the run accepts: when a member is lost or "
                             "cordoned and no spare is free, the run goes on with the other "
                             "members (same global batch) down to N nodes, and grows back at "
                             "a checkpoint once a node is free (default: the declared "
                             "--nnodes, i.e. wait for a node)")
    parser.add_argument("--advertise-addr", default="", metavar="HOST",
                        help="the address other nodes reach this node's rendezvous at when "
                             "the supervisor makes it node rank 0 (default: the address the "
                             "supervisor sees this agent's requests come from)")
    parser.add_argument("--rendezvous-timeout", type=int, default=RENDEZVOUS_TIMEOUT_S,
                        metavar="S",
                        help="how long torchrun waits for the run's rendezvous to form, in "
                             f"seconds (default {RENDEZVOUS_TIMEOUT_S}): a node that cannot "
                             "reach the rank-0 host fails after it, and is replaced")
    parser.add_argument("--no-preflight", dest="preflight", action="store_false",
                        help="skip the workers' preflight health check (their device, a "
                             "checked matmul, a timed all-reduce) before the first step")
    parser.add_argument("--preflight-timeout", type=float, default=PREFLIGHT_TIMEOUT_S,
                        metavar="S",
                        help="the preflight's bound on its all-reduce, in seconds (default "
                             f"{PREFLIGHT_TIMEOUT_S:g}; raise it for a large NCCL job)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the torchrun command to supervise")


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    kwargs: dict[str, object] = {}
    if args.node:
        kwargs["node"] = args.node
    return AgentConfig(
        supervisor_url=args.supervisor,
        run=args.run,
        command=command,
        token=args.token or os.environ.get(ENV_AGENT_TOKEN) or None,
        state_dir=args.state_dir,
        checkpoint_root=args.checkpoint_root,
        stop_grace_s=args.stop_grace,
        hang=_hang_config(args.hang_floor, args.hang_startup),
        spare=bool(getattr(args, "spare", False)),
        advertise_addr=str(getattr(args, "advertise_addr", "") or ""),
        min_nodes=getattr(args, "min_nodes", None),
        preflight=args.preflight,
        preflight_timeout_s=args.preflight_timeout,
        rendezvous_timeout_s=args.rendezvous_timeout,
        # (the optional settings given on the command line, each of its field's type)
        **kwargs,  # type: ignore[arg-type]
    )


def _hang_config(floor_s: float, startup_s: float) -> HangConfig:
    """The watchdog's deadlines from the two flags; the first steps get the default warm-up
    allowance, shortened along with a shortened start-up allowance."""
    try:
        return HangConfig(floor_s=floor_s, startup_s=startup_s,
                          warmup_s=min(_HANG.warmup_s, max(floor_s, startup_s / 2)))
    except ValueError as e:
        raise ValueError(f"--hang-floor / --hang-startup: {e}") from None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "INFO")),
        format="%(asctime)s trainwarden-agent %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"trainwarden agent: {e}", file=sys.stderr)
        return AgentExit.USAGE
    # One line per request at INFO is noise next to the training's own output.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from trainwarden.agent.loop import Agent, AgentAlreadyRunning  # after validation: fail fast

    try:
        agent = Agent(cfg)
    except AgentAlreadyRunning as e:
        print(f"trainwarden agent: {e}", file=sys.stderr)
        return AgentExit.USAGE
    return agent.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainwarden agent",
                                     description="Supervise the local torchrun of a run.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
