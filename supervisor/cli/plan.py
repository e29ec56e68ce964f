"""``trainwarden plan``: the capacity planner's command line (tables, ``--json``, ``--check``).

Standard library only, except ``--check RUN``, which reads the run from the supervisor's
REST API through ``trainwarden.supervisor.cli.client`` (httpx) and is imported only then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from trainwarden.supervisor.cli.tables import printable, table
from trainwarden.supervisor.goodput import plan as pl
from trainwarden.supervisor.goodput.units import duration as _dur

_DEFAULTS = pl.PlanInputs(params=1.0)  # the planner's defaults, read for the help texts


def _count(text: str) -> float:
    try:
        return pl.parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rate(text: str) -> str | float:
    if text in pl.FAILURE_RATES:
        return text
    try:
        return float(text) / 1000.0  # given per 1,000 node-days, like the papers
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--failure-rate {text!r}: one of {', '.join(pl.FAILURE_RATES)} or failures per "
            "1,000 node-days") from None


def build_parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = argparse.ArgumentParser(
        prog="trainwarden plan",
        description="Capacity planner: memory per device for DDP and ZeRO/FSDP stages, "
                    "activation memory, gradient-sync time per interconnect, expected MFU, "
                    "failures per day and ETTR at a checkpoint interval.")
    m = p.add_argument_group("model")
    m.add_argument("--params", type=_count, help="parameters (7e9, 7B, 125M); or the shape")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--seq-len", type=int, help="tokens per sequence")
    m.add_argument("--vocab", type=int)
    m.add_argument("--micro-batch", type=int, default=d.micro_batch,
                   help=f"sequences per device per forward (default {d.micro_batch})")
    m.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help=f"micro-batches per optimizer step (default {d.grad_accum})")
    h = p.add_argument_group("hardware")
    h.add_argument("--devices", type=int, default=d.devices, help=f"default {d.devices}")
    h.add_argument("--devices-per-node", type=int, default=d.devices_per_node)
    h.add_argument("--gpu", choices=list(pl.DEVICES), default=d.gpu,
                   help=f"memory and peak FLOP/s preset (default {d.gpu})")
    h.add_argument("--device-memory-gib", "--device-memory-gb", type=float,
                   dest="device_memory_gib", metavar="GIB",
                   help="override the preset's memory: the card's size as its label says "
                        "(an 80 GB card: 80), counted as GiB")
    h.add_argument("--peak-tflops", type=float, help="override the preset's dense peak")
    h.add_argument("--interconnect", choices=list(pl.INTERCONNECTS), default=d.interconnect)
    t = p.add_argument_group("training")
    t.add_argument("--precision", choices=list(pl.PRECISIONS), default=d.precision,
                   help="bf16/fp16: mixed precision with fp32 master weights")
    t.add_argument("--optimizer", choices=list(pl.OPTIMIZERS), default=d.optimizer)
    t.add_argument("--activation-checkpointing", choices=pl.ACTIVATION_MODES,
                   default=d.activation_checkpointing)
    t.add_argument("--strategy", choices=pl.STRATEGIES,
                   help="default: the least sharded that fits")
    t.add_argument("--kernel-efficiency", type=float, default=d.kernel_efficiency,
                   help=f"share of peak the compute reaches (default {d.kernel_efficiency})")
    r = p.add_argument_group("reliability")
    r.add_argument("--failure-rate", type=_rate, default=d.failure_rate,
                   help="meta (6.5), llama3 (3.8) or failures per 1,000 node-days")
    r.add_argument("--restart-s", type=float, default=d.restart_s,
                   help=f"fault to training again (default {d.restart_s:g} s)")
    r.add_argument("--checkpoint-interval-s", type=float, default=d.checkpoint_interval_s)
    r.add_argument("--checkpoint-write-gb-per-s", type=float,
                   default=d.checkpoint_write_gb_per_s, help="per node")
    r.add_argument("--checkpoint-stall-s", type=float,
                   help="training stall per save (default: a synchronous save's)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")
    o.add_argument("--check", metavar="RUN",
                   help="compare with a live run (GET /api/v1/runs/RUN)")
    o.add_argument("--supervisor", metavar="URL",
                   help="supervisor URL (default $TRAINWARDEN_URL or local)")
    o.add_argument("--token", metavar="T", help="token (default $TRAINWARDEN_OPERATOR_TOKEN)")
    return p


def inputs_from(args: argparse.Namespace) -> pl.PlanInputs:
    return pl.PlanInputs(
        params=args.params, layers=args.layers, hidden=args.hidden, heads=args.heads,
        seq_len=args.seq_len, vocab=args.vocab, micro_batch=args.micro_batch,
        grad_accum=args.grad_accum, devices=args.devices,
        devices_per_node=args.devices_per_node, gpu=args.gpu,
        device_memory_gib=args.device_memory_gib, peak_tflops=args.peak_tflops,
        precision=args.precision, optimizer=args.optimizer, interconnect=args.interconnect,
        activation_checkpointing=args.activation_checkpointing, strategy=args.strategy,
        kernel_efficiency=args.kernel_efficiency, failure_rate=args.failure_rate,
        restart_s=args.restart_s, checkpoint_interval_s=args.checkpoint_interval_s,
        checkpoint_write_gb_per_s=args.checkpoint_write_gb_per_s,
        checkpoint_stall_s=args.checkpoint_stall_s)


def _f(x: float | None, fmt: str = ".1f") -> str | None:
    return None if x is None else format(x, fmt)


def _pct(x: float | None, fmt: str = ".0%") -> str | None:
    return None if x is None else format(x, fmt)


def render(plan: pl.Plan) -> str:
    inp = plan.inputs
    dev = pl.DEVICES[inp.gpu]
    out = [f"trainwarden plan: {plan.params / 1e9:.2f} B parameters on {inp.devices} x "
           f"{dev.description} ({plan.nodes} node(s)); {pl.PRECISIONS[inp.precision].description}"
           f", {inp.optimizer}; {pl.INTERCONNECTS[inp.interconnect].description}", ""]
    b = plan.bytes_per_param
    out += ["Bytes per parameter",
            table([[b["weights"], b["grads"], b["master"], b["optimizer"], b["total"]]],
                  ["WEIGHTS", "GRADS", "FP32 MASTER", "OPTIMIZER", "TOTAL"]), ""]
    out += [f"Memory per device (GiB; {plan.usable_memory_gib:.1f} usable of "
            f"{plan.device_memory_gib:g} after a {inp.memory_reserve:.0%} reserve; "
            f"activations with checkpointing '{inp.activation_checkpointing}')",
            table([[r.strategy + (" *" if r.strategy == plan.strategy else ""),
                    _f(r.states_gib), _f(r.activations_gib), _f(r.total_gib),
                    "yes" if r.fits else "no"] for r in plan.memory],
                  ["STRATEGY", "MODEL STATES", "ACTIVATIONS", "TOTAL", "FITS"])]
    if plan.activations_gib:
        a = plan.activations_gib
        out.append(f"activations per device: none {a['none']:.1f} GiB, selective "
                   f"{a['selective']:.1f} GiB, full {a['full']:.1f} GiB (micro-batch "
                   f"{inp.micro_batch} x {inp.seq_len} tokens)")
    out += ["", f"Gradient sync per step ({plan.strategy}; nominal link rates)",
            table([[r.interconnect + (" *" if r.chosen else ""), f"{r.gb_per_s:g}",
                    _f(r.sync_s, ".3f"), _f(r.exposed_s, ".3f"), _pct(r.share_of_step)]
                   for r in plan.sync],
                  ["INTERCONNECT", "GB/S", "SYNC S", "EXPOSED S", "SHARE OF STEP"]), ""]
    if plan.step_s is not None:
        out.append(f"Step: {plan.tokens_per_step:.0f} tokens, compute {plan.compute_s:.3f} s, "
                   f"step {plan.step_s:.3f} s; expected MFU {plan.mfu:.0%} ({plan.mfu_band})")
    ad = plan.advice
    rate = ad.rate_per_node_day
    out += ["", "Reliability",
            table([[plan.nodes, _f(rate * 1000 if rate is not None else None, ".2f"),
                    _f(plan.failures_per_day, ".2f"), _dur(ad.mtbf_s), _f(plan.checkpoint_gb),
                    _dur(plan.checkpoint_stall_s), _dur(inp.restart_s)]],
                  ["NODES", "FAILURES/1000 NODE-DAYS", "FAILURES/DAY", "MTBF", "CHECKPOINT GB",
                   "SAVE STALL", "RESTART"]),
            table([["current", _dur(ad.current_s), _pct(ad.ettr_current, ".1%")],
                   ["recommended", _dur(ad.recommended_s), _pct(ad.ettr_recommended, ".1%")]],
                  ["INTERVAL", "EVERY", "EXPECTED ETTR"]),
            ad.note]
    out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)


def render_check(rows: Sequence[pl.CheckRow], run: str) -> str:
    return f"Plan against run {printable(run)}\n" + table(
        [[r.quantity, _f(r.planned, ".3g"), _f(r.measured, ".3g"),
          _f(r.ratio, ".2f"), r.note] for r in rows],
        ["QUANTITY", "PLAN", "MEASURED", "MEASURED/PLAN", "HOW"])


def _fetch(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from trainwarden.supervisor.cli import client

    url = args.supervisor or os.environ.get(client.ENV_URL, client.DEFAULT_URL)
    try:
        with client.connect(url, args.token) as c:
            r = c.get(client.run_path(args.check))
            r.raise_for_status()
            data: dict[str, Any] = r.json()
            return data
    except httpx.HTTPStatusError as e:
        raise SystemExit(f"trainwarden plan --check: {e.response.status_code} "
                         f"{e.response.text}") from None
    except httpx.HTTPError as e:
        raise SystemExit(f"trainwarden plan --check: cannot reach {url}: {e}") from None


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        plan = pl.make_plan(inputs_from(args))
    except ValueError as e:
        print(f"trainwarden plan: {e}", file=sys.stderr)
        return 2
    checked = None
    if args.check:
        checked = pl.compare(plan, _fetch(args))
    if args.json:
        doc = plan.as_dict()
        if checked is not None:
            doc["check"] = {"run": args.check,
                            "rows": [{"quantity": r.quantity, "planned": r.planned,
                                      "measured": r.measured, "ratio": r.ratio, "how": r.note}
                                     for r in checked]}
        print(json.dumps(doc, indent=1, default=str))
        return 0
    print(render(plan))
    if checked is not None:
        print()
        print(render_check(checked, args.check))
    return 0
