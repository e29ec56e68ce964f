"""One rule for a run's name and one parser of the supervisor's address(es), both sides."""

from __future__ import annotations

import re

import pytest

from trainwarden.agent.config import AgentConfig
from trainwarden.agent.core.names import (
    RUN_NAME_MAX,
    RUN_NAME_PATTERN,
    RUN_SCOPE_PATTERN,
    is_run_name,
    supervisor_urls,
)


@pytest.mark.parametrize("text, urls", [
    ("http://a:8765", ["http://a:8765"]),
    ("http://a:8765/", ["http://a:8765"]),
    (" https://a/ , http://b:1 ,, ", ["https://a", "http://b:1"]),
])
def test_supervisor_urls_are_split_stripped_and_kept_in_order(text: str, urls: list[str]
                                                              ) -> None:
    assert supervisor_urls(text) == urls


@pytest.mark.parametrize("text", ["", " ", ",", " , "])
def test_no_address_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="at least one http:// or https:// URL"):
        supervisor_urls(text)


@pytest.mark.parametrize("text, bad", [
    ("localhost:8765", "'localhost:8765'"),
    ("http://a, ftp://b", "'ftp://b'"),
])
def test_an_address_that_is_not_http_is_named(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match=f"http:// or https:// URL.*got {re.escape(bad)}"):
        supervisor_urls(text)


def test_the_agent_and_the_client_parse_addresses_alike(
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = AgentConfig(supervisor_url=" http://a/ ,http://b ", run="r", command=["x"])
    assert cfg.supervisor_url == "http://a,http://b"
    with pytest.raises(ValueError, match="got 'a:1'"):
        AgentConfig(supervisor_url="a:1", run="r", command=["x"])
    from trainwarden.supervisor.cli import main as cli
    assert cli.main(["runs", "--supervisor", "a:1"]) == 1
    assert "got 'a:1'" in capsys.readouterr().err


@pytest.mark.parametrize("name, ok", [
    ("llama-7b", True), ("a.b_c-1", True), ("7", True), ("x" * RUN_NAME_MAX, True),
    ("", False), ("-a", False), (".a", False), ("a b", False), ("a/b", False), ("a*", False),
    ("x" * (RUN_NAME_MAX + 1), False),
])
def test_one_run_name_rule(name: str, ok: bool) -> None:
    assert is_run_name(name) is ok
    assert (re.match(RUN_NAME_PATTERN, name) is not None) is (ok or len(name) > RUN_NAME_MAX)
    if ok:  # a token's scope: a run's name, or a prefix of names ending in '*'
        assert re.match(RUN_SCOPE_PATTERN, name) and re.match(RUN_SCOPE_PATTERN, name + "*")
    assert re.match(RUN_SCOPE_PATTERN, "*") is None


def test_the_agent_refuses_a_run_name_the_supervisor_would() -> None:
    with pytest.raises(ValueError, match="letters, digits"):
        AgentConfig(supervisor_url="http://a", run="a/b", command=["x"])
    with pytest.raises(ValueError, match=f"at most {RUN_NAME_MAX} characters"):
        AgentConfig(supervisor_url="http://a", run="x" * (RUN_NAME_MAX + 1), command=["x"])
