"""The deployment files: Prometheus alert rules (checked and unit-tested with the real
``promtool``), the example Prometheus config, and the Grafana dashboard.

``promtool`` comes from the Prometheus release or a distribution package (Debian/Ubuntu:
``apt-get install -y prometheus``); the tests that need it skip, saying so, when it is not on
PATH.  The structural checks run everywhere.

PyYAML is not a dependency of the project, so the rule files are read with a small line-based
reader that relies on the layout the files keep (one ``- alert:`` per rule, one ``alertname:``
per test item, each before its ``exp_alerts:``); ``test_rule_count_matches_promtool`` checks the
reader against promtool's own count so a layout drift cannot hide a rule.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "deploy" / "prometheus"
ALERTS = PROM / "alerts.yml"
ALERTS_TEST = PROM / "alerts_test.yml"
PROM_CONFIG = PROM / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "trainwarden.json"

# The metrics the supervisor exports (supervisor/observability/metrics.py): the contract the
# rules and the
# dashboard are written against.
CONTRACT = {
    "trainwarden_run_info",
    "trainwarden_run_active",
    "trainwarden_run_step",
    "trainwarden_run_attempt",
    "trainwarden_run_loss",
    "trainwarden_run_throughput_samples_per_second",
    "trainwarden_run_seconds_since_last_step",
    "trainwarden_run_checkpoint_age_seconds",
    "trainwarden_run_checkpoint_age_steps",
    "trainwarden_run_checkpoint_failed_saves",
    "trainwarden_run_restarts_total",
    "trainwarden_run_restart_budget_remaining",
    "trainwarden_run_open_incidents",
    "trainwarden_run_restarts_without_progress",
    "trainwarden_run_restarts_without_progress_limit",
    "trainwarden_rank_straggler_score",
    "trainwarden_rank_straggler_slow",
    "trainwarden_run_straggler_threshold",
    "trainwarden_agent_heartbeat_age_seconds",
    "trainwarden_agent_disk_free_bytes",
    "trainwarden_agent_disk_free_ratio",
    "trainwarden_agent_worker_cpu_percent",
    "trainwarden_agent_worker_rss_bytes",
    "trainwarden_agent_gpu_available",
    "trainwarden_gpu_utilization_percent",
    "trainwarden_gpu_memory_used_bytes",
    "trainwarden_gpu_temperature_celsius",
    "trainwarden_gpu_ecc_uncorrected_errors",
    "trainwarden_run_spares",
    "trainwarden_run_spares_configured",
    "trainwarden_run_nodes_missing",
    "trainwarden_run_membership_epoch",
    "trainwarden_run_world_nodes",
    "trainwarden_run_declared_nodes",
    "trainwarden_host_cordoned",
    "trainwarden_host_probation",
    "trainwarden_fleet_ok",
    "trainwarden_fleet_command_failures_total",
    "trainwarden_run_mfu_ratio",
    "trainwarden_run_goodput_ratio",
    "trainwarden_run_badput_seconds",
    "trainwarden_run_productive_seconds",
    "trainwarden_run_wall_seconds",
    "trainwarden_http_requests_total",
    "trainwarden_supervisor_overloaded",
    "trainwarden_evaluator_run_failures_total",
    "trainwarden_ingest_lateness_seconds",
    # histogram: only its series are queryable
    "trainwarden_ingest_latency_seconds_bucket",
    "trainwarden_ingest_latency_seconds_sum",
    "trainwarden_ingest_latency_seconds_count",
}
# Series Prometheus itself makes for every scrape target (rules may use them).
PROMETHEUS_SERIES = {"up"}

PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "atan2",
}


# --------------------------------------------------------------------------- helpers


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip(
            "promtool is not on PATH (install Prometheus, e.g. `apt-get install -y prometheus`)"
        )
    return exe


def _run_promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [_promtool(), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    output = f"$ promtool {' '.join(map(str, args))}\n{proc.stdout}{proc.stderr}"
    print(output)
    assert proc.returncode == 0, output
    return proc


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _alert_blocks(text: str) -> dict[str, list[str]]:
    """``{alertname: lines of its rule}`` from alerts.yml."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    rule_indent = -1
    for line in text.splitlines():
        m = re.match(r"^(\s*)- (alert|record):\s*(\S+)", line)
        if m:
            rule_indent = len(m.group(1))
            if m.group(2) == "alert":
                name = m.group(3).strip("'\"")
                assert name not in blocks, f"alert {name} is defined twice"
                current = blocks[name] = [line]
            else:
                current = None
            continue
        if current is not None and line.strip() and _indent(line) <= rule_indent:
            current = None  # left the rule (next group, or the end of the rules list)
        if current is not None:
            current.append(line)
    return blocks


