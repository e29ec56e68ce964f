"""Settings: one model of sections (each component's config); every field set by flag,
environment variable and config file, in that precedence; today's flat names kept; the
cross-field rules; and the generated reference covering every field."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainwarden.agent.core.bounds import BOUND_KEY, Bound
from trainwarden.supervisor.cli import main as cli
from trainwarden.supervisor.cli.settings_reference import markdown, rows
from trainwarden.supervisor.config import (
    LEGACY_NAMES,
    Setting,
    SupervisorSettings,
    flag_values,
    hash_token,
    load_settings,
    settings_fields,
)
from trainwarden.supervisor.control.detection import DetectionConfig
from trainwarden.supervisor.control.policy import PolicyConfig
from trainwarden.supervisor.detect import HangConfig, NodeLostConfig

TOKENS = {"auth": {"agent_token": "a", "operator_token": "o"}}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("TRAINWARDEN_") and k != "TRAINWARDEN_TEST_POSTGRES_URL":
            monkeypatch.delenv(k)


def flags(*argv: str) -> dict[str, dict[str, object]]:
    """What ``trainwarden supervisor ARGV`` passes on to the settings."""
    return flag_values(cli.build_parser(with_settings=True).parse_args(["supervisor", *argv]))


def test_defaults_are_the_components_own(tmp_path: Path) -> None:
    """A user who sets nothing gets exactly the defaults the components declare."""
    s = load_settings(**TOKENS)
    assert s.policy_config() == PolicyConfig()
    assert s.detection_config() == DetectionConfig()
    assert s.hang == HangConfig() and s.node_lost == NodeLostConfig()
    assert (s.server.host, s.server.port) == ("127.0.0.1", 8765)
    sqlite = (Path("trainwarden-data") / "trainwarden.db").resolve()
    assert s.db.database_url == f"sqlite:///{sqlite}"
    assert s.auth.agent_token_hash == hash_token("a")
    assert s.auth.agent_token_hash.startswith("sha256:")


def test_every_field_by_flag() -> None:
    given = flags("--hang-floor-s", "6", "--rollback-skip-batches", "40",
                  "--straggler-threshold", "0.6", "--loss-z", "4", "--throughput-drop", "0.5",
                  "--detection-interval-history", "50", "--server-port", "9000",
                  "--auth-public-reads")
    s = load_settings(**{**given, "auth": {**given["auth"], **TOKENS["auth"]}})
    assert s.hang.floor_s == 6.0
    assert s.policy_config().rollback_skip_batches == 40
    assert s.detection_config().straggler.threshold == 0.6
    assert s.detection_config().loss.z == 4.0
    assert s.detection_config().throughput.drop == 0.5
    assert s.detection_config().interval_history == 50
    assert s.server.port == 9000 and s.auth.public_reads is True


def test_the_flags_of_the_first_versions_still_work() -> None:
    given = flags("--host", "127.0.0.2", "--port", "9001", "--db", "sqlite:///x.db",
                  "--data-dir", "d", "--restart-budget", "4", "--public-reads",
                  "--insecure-no-auth", "--log-level", "debug")
    assert given == {"server": {"host": "127.0.0.2", "port": 9001, "log_level": "debug"},
                     "db": {"url": "sqlite:///x.db", "data_dir": Path("d")},
                     "restart": {"budget": 4},
                     "auth": {"public_reads": True, "insecure_no_auth": True}}


def test_every_field_has_a_flag() -> None:
    parser = cli.build_parser(with_settings=True)
    sub = next(a for a in parser._actions if a.dest == "cmd").choices["supervisor"]  # type: ignore[union-attr]
    options = {o for a in sub._actions for o in a.option_strings}
    assert [s.flag for s in settings_fields() if s.flag not in options] == []


def test_every_field_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINWARDEN_HANG_FLOOR_S", "6")
    monkeypatch.setenv("TRAINWARDEN_ROLLBACK_SKIP_BATCHES", "40")
    monkeypatch.setenv("TRAINWARDEN_STRAGGLER_HOLD_STEPS", "0")
    monkeypatch.setenv("TRAINWARDEN_NODE_LOST_DEADLINE_S", "12")
    monkeypatch.setenv("TRAINWARDEN_AUTH_AGENT_TOKEN", "ea")
    monkeypatch.setenv("TRAINWARDEN_AUTH_OPERATOR_TOKEN", "eo")
    monkeypatch.setenv("TRAINWARDEN_DETECTION_STRAGGLER_INTERVAL_S", "2.5")
    s = load_settings()
    assert s.hang.floor_s == 6.0 and s.rollback.skip_batches == 40
    assert s.straggler.hold_steps == 0 and s.node_lost.deadline_s == 12.0
    assert s.auth.agent_token == "ea" and s.detection.straggler_interval_s == 2.5


def test_the_environment_names_of_the_first_versions_still_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"TRAINWARDEN_AGENT_TOKEN": "a", "TRAINWARDEN_OPERATOR_TOKEN": "o",
           "TRAINWARDEN_DB_URL": "sqlite:///tw.db", "TRAINWARDEN_DATA_DIR": "/tmp/twd",
           "TRAINWARDEN_PUBLIC_READS": "true", "TRAINWARDEN_HANG_FLOOR_S": "6",
           "TRAINWARDEN_HANG_STARTUP_S": "120", "TRAINWARDEN_HANG_WARMUP_S": "20",
           "TRAINWARDEN_NODE_LOST_S": "3600", "TRAINWARDEN_RESTART_BUDGET": "4",
           "TRAINWARDEN_RESTART_BACKOFF_S": "0.5", "TRAINWARDEN_ROLLBACK_BUDGET": "2",
           "TRAINWARDEN_ROLLBACK_SKIP_BATCHES": "40", "TRAINWARDEN_ROLLBACK_LR_STEPS": "30",
           "TRAINWARDEN_DISK_LOW_RATIO": "0.2", "TRAINWARDEN_MAX_BODY_BYTES": "65536",
           "TRAINWARDEN_PORT": "2000", "TRAINWARDEN_NO_PROGRESS_RESTARTS": "5"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = load_settings()
    p = s.policy_config()
    assert (s.auth.agent_token, s.auth.operator_token, s.auth.public_reads) == ("a", "o", True)
    assert (s.db.url, s.db.data_dir) == ("sqlite:///tw.db", Path("/tmp/twd"))
    assert (s.hang.floor_s, s.hang.startup_s, s.hang.warmup_s) == (6.0, 120.0, 20.0)
    assert s.node_lost.deadline_s == 3600.0 and s.disk.low_ratio == 0.2
    assert (p.restart_budget, p.backoff_s, p.no_progress_restarts) == (4, 0.5, 5)
    assert (p.rollback_budget, p.rollback_skip_batches, p.rollback_lr_steps) == (2, 40, 30)
    assert (s.server.max_body_bytes, s.server.port) == (65536, 2000)


def test_the_sections_own_name_wins_over_the_old_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINWARDEN_NODE_LOST_S", "100")
    monkeypatch.setenv("TRAINWARDEN_NODE_LOST_DEADLINE_S", "200")
    assert load_settings(**TOKENS).node_lost.deadline_s == 200.0


def test_every_field_by_config_file(tmp_path: Path) -> None:
    f = tmp_path / "tw.toml"
    f.write_text('[auth]\nagent_token = "fa"\noperator_token = "fo"\n'
                 '[hang]\nfloor_s = 6\n[rollback]\nskip_batches = 40\n'
                 '[straggler]\nthreshold = 0.6\n[server]\nport = 1000\n')
    s = load_settings(f)
    assert (s.auth.agent_token, s.hang.floor_s, s.rollback.skip_batches) == ("fa", 6.0, 40)
    assert (s.straggler.threshold, s.server.port) == (0.6, 1000)
    j = tmp_path / "tw.json"
    j.write_text(json.dumps({"supervisor": {"restart": {"budget": 7}, **TOKENS}}))
    assert load_settings(j).restart.budget == 7


def test_a_config_file_of_the_first_versions_still_works(tmp_path: Path) -> None:
    f = tmp_path / "tw.toml"
    f.write_text('[supervisor]\nport = 1000\nrestart_budget = 5\nagent_token = "fa"\n'
                 'operator_token = "fo"\npublic_reads = true\nhang_floor_s = 7\n')
    s = load_settings(f)
    assert (s.server.port, s.restart.budget, s.auth.public_reads, s.hang.floor_s) == (
        1000, 5, True, 7.0)


def test_precedence_flags_then_env_then_file(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "tw.toml"
    f.write_text('[server]\nport = 1000\n[restart]\nbudget = 5\n[hang]\nfloor_s = 9\n'
                 'startup_s = 90\n[auth]\nagent_token = "fa"\noperator_token = "fo"\n')
    monkeypatch.setenv("TRAINWARDEN_CONFIG", str(f))
    monkeypatch.setenv("TRAINWARDEN_SERVER_PORT", "2000")
    monkeypatch.setenv("TRAINWARDEN_HANG_FLOOR_S", "8")
    s = load_settings()
    assert (s.server.port, s.restart.budget) == (2000, 5)
    assert (s.hang.floor_s, s.hang.startup_s) == (8.0, 90.0)  # one section, two sources
    s = load_settings(**flags("--server-port", "3000", "--hang-floor-s", "7"))
    assert (s.server.port, s.restart.budget, s.hang.floor_s, s.hang.startup_s) == (
        3000, 5, 7.0, 90.0)


@pytest.mark.parametrize("kw, needle", [
    ({}, r"auth\.agent_token must be set \(no token is configured\)"),
    ({**TOKENS, "restart": {"backoff_s": 10, "backoff_max_s": 5}}, "raise the maximum"),
    ({"auth": {"agent_token": "same", "operator_token": "same"}}, "the same"),
    ({"auth": {"insecure_no_auth": True}, "server": {"host": "0.0.0.0"}}, "loopback"),
    ({"auth": {"insecure_no_auth": True, "agent_token": "a"}}, "drop --insecure-no-auth"),
    ({**TOKENS, "server": {"port": 70000}}, "server.port"),
    ({**TOKENS, "rollback": {"lr_scale": 2.0}}, r"rollback\.lr_scale must be in \(0, 1\]"),
    ({**TOKENS, "hang": {"floor_s": 0}}, r"hang\.floor_s must be > 0 \(got 0"),
    ({**TOKENS, "straggler": {"hold_steps": 5}}, "hold_steps"),
])
def test_bad_settings_name_the_fix(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SupervisorSettings(**kw)


def _bound(s: Setting) -> Bound | None:
    """The bound the component declares on a setting's field (None: no bound)."""
    field = {f.name: f for f in dataclasses.fields(s.owner)}[s.owner_field]
    return field.metadata.get(BOUND_KEY)


