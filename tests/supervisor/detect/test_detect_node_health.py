"""The node-health rule and what counts as evidence (``detect.node_health``): pure, the clock
passed in, on synthetic evidence and incidents."""

from __future__ import annotations

from typing import Any

import pytest

from trainwarden.supervisor.detect.node_health import (
    CordonConfig,
    Evidence,
    disk_fault,
    gpu_evidence,
    incident_evidence,
    judge,
    preflight_result,
)
from trainwarden.supervisor.enums import EvidenceKind, IncidentKind

DAY = 86400.0
NOW = 1_000_000.0
CFG = CordonConfig()


def ev(i: int, kind: str, t: float, **detail: Any) -> Evidence:
    return Evidence(id=i, kind=kind, t=t, attempt=i, detail={"run": "llm", **detail})


def crash_at(i: int, t: float) -> Evidence:
    return ev(i, EvidenceKind.INFRA_FAILURE, t, what="crash (killed by signal 9)")


# --- the rule ---------------------------------------------------------------------------------


def test_two_infrastructure_failures_within_the_window_cordon() -> None:
    v = judge([crash_at(1, NOW - 3600), crash_at(2, NOW - 60)], now=NOW, cfg=CFG)
    assert v is not None and v.rule == "infra_failures"
    assert v.evidence_ids == (1, 2)
    assert v.reason.startswith("2 infrastructure failures within 24 h: crash (killed by "
                               "signal 9) at ")
    assert "(run llm, attempt 1)" in v.reason and "(run llm, attempt 2)" in v.reason


def test_two_failures_further_apart_than_the_window_do_not() -> None:
    assert judge([crash_at(1, NOW - DAY - 1), crash_at(2, NOW)], now=NOW, cfg=CFG) is None
    assert judge([crash_at(1, NOW)], now=NOW, cfg=CFG) is None
    # a shorter window is the setting's
    short = CordonConfig(window_s=600)
    assert judge([crash_at(1, NOW - 700), crash_at(2, NOW)], now=NOW, cfg=short) is None
    v = judge([crash_at(1, NOW - 500), crash_at(2, NOW)], now=NOW, cfg=short)
    assert v is not None and "within 10 min" in v.reason


def test_a_hang_culprit_counts_as_an_infrastructure_failure() -> None:
    v = judge([crash_at(1, NOW - 60), ev(2, EvidenceKind.HANG_CULPRIT, NOW, what="hang")],
              now=NOW, cfg=CFG)
    assert v is not None and v.evidence_ids == (1, 2)


def test_collective_timeouts_can_be_left_out() -> None:
    ct = ev(2, EvidenceKind.INFRA_FAILURE, NOW, incident_kind="collective_timeout")
    assert judge([crash_at(1, NOW - 60), ct], now=NOW, cfg=CFG) is not None
    off = CordonConfig(collective_timeouts=False)
    assert judge([crash_at(1, NOW - 60), ct], now=NOW, cfg=off) is None


def test_any_uncorrected_ecc_error_cordons() -> None:
    v = judge([ev(7, EvidenceKind.ECC, NOW, count=1, what="1 new uncorrected ECC error(s) "
                                                          "on GPU 3")], now=NOW, cfg=CFG)
    assert v is not None and v.rule == "ecc_errors" and v.evidence_ids == (7,)
    assert "GPU 3" in v.reason
    assert judge([ev(7, EvidenceKind.ECC, NOW, count=1)], now=NOW,
                 cfg=CordonConfig(ecc_errors=0)) is None
    # a threshold counts errors, not readings
    three = CordonConfig(ecc_errors=3)
    assert judge([ev(7, EvidenceKind.ECC, NOW, count=2)], now=NOW, cfg=three) is None
    assert judge([ev(7, EvidenceKind.ECC, NOW, count=2), ev(8, EvidenceKind.ECC, NOW, count=1)],
                 now=NOW, cfg=three) is not None


def test_a_failed_preflight_cordons_and_names_itself_first() -> None:
    pf = ev(9, EvidenceKind.PREFLIGHT_FAILED, NOW, what="failed a preflight (nccl_allreduce)")
    v = judge([crash_at(1, NOW - 60), crash_at(2, NOW - 30), pf], now=NOW, cfg=CFG)
    assert v is not None and v.rule == "on_failed_preflight" and v.evidence_ids == (9,)
    assert "nccl_allreduce" in v.reason
    assert judge([pf], now=NOW, cfg=CordonConfig(on_failed_preflight=False)) is None