def _key_value(block: list[str], key: str) -> str:
    """The text of ``key:`` in a rule block, folded or literal blocks included."""
    for i, line in enumerate(block):
        m = re.match(rf"^(\s*){re.escape(key)}:\s*(.*)$", line)
        if not m:
            continue
        value = m.group(2).strip()
        if value and value[0] not in "|>":
            return value.strip("'\"")
        parts = []
        for nxt in block[i + 1 :]:
            if nxt.strip() and _indent(nxt) <= len(m.group(1)):
                break
            parts.append(nxt.strip())
        return "\n".join(p for p in parts if p)
    return ""


def _alert_tests(text: str) -> list[tuple[str, bool]]:
    """``(alertname, fires)`` for every alert_rule_test item in alerts_test.yml; ``fires`` is
    False for ``exp_alerts: []`` (the alert must not fire)."""
    found: list[tuple[str, bool]] = []
    name: str | None = None
    for line in text.splitlines():
        m = re.match(r"^\s*alertname:\s*(\S+)\s*$", line)
        if m:
            name = m.group(1).strip("'\"")
            continue
        m = re.match(r"^\s*exp_alerts:\s*(\[\s*\])?\s*$", line)
        if m:
            assert name is not None, "exp_alerts before any alertname in alerts_test.yml"
            found.append((name, m.group(1) is None))
            name = None
    return found


def _metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (Grafana variables allowed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"\b(group_left|group_right)\s*(\([^)]*\))?", " ", s)
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)  # Grafana variables
    s = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?[smhdwy]?\b", " ", s)  # numbers, durations
    names = set()
    for m in re.finditer(r"[A-Za-z_:][\w:]*", s):
        word = m.group(0)
        if word.lower() in PROMQL_KEYWORDS:
            continue
        if re.match(r"\s*\(", s[m.end() :]):
            continue  # a function or an aggregation
        names.add(word)
    return names


def _dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every query of every panel, rows' nested panels included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels", []))

    walk(dash.get("panels", []))
    return out


# --------------------------------------------------------------------------- promtool


def test_promtool_check_rules() -> None:
    _run_promtool("check", "rules", ALERTS)


def test_promtool_test_rules() -> None:
    # rule_files in the test file are relative to it; run from its directory too.
    proc = _run_promtool("test", "rules", ALERTS_TEST.name, cwd=PROM)
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_rule_count_matches_promtool() -> None:
    """The line-based reader below sees every rule promtool sees."""
    proc = _run_promtool("check", "rules", ALERTS)
    m = re.search(r"SUCCESS: (\d+) rules found", proc.stdout + proc.stderr)
    assert m, proc.stdout + proc.stderr
    assert int(m.group(1)) == len(_alert_blocks(ALERTS.read_text()))


