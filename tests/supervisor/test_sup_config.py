"""Settings: precedence (flags > env > file), defaults, and the cross-field rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.config import SupervisorSettings, hash_token, load_settings

TOKENS = {"agent_token": "a", "operator_token": "o"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("TRAINWARDEN_") and k != "TRAINWARDEN_TEST_POSTGRES_URL":
            monkeypatch.delenv(k)


def test_defaults(tmp_path: Path) -> None:
    s = load_settings(data_dir=str(tmp_path), **TOKENS)
    assert (s.host, s.port, s.restart_budget, s.restart_backoff_max_s) == (
        "127.0.0.1", 8765, 10, 60.0)
    assert s.database_url == f"sqlite:///{(tmp_path / 'trainwarden.db').resolve()}"
    assert s.agent_token_hash == hash_token("a") and s.agent_token_hash.startswith("sha256:")


def test_precedence_file_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "tw.toml"
    f.write_text('[supervisor]\nport = 1000\nrestart_budget = 5\nagent_token = "fa"\n'
                 'operator_token = "fo"\npublic_reads = true\n')
    s = load_settings(f)
    assert (s.port, s.restart_budget, s.public_reads) == (1000, 5, True)
    monkeypatch.setenv("TRAINWARDEN_PORT", "2000")
    monkeypatch.setenv("TRAINWARDEN_CONFIG", str(f))
    s = load_settings()
    assert (s.port, s.restart_budget) == (2000, 5)
    s = load_settings(port=3000)
    assert (s.port, s.restart_budget) == (3000, 5)
    j = tmp_path / "tw.json"
    j.write_text(json.dumps({"restart_budget": 7, **TOKENS}))
    assert load_settings(j).restart_budget == 7


@pytest.mark.parametrize("kw, needle", [
    ({}, "no token configured"),
    ({**TOKENS, "restart_backoff_s": 10, "restart_backoff_max_s": 5}, "restart_backoff_max_s"),
    ({"agent_token": "same", "operator_token": "same"}, "the same"),
    ({"insecure_no_auth": True, "host": "0.0.0.0"}, "loopback"),
    ({"insecure_no_auth": True, **TOKENS}, "drop --insecure-no-auth"),
    ({**TOKENS, "port": 70000}, "port"),
])
def test_bad_settings_name_the_fix(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SupervisorSettings(**kw)  # type: ignore[arg-type]


def test_bad_config_file(tmp_path: Path) -> None:
    f = tmp_path / "tw.toml"
    f.write_text("port = [")
    with pytest.raises(ValueError, match="not valid"):
        load_settings(f)
    f.write_text("nonsense = 1\n")
    with pytest.raises(ValueError, match="nonsense"):
        load_settings(f, **TOKENS)
    with pytest.raises(ValueError, match="cannot read"):
        load_settings(tmp_path / "missing.toml")


def test_insecure_loopback_ok() -> None:
    s = SupervisorSettings(insecure_no_auth=True)
    assert s.agent_token_hash is None and s.operator_token_hash is None


def test_spike_and_rollback_settings_reach_the_detector_and_the_policy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from supervisor.app import create_app

    env = {"SPIKE_RECOVERY_WINDOW_STEPS": "80", "SPIKE_SUSTAIN_STEPS": "12",
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
    s = load_settings(data_dir=str(tmp_path), **TOKENS)
    assert (s.rollback_skip_batches, s.rollback_lr_steps, s.rollback_lr_ramp_steps) == (
        None, None, None)
    assert (s.spike_recovery_window_steps, s.rollback_lr_ratio) == (50, 0.25)
    with pytest.raises(ValueError, match=r"spike_recovery_window_steps \(5\) is below"):
        load_settings(spike_recovery_window_steps=5, **TOKENS)
