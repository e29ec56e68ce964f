"""Root causes read from what a failed worker left: real tracebacks captured from torch 2.13's
torchrun on this machine (tests/data/tracebacks), and what the agent sends of them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainwarden.agent.core import rootcause as rc_
from trainwarden.agent.core.rootcause import FailureClass, Frame, RootCause
from trainwarden.agent.launcher import (
    attach_root_causes,
    launcher_failure,
    parse_failure_summary,
    read_error_file,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "tracebacks"


def text(name: str) -> str:
    return (DATA / name).read_text()


def test_chained_exception_names_the_final_one_and_keeps_the_chain() -> None:
    rc = rc_.parse_traceback(text("chained_no_record.stderr.txt"))
    assert rc is not None
    assert (rc.exc_type, rc.message) == ("KeyError", "'label'")
    assert rc.frame == Frame("/tmp/wt-rootcause-exp/t.py", 5, "collate")
    assert rc.user_frame == rc.frame
    assert "During handling of the above exception" in rc.traceback
    assert rc.traceback.rstrip().endswith("KeyError: 'label'")  # torchrun's lines not in it
    assert "ChildFailedError" not in rc.traceback  # torchrun's own traceback is passed over
    assert rc_.classify(rc, exit_code=1) == FailureClass.USER_CODE
    assert rc_.headline(rc, rank=1, host="node1") == \
        "KeyError: 'label' at t.py:5 in collate (rank 1, host node1)"


def test_rank_prefixed_stderr_attributes_each_traceback_to_its_rank() -> None:
    out = text("rank_prefixed.stderr.txt")
    one = rc_.from_stderr(out, rank=1, sole_failure=False)
    zero = rc_.from_stderr(out, rank=0, sole_failure=False)
    assert one is not None and one.exc_type == "KeyError" and one.frame is not None
    assert one.frame.short == "d.py:4 in collate"
    assert rc_.classify(one) == FailureClass.USER_CODE
    # The survivor fails on the broken connection: gloo's error, the machine's side.
    assert zero is not None and zero.exc_type == "RuntimeError" and "gloo" in zero.message
    assert rc_.classify(zero) == FailureClass.MACHINE and rc_.fingerprint(zero) is None
    # And torchrun's summary says nothing ("To enable traceback see ...").
    assert "traceback" not in {k for k, v in rc_.summary_details(out)[1].items()
                               if v.startswith("Traceback")}


def test_torchrun_tee_prefix_and_a_sigkilled_rank_without_a_traceback() -> None:
    out = text("gloo_tee_sigkill.stderr.txt")
    assert rc_.from_stderr(out, rank=1, sole_failure=False) is None  # killed: it wrote nothing
    assert rc_.classify(None, exit_code=-9) == FailureClass.MACHINE
    assert rc_.classify(None, signal=9) == FailureClass.MACHINE
    assert rc_.classify(None, exit_code=1) == FailureClass.UNKNOWN
    survivor = rc_.from_stderr(out, rank=0, sole_failure=False)
    assert survivor is not None and rc_.classify(survivor) == FailureClass.MACHINE


def test_a_traceback_from_torchs_cpp_side() -> None:
    rc = rc_.parse_traceback(text("cpp_side.stderr.txt"))
    assert rc is not None and rc.exc_type == "RuntimeError"
    assert rc.message == "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"
    assert rc.user_frame is not None and rc.user_frame.short == "c.py:3 in helper"
    # The Python part is kept whole; of the C++ stack only its first lines.
    assert "helper(torch.ones(4, 5))" in rc.traceback
    assert "Exception raised from meta" in rc.traceback
    assert "#12 " not in rc.traceback
    assert rc_.classify(rc) == FailureClass.USER_CODE


def test_output_with_no_traceback() -> None:
    assert rc_.parse_traceback("") is None
    assert rc_.parse_traceback("Fatal Python error: Segmentation fault\n\nCurrent thread "
                               "0x7f (most recent call first):\n  File \"x.py\", line 3\n") \
        is None
    assert rc_.from_stderr("step 1 loss 2.0\nstep 2 loss 1.9\n", rank=0, sole_failure=True) \
        is None


def test_structured_error_file_and_the_summary_carry_the_same_root_cause(tmp_path: Path
                                                                         ) -> None:
    data = json.loads(text("record_error_file.json"))
    from_file = rc_.from_error_file(data)
    assert from_file is not None and from_file.source == rc_.RootCauseSource.ERROR_FILE
    summary = rc_.summary_details(text("record_summary.stderr.txt"))
    assert summary[1]["host"] == "localhost" and summary[1]["error_file"].endswith(
        "/attempt_0/1/error.json")
    from_summary = rc_.from_summary(summary[1]["traceback"])
    assert from_summary is not None
    assert (from_file.exc_type, from_file.frame, from_file.user_frame) == (
        from_summary.exc_type, from_summary.frame, from_summary.user_frame)
    # @record's own frame (site-packages) is not the user's code.
    assert from_file.user_frame == Frame("/tmp/wt-rootcause-exp/t.py", 5, "collate")
    assert rc_.from_error_file({"message": "not json"}) is None
    assert rc_.from_error_file([1, 2]) is None


def test_the_agent_prefers_the_error_file_then_the_summary_then_stderr(tmp_path: Path) -> None:
    out = text("record_summary.stderr.txt")
    err_file = tmp_path / "torchelastic_x" / "none_y" / "attempt_0" / "1" / "error.json"
    err_file.parent.mkdir(parents=True)
    err_file.write_text(text("record_error_file.json"))
    out = out.replace("/tmp/torchelastic_f1g4_7n8/none_a8d_ibi0/attempt_0/1/error.json",
                      str(err_file))
    failed = parse_failure_summary(out)
    attach_root_causes(failed, out, out)
    root = failed[0]
    assert root["rank"] == 1 and root["message"] == "KeyError: 'label'"
    assert root["root_cause"]["source"] == "error_file"
    assert root["root_cause"]["host"] == "localhost" and root["root_cause"]["rank"] == 1
    assert "root_cause" not in failed[1]  # rank 0 was SIGTERMed: nothing of its own
    err_file.unlink()  # gone: the summary's copy of it
    failed = parse_failure_summary(out)
    attach_root_causes(failed, out, out)
    assert failed[0]["root_cause"]["source"] == "summary"
    # Without @record: from the node's stderr.
    plain = text("rank_prefixed.stderr.txt")
    failed = parse_failure_summary(plain)
    assert failed[0]["message"] == ""  # torchrun's "To enable traceback see: ..." is dropped
    attach_root_causes(failed, plain, plain)
    assert failed[0]["root_cause"]["source"] == "stderr"
    assert failed[0]["root_cause"]["user_frame"]["line"] == 4
    assert failed[0]["message"] == "KeyError: 'label'"


def test_an_error_file_path_is_followed_only_when_it_is_torchruns(tmp_path: Path) -> None:
    good = tmp_path / "attempt_0" / "1" / "error.json"
    good.parent.mkdir(parents=True)
    good.write_text(text("record_error_file.json"))
    assert read_error_file(str(good)) is not None
    other = tmp_path / "secret.json"
    other.write_text(text("record_error_file.json"))
    assert read_error_file(str(other)) is None  # not an error file's shape
    assert read_error_file("attempt_0/1/error.json") is None  # relative
    link = tmp_path / "attempt_1" / "0" / "error.json"
    link.parent.mkdir(parents=True)
    os.symlink(other, link)
    assert read_error_file(str(link)) is None  # a link is not followed
    fifo = tmp_path / "attempt_2" / "0" / "error.json"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    assert read_error_file(str(fifo)) is None  # never blocks on a pipe


def test_hostile_worker_text_is_made_harmless_and_bounded() -> None:
    evil = ("Traceback (most recent call last):\n"
            '  File "/home/u/train.py", line 9, in step\n'
            "    boom()\n"
            "ValueError: \x1b[31mred\x00 " + "x" * 50_000 + "\n")
    failed = [{"rank": 0, "local_rank": 0, "exit_code": 1, "signal": None, "pid": 1,
               "message": ""}]
    attach_root_causes(failed, "", evil)
    rc = failed[0]["root_cause"]
    assert "\x1b" not in rc["message"] and "\\x1b" in rc["message"]
    assert "\x00" not in rc["traceback"]
    # Cut before the escapes (which are longer than what they stand for), well in the wire's
    # bounds, which the supervisor checks by cutting too.
    assert len(rc["message"]) <= rc_.MESSAGE_CHARS + 10
    assert len(rc["traceback"]) <= rc_.TAIL_CHARS + 10
    from trainwarden.supervisor.contract.wire import FailedRank

    wired = FailedRank.model_validate(failed[0])
    assert wired.root_cause is not None and wired.root_cause.exc_type == "ValueError"
    assert wired.root_cause.user_frame is not None and wired.root_cause.user_frame.line == 9


def rc(exc: str, file: str, line: int, fn: str, msg: str = "m") -> RootCause:
    f = Frame(file, line, fn)
    return RootCause(exc, msg, f, f if rc_.is_user_file(file) else None, "")


def test_fingerprint_is_the_exception_type_and_the_innermost_user_frame() -> None:
    a = rc("KeyError", "/home/u/train.py", 57, "collate", "'label'")
    # Another message (a value of this step), another node's checkout: the same bug.
    b = rc("KeyError", "/other/checkout/train.py", 57, "collate", "'label2'")
    assert rc_.fingerprint(a) is not None and rc_.fingerprint(a) == rc_.fingerprint(b)
    assert rc_.fingerprint(a) != rc_.fingerprint(rc("KeyError", "/home/u/train.py", 58,
                                                    "collate"))
    assert rc_.fingerprint(a) != rc_.fingerprint(rc("ValueError", "/home/u/train.py", 57,
                                                    "collate"))
    # Not the user's code: no fingerprint.
    assert rc_.fingerprint(rc("RuntimeError", "/x/site-packages/torch/distributed/c10d.py",
                              3, "wait")) is None
    assert rc_.fingerprint(rc("RuntimeError", "/home/u/train.py", 3, "f",
                              "NCCL error: unhandled system error")) is None
    assert rc_.fingerprint(rc("torch.OutOfMemoryError", "/home/u/train.py", 3, "f")) is None
    assert rc_.fingerprint(None) is None


@pytest.mark.parametrize("path,user", [
    ("/home/u/train.py", True), ("train.py", True),
    ("/usr/lib/python3.11/json/decoder.py", False),
    ("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", False),
    ("<frozen runpy>", False), ("", False),
])
def test_is_user_file(path: str, user: bool) -> None:
    assert rc_.is_user_file(path) is user


def test_wire_dict_round_trip() -> None:
    a = rc("KeyError", "/home/u/train.py", 57, "collate", "'label'")
    assert rc_.from_dict(a.as_dict()) == a
    assert rc_.from_dict({"exc_type": 3}) is None and rc_.from_dict("x") is None


def test_torchrun_failing_before_any_worker_is_its_own_root_cause() -> None:
    """torchrun's static rendezvous on the host whose port is taken: it exits 1 with its own
    traceback and no failure summary; the entry names torchrun, the port taken and the
    launcher as the source."""
    out = text("torchrun_rendezvous_port_in_use.stderr.txt")
    failed = parse_failure_summary(out)
    attach_root_causes(failed, out, out)
    assert failed == []  # no worker ran
    entry = launcher_failure(1, out)
    assert entry is not None and entry["rank"] is None and entry["launcher"] is True
    assert entry["message"].startswith("torch.distributed.DistNetworkError: The server socket "
                                       "has failed to listen")
    rc = rc_.from_dict(entry["root_cause"])
    assert rc is not None and rc.source == rc_.RootCauseSource.LAUNCHER
    assert rc.frame is not None and rc.frame.short == \
        "static_tcp_rendezvous.py:67 in next_rendezvous"
    assert rc_.port_in_use(rc)
    assert rc.user_frame is None  # torchrun's frames are not the user's script
    assert rc_.classify(rc, exit_code=1) == FailureClass.MACHINE
    assert rc_.fingerprint(rc, exit_code=1) is None
    assert launcher_failure(0, out) is None  # a clean exit has no failure
    assert launcher_failure(1, "torchrun: error: unrecognized arguments") is None
    # torchrun reporting a failed worker whose summary did not reach us: not torchrun's own
    assert launcher_failure(1, text("chained_no_record.stderr.txt")) is None


def test_only_a_taken_port_reads_as_one() -> None:
    def rc(exc: str, msg: str) -> RootCause:
        return RootCause(exc, msg, None, None, "")

    assert rc_.port_in_use(rc("OSError", "[Errno 98] Address already in use"))
    assert not rc_.port_in_use(rc("torch.distributed.DistNetworkError",
                                  "failed to connect to 127.0.0.1:29500: Connection refused"))
    assert not rc_.port_in_use(rc("KeyError", "'label'"))
    assert not rc_.port_in_use(None)


# --- no traceback: the rank's last lines of stderr -------------------------------------------


def test_a_usage_error_is_its_last_line_of_stderr_not_torchruns_hint() -> None:
    """argparse rejects an argument on both ranks (exit 2, no traceback; torch 2.13's real
    output): each rank's cause is argparse's error line; torchrun's log lines, its
    ChildFailedError traceback and its summary are not the workers' last words."""
    out = text("argparse_usage.stderr.txt")
    failed = parse_failure_summary(out)
    assert [(f["rank"], f["exit_code"], f["message"]) for f in failed] == [
        (0, 2, ""), (1, 2, "")]  # torchrun's "To enable traceback see: ..." says nothing
    attach_root_causes(failed, out, out)
    error = ("bad.py: error: argument --inject: invalid choice: 'bogus' (choose from "
             "'crash', 'hang')")
    for f in failed:
        assert f["message"] == error, f
        rc = rc_.from_dict(f["root_cause"])
        assert rc is not None and rc.source == rc_.RootCauseSource.STDERR_TAIL
        assert rc.rank == f["rank"] and rc.exc_type == "" and rc.frame is None
        assert rc.traceback.splitlines()[0].startswith("usage: bad.py [-h]")
        assert rc.traceback.splitlines()[-1] == error
        for torchrun in ("W1206", "ChildFailedError", "Failures:", "To enable traceback",
                         "FAILED"):
            assert torchrun not in rc.traceback, rc.traceback
        assert rc_.classify(rc, exit_code=2) == FailureClass.UNKNOWN
        assert rc_.fingerprint(rc, exit_code=2) is None  # no frame of the user's code
        assert rc_.headline(rc, rank=0, host="node0") == \
            f'last stderr line: "{error}" (rank 0, host node0)'