def _outside(b: Bound, tp: type) -> object:
    """A value of type ``tp`` just outside ``b``."""
    if b.finite:
        return math.inf
    if b.ge is not None:
        return tp(b.ge - 1)
    if b.gt is not None:
        return tp(b.gt)
    if b.le is not None:
        return tp(b.le + 1)
    assert b.lt is not None
    return tp(b.lt)


BOUNDED = [(s, b) for s in settings_fields() if (b := _bound(s)) is not None and b.one_of is None]


def test_every_section_has_bounded_fields() -> None:
    sections = {s.section for s, _ in BOUNDED}
    assert sections >= {"server", "http", "ingest", "evaluator", "lease", "retention", "hang",
                        "node_lost", "disk", "straggler", "loss", "throughput", "overload",
                        "restart", "rollback"}


@pytest.mark.parametrize("s, b", BOUNDED, ids=[f"{s.section}.{s.name}" for s, _ in BOUNDED])
def test_a_bad_value_names_section_and_field(s: Setting, b: Bound,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Every bounded field of every section, set out of bounds as a value and as a flag: one
    message, ``<section>.<field> must be <bound> (got <value>)``, and a plain exit."""
    bad = _outside(b, s.type)
    text = f"{s.section}.{s.name} must be {b.describe()} (got "
    with pytest.raises(ValueError, match=re.escape(text)):
        SupervisorSettings(**TOKENS, **{s.section: {s.name: bad}})
    with pytest.raises(SystemExit) as exit_:
        cli.main(["supervisor", "--insecure-no-auth", s.flag, str(bad)])
    assert str(exit_.value.code).startswith(f"trainwarden: bad settings: {text}")


def test_a_bad_flag_exits_with_the_message_and_no_traceback(repo_root: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")}
    r = subprocess.run([sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor",
                        "--insecure-no-auth", "--hang-k", "-1"],
                       cwd=repo_root, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr == "trainwarden: bad settings: hang.k must be > 0 (got -1.0); try 8\n"


def test_bad_config_file(tmp_path: Path) -> None:
    f = tmp_path / "tw.toml"
    f.write_text("port = [")
    with pytest.raises(ValueError, match="not valid"):
        load_settings(f)
    f.write_text("nonsense = 1\n")
    with pytest.raises(ValueError, match="nonsense"):
        load_settings(f, **TOKENS)
    f.write_text("[hang]\nflor_s = 1\n")
    with pytest.raises(ValueError, match="flor_s"):
        load_settings(f, **TOKENS)
    with pytest.raises(ValueError, match="cannot read"):
        load_settings(tmp_path / "missing.toml")


def test_insecure_loopback_ok() -> None:
    s = SupervisorSettings(auth={"insecure_no_auth": True})
    assert s.auth.agent_token_hash is None and s.auth.operator_token_hash is None


def test_the_reference_covers_every_field() -> None:
    """One row per field of every section, each with its flag, environment variable and
    meaning; the table lists the old names too."""
    table = markdown()
    fields = list(settings_fields())
    assert [r.name for r in rows()] == [f"{s.section}.{s.name}" for s in fields]
    for s in fields:
        assert f"`{s.section}.{s.name}`" in table and s.flag in table and s.env in table
    assert [r.name for r in rows() if not r.meaning] == []
    for old in LEGACY_NAMES:
        assert f"TRAINWARDEN_{old.upper()}" in table
    assert len(fields) == sum(
        len(getattr(SupervisorSettings(**TOKENS), section).__dict__)
        for section in SupervisorSettings.model_fields)


def test_settings_command_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == markdown()


def test_spike_and_rollback_settings_reach_the_detector_and_the_policy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainwarden.supervisor.server.app import create_app

    env = {"LOSS_RECOVERY_WINDOW_STEPS": "80", "LOSS_SUSTAIN_STEPS": "12",
           "ROLLBACK_BUDGET": "5", "ROLLBACK_MARGIN_STEPS": "20",
           "ROLLBACK_SKIP_BEFORE": "4", "ROLLBACK_SKIP_AFTER": "6",
           "ROLLBACK_SKIP_BATCHES": "300", "ROLLBACK_LR_SCALE": "0.3",
           "ROLLBACK_LR_RATIO": "0.5", "ROLLBACK_LR_STEPS": "70",
           "ROLLBACK_LR_RAMP_STEPS": "35"}
    for k, v in env.items():
        monkeypatch.setenv(f"TRAINWARDEN_{k}", v)
    s = load_settings(data_dir=str(tmp_path), **TOKENS)
    ev = create_app(s, upgrade_schema=False, start_evaluator=False).state.evaluator
    loss, pol = ev.detection.loss, ev.cfg
    assert (loss.recovery_window_steps, loss.sustain_steps) == (80, 12)
    assert (pol.rollback_budget, pol.rollback_margin_steps, pol.rollback_skip_before,
            pol.rollback_skip_after, pol.rollback_skip_batches) == (5, 20, 4, 6, 300)
    assert (pol.rollback_lr_scale, pol.rollback_lr_ratio, pol.rollback_lr_steps,
            pol.rollback_lr_ramp_steps) == (0.3, 0.5, 70, 35)


def test_rollback_defaults_size_the_skip_and_the_lr_from_what_was_seen(tmp_path: Path) -> None:
    pol = load_settings(data_dir=str(tmp_path), **TOKENS).policy_config()
    assert (pol.rollback_skip_batches, pol.rollback_lr_steps, pol.rollback_lr_ramp_steps) == (
        None, None, None)
    assert pol.rollback_lr_ratio == 0.25
    loss = load_settings(data_dir=str(tmp_path), **TOKENS).detection_config().loss
    assert loss.recovery_window_steps == 50
    with pytest.raises(ValueError, match=r"recovery_window_steps"):
        load_settings(loss={"recovery_window_steps": 5}, **TOKENS)


def test_the_docs_hold_the_reference_as_generated() -> None:
    """The docs' settings table is `trainwarden settings --markdown`, unedited (rebuild it
    with that command when a setting changes)."""
    page = Path(__file__).resolve().parents[2] / "docs" / "reference" / "settings.md"
    text = page.read_text()
    begin, end = "<!-- settings:begin -->\n", "<!-- settings:end -->"
    assert begin in text and end in text, f"{page} has no settings reference block"
    block = text[text.index(begin) + len(begin):text.index(end)]
    assert block == markdown()
