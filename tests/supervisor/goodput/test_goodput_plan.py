"""Capacity planner: known answers from the ZeRO and activation-recomputation papers, and by
hand."""

from __future__ import annotations

import pytest

from trainwarden.supervisor.goodput import interval as iv
from trainwarden.supervisor.goodput.plan import (
    PlanInputs,
    activation_bytes_per_layer,
    bytes_per_param,
    compare,
    make_plan,
    params_from_shape,
    parse_count,
    ring_allreduce_s,
    state_bytes_per_device,
    sync_s,
)

GB = 1e9
MIXED = bytes_per_param("bf16", "adam")


def states_gb(params: float, devices: int, strategy: str) -> float:
    return state_bytes_per_device(params, MIXED, devices, strategy) / GB


def test_mixed_precision_adam_is_16_bytes_per_parameter() -> None:
    assert MIXED == {"weights": 2, "grads": 2, "master": 4, "optimizer": 8, "total": 16}
    assert bytes_per_param("fp32", "adam")["total"] == 16  # 4 + 4 + 8, no separate master
    assert bytes_per_param("bf16-pure", "adam")["total"] == 8  # 2 + 2 + bf16 moments 4
    assert bytes_per_param("bf16", "sgd")["total"] == 8


def test_7b_ddp_and_zero3_on_8_devices() -> None:
    assert states_gb(7e9, 8, "ddp") == pytest.approx(112.0)
    assert states_gb(7e9, 8, "zero1") == pytest.approx(28 + 84 / 8)
    assert states_gb(7e9, 8, "zero2") == pytest.approx(14 + 98 / 8)
    assert states_gb(7e9, 8, "zero3") == pytest.approx(14.0)


def test_the_7b_table_on_8_devices_in_gib() -> None:
    """The plan counts memory in GiB (2^30 bytes), as nvidia-smi does: 7B parameters, mixed
    precision Adam (16 bytes each), 8 devices."""
    plan = make_plan(PlanInputs(params=7e9, devices=8))
    table = {r.strategy: round(r.states_gib, 1) for r in plan.memory}
    assert table == {"ddp": 104.3, "zero1": 35.9, "zero2": 24.4, "zero3": 13.0}
    assert plan.memory[0].total_gib == pytest.approx(112e9 / 2**30)


def test_an_80_gb_card_is_80_gib_in_the_fit_decision() -> None:
    """A card sold as "80 GB" is 80 GiB in the plan, as nvidia-smi counts: 90% of it
    usable is 72 GiB.  4.8B parameters in DDP on one device need 76.8e9 bytes, 71.5 GiB:
    they fit (read as 80e9 bytes they would not)."""
    plan = make_plan(PlanInputs(params=4.8e9, devices=1, gpu="h100"))
    assert plan.device_memory_gib == 80 and plan.usable_memory_gib == pytest.approx(72.0)
    ddp = plan.memory[0]
    assert ddp.strategy == "ddp" and ddp.total_gib == pytest.approx(71.53, abs=0.01)
    assert ddp.fits and plan.strategy == "ddp"
    given = make_plan(PlanInputs(params=4.8e9, devices=1, device_memory_gib=79.0))
    assert not given.memory[0].fits  # 71.1 GiB usable of 79