def test_a_worker_that_os_exits_says_its_exit_code_rank_and_last_words() -> None:
    """Rank 1 writes a line and calls os._exit(1) mid-training (torch 2.13's real output):
    its cause is that line; rank 0, SIGTERMed after losing its peer, keeps its own
    traceback."""
    out = text("os_exit_no_traceback.stderr.txt")
    failed = parse_failure_summary(out)
    attach_root_causes(failed, out, out)
    by_rank = {f["rank"]: f for f in failed}
    one = by_rank[1]
    assert one["exit_code"] == 1
    assert one["message"] == "loader: shard 7 is unreadable, giving up"
    assert one["root_cause"]["source"] == "stderr_tail"
    assert one["root_cause"]["traceback"] == "loader: shard 7 is unreadable, giving up"
    assert by_rank[0]["root_cause"]["source"] == "stderr"  # its [rank0] traceback
    assert "Connection reset by peer" in by_rank[0]["message"]


def test_a_rank_killed_by_a_signal_is_not_given_another_ranks_lines() -> None:
    out = text("gloo_tee_sigkill.stderr.txt")
    failed = parse_failure_summary(out)
    attach_root_causes(failed, out, out)
    killed = next(f for f in failed if f["rank"] == 1)
    assert "root_cause" not in killed and killed["signal"] == 9
    assert killed["message"].startswith("Signal 9")  # what torchrun knows of it is kept
    assert rc_.from_stderr_tail("W1206 01:54:25.565000 12499 torch/distributed/run.py:874] "
                                "x\n\n", rank=0) is None  # nothing of the worker's own


