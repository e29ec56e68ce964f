"""``agent/protocol.py`` (TypedDicts, what the agent sends and reads: the wire's definition)
against ``supervisor/contract/wire.py`` (pydantic, what the supervisor validates and answers
with): every field of each message, nested ones included, is on both sides with a compatible
type, so the two cannot drift apart unnoticed."""

from __future__ import annotations

import enum
import hashlib
import json
import random
import types
import typing
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel

from trainwarden.agent import protocol
from trainwarden.agent.core.states import COMMAND_RESULTS
from trainwarden.supervisor.contract import wire

# protocol TypedDict -> the pydantic model the supervisor validates it with (or answers with)
PAIRS: dict[Any, type[BaseModel]] = {
    protocol.StepReport: wire.StepItem,
    protocol.WorkerEvent: wire.EventItem,
    protocol.CheckpointReport: wire.CheckpointItem,
    protocol.HeartbeatItem: wire.HeartbeatItem,
    protocol.ExitItem: wire.ExitItem,
    protocol.CommandResultItem: wire.CommandResultItem,
    protocol.IngestBatch: wire.IngestBatch,
    protocol.RegisterRequest: wire.RegisterRequest,
    protocol.RegisterReply: wire.RegisterReply,
    protocol.Command: wire.CommandOut,
    protocol.IngestReply: wire.IngestReply,
    protocol.MembershipView: wire.MembershipOut,
    protocol.FailedRank: wire.FailedRank,
    protocol.RootCause: wire.RootCause,
    protocol.RootFrame: wire.RootFrame,
}


