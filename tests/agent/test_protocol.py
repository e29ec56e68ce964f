from __future__ import annotations

import json

import pytest

from trainwarden.agent.protocol import (
    LRSchedule,
    ResumePlan,
    decode_datagram,
    encode_datagram,
    normalize_ranges,
)


def test_lr_schedule_scale_then_linear_ramp() -> None:
    s = LRSchedule(0.5, steps=2, ramp_steps=4, start_step=10)
    assert [s.factor(i) for i in range(9, 18)] == [1.0, 0.5, 0.5, 0.625, 0.75, 0.875, 1.0, 1.0,
                                                   1.0]
    assert s.end_step() == 16
    assert LRSchedule(0.1, steps=3, start_step=0).factor(3) == 1.0  # no ramp: straight back


def test_resume_plan_round_trip() -> None:
    plan = ResumePlan(checkpoint="/ck/step_40", skip=((5, 9),), lr=LRSchedule(0.5, 10, 5),
                      attempt=3, reason="loss spike", action_id=7)
    again = ResumePlan.from_json(plan.to_json())
    assert again == plan


@pytest.mark.parametrize("doc, msg", [
    ("[]", "JSON object"), ("{", "not JSON"), ('{"bogus": 1}', "unknown fields"),
    ('{"skip": [[3, 1]]}', "0 <= from <= to"), ('{"skip": [[1]]}', "two integers"),
    ('{"skip": 5}', "list of"), ('{"lr": {"scale": 0}}', '"scale" and "steps"'),
    ('{"lr": {"scale": 0, "steps": 3}}', "lr scale"), ('{"version": 9}', "version 9"),
    ('{"checkpoint": 5}', "path or null"),
])
def test_bad_plans_are_refused_with_the_reason(doc: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        ResumePlan.from_json(doc)


def test_ranges_merge() -> None:
    assert normalize_ranges([[10, 20], [1, 2], [3, 4], [15, 30]]) == [(1, 4), (10, 30)]


def test_datagrams() -> None:
    msg = {"type": "step", "step": 1, "loss": float("inf")}
    assert decode_datagram(encode_datagram(msg))["loss"] == float("inf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a JSON"):
        decode_datagram(b"\xff")
    with pytest.raises(ValueError, match="not a step"):
        decode_datagram(json.dumps({"type": "other"}).encode())