def test_stragglers_disk_errors_and_passed_preflights_do_not_cordon_by_default() -> None:
    quiet = [ev(i, k, NOW - i) for i, k in enumerate(
        [EvidenceKind.STRAGGLER] * 3 + [EvidenceKind.DISK_ERROR] * 3
        + [EvidenceKind.PREFLIGHT_PASSED] * 3)]
    assert judge(quiet, now=NOW, cfg=CFG) is None
    v = judge(quiet, now=NOW, cfg=CordonConfig(stragglers=2))
    assert v is not None and v.rule == "stragglers"
    v = judge(quiet, now=NOW, cfg=CordonConfig(disk_errors=3))
    assert v is not None and v.rule == "disk_errors"


def test_the_settings_are_bounded() -> None:
    with pytest.raises(ValueError, match=r"cordon.window_s must be > 0"):
        CordonConfig(window_s=0)
    with pytest.raises(ValueError, match=r"cordon.infra_failures must be >= 0"):
        CordonConfig(infra_failures=-1)


# --- what counts, and as what -----------------------------------------------------------------


def frame(file: str) -> dict[str, Any]:
    return {"file": file, "line": 57, "function": "f"}


def crash_details(exc: str, msg: str, *, user: bool, cls: str) -> dict[str, Any]:
    f = frame("/home/u/train.py" if user else "/usr/lib/python3/site-packages/torch/x.py")
    return {"failure_class": cls,
            "root_cause": {"exc_type": exc, "message": msg, "frame": f,
                           "user_frame": f if user else None, "traceback": ""}}


def crash(details: dict[str, Any], **kw: Any) -> list[Any]:
    return incident_evidence(IncidentKind.CRASH, node="n1", rank=3, cause="worker died",
                             details=details, rank_nodes={}, **kw)


def test_a_user_code_crash_is_never_evidence() -> None:
    assert crash(crash_details("KeyError", "'label'", user=True, cls="user_code")) == []


def test_a_machine_crash_is_evidence_against_its_node() -> None:
    (f,) = crash(crash_details("torch.distributed.DistBackendError", "NCCL error: unhandled "
                               "system error", user=False, cls="machine"))
    assert (f.node, f.kind) == ("n1", EvidenceKind.INFRA_FAILURE)
    assert f.detail["what"].startswith("crash (torch.distributed.DistBackendError: NCCL")
    assert f.detail["rank"] == 3
    (f,) = crash({"failure_class": "machine", "root_cause": None}, signal=9)
    assert f.detail["what"] == "crash (killed by signal 9)"


def test_unknown_oom_and_a_lost_peer_are_not_evidence() -> None:
    assert crash({"failure_class": "unknown", "root_cause": None}, exit_code=1) == []
    assert crash({}) == []  # an incident from before the classification
    assert crash(crash_details("torch.OutOfMemoryError", "CUDA out of memory. Tried to "
                               "allocate 2 GiB", user=False, cls="machine")) == []
    assert crash(crash_details("RuntimeError", "[pair.cc:537] Read error: Connection reset "
                               "by peer", user=False, cls="machine")) == []


def test_a_collective_timeout_and_a_straggler_name_their_node() -> None:
    (f,) = incident_evidence(IncidentKind.COLLECTIVE_TIMEOUT, node="n2", rank=5, cause="x",
                             details={"collective": "all_reduce"}, rank_nodes={})
    assert (f.node, f.kind) == ("n2", EvidenceKind.INFRA_FAILURE)
    assert f.detail["incident_kind"] == "collective_timeout"
    assert "all_reduce" in f.detail["what"]
    (f,) = incident_evidence(IncidentKind.STRAGGLER, node="n2", rank=5, cause="slow",
                             details={}, rank_nodes={})
    assert f.kind == EvidenceKind.STRAGGLER
    assert incident_evidence(IncidentKind.NODE_LOST, node="n2", rank=None, cause="lost",
                             details={}, rank_nodes={}) == []


def test_a_hang_counts_against_the_nodes_of_the_culprits_that_did_not_answer() -> None:
    culprit = {"ranks": [1, 2, 3], "reason": "...",
               "per_rank": {"0": {"state": "collective"}, "1": {"state": "elsewhere"},
                            "2": {"state": "no_dump"}, "3": {"state": "no_dump"}}}
    nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    found = incident_evidence(IncidentKind.HANG, node="b", rank=2, cause="hang",
                              details={"culprit": culprit}, rank_nodes=nodes)
    assert [(f.node, f.kind, f.detail["ranks"]) for f in found] == [
        ("b", EvidenceKind.HANG_CULPRIT, [2, 3])]
    # before the stacks came: no culprit, no evidence
    assert incident_evidence(IncidentKind.HANG, node="b", rank=2, cause="hang", details={},
                             rank_nodes=nodes) == []
    # a culprit in the script's own code is the script's business
    elsewhere = {**culprit, "ranks": [1]}
    assert incident_evidence(IncidentKind.HANG, node="a", rank=1, cause="hang",
                             details={"culprit": elsewhere}, rank_nodes=nodes) == []


