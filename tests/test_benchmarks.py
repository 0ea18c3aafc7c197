"""The overhead benchmark's harness keeps working: its clock, its workloads on a device, and
one short run whose figures hang together. No timing is asserted: the targets live in
``benchmarks/`` and ``docs/performance.md``, not in the suite."""

import math
import time
import warnings

import pytest

from models import layerwatch_messages
import torch


def test_the_cpu_clock_times_each_action_in_turn(benchmarks):
    from timing import Clock

    clock = Clock("cpu")
    order = []
    first, second = clock.times(lambda: (order.append(1), time.sleep(0.02)), lambda: order.append(2))
    assert order == [1, 2]
    assert 0.02 <= first < 1 and 0 <= second < first
    assert clock.name().startswith("cpu")


def test_a_clock_for_a_device_it_cannot_time_says_which(benchmarks):
    from timing import Clock

    with pytest.raises(ValueError, match="'meta'"):
        Clock("meta")


def test_a_workload_is_built_on_the_device_it_is_given(benchmarks):
    from workloads import WORKLOADS

    model, _, step = WORKLOADS["tfm-tiny"](device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    on_cpu, _, _ = WORKLOADS["tfm-tiny"]()
    again, _, _ = WORKLOADS["tfm-tiny"](device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(on_cpu.parameters(), again.parameters()))


def test_a_short_overhead_run_reports_consistent_figures(benchmarks):
    from overhead import run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a two-sample run is too short for the trend alerts
        r = run("tfm-tiny", "wgu", rounds=2, naive_rounds=0, wandb_rounds=0, families=(), sentinel=False)
    assert r["device"].startswith("cpu") and r["families"] == "weights,grads,updates"
    assert r["tensors"] == 75 and r["base_ms"] > 0
    assert r["sampled_ms"] > 0 and r["sampled"] > 0
    assert r["reported_overhead_ms"] > 0  # the second sample's: the first also records the layer table
    assert math.isclose(r["sampled_delta_ms"], r["sampled_ms"] - r["base_ms"], rel_tol=1e-9, abs_tol=1e-9)
    assert r["bytes_per_sampled_step"] > 0 and r["bytes_per_histogram"] > 0


def test_a_short_compiled_overhead_run_measures_its_re_runs(benchmarks, capsys):
    from overhead import run

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = run("tfm-tiny", "defaults", rounds=1, naive_rounds=0, wandb_rounds=0, families=(), sentinel=True,
                compiled="aot_eager")
    assert r["workload"] == "tfm-tiny (compiled)" and r["base_ms"] > 0 and r["sampled"] > 0
    assert layerwatch_messages(seen) == []
    assert "forward-only re-run" in capsys.readouterr().err  # what a compiled model's sampled steps measure on


def test_a_short_replay_benchmark_names_the_module_and_reports_ratios(benchmarks):
    from replay import run

    r = run("stack32", rounds=1, steps=1)
    assert r["device"].startswith("cpu") and r["base_ms"] > 0
    assert r["sentinel_ratio"] > 0 and r["replay_ratio"] > 0 and r["replay_step_ms"] > 0
    assert r["replay_named"]  # the NaN weight's first user, found by the replay


def test_a_short_budget_run_measures_the_amortized_ratio_at_the_interval_it_chose(benchmarks):
    from budget import run

    r = run("tfm-tiny", 1.0, steps=4, block=2, warmup=3, calibrate=2)  # the whole budget: a sample every step or two
    assert r["budget"] == 1.0 and r["interval"] in (1, 2, 5) and r["steps"] % r["interval"] == 0
    assert 1 <= r["samples"] <= r["steps"] and r["base_ms"] > 0 and r["amortized"] > 0


def test_a_short_load_speed_run_reads_back_every_value_it_wrote(benchmarks, tmp_path, capsys):
    pytest.importorskip("pandas")
    import load_speed

    import layerwatch

    load_speed.write_run(tmp_path, layers=6, samples=3)
    frame = layerwatch.load(tmp_path)
    per_step = frame[frame.layer != ""].groupby("step").size()
    # per layer: the weights' and the gradients' default stats (norm, nonfinite), the update ratio
    # and the five per-module series
    assert per_step.tolist() == [6 * (2 * 2 + 1 + 5)] * 3
    assert sorted(frame.step.unique()) == [0, 10, 20]


def test_the_call_count_of_a_sample_is_the_same_from_run_to_run(benchmarks):
    from step_calls import step_calls
    from timing import counted_calls

    assert counted_calls(lambda: math.sqrt(4.0)) == 1  # the lambda; a builtin is no Python call
    (adds, unsampled), (adds_again, unsampled_again) = step_calls("tfm-tiny", True), step_calls("tfm-tiny", True)
    assert unsampled == unsampled_again and abs(adds - adds_again) <= 4  # a cache or two filled once per process
    assert adds > 2 * unsampled > 0  # a sample is read, reduced and written; an unsampled step only checked


def test_a_short_between_samples_run_reports_the_host_cost_and_the_calls(benchmarks):
    from between_samples import measure, sample_calls

    figures = measure(20, sentinel=True, rounds=1, steps=5)
    assert set(figures) == {"step_us", "own_us", "ratio"} and figures["step_us"] > 0 and figures["ratio"] > 0
    assert sample_calls(20) > 10  # a sample reads, reduces and writes every tensor


def test_the_moe_familys_host_calls_per_router_do_not_grow_with_the_experts(benchmarks):
    from moe import moe_calls

    # 2 routers of 4 and of 32 experts, 56 more rows; 2 x 64 tokens, so that both are judged by the router
    # rules (a sample of fewer than 4 tokens per expert is not, and takes another path)
    few, many = (moe_calls(experts, hidden=32, width=32, seq=64, layers=2) for experts in (4, 32))
    assert few > 0 and abs(many - few) <= 4  # the event file's varints grow with its bytes; nothing per expert
