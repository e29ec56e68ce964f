"""MFU bands, per-rank shares and the scaling diagnosis against hand-computed numbers."""

from __future__ import annotations

import pytest

from trainwarden.supervisor.goodput.mfu import (
    RankPhases,
    ScalingConfig,
    band,
    diagnose_mfu,
    diagnose_scaling,
    rank_share,
    scaling_efficiency,
)


@pytest.mark.parametrize("mfu,name", [
    (0.45, "healthy"), (0.40, "healthy"), (0.38, "healthy"),  # 35-40% gap split at 37.5%
    (0.37, "communication"), (0.30, "communication"), (0.23, "communication"),
    (0.22, "input_or_batch"), (0.15, "input_or_batch"), (0.10, "input_or_batch"),
    (0.099, "host_bound"), (0.0, "host_bound"),
    (0.50, "excellent"), (0.74, "excellent"), (0.75, "check_declaration"),
    (1.3, "check_declaration"),
])
def test_bands(mfu: float, name: str) -> None:
    assert band(mfu).name == name


def test_band_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="MFU"):
        band(-0.1)


def test_rank_share_by_hand() -> None:
    s = rank_share(RankPhases(3, data_s=0.1, compute_s=0.6, step_s=1.0),
                   flops_per_rank_step=4e14, peak_flops_per_rank=1e15)
    assert s.data == pytest.approx(0.1)
    assert s.compute == pytest.approx(0.6)
    assert s.comm == pytest.approx(0.3)
    assert s.mfu == pytest.approx(0.4)  # 0.4 s of work at peak in a 1 s step
    assert s.compute_utilisation == pytest.approx(0.4 / 0.6)


def test_rank_share_without_compute_time_leaves_comm_unknown() -> None:
    s = rank_share(RankPhases(0, data_s=0.2, compute_s=None, step_s=0.5))
    assert s.data == pytest.approx(0.4)
    assert s.compute is None and s.comm is None and s.mfu is None


def test_diagnose_mfu_names_the_band_and_medians() -> None:
    d = diagnose_mfu(0.31, [RankPhases(r, 0.05, 0.5, 1.0) for r in range(4)])
    assert d.band is not None and d.band.name == "communication"
    assert d.data_share == pytest.approx(0.05)
    assert d.comm_share == pytest.approx(0.45)
    assert [r.rank for r in d.ranks] == [0, 1, 2, 3]
    assert diagnose_mfu(None, []).band is None


def test_scaling_efficiency() -> None:
    assert scaling_efficiency(600.0, 8, 100.0) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        scaling_efficiency(600.0, 8, 0.0)


def verdicts(ranks: list[RankPhases], **kw: float) -> dict[str, str]:
    s = diagnose_scaling(ranks, devices=len(ranks), **kw)  # type: ignore[arg-type]
    return {c.name: c.verdict for c in s.causes}


def test_data_loader_bound() -> None:
    ranks = [RankPhases(r, data_s=0.3, compute_s=0.6, step_s=1.0) for r in range(4)]
    s = diagnose_scaling(ranks, devices=4, throughput=300.0, baseline_per_device=100.0)
    assert s.efficiency == pytest.approx(0.75)
    assert s.likely == "data_loader"
    assert verdicts(ranks) == {"data_loader": "for", "batch_per_device": "against",
                               "interconnect": "against", "straggler": "against"}


def test_batch_too_small() -> None:
    ranks = [RankPhases(r, data_s=0.001, compute_s=0.02, step_s=0.05) for r in range(8)]
    s = diagnose_scaling(ranks, devices=8)
    assert s.likely == "batch_per_device"
    assert s.efficiency is None  # no baseline declared
    assert "20.0 ms" in s.causes[1].evidence


def test_interconnect_bound_quotes_the_expected_all_reduce() -> None:
    ranks = [RankPhases(r, data_s=0.01, compute_s=0.5, step_s=1.0) for r in range(8)]
    s = diagnose_scaling(ranks, devices=8, expected_sync_s=0.2)
    assert s.likely == "interconnect"
    inter = s.causes[2]
    assert inter.share == pytest.approx(0.49)  # 1.0 - 0.51
    assert "0.490 s measured against 0.200 s" in inter.evidence


def test_one_straggler_is_not_mistaken_for_the_network() -> None:
    ranks = [RankPhases(r, data_s=0.01, compute_s=0.59, step_s=1.0) for r in range(7)]
    ranks.append(RankPhases(7, data_s=0.01, compute_s=0.89, step_s=1.0))
    s = diagnose_scaling(ranks, devices=8)
    assert s.likely == "straggler"
    assert verdicts(ranks)["interconnect"] == "against"  # 0.1 after the slowest arrives
    strag = s.causes[3]
    assert strag.share == pytest.approx(0.3)
    assert "rank 7" in strag.evidence


def test_missing_phase_times_are_unknown_not_against() -> None:
    ranks = [RankPhases(r, data_s=None, compute_s=None, step_s=1.0) for r in range(2)]
    assert set(verdicts(ranks).values()) == {"unknown"}


def test_scaling_config_validates() -> None:
    with pytest.raises(ValueError,
                       match=r"^ScalingConfig\.comm_share must be in \(0, 1\) \(got 1\.5\)$"):
        ScalingConfig(comm_share=1.5)


def test_a_figure_above_100_percent_says_the_declaration_is_off() -> None:
    """A peak declared too low shows as a rank's compute utilisation of 118%: the diagnosis
    says the declaration is the cause, and how to fix it."""
    ranks = [RankPhases(0, 0.0, 0.5, 1.0), RankPhases(1, 0.0, 0.5, 1.0)]
    d = diagnose_mfu(0.59, ranks, flops_per_rank_step=0.59, peak_flops_per_rank=1.0)
    assert d.ranks[0].compute_utilisation == pytest.approx(1.18)
    assert d.declaration_warning is not None
    assert "rank 0's compute utilisation 118%" in d.declaration_warning
    assert "declared peak FLOP/s per rank" in d.declaration_warning
    assert d.as_dict()["declaration_warning"] == d.declaration_warning
    fine = diagnose_mfu(0.3, ranks, flops_per_rank_step=0.3, peak_flops_per_rank=1.0)
    assert fine.declaration_warning is None
