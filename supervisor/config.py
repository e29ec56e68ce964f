"""Supervisor settings: one pydantic-settings model whose sections are the components' own
configs.

Each section is the config class of the component it configures, and holds its defaults:

* ``server``, ``auth``: the HTTP service (this module); ``http``: its deadlines for slow and
  idle clients (``HttpConfig``, read by ``server.httpguard``);
* ``db``: the store (``store.db.StoreConfig``); ``ingest``: what agent batches must satisfy
  (``store.ingest.IngestConfig``: the agent-clock rule); ``evaluator``: the loop
  (``control.evaluator.EvaluatorConfig``); ``lease``: which of several replicas on one
  Postgres runs the evaluator (``control.leader.LeaseConfig``); ``retention``: how long
  per-rank rows are kept before they are rolled up (``control.retention.RetentionConfig``);
* ``hang``, ``node_lost``, ``disk``, ``straggler``, ``loss``, ``throughput``: the detectors'
  configs as ``control.detection.DetectionConfig`` holds them; ``detection``: its other
  fields (how much and how often the windows are read);
* ``cordon``: the rule that cordons a node on the health ledger's evidence
  (``detect.node_health.CordonConfig``); ``fleet``: the scheduler that owns the nodes
  (``control.fleet_sync.FleetConfig``);
* ``restart``, ``rollback``: the fields of ``control.policy.PolicyConfig`` (``rollback_X`` is
  ``rollback.X``, the others are ``restart``'s, ``restart_budget`` as ``restart.budget``).

Every field is set the same three ways, highest first: a flag (``--SECTION-FIELD``, see
``add_flags``), an environment variable (``TRAINWARDEN_SECTION_FIELD``), the config file (TOML
``[section]`` tables, or JSON objects, at top level or under ``supervisor``; ``--config`` or
``TRAINWARDEN_CONFIG``).  The flat names of the first versions (``TRAINWARDEN_AGENT_TOKEN``,
``TRAINWARDEN_NODE_LOST_S``, ``port = 8765`` in a file...) keep working: ``LEGACY_NAMES``.
``trainwarden settings --markdown`` prints every setting
(``trainwarden.supervisor.cli.settings_reference``).
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import hashlib
import ipaddress
import json
import os
import tomllib
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from trainwarden.agent.core.bounds import bounded, check, cross_check
from trainwarden.supervisor.control.detection import DetectionConfig
from trainwarden.supervisor.control.evaluator import EvaluatorConfig
from trainwarden.supervisor.control.fleet_sync import FleetConfig
from trainwarden.supervisor.control.leader import LeaseConfig
from trainwarden.supervisor.control.policy import PolicyConfig
from trainwarden.supervisor.control.retention import RetentionConfig
from trainwarden.supervisor.control.retention import check as check_retention
from trainwarden.supervisor.detect import (
    HangConfig,
    LossSpikeConfig,
    NodeLostConfig,
    StragglerConfig,
    ThroughputConfig,
)
from trainwarden.supervisor.detect.disk import DiskConfig
from trainwarden.supervisor.detect.node_health import CordonConfig
from trainwarden.supervisor.detect.overload import OverloadConfig
from trainwarden.supervisor.store.db import StoreConfig
from trainwarden.supervisor.store.ingest import IngestConfig

ENV_PREFIX = "TRAINWARDEN_"
ENV_CONFIG = "TRAINWARDEN_CONFIG"


def hash_token(token: str) -> str:
    """Tokens are kept (and may be configured) only as ``sha256:<hex>`` digests."""
    if token.startswith("sha256:"):
        return token
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# the service's own sections


@dataclass(frozen=True)
class ServerConfig:
    SECTION: ClassVar[str] = "server"

    host: str = "127.0.0.1"  # listen address
    port: int = bounded(8765, ge=0, le=65535)  # listen port (0: any free port)
    # larger request bodies are refused with 413
    max_body_bytes: int = bounded(4 * 1024 * 1024, ge=1024)
    heartbeat_interval_s: float = bounded(1.0, gt=0)  # told to agents at registration
    log_level: str = "info"  # uvicorn's and the supervisor's log level

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class HttpConfig:
    """Slow and idle clients (the settings' ``http`` section)."""

    SECTION: ClassVar[str] = "http"

    # a request's headers complete within this (else 408)
    header_timeout_s: float = bounded(10.0, gt=0)
    body_timeout_s: float = bounded(30.0, gt=0)  # its body within this of the headers (else 408)
    keep_alive_s: int = bounded(5, ge=1)  # an idle keep-alive connection is closed after this
    # past this many open connections requests get 503
    max_connections: int = bounded(2048, ge=1)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class AuthConfig:
    SECTION: ClassVar[str] = "auth"

    # The token node agents write with (plain, or "sha256:<hex>" of it; hashed at load)
    agent_token: str | None = None
    # The token of operators: every read and write (plain or "sha256:<hex>")
    operator_token: str | None = None
    # The bootstrap admin token: everything, and the token commands (plain or "sha256:<hex>")
    admin_token: str | None = None
    # No tokens at all (allowed on a loopback host only)
    insecure_no_auth: bool = False
    public_reads: bool = False  # reads (API, dashboard, /metrics) without a token
    # Directories agents' checkpoint roots must lie in, separated by ':' as in PATH (for
    # example "/data/ckpt:/scratch"); empty: any directory but the system's
    checkpoint_roots_allowed: str = ""
    # Admit only run-scoped agent tokens (a shared cluster: one team's agents never reach
    # another team's runs); the bootstrap agent token, scoped to no run, is off
    scoped_agents_only: bool = False

    def __post_init__(self) -> None:
        # (the tokens themselves are never shown in a refusal)
        cross_check(not (self.insecure_no_auth and (self.agent_token or self.operator_token
                                                    or self.admin_token)),
                    self, "insecure_no_auth", "false when a token is set", got=True,
                    hint="drop --insecure-no-auth (tokens are then required) or drop the tokens")
        cross_check(not (self.agent_token and self.operator_token
                         and hash_token(self.agent_token) == hash_token(self.operator_token)),
                    self, "operator_token", "different from agent_token",
                    hint="the same token would grant agents operator rights; choose two "
                         "different tokens")
        cross_check(not (self.scoped_agents_only and self.agent_token), self, "agent_token",
                    "unset with scoped_agents_only",
                    hint="the bootstrap agent token is scoped to no run; drop it and mint a "
                         "run-scoped agent token per job (trainwarden token create NAME --role "
                         "agent --scope RUN)")
        for prefix in self.checkpoint_roots_allowed.split(":"):
            cross_check(not prefix.strip() or prefix.strip().startswith("/"), self,
                        "checkpoint_roots_allowed", "absolute directories separated by ':'",
                        got=self.checkpoint_roots_allowed,
                        hint=f"{prefix.strip()!r} is not an absolute path (for example "
                             "/data:/scratch)")
        cross_check(not (self.admin_token and any(
                        t and hash_token(t) == hash_token(self.admin_token)
                        for t in (self.agent_token, self.operator_token))),
                    self, "admin_token", "different from the agent and the operator token",
                    hint="the same token would grant admin rights; choose a different token")

    @property
    def agent_token_hash(self) -> str | None:
        return hash_token(self.agent_token) if self.agent_token else None

    @property
    def operator_token_hash(self) -> str | None:
        return hash_token(self.operator_token) if self.operator_token else None

    @property
    def admin_token_hash(self) -> str | None:
        return hash_token(self.admin_token) if self.admin_token else None


# ---------------------------------------------------------------------------------------------
# sections over some fields of a component's config


class _View(BaseModel):
    """A settings section over some fields of a component's dataclass: the types and defaults
    are the component's (``FIELDS``: this section's field -> the component's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    COMPONENT: ClassVar[type]
    FIELDS: ClassVar[dict[str, str]]

    def component_fields(self) -> dict[str, Any]:
        return {theirs: getattr(self, ours) for ours, theirs in self.FIELDS.items()}


def _view(name: str, component: type, fields: dict[str, str]) -> type[_View]:
    hints = typing.get_type_hints(component)
    defaults = component()
    # (the fields are built from the dataclass's hints, which pydantic's overloads cannot type)
    model = create_model(  # type: ignore[call-overload]
        name, __base__=_View,
        **{ours: (hints[theirs], getattr(defaults, theirs)) for ours, theirs in fields.items()})
    model.COMPONENT, model.FIELDS = component, fields
    return typing.cast(type[_View], model)


def _view_fields(view: Any) -> dict[str, Any]:
    return typing.cast(_View, view).component_fields()


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


_POLICY_FIELDS = [f.name for f in dataclasses.fields(PolicyConfig)]
_DETECTION_HINTS = typing.get_type_hints(DetectionConfig)
RollbackSection = _view("RollbackSection", PolicyConfig, {
    n.removeprefix("rollback_"): n for n in _POLICY_FIELDS if n.startswith("rollback_")})
RestartSection = _view("RestartSection", PolicyConfig, {
    n.removeprefix("restart_"): n for n in _POLICY_FIELDS if not n.startswith("rollback_")})
DetectionSection = _view("DetectionSection", DetectionConfig, {
    n: n for n, tp in _DETECTION_HINTS.items() if not _is_section(tp)})
_DETECTORS = [n for n, tp in _DETECTION_HINTS.items() if _is_section(tp)]


def _detector(name: str) -> Any:
    """The default of a detector section: the detector's config as DetectionConfig has it."""
    return Field(default_factory=lambda: getattr(DetectionConfig(), name))


# ---------------------------------------------------------------------------------------------
# the settings

# The flat names of the first versions -> (section, field).  They keep working as environment
# variables (TRAINWARDEN_ + the name), config file keys and keyword arguments.
LEGACY_NAMES: dict[str, tuple[str, str]] = {
    "data_dir": ("db", "data_dir"), "db_url": ("db", "url"),
    "host": ("server", "host"), "port": ("server", "port"),
    "max_body_bytes": ("server", "max_body_bytes"),
    "heartbeat_interval_s": ("server", "heartbeat_interval_s"),
    "log_level": ("server", "log_level"),
    **{f"http_{k}": ("http", k) for k in (
        "header_timeout_s", "body_timeout_s", "keep_alive_s", "max_connections")},
    "agent_token": ("auth", "agent_token"), "operator_token": ("auth", "operator_token"),
    "admin_token": ("auth", "admin_token"),
    "insecure_no_auth": ("auth", "insecure_no_auth"), "public_reads": ("auth", "public_reads"),
    "evaluator_interval_s": ("evaluator", "interval_s"),
    "restart_budget": ("restart", "budget"), "restart_backoff_s": ("restart", "backoff_s"),
    "restart_backoff_max_s": ("restart", "backoff_max_s"),
    "no_progress_restarts": ("restart", "no_progress_restarts"),
    "hang_floor_s": ("hang", "floor_s"), "hang_startup_s": ("hang", "startup_s"),
    "hang_warmup_s": ("hang", "warmup_s"), "node_lost_s": ("node_lost", "deadline_s"),
    "disk_low_ratio": ("disk", "low_ratio"),
    **{f"rollback_{k}": ("rollback", k) for k in (
        "budget", "margin_steps", "skip_before", "skip_batches", "lr_scale", "lr_steps",
        "lr_ramp_steps")},
}


def nest_legacy(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the flat names of ``LEGACY_NAMES`` moved into their sections (a value
    given in its section wins)."""
    out = {k: v for k, v in values.items() if k not in LEGACY_NAMES}
    for name, (section, key) in LEGACY_NAMES.items():
        if name in values:
            sec = out.get(section)
            if isinstance(sec, dict):
                sec.setdefault(key, values[name])
            elif sec is None:
                out[section] = {key: values[name]}
    return out


# The config file of the settings being built.  pydantic-settings builds sources from the class,
# so the file chosen at run time travels in a context variable instead of a global.
_config_data: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "trainwarden_config_data", default=None
)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a ``.toml`` or ``.json`` config file; raises ``ValueError`` saying what is wrong.

    The sections may be at top level or under ``supervisor`` (``[supervisor.hang]``)."""
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
    return cast(dict[str, Any], data)


class _FileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return nest_legacy(dict(_config_data.get() or {}))


class _EnvSource(EnvSettingsSource):
    """``TRAINWARDEN_SECTION_FIELD`` (pydantic-settings' nested variables, split once after
    the section), plus the flat names of ``LEGACY_NAMES``."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        env = dict(self.env_vars)
        prefix = ENV_PREFIX.lower()
        for name, (section, key) in LEGACY_NAMES.items():
            old, new = prefix + name, f"{prefix}{section}_{key}"
            if old != new and old in env:
                value = env.pop(old)
                env.setdefault(new, value)  # the section's own name wins
        self.env_vars = env


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SupervisorSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="_", env_nested_max_split=1,
        extra="forbid", validate_default=True, frozen=True,
    )

    server: ServerConfig = Field(default_factory=ServerConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    db: StoreConfig = Field(default_factory=StoreConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    evaluator: EvaluatorConfig = Field(default_factory=EvaluatorConfig)
    lease: LeaseConfig = Field(default_factory=LeaseConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    hang: HangConfig = _detector("hang")
    node_lost: NodeLostConfig = _detector("node_lost")
    disk: DiskConfig = _detector("disk")
    straggler: StragglerConfig = _detector("straggler")
    loss: LossSpikeConfig = _detector("loss")
    throughput: ThroughputConfig = _detector("throughput")
    overload: OverloadConfig = _detector("overload")
    cordon: CordonConfig = Field(default_factory=CordonConfig)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    # (built at import time: their types are not known to the type checker)
    detection: DetectionSection = Field(default_factory=DetectionSection)  # type: ignore[valid-type]
    restart: RestartSection = Field(default_factory=RestartSection)  # type: ignore[valid-type]
    rollback: RollbackSection = Field(default_factory=RollbackSection)  # type: ignore[valid-type]

    def __init__(self, **values: Any) -> None:
        super().__init__(**nest_legacy(values))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _EnvSource(settings_cls), _FileSource(settings_cls))

    @model_validator(mode="after")
    def _cross_section(self) -> SupervisorSettings:
        self.policy_config()  # its own rules (budgets, backoff, LR scale) raise ValueError
        check_retention(self.retention, self.detection_config())  # the kept window's floor
        auth = self.auth
        cross_check(bool(auth.agent_token or auth.operator_token or auth.admin_token
                         or auth.insecure_no_auth), auth, "agent_token",
                    "set (no token is configured)",
                    hint="set TRAINWARDEN_AGENT_TOKEN and TRAINWARDEN_OPERATOR_TOKEN (or "
                         "agent_token/operator_token in the [auth] table of the config file), "
                         "or pass --insecure-no-auth to run without authentication on a "
                         "loopback address")
        cross_check(not auth.insecure_no_auth or _is_loopback(self.server.host), self.server,
                    "host", "a loopback address with --insecure-no-auth",
                    got=self.server.host,
                    hint="configure agent_token and operator_token to listen on other "
                         "addresses")
        return self

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(**_view_fields(self.restart), **_view_fields(self.rollback))

    def detection_config(self) -> DetectionConfig:
        return DetectionConfig(**{name: getattr(self, name) for name in _DETECTORS},
                               **_view_fields(self.detection))

    @property
    def database_url(self) -> str:
        return self.db.database_url


def load_settings(
    config_file: str | Path | None = None, **overrides: Any
) -> SupervisorSettings:
    """Build settings from overrides (``None`` values are dropped; a section's values as a
    dict, or the flat names of ``LEGACY_NAMES``), the environment and the config file.

    Raises ``ValueError`` (pydantic's ``ValidationError`` is one) naming the bad setting."""
    path = config_file or os.environ.get(ENV_CONFIG) or None
    data = read_config_file(path) if path else None
    token = _config_data.set(data)
    try:
        return SupervisorSettings(**{k: v for k, v in overrides.items() if v is not None})
    finally:
        _config_data.reset(token)


# ---------------------------------------------------------------------------------------------
# the fields, for flags and the reference


@dataclass(frozen=True)
class Setting:
    section: str
    name: str
    type: Any  # the field's type, Optional unwrapped
    default: Any
    owner: type  # the class that declares the field (for its comment)
    owner_field: str  # the field's name there

    @property
    def flag(self) -> str:
        return f"--{self.section}-{self.name}".replace("_", "-")

    @property
    def env(self) -> str:
        return f"{ENV_PREFIX}{self.section}_{self.name}".upper()

    @property
    def dest(self) -> str:
        return f"{self.section}__{self.name}"

    @property
    def legacy(self) -> list[str]:
        """Today's other names of this setting (environment variable spelling)."""
        return [f"{ENV_PREFIX}{n}".upper() for n, (s, f) in LEGACY_NAMES.items()
                if (s, f) == (self.section, self.name) and
                f"{ENV_PREFIX}{n}".upper() != self.env]


def _unwrap(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def settings_fields() -> Iterator[Setting]:
    """Every field of every section, in the model's order."""
    for section, info in SupervisorSettings.model_fields.items():
        cls = info.annotation
        assert isinstance(cls, type)
        value = info.get_default(call_default_factory=True)
        if issubclass(cls, _View):
            hints = typing.get_type_hints(cls.COMPONENT)
            for ours, theirs in cls.FIELDS.items():
                yield Setting(section, ours, _unwrap(hints[theirs]), getattr(value, ours),
                              cls.COMPONENT, theirs)
        else:
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                yield Setting(section, f.name, _unwrap(hints[f.name]), getattr(value, f.name),
                              cls, f.name)


_FLAG_ALIASES = {("server", "host"): "--host", ("server", "port"): "--port",
                 ("server", "log_level"): "--log-level", ("auth", "public_reads"): "--public-reads",
                 ("auth", "insecure_no_auth"): "--insecure-no-auth", ("db", "url"): "--db",
                 ("db", "data_dir"): "--data-dir", ("fleet", "backend"): "--fleet"}


def add_flags(parser: argparse.ArgumentParser, sections: tuple[str, ...] | None = None,
              describe: Callable[[Setting], str] | None = None) -> None:
    """A flag for every field (of ``sections``, or all): ``--SECTION-FIELD`` (and the short
    names of the first versions: ``--host``, ``--port``, ``--db``...)."""
    for s in settings_fields():
        if sections is not None and s.section not in sections:
            continue
        names = [s.flag]
        alias = _FLAG_ALIASES.get((s.section, s.name))
        if alias and alias != s.flag:
            names.append(alias)
        text = (describe(s) if describe else "").replace("%", "%%")
        if s.type is bool:
            parser.add_argument(*names, dest=s.dest, default=None,
                                action=argparse.BooleanOptionalAction, help=text)
        else:
            kind = s.type if s.type in (int, float, str, Path) else str
            parser.add_argument(*names, dest=s.dest, default=None, type=kind,
                                metavar=s.name.upper(), help=text)


def flag_values(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags given on the command line (by ``add_flags``), as sections of values."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "__" in key and value is not None:
            section, name = key.split("__", 1)
            out.setdefault(section, {})[name] = value
    return out