def shape(tp: Any) -> Any:
    """A type reduced to what both sides can express: optionality and constraints dropped,
    enums as the set of their values."""
    origin = get_origin(tp)
    if origin in (Annotated, typing.NotRequired, typing.Required):
        return shape(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return shape(args[0])
        return ("union", frozenset(shape(a) for a in args))
    if origin is Literal:
        return ("literal", frozenset(str(v) for v in get_args(tp)))
    if origin in (list, tuple):
        return ("list", shape(get_args(tp)[0]))
    if origin is dict or tp is dict:
        return "object"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return ("literal", frozenset(str(m.value) for m in tp))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return ("model", tp)
    if typing.is_typeddict(tp):
        return ("typeddict", tp)
    return tp


def compatible(ours: Any, theirs: Any) -> bool:
    """``ours``: the protocol's shape, ``theirs``: the wire model's."""
    if ours == theirs or ours is Any or theirs is Any:
        return True
    if theirs is str and isinstance(ours, tuple) and ours[0] == "literal":
        return True  # a state or kind a newer agent sends is stored as it is
    if isinstance(theirs, tuple) and theirs[0] == "literal":
        # The supervisor may accept fewer values than the protocol's type allows, never others.
        if ours is str:
            return True
        return isinstance(ours, tuple) and ours[0] == "literal" and theirs[1] <= ours[1]
    if isinstance(ours, tuple) and isinstance(theirs, tuple):
        if ours[0] == theirs[0] == "list":
            return compatible(ours[1], theirs[1])
        if ours[0] == "typeddict" and theirs[0] == "model":
            return PAIRS.get(ours[1]) is theirs[1]
    if ours == "object":  # a plain JSON object: the supervisor validates each kind by model
        return isinstance(theirs, tuple) and theirs[0] in ("model", "union")
    return False


@pytest.mark.parametrize("typed, model", PAIRS.items(), ids=[t.__name__ for t in PAIRS])
def test_protocol_and_wire_models_agree(typed: Any, model: type[BaseModel]) -> None:
    ours = get_type_hints(typed, include_extras=True)
    theirs = {name: f.annotation for name, f in model.model_fields.items()}
    assert sorted(set(ours) - set(theirs)) == [], f"{model.__name__} lacks protocol fields"
    assert sorted(set(theirs) - set(ours)) == [], f"{typed.__name__} lacks wire fields"
    bad = {name: (ours[name], theirs[name]) for name in ours
           if not compatible(shape(ours[name]), shape(theirs[name]))}
    assert bad == {}, "types differ"


def test_every_item_kind_of_a_batch_has_its_protocol_message() -> None:
    """The batch's item union holds exactly the models paired with a protocol message."""
    (item,) = get_args(wire.IngestBatch.model_fields["items"].annotation)
    kinds = set(get_args(get_args(item)[0]))
    assert kinds == {wire.StepItem, wire.EventItem, wire.CheckpointItem, wire.HeartbeatItem,
                     wire.ExitItem, wire.CommandResultItem}
    assert kinds <= set(PAIRS.values())


def test_every_model_of_the_wire_has_its_protocol_definition() -> None:
    """A model added to the supervisor's side of the wire without its TypedDict in the
    agent's protocol is a drift too."""
    models = {m for m in vars(wire).values()
              if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == wire.__name__
              and not m.__name__.startswith("_")}
    assert sorted(m.__name__ for m in models - set(PAIRS.values())) == []


def test_the_check_sees_a_drift() -> None:
    """A field added on one side only, or with another type, is caught."""

    class Drifted(protocol.CommandResultItem, total=False):
        extra: int

    ours = get_type_hints(Drifted, include_extras=True)
    assert set(ours) - set(wire.CommandResultItem.model_fields) == {"extra"}
    assert not compatible(shape(ours["command_id"]), shape(str))
    assert not compatible(shape(Literal["a", "b"]), shape(Literal["a", "c"]))


def test_what_an_agent_may_report_about_a_command_is_what_the_supervisor_accepts() -> None:
    accepted = get_args(wire.CommandResultItem.model_fields["status"].annotation)
    assert set(accepted) == set(COMMAND_RESULTS)


# -- the content digest -----------------------------------------------------------------------


def _reference_digest(batch: wire.IngestBatch) -> str:
    """The digest's definition (what every stored ``ingested_batches.digest`` was made of)."""
    data = batch.model_dump_json(include={"attempt", "items"}, exclude_defaults=True)
    return hashlib.blake2b(data.encode(), digest_size=16).hexdigest()


def _random_items(rng: random.Random) -> list[dict[str, Any]]:
    num = [0.0, -0.0, 1.5, 1e-7, 1e300, float("nan"), float("inf"), float("-inf"), None]
    out: list[dict[str, Any]] = []
    for _ in range(rng.randrange(0, 12)):
        kind = rng.choice(["step", "step", "event", "checkpoint", "heartbeat", "exit",
                           "command_result"])
        if kind == "step":
            it: dict[str, Any] = {"type": "step", "rank": rng.randrange(9), "step": rng.randrange(
                99), "loss": rng.choice(num), "grad_norm": rng.choice(num),
                "samples": rng.choice([None, 0, 8]), "t": rng.choice([None, 1.25, 1e9])}
            if rng.random() < 0.5:
                it.update(attempt=rng.choice([None, 0, 2]), v=1, data_s=0.01, dropped=0,
                          world_size=8, batch_index=2**40)
        elif kind == "event":
            it = {"type": "event", "name": rng.choice(["started", "ünïcode ✓"]),
                  "message": rng.choice(["", "a \"quoted\" line\\"]),
                  "details": rng.choice([{}, {"x": [1, 2.5, None, "s"], "y": {"z": True}}])}
        elif kind == "checkpoint":
            it = {"type": "checkpoint", "step": 3, "path": "ckpt/step-3",
                  "async_save": rng.random() < 0.5, "complete": rng.random() < 0.5,
                  "lineage": rng.choice([None, "main"]), "save_s": rng.choice([None, 2.0])}
        elif kind == "heartbeat":
            it = {"type": "heartbeat", "state": rng.choice(["running", "idle"]),
                  "workers": rng.choice([[], [{"rank": 0, "cpu_percent": 99.5}]]),
                  "gpus": rng.choice([None, {"available": False, "reason": "no nvml"}])}
        elif kind == "exit":
            it = {"type": "exit", "outcome": "crashed", "exit_code": rng.choice([None, 1]),
                  "failed_ranks": rng.choice([[], [{"rank": 1, "message": "boom",
                                                     "extra_key": [1, {"k": "v"}]}]])}
        else:
            it = {"type": "command_result", "command_id": 4,
                  "status": rng.choice(["delivered", "done"]), "detail": rng.choice(["", "ok"])}
        out.append(it)
    return out


def test_the_content_digest_is_its_definition_for_every_kind_of_batch() -> None:
    """The digest is assembled item by item for speed; it must hash exactly the text of its
    definition, or a replay of a batch stored by an earlier version would be refused as a
    conflict (409) instead of answered as a duplicate."""
    rng = random.Random(11)
    kinds: set[str] = set()
    for _ in range(400):
        body = {"agent_id": 1, "seq": rng.randrange(5), "attempt": rng.choice([0, 0, 3]),
                "sent_at": rng.choice([None, 2.5]), "dropped": rng.choice([0, 4]),
                "items": _random_items(rng)}
        if rng.random() < 0.2:
            del body["items"]
        batch = wire.IngestBatch.model_validate_json(json.dumps(body))
        kinds.update(it.type for it in batch.items)
        assert batch.content_digest() == _reference_digest(batch), body
    assert kinds == {"step", "event", "checkpoint", "heartbeat", "exit", "command_result"}


def test_the_content_digest_ignores_when_and_how_a_batch_was_sent() -> None:
    items = [{"type": "step", "rank": 0, "step": 1, "loss": float("nan")}]
    one = wire.IngestBatch.model_validate({"agent_id": 1, "seq": 0, "items": items})
    later = wire.IngestBatch.model_validate({"agent_id": 1, "seq": 0, "items": items,
                                             "sent_at": 99.0, "dropped": 3})
    other = wire.IngestBatch.model_validate({"agent_id": 1, "seq": 0, "items": [
        {**items[0], "loss": None}]})
    assert one.content_digest() == later.content_digest()
    assert one.content_digest() != other.content_digest()  # a NaN loss is not a missing one


@pytest.mark.parametrize("source", [{"a": 1}, ["x"], 3, None, "a-newer-agents-source"])
def test_a_root_cause_source_the_supervisor_does_not_know_is_dropped_not_a_500(
        source: Any) -> None:
    """Whatever an agent puts in a failed rank's root cause ``source`` (a value of a newer
    agent, or garbage), the exit is kept and only the source is dropped."""
    from trainwarden.supervisor.contract.wire import RootCause

    rc = RootCause.model_validate({"exc_type": "KeyError", "source": source})
    assert rc.source is None and rc.exc_type == "KeyError"


@pytest.mark.parametrize("mark", [3, ["x"], {"a": 1}])
def test_a_launcher_mark_that_does_not_validate_is_dropped_and_the_exit_kept(mark: Any) -> None:
    """``launcher`` only says the failure was torchrun's own: garbage there drops the mark,
    never the exit report."""
    item = wire.ExitItem.model_validate({
        "type": "exit", "t": 1.0, "attempt": 0, "exit_code": 1, "signal": None,
        "outcome": "crashed", "failed_ranks": [{"rank": None, "exit_code": 1, "launcher": mark,
                                                "root_cause": {"exc_type": "OSError"}}]})
    (f,) = item.failed_ranks
    assert f.launcher is None and f.root_cause is not None and f.exit_code == 1
    assert wire.FailedRank.model_validate({"launcher": True}).launcher is True
