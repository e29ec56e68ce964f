"""The replicas' exact fingerprints: every single flipped bit changes one; the minority is
named with three replicas or more; with two, every rank is a suspect."""

from __future__ import annotations

import pytest
import torch

from trainwarden.agent.worker.faults import BITS, FaultInjector, flip_bit, parse_fault
from trainwarden.agent.worker.fingerprint import Fingerprints, fingerprint, judge


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
def test_every_single_bit_flip_changes_the_fingerprint(dtype: torch.dtype) -> None:
    t = torch.randn(257).to(dtype)
    before = fingerprint([t])
    width = t.element_size() * 8
    ints = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    for i in (0, 100, 256):
        for b in range(width):
            ints[i] ^= (1 << b) if b < width - 1 else -(1 << b)
            assert fingerprint([t]) != before, (i, b)
            ints[i] ^= (1 << b) if b < width - 1 else -(1 << b)
            assert fingerprint([t]) == before


def test_fingerprint_is_exact_not_a_norm() -> None:
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])
    assert a.norm() == b.norm() and fingerprint([a]) != fingerprint([b])
    # the same bytes in another tensor split, or order, are another fingerprint
    assert fingerprint([a, b]) != fingerprint([b, a])
    assert fingerprint([torch.tensor([]), a]) != fingerprint([a])


@pytest.mark.parametrize("bit", ["exponent", "mantissa"])
def test_the_injected_flip_changes_the_model_fingerprint(bit: str) -> None:
    m = model()
    before = fingerprint(m.parameters())
    w = m[0].weight.detach().clone()
    name, i, b = flip_bit(m, 150, bit)
    assert name == "0.weight" and b == BITS[bit]
    changed = (m[0].weight.detach() != w).nonzero()
    assert changed.tolist() == [[i // 16, i % 16]]
    ratio = float(m[0].weight.detach().view(-1)[i] / w.view(-1)[i])
    if bit == "exponent":
        assert ratio in (2.0 ** 8, 2.0 ** -8)
    else:
        assert abs(ratio - 1) < 1e-6  # subtle: the loss cannot see it
    assert fingerprint(m.parameters()) != before


def test_judge_names_the_minority_or_every_suspect() -> None:
    assert judge(10, [5, 5, 5], [0, 1, 2]).agree
    v = judge(10, [5, 5, 7], [0, 1, 2])
    assert not v.agree and v.corrupt == (2,) and v.suspects == ()
    assert v.details()["fingerprints"] == ["0000000000000005"] * 2 + ["0000000000000007"]
    v = judge(10, [5, 7], [0, 1])  # two replicas: no majority
    assert not v.agree and v.corrupt == () and v.suspects == (0, 1)
    v = judge(10, [5, 5, 7, 7], [0, 1, 2, 3])  # a tie
    assert v.corrupt == () and v.suspects == (0, 1, 2, 3)
    v = judge(10, [-3, 5, 5, 5, 9], [4, 5, 6, 7, 8])  # global ranks of a replicate group
    assert v.corrupt == (4, 8)


def test_one_rank_compares_with_nothing_and_never_raises() -> None:
    fp = Fingerprints(model(), every=10)
    assert fp.maybe_check(5) is None and fp.maybe_check(10) is None  # no process group
    with pytest.raises(ValueError):
        Fingerprints(model(), every=0)


def test_bitflip_parse_and_persistent_form(monkeypatch: pytest.MonkeyPatch) -> None:
    f = parse_fault("bitflip@150:rank=2:len=3:bit=mantissa")
    assert (f.kind, f.step, f.rank, f.length, f.bit) == ("bitflip", 150, 2, 3, "mantissa")
    assert str(f) == "bitflip@150:rank=2:len=3:bit=mantissa"
    for bad, msg in (("bitflip@1:bit=sign", "bit must be"), ("crash@1:bit=0", "bitflip option"),
                     ("bitflip@1:node=", "needs a name")):
        with pytest.raises(ValueError, match=msg):
            parse_fault(bad)
    # node=: fires on that node's ranks, on every attempt (a machine that corrupts again)
    monkeypatch.setenv("TRAINWARDEN_NODE", "node1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    sticky = parse_fault("bitflip@5:node=node1")
    for attempt in (0, 3):
        inj = FaultInjector([sticky], rank=1, world_size=2, attempt=attempt)
        assert inj.faults == [sticky]
    assert FaultInjector([parse_fault("bitflip@5:node=node0")], rank=1, world_size=2,
                         attempt=0).faults == []
    # without node=: once per run, on its rank
    once = parse_fault("bitflip@5:rank=1")
    assert FaultInjector([once], rank=1, world_size=2, attempt=0).faults == [once]
    assert FaultInjector([once], rank=1, world_size=2, attempt=1).faults == []
    assert FaultInjector([once], rank=0, world_size=2, attempt=0).faults == []
    m = model()
    before = fingerprint(m.parameters())
    inj = FaultInjector([parse_fault("bitflip@5:rank=1:len=2")], rank=1, world_size=2, attempt=0)
    inj.after_step(4, m)
    assert fingerprint(m.parameters()) == before
    inj.after_step(5, m)
    five = fingerprint(m.parameters())
    inj.after_step(6, m)
    assert len({before, five, fingerprint(m.parameters())}) == 3
    inj.after_step(7, m)
