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
    assert failed[0]["message"].startswith("To enable traceback")
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