@pytest.mark.parametrize("strategy,paper_gb", [("ddp", 120.0), ("zero1", 31.4),
                                               ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_figure_1(strategy: str, paper_gb: float) -> None:
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 devices, K = 12.
    assert states_gb(7.5e9, 64, strategy) == pytest.approx(paper_gb, abs=0.05)


def test_activations_per_layer_korthikanti() -> None:
    # GPT-3 175B layer: s=2048, b=1, h=12288, a=96: sbh(34 + 5as/h) = 25,165,824 x 114
    kw = {"seq_len": 2048, "micro_batch": 1, "hidden": 12288, "heads": 96}
    assert activation_bytes_per_layer(mode="none", **kw) == 2_868_903_936
    assert activation_bytes_per_layer(mode="selective", **kw) == 25_165_824 * 34
    assert activation_bytes_per_layer(mode="full", **kw) == 25_165_824 * 2


def test_params_from_the_gpt3_shape() -> None:
    p = params_from_shape(layers=96, hidden=12288, vocab=50257, seq_len=2048)
    assert p == pytest.approx(174.6e9, rel=1e-3)


def test_ring_all_reduce_time() -> None:
    grads = 7e9 * 2  # bf16 gradients of 7B
    assert ring_allreduce_s(grads, 8, 450e9) == pytest.approx(2 * 7 / 8 * 14e9 / 450e9)
    assert ring_allreduce_s(grads, 8, 12.5e9) == pytest.approx(1.96)
    assert ring_allreduce_s(grads, 1, 12.5e9) == 0.0
    assert sync_s(grads, 8, 12.5e9, "zero3") == pytest.approx(1.96 * 1.5)


def test_parse_count() -> None:
    assert parse_count("7B") == 7e9
    assert parse_count("1.3b") == pytest.approx(1.3e9)
    assert parse_count("125M") == 125e6
    assert parse_count("7e9") == 7e9
    with pytest.raises(ValueError, match="parameter count"):
        parse_count("seven")


def test_step_time_mfu_and_sync_share_by_hand() -> None:
    # 1e9 params, 1000 tokens per device, 2 devices on 10 GbE, peak 100 TFLOP/s at 50%:
    # compute 6e9 x 1000 / 5e13 = 0.12 s; all-reduce of 2e9 bytes: 2 x 1/2 x 2e9 / 1.25e9
    # = 1.6 s, 0.08 s hidden under the backward (2/3 of compute): step 0.12 + 1.52 = 1.64 s.
    plan = make_plan(PlanInputs(params=1e9, seq_len=1000, devices=2, peak_tflops=100,
                                kernel_efficiency=0.5, interconnect="10gbe", strategy="ddp"))
    assert plan.compute_s == pytest.approx(0.12)
    assert plan.step_s == pytest.approx(1.64)
    assert plan.mfu == pytest.approx(0.06 / 1.64)
    assert plan.mfu_band == "host_bound"
    row = next(r for r in plan.sync if r.chosen)
    assert row.interconnect == "10gbe"
    assert row.sync_s == pytest.approx(1.6)
    assert row.share_of_step == pytest.approx(1.52 / 1.64)
    nvlink = next(r for r in plan.sync if r.interconnect == "nvlink")
    assert nvlink.exposed_s == 0.0  # hidden under the backward pass


def test_full_activation_checkpointing_costs_a_forward_pass() -> None:
    kw = {"params": 1e9, "seq_len": 1000, "devices": 1, "peak_tflops": 100.0}
    plain = make_plan(PlanInputs(**kw))  # type: ignore[arg-type]
    full = make_plan(PlanInputs(activation_checkpointing="full", **kw))  # type: ignore[arg-type]
    assert full.compute_s == pytest.approx(plain.compute_s * 4 / 3)  # type: ignore[operator]
    assert full.mfu == pytest.approx(plain.mfu * 3 / 4)  # type: ignore[operator]


def test_strategy_is_the_least_sharded_that_fits() -> None:
    shape = {"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 4096, "vocab": 32000}
    plan = make_plan(PlanInputs(params=7e9, devices=8, **shape))  # type: ignore[arg-type]
    fits = {r.strategy: r.fits for r in plan.memory}
    assert fits == {"ddp": False, "zero1": True, "zero2": True, "zero3": True}
    assert plan.strategy == "zero1"
    assert plan.activations_gib is not None
    assert plan.activations_gib["full"] < plan.activations_gib["selective"] \
        < plan.activations_gib["none"]


def test_a_plan_without_a_shape_says_what_it_cannot_count() -> None:
    plan = make_plan(PlanInputs(params=7e9))
    assert plan.activations_gib is None and plan.step_s is None and plan.mfu is None
    assert any("activation memory needs the shape" in n for n in plan.notes)


def test_reliability_at_16k_gpus() -> None:
    plan = make_plan(PlanInputs(params=405e9, devices=16_384, checkpoint_stall_s=60.0,
                                restart_s=600.0, checkpoint_interval_s=1800.0))
    assert plan.nodes == 2048
    assert plan.failures_per_day == pytest.approx(2048 * 6.5 / 1000)
    lam = 2048 * 6.5 / 1000 / 86_400
    expect = (1 - lam * (600 + 900)) / (1 + 60 / 1800)
    assert plan.advice.ettr_current == pytest.approx(expect)
    assert plan.advice.recommended_s == pytest.approx(
        iv.optimal_interval(mtbf_s=1 / lam, restart_s=600.0, save_stall_s=60.0))
    llama = make_plan(PlanInputs(params=405e9, devices=16_384, failure_rate="llama3"))
    assert llama.failures_per_day == pytest.approx(419 / 54)


def test_checkpoint_size_and_synchronous_stall() -> None:
    plan = make_plan(PlanInputs(params=7e9, devices=8))
    assert plan.checkpoint_gb == pytest.approx(84.0)  # fp32 master + two moments
    assert plan.checkpoint_stall_s == pytest.approx(42.0)  # 84 GB / (1 node x 2 GB/s)


@pytest.mark.parametrize("kw,field", [
    ({}, "--params"),
    ({"params": 1e9, "precision": "int4"}, "precision"),
    ({"params": 1e9, "hidden": 100, "heads": 3, "layers": 2}, "heads"),
    ({"params": 1e9, "devices": 0}, "devices"),
    ({"params": 1e9, "kernel_efficiency": 2.0}, "kernel_efficiency"),
    ({"params": 1e9, "failure_rate": "weekly"}, "failure_rate"),
])
def test_bad_inputs_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PlanInputs(**kw)  # type: ignore[arg-type]


def test_compare_with_a_run_summary() -> None:
    plan = make_plan(PlanInputs(params=1e9, seq_len=1000, devices=2, peak_tflops=100))
    run = {"throughput": {"steps_per_s": 4.0, "tokens_per_s": 8000.0, "samples_per_s": 8.0,
                          "ranks": 2},
           "agents": [{"gpus": {"available": True, "devices": [
               {"index": 0, "mem_used_bytes": 30 * 2**30},
               {"index": 1, "mem_used_bytes": 31 * 2**30}]}},
               {"gpus": {"available": False, "reason": "no driver"}}]}
    rows = {r.quantity.split(" (")[0]: r for r in compare(plan, run)}
    assert rows["step time s"].measured == pytest.approx(0.25)
    assert rows["MFU"].measured == pytest.approx(8000 * plan.flops_per_token / (2 * 1e14))
    assert rows["memory per device GiB"].measured == pytest.approx(31.0)
    assert rows["ranks"].measured == 2.0
    assert rows["step time s"].ratio == pytest.approx(0.25 / plan.step_s)  # type: ignore[operator]


def test_compare_says_what_is_missing() -> None:
    plan = make_plan(PlanInputs(params=1e9, devices=2))
    rows = compare(plan, {"throughput": {"steps_per_s": None, "ranks": None}, "agents": []})
    assert all(r.measured is None for r in rows)
    assert "no NVML reading" in rows[2].note


def test_compare_reads_the_runs_declared_mfu_from_its_diagnosis() -> None:
    """``GET /runs/{run}`` carries ``mfu`` as the diagnosis object; its ``mfu`` is the run's
    MFU from the declared FLOPs, taken as it is."""
    plan = make_plan(PlanInputs(params=1e9, seq_len=1000, devices=2, peak_tflops=100))
    run = {"throughput": {"steps_per_s": 4.0, "tokens_per_s": 8000.0, "ranks": 2},
           "mfu": {"mfu": 0.31, "band": {"name": "communication"}}, "agents": []}
    rows = {r.quantity.split(" (")[0]: r for r in compare(plan, run)}
    assert rows["MFU"].measured == pytest.approx(0.31)
