"""The hang culprit from real stack dumps (``stacks/``, captured from real hangs: see its
README): which rank waits in a collective, which is elsewhere, and who is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainwarden.supervisor.detect.stacks import classify_dump, hang_culprit, parse_dump

DUMPS = Path(__file__).with_name("stacks")


def dump(name: str) -> str:
    return (DUMPS / f"{name}.txt").read_text()


@pytest.mark.parametrize(("name", "state", "where"), [
    ("ddp_hang_rank0", "collective", "_engine_run_backward"),  # DDP's gradient all-reduce
    ("fsdp_hang_rank0", "collective", "all_gather_single"),  # FSDP2's forward all-gather
    ("barrier_rank0", "collective", "barrier"),
    ("mismatch_all_reduce_rank0", "collective", "all_reduce"),
    ("mismatch_broadcast_rank1", "collective", "broadcast"),
    ("ddp_hang_rank1", "elsewhere", "before_step (worker/faults.py:122)"),
    ("fsdp_hang_rank1", "elsewhere", "before_step (worker/faults.py:122)"),
    ("dataloader_rank1", "elsewhere", "__getitem__ (decide-cap/stuck.py:18)"),
])
def test_real_dumps_are_classified(name: str, state: str, where: str) -> None:
    c = classify_dump(dump(name))
    assert c.state == state, c
    assert c.where.startswith(where), c


def test_the_training_thread_is_judged_not_the_reporter_thread() -> None:
    threads = parse_dump(dump("fsdp_hang_rank0"))
    assert len(threads) == 2  # the reporter's sender thread and the main thread
    assert [t.helper for t in threads] == [True, False]
    assert threads[1].current and threads[1].frames[-1].func == "<module>"


def test_no_dump_and_noise_around_a_dump() -> None:
    assert classify_dump("").state == "no_dump"
    assert classify_dump("[rank0] trainwarden: resuming at step 0\n").state == "no_dump"
    noisy = "[rank1] some log line\n" + dump("ddp_hang_rank1") + "\nW1201 torchrun warning\n"
    assert classify_dump(noisy).state == "elsewhere"


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_rank_outside_the_collective_is_named(kind: str) -> None:
    c = hang_culprit({0: dump(f"{kind}_hang_rank0"), 1: dump(f"{kind}_hang_rank1")},
                     {0: "node0", 1: "node0"}, ["node0"])
    assert c.ranks == (1,)
    assert c.reason.startswith("rank 1 is not in a collective (before_step")
    assert "rank(s) 0 wait in a collective" in c.reason


def test_a_data_loader_that_never_answers_is_named_against_a_barrier() -> None:
    c = hang_culprit({0: dump("barrier_rank0"), 1: dump("dataloader_rank1")},
                     {0: "a", 1: "b"}, ["a", "b"])
    assert c.ranks == (1,) and "__getitem__" in c.reason


def test_every_rank_in_a_collective_names_nobody_and_says_why() -> None:
    c = hang_culprit({0: dump("mismatch_all_reduce_rank0"), 1: dump("mismatch_broadcast_rank1")},
                     {0: "n", 1: "n"}, ["n"])
    assert c.ranks == ()
    assert c.reason.startswith("cannot tell: every rank waits in a collective in different "
                               "places (all_reduce, broadcast: mismatched collectives)")
    same = hang_culprit({0: dump("ddp_hang_rank0"), 1: dump("ddp_hang_rank0")},
                        {0: "n", 1: "n"}, ["n"])
    assert same.ranks == () and "in the same place (_engine_run_backward)" in same.reason


def test_a_rank_that_did_not_answer_is_named_once_its_node_delivered() -> None:
    stacks = {0: dump("ddp_hang_rank0")}
    # node1's agent has not sent its dumps yet: nobody is named
    pending = hang_culprit(stacks, {0: "node0", 1: "node1"}, ["node0"])
    assert pending.ranks == () and pending.waiting_for_nodes == ("node1",)
    assert "waiting for the stacks of node(s) node1" in pending.reason
    # node1 sent its dumps but rank 1 did not answer (SIGSTOPped): rank 1 is named
    stopped = hang_culprit(stacks, {0: "node0", 1: "node1"}, ["node0", "node1"])
    assert stopped.ranks == (1,) and "rank 1 did not answer the stack dump" in stopped.reason


def test_nobody_waiting_or_nobody_answering_names_nobody() -> None:
    outside = hang_culprit({0: dump("ddp_hang_rank1"), 1: dump("dataloader_rank1")},
                           {0: "n", 1: "n"}, ["n"])
    assert outside.ranks == () and "no rank waits in a collective" in outside.reason
    gone = hang_culprit({}, {0: "n", 1: "n"}, ["n"])
    assert gone.ranks == () and "no rank answered the stack dump" in gone.reason
    assert hang_culprit({}, {}, []).reason == "cannot tell: no stacks were captured"