def test_preflight_results_and_disk_faults() -> None:
    assert preflight_result({"passed": True}) is True
    assert preflight_result({"passed": False, "failed": "gpu_burn"}) is False
    assert preflight_result({"passed": "no"}) is None and preflight_result({}) is None
    assert disk_fault("OSError: [Errno 5] Input/output error: '/ck/step_10/rank0.pt'")
    assert disk_fault("OSError: [Errno 30] Read-only file system: '/ck'")
    assert not disk_fault("OSError: [Errno 28] No space left on device")
    assert not disk_fault("PicklingError: Can't pickle <lambda>")
    # The worker's reason, where it gives one, decides (its message may name any path).
    assert not disk_fault("checkpoint disk full on node n0: ... [Errno 5]", "disk_full")
    assert disk_fault("checkpoint file system read-only on node n0", "read_only")
    assert disk_fault("checkpoint disk I/O error on node n0", "io_error")
    assert not disk_fault("checkpoint directory gone on node n0", "vanished")


def test_a_crash_on_a_full_checkpoint_disk_is_no_evidence_against_the_node() -> None:
    details = {"failure_class": "storage", "root_cause": {
        "exc_type": "torch.distributed.checkpoint.api.CheckpointException",
        "message": "CheckpointException ranks:dict_keys([0, 1])", "frame": None,
        "user_frame": None, "traceback": "OSError: [Errno 28] No space left on device"}}
    assert incident_evidence(IncidentKind.CRASH, node="n0", rank=0, cause="disk full",
                             details=details, rank_nodes={}, exit_code=1) == []


def reading(*devices: dict[str, Any]) -> dict[str, Any]:
    return {"available": True, "devices": list(devices)}


def test_gpu_counters_are_evidence_when_they_grow() -> None:
    found, kept = gpu_evidence(reading({"index": 0, "ecc_uncorrected": 0},
                                       {"index": 1, "ecc_uncorrected": 2}), {})
    assert [(k, d["gpu"], d["count"]) for k, d in found] == [(EvidenceKind.ECC, "1", 2)]
    assert kept["ecc"] == {"0": 0, "1": 2}
    # read again: nothing new
    again, kept2 = gpu_evidence(reading({"index": 0, "ecc_uncorrected": 0},
                                        {"index": 1, "ecc_uncorrected": 2}), kept)
    assert again == [] and kept2 == kept
    # one more on GPU 1; GPU 0 not read this time keeps its count
    more, kept3 = gpu_evidence(reading({"index": 0, "ecc_uncorrected": None},
                                       {"index": 1, "ecc_uncorrected": 3}), kept2)
    assert [(d["gpu"], d["count"], d["total"]) for _, d in more] == [("1", 1, 3)]
    assert kept3["ecc"] == {"0": 0, "1": 3}
    # a driver reload resets the volatile count: the new base, no evidence
    reset, kept4 = gpu_evidence(reading({"index": 1, "ecc_uncorrected": 0}), kept3)
    assert reset == [] and kept4["ecc"]["1"] == 0


def test_xid_errors_are_evidence_with_the_newest_code() -> None:
    found, kept = gpu_evidence(reading({"index": 2, "xid_errors": 1, "xid_last": 79}), {})
    ((kind, d),) = found
    assert kind == EvidenceKind.XID and d["xid_last"] == 79 and "XID 79" in d["what"]
    assert kept["xid"] == {"2": 1}
    assert gpu_evidence({"available": False, "reason": "no NVML"}, kept)[0] == []


def test_silent_data_corruption_on_the_same_node_twice_cordons_it() -> None:
    """The incident that names a rank is evidence against its node; one is a transient
    (rolled back), the second within the window a persistent fault of the machine."""
    details = {"corrupt": [2], "first_disagreement": 200}
    (found,) = incident_evidence(IncidentKind.SDC, node="node1", rank=2,
                                 cause="silent data corruption: ...", details=details,
                                 rank_nodes={2: "node1"})
    assert (found.node, found.kind) == ("node1", EvidenceKind.SDC)
    # two replicas: no rank named, no node to hold it against
    assert incident_evidence(IncidentKind.SDC, node=None, rank=None, cause="", details={},
                             rank_nodes={}) == []
    sdc = [ev(1, EvidenceKind.SDC, NOW - 3600, what="silent data corruption")]
    assert judge(sdc, now=NOW, cfg=CFG) is None
    sdc.append(ev(2, EvidenceKind.SDC, NOW - 60, what="silent data corruption"))
    v = judge(sdc, now=NOW, cfg=CFG)
    assert v is not None and v.rule == "sdc" and v.evidence_ids == (1, 2)
    assert v.reason.startswith("2 silent data corruptions within 24 h")
    assert judge(sdc, now=NOW, cfg=CordonConfig(sdc=0)) is None
    assert judge(sdc, now=NOW + DAY, cfg=CFG) is None  # the first has left the window