def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    """The example config (with a placeholder token file; promtool checks it exists)."""
    token = tmp_path / "token"
    token.write_text("example-agent-token\n")
    config = PROM_CONFIG.read_text()
    m = re.search(r"credentials_file:\s*(\S+)", config)
    assert m, "prometheus.yml must read the bearer token from a credentials_file"
    (tmp_path / "prometheus.yml").write_text(config.replace(m.group(1), str(token)))
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    proc = _run_promtool("check", "config", tmp_path / "prometheus.yml")
    assert "1 rule files found" in proc.stdout + proc.stderr


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every dashboard query is valid PromQL (checked as recording rules by promtool)."""
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, (_, expr) in enumerate(_dashboard_exprs(json.loads(DASHBOARD.read_text()))):
        expr = expr.replace("$__rate_interval", "5m").replace("$__range", "1h")
        expr = expr.replace("$run", ".+")
        lines += [f"      - record: dashboard:query{i}", f"        expr: {json.dumps(expr)}"]
    rules = tmp_path / "dashboard_rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    _run_promtool("check", "rules", rules)


# --------------------------------------------------------------------------- structure


def test_every_alert_is_documented_and_labelled() -> None:
    blocks = _alert_blocks(ALERTS.read_text())
    assert len(blocks) >= 9, sorted(blocks)
    for name, block in blocks.items():
        assert name.startswith("Trainwarden"), name
        assert _key_value(block, "severity") in {"critical", "warning"}, name
        for key in ("summary", "description", "runbook"):
            assert _key_value(block, key), f"alert {name} has no {key} annotation"
        assert "\n" not in _key_value(block, "runbook"), f"{name}: runbook must be one line"
        assert _key_value(block, "for"), f"alert {name} has no for: duration (flapping)"


def test_every_alert_has_a_firing_and_a_quiet_test_case() -> None:
    alerts = set(_alert_blocks(ALERTS.read_text()))
    cases = _alert_tests(ALERTS_TEST.read_text())
    unknown = {name for name, _ in cases} - alerts
    assert not unknown, f"alerts_test.yml tests alerts that do not exist: {sorted(unknown)}"
    for name in sorted(alerts):
        assert (name, True) in cases, f"{name}: no test case where it fires"
        assert (name, False) in cases, f"{name}: no test case where it must not fire"


def test_alert_rules_use_only_contract_metrics() -> None:
    for name, block in _alert_blocks(ALERTS.read_text()).items():
        used = _metric_names(_key_value(block, "expr"))
        assert used, f"{name}: no metric found in its expr"
        assert used <= CONTRACT | PROMETHEUS_SERIES, (name, sorted(used - CONTRACT))
    # the queries inside annotation templates too
    tokens = set(re.findall(r"\btrainwarden_[a-z0-9_]+", ALERTS.read_text()))
    assert tokens <= CONTRACT, sorted(tokens - CONTRACT)


def test_metric_name_reader() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le) (rate(trainwarden_ingest_latency_seconds_bucket"
        '{job="x"}[$__rate_interval]))) > 1e-1 and on (run) trainwarden_run_active{run=~"$run"}'
        " == 1 unless ignoring (kind) up offset 5m"
    )
    assert _metric_names(expr) == {
        "trainwarden_ingest_latency_seconds_bucket",
        "trainwarden_run_active",
        "up",
    }


def test_dashboard_loads_and_uses_only_contract_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert "run" in variables
    run_query = json.dumps(variables["run"].get("query"))
    assert set(re.findall(r"label_values\((\w+)", run_query)) <= CONTRACT

    exprs = _dashboard_exprs(dash)
    titles = {title for title, _ in exprs}
    for wanted in (
        "Step",
        "Loss",
        "Throughput",
        "Seconds since last step",
        "Checkpoint age",
        "Restarts by cause",
        "Open incidents",
        "Straggler score per rank",
        "Agent heartbeat age",
        "Checkpoint disk free",
        "Ingest latency",
    ):
        assert wanted in titles, f"dashboard has no {wanted!r} panel"
    for title, expr in exprs:
        used = _metric_names(expr)
        assert used, (title, expr)
        assert used <= CONTRACT, (title, sorted(used - CONTRACT))
        if any(
            m.startswith(("trainwarden_run_", "trainwarden_rank_", "trainwarden_agent_"))
            for m in used
        ):
            assert "$run" in expr, f"{title}: per-run query ignores the run variable"

    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