def _usage(rank: int) -> list[str]:
    return [f"[{rank}] usage: t.py [-h] [--inject {{crash,hang}}]",
            "t.py: error: argument --inject: invalid choice: 'x'"]


def sig(text: str, *, rank: int = 0, code: int | None = 2, signal: int | None = None,
        phase: str = "before the first step") -> str | None:
    rc = rc_.from_stderr_tail(text, rank=rank)
    return rc_.signature(rc, ranks=[rank], exit_code=code, signal=signal, phase=phase)


def test_the_signature_of_a_failure_is_rank_code_last_lines_and_phase() -> None:
    usage = "usage: t.py [-h]\nt.py: error: argument --inject: invalid choice: 'x'\n"
    base = sig(usage)
    assert base is not None and base == sig(usage)
    # Two ranks printing the same lines interleave them differently from run to run.
    assert sig(usage + usage) == base
    assert sig("usage: t.py [-h]\nusage: t.py [-h]\nt.py: error: argument --inject: "
               "invalid choice: 'x'\nt.py: error: argument --inject: invalid choice: 'x'\n"
               ) == base
    # Another rank, exit code, signal, phase or last line: another failure.
    assert sig(usage, rank=1) != base
    assert sig(usage, code=1) != base
    assert sig(usage, code=None, signal=9) != base
    assert sig(usage, phase="at step 41") != base
    assert sig("usage: t.py [-h]\nt.py: error: argument --inject: invalid choice: 'y'\n") \
        != base
    # Clocks, process ids and addresses vary between attempts of the same failure.
    a = "[E1206 01:56:06.468 12 ProcessGroup.cpp:9] abort at 0x7f00ab pid 1234 2026-12-06 " \
        "01:56:06\n"
    b = "[E1206 02:10:44.001 99 ProcessGroup.cpp:9] abort at 0x7f1234 pid 98 2026-12-06 " \
        "02:10:44\n"
    assert sig(a) == sig(b) is not None
    # Nothing left to read identifies no failure.
    assert rc_.signature(None, ranks=[0], exit_code=2, signal=None, phase="") is None
    # A traceback is signed by its last lines too.
    tb = rc_.parse_traceback(text("chained_no_record.stderr.txt"))
    assert rc_.signature(tb, ranks=[1], exit_code=1, signal=None, phase="at step 3") \
        is not None
