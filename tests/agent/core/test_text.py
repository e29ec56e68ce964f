"""The one rule for untrusted text (``trainwarden.agent.core.text``): what a worker or an agent
sends as
free text is kept, made harmless: controls escaped, lone surrogates replaced, cut with a
marker."""

from __future__ import annotations

import json

from trainwarden.agent.core.text import (
    DEPTH_MARKER,
    MAX_DEPTH,
    clean,
    clean_json,
    is_clean,
    without_surrogates,
)


def test_controls_are_escaped_and_the_lines_of_free_text_kept() -> None:
    assert clean("a\x00b\x1b[31mc\x7f\x9bd\te\r\nf") == "a\\x00b\\x1b[31mc\\x7f\\x9bd\te\r\nf"
    assert clean("a\tb\nc", multiline=False) == "a\\x09b\\x0ac"


def test_a_lone_surrogate_becomes_the_replacement_character() -> None:
    out = clean("a\ud800b\udc80")
    assert out == "a\ufffdb\ufffd" and out.encode("utf-8")


def test_over_long_text_is_cut_to_its_bound_with_the_count_cut() -> None:
    for n, bound in ((50, 30), (20_000, 16_384), (10, 5)):
        out = clean("x" * n, bound)
        kept, _, marker = out.partition("... [")
        assert len(out) <= bound
        if marker:
            assert len(kept) + int(marker.split()[0]) == n
    assert clean("short", 10) == "short"


def test_every_string_of_a_json_object_is_cleaned_keys_too_and_nesting_bounded() -> None:
    deep: object = "leaf"
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    out = clean_json({"k\x00": ["\x1b", {"n": 1.5, "b": True}], "deep": deep})
    assert out["k\\x00"] == ["\\x1b", {"n": 1.5, "b": True}]
    assert DEPTH_MARKER in json.dumps(out) and "leaf" not in json.dumps(out)
    assert json.dumps(out).encode()


def test_what_the_agent_forwards_loses_only_its_lone_surrogates() -> None:
    item = {"type": "event", "name": "x\x00", "message": "m\ud800", "details": {"\udc80": 1}}
    out = without_surrogates(item)
    assert out == {"type": "event", "name": "x\x00", "message": "m\ufffd",
                   "details": {"\ufffd": 1}}
    json.dumps(out, ensure_ascii=False).encode("utf-8")  # (would raise with a surrogate)
    assert is_clean("plain\ttext\n") and not is_clean("\x00") and not is_clean("\ud800")
