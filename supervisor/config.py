"""Supervisor settings: one pydantic-settings model.

Precedence, highest first: explicit arguments (the CLI's flags), ``TRAINWARDEN_*`` environment
variables, then an optional TOML or JSON config file (``--config`` or ``TRAINWARDEN_CONFIG``).
"""

from __future__ import annotations

import contextvars
import hashlib
import ipaddress
import json
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "TRAINWARDEN_"
ENV_CONFIG = "TRAINWARDEN_CONFIG"

# The config file of the settings being built.  pydantic-settings builds sources from the class,
# so the file chosen at run time travels in a context variable instead of a global.
_config_data: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "trainwarden_config_data", default=None
)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a ``.toml`` or ``.json`` config file; raises ``ValueError`` saying what is wrong.

    A TOML file may hold the keys at top level or in a ``[supervisor]`` table."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        elif p.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        else:
            raise ValueError(f"config file {p} must end in .toml or .json")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"config file {p} is not valid: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold an object of settings")
    if isinstance(data.get("supervisor"), dict):
        data = data["supervisor"]
    return data


class _FileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        data = _config_data.get() or {}
        return data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_config_data.get() or {})


def hash_token(token: str) -> str:
    """Tokens are kept (and may be configured) only as ``sha256:<hex>`` digests."""
    if token.startswith("sha256:"):
        return token
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class SupervisorSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, frozen=True
    )

    data_dir: Path = Path("./trainwarden-data")
    db_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default: SQLite file trainwarden.db in data_dir"
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    # Either may be a plain token or "sha256:<hex>" of one; both are hashed at load.
    agent_token: str | None = None
    operator_token: str | None = None
    insecure_no_auth: bool = False
    public_reads: bool = False
    restart_budget: int = Field(default=10, ge=0)
    restart_backoff_s: float = Field(default=1.0, ge=0.0)
    restart_backoff_max_s: float = Field(default=60.0, ge=0.0)
    heartbeat_interval_s: float = Field(default=1.0, gt=0.0)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # Slow and idle clients (supervisor/httpguard.py): a request's headers must be complete
    # within http_header_timeout_s of the connection opening (or of the previous response),
    # its body within http_body_timeout_s of the headers (else 408 and closed); an idle
    # keep-alive connection is closed after http_keep_alive_s; past http_max_connections open
    # connections, requests are answered 503.
    http_header_timeout_s: float = Field(default=10.0, gt=0.0)
    http_body_timeout_s: float = Field(default=30.0, gt=0.0)
    http_keep_alive_s: int = Field(default=5, ge=1)
    http_max_connections: int = Field(default=2048, ge=1)
    evaluator_interval_s: float = Field(default=0.5, gt=0.0)
    # Detection (see supervisor/detect/): the hang deadline's floor and its allowances for
    # start-up and the first steps of an attempt; how long an agent may be silent.
    hang_floor_s: float = Field(default=25.0, gt=0.0)
    hang_startup_s: float = Field(default=600.0, gt=0.0)
    hang_warmup_s: float = Field(default=300.0, gt=0.0)
    node_lost_s: float = Field(default=30.0, gt=0.0)
    # A node's checkpoint disk below this free share: a disk_low event (and the alert).
    disk_low_ratio: float = Field(default=0.10, gt=0.0, lt=1.0)
    # Recovery from loss spikes / NaN (0 rollbacks: incidents only, no automatic rollback).
    # A loss spike back to baseline within spike_recovery_window_steps is an event, not a
    # rollback; one that is not, with at least spike_sustain_steps steps above the threshold,
    # is an incident (see supervisor/detect/loss_spike.py).
    spike_recovery_window_steps: int = Field(default=50, ge=1)
    spike_sustain_steps: int = Field(default=10, ge=1)
    rollback_budget: int = Field(default=3, ge=0)
    rollback_margin_steps: int = Field(default=10, ge=0)
    # Skip from rollback_skip_before batches before the spike's first batch through the batch
    # where it was detected (+ rollback_skip_after), or rollback_skip_batches when set.
    rollback_skip_before: int = Field(default=10, ge=0)
    rollback_skip_after: int = Field(default=0, ge=0)
    rollback_skip_batches: int | None = Field(default=None, ge=1)
    # LR x rollback_lr_scale for rollback_lr_ratio x the batches skipped, back over half as
    # many; rollback_lr_steps / rollback_lr_ramp_steps fix either.
    rollback_lr_scale: float = Field(default=0.5, gt=0.0, le=1.0)
    rollback_lr_ratio: float = Field(default=0.25, ge=0.0)
    rollback_lr_steps: int | None = Field(default=None, ge=0)
    rollback_lr_ramp_steps: int | None = Field(default=None, ge=0)
    no_progress_restarts: int = Field(default=3, ge=1)
    log_level: str = "info"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _FileSource(settings_cls))

    @model_validator(mode="after")
    def _cross_field(self) -> SupervisorSettings:
        if self.spike_recovery_window_steps < self.spike_sustain_steps:
            raise ValueError(
                f"spike_recovery_window_steps ({self.spike_recovery_window_steps}) is below "
                f"spike_sustain_steps ({self.spike_sustain_steps}): a spike cannot have more "
                "high steps than the window holds; raise the window or lower sustain_steps"
            )
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(
                f"restart_backoff_max_s ({self.restart_backoff_max_s}) is below "
                f"restart_backoff_s ({self.restart_backoff_s}): raise the maximum or lower the base"
            )
        if not self.agent_token and not self.operator_token and not self.insecure_no_auth:
            raise ValueError(
                "no token configured: set TRAINWARDEN_AGENT_TOKEN and TRAINWARDEN_OPERATOR_TOKEN "
                "(or agent_token/operator_token in the config file), or pass --insecure-no-auth "
                "to run without authentication on a loopback address"
            )
        if self.insecure_no_auth and (self.agent_token or self.operator_token):
            raise ValueError(
                "insecure_no_auth is set together with a token: drop --insecure-no-auth "
                "(tokens are then required) or drop the tokens"
            )
        if self.insecure_no_auth and not _is_loopback(self.host):
            raise ValueError(
                f"--insecure-no-auth is only allowed on a loopback host, not {self.host!r}: "
                "configure agent_token and operator_token to listen on other addresses"
            )
        if (
            self.agent_token
            and self.operator_token
            and hash_token(self.agent_token) == hash_token(self.operator_token)
        ):
            raise ValueError(
                "agent_token and operator_token are the same: the agent token would grant "
                "operator rights; choose two different tokens"
            )
        return self

    @property
    def database_url(self) -> str:
        """The effective database URL (``db_url``, or the SQLite file in ``data_dir``)."""
        if self.db_url:
            return self.db_url
        return f"sqlite:///{(self.data_dir / 'trainwarden.db').resolve()}"

    @property
    def agent_token_hash(self) -> str | None:
        return hash_token(self.agent_token) if self.agent_token else None

    @property
    def operator_token_hash(self) -> str | None:
        return hash_token(self.operator_token) if self.operator_token else None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_settings(
    config_file: str | Path | None = None, **overrides: Any
) -> SupervisorSettings:
    """Build settings from overrides (``None`` values are dropped), env and the config file.

    Raises ``ValueError`` (pydantic's ``ValidationError`` is one) naming the bad setting."""
    path = config_file or os.environ.get(ENV_CONFIG) or None
    data = read_config_file(path) if path else None
    token = _config_data.set(data)
    try:
        return SupervisorSettings(**{k: v for k, v in overrides.items() if v is not None})
    finally:
        _config_data.reset(token)
