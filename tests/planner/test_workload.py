"""Workload files and profile files: what they generate, and the errors that name what is wrong."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cluster.planner.cluster_file import helm_flags, to_cluster_config
from cluster.planner.profile import PROFILE_VERSION, Grid, Serving, interpolate, load_profile
from cluster.planner.simulator import COLOCATED, DISAGGREGATED, PoolLimits, Topology
from cluster.planner.workload import load_workload, workload_from_dict
from tests.planner.profiles import linear_profile


def test_constant_and_burst_arrivals_and_lengths():
    constant = workload_from_dict({"arrival": "constant", "rate": 4, "num_requests": 3,
                                   "prompt": {"kind": "uniform", "low": 5, "high": 9}})
    assert [r.arrival_s for r in constant] == [0.0, 0.25, 0.5]
    assert all(5 <= r.prompt_tokens <= 9 and r.output_tokens == 64 for r in constant)
    burst = workload_from_dict({"arrival": "burst", "rate": 2, "burst_size": 2, "num_requests": 4})
    assert [r.arrival_s for r in burst] == [0.0, 0.0, 1.0, 1.0]


def test_poisson_arrivals_average_the_rate_and_repeat_with_the_seed():
    values = {"arrival": "poisson", "rate": 5, "num_requests": 2000, "seed": 3,
              "output": {"kind": "lognormal", "median": 50, "sigma": 0.5, "max": 80}}
    first = workload_from_dict(values)
    assert first == workload_from_dict(values)
    assert first[-1].arrival_s / 1999 == pytest.approx(0.2, rel=0.1)
    assert max(r.output_tokens for r in first) == 80


def test_trace_is_read_in_arrival_order(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"trace": [{"arrival_s": 2, "prompt_tokens": 10, "output_tokens": 3},
                                          {"arrival_s": 1, "prompt_tokens": 20, "output_tokens": 4}]}))
    assert [r.prompt_tokens for r in load_workload(path)] == [20, 10]


@pytest.mark.parametrize("values, field", [({"arrival": "gamma"}, "arrival"), ({"rate": 0}, "rate"),
                                           ({"prompt": {"kind": "zipf"}}, "length kind"),
                                           ({"trace": [{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 1}]},
                                            "prompt_tokens"),
                                           ({"colour": "red"}, "colour")])
def test_bad_workloads_are_refused_by_name(values, field):
    with pytest.raises(ValueError, match=field):
        workload_from_dict(values)


def test_interpolation_is_linear_between_points_and_extends_the_last_segment():
    assert interpolate([0, 10, 20], [0.0, 1.0, 3.0], 15) == pytest.approx(2.0)
    assert interpolate([0, 10, 20], [0.0, 1.0, 3.0], 30) == pytest.approx(5.0)
    grid = Grid([1, 3], [0, 100], [[1.0, 2.0], [3.0, 4.0]])
    assert grid.at(2, 50) == pytest.approx(2.5)
    noisy = Grid([1, 2, 3], [0, 10], [[2.0, 1.0], [1.0, 3.0], [4.0, 0.5]])
    assert noisy.monotone().seconds == [[2.0, 2.0], [2.0, 3.0], [4.0, 4.0]]
    with pytest.raises(ValueError, match="increasing"):
        Grid([3, 1], [0], [[1.0], [2.0]])


def test_profile_round_trips_and_an_old_or_foreign_file_is_refused(tmp_path):
    profile = linear_profile(transfer_per_token_s=1e-3)
    assert load_profile(profile.save(tmp_path / "p.json")) == profile
    (tmp_path / "old.json").write_text(json.dumps({**profile.as_dict(), "version": 0}))
    with pytest.raises(ValueError, match="version"):
        load_profile(tmp_path / "old.json")
    (tmp_path / "other.json").write_text(json.dumps({"version": 1, "prefill": {}}))
    with pytest.raises(ValueError, match="not a pdserve profile"):
        load_profile(tmp_path / "other.json")


def test_prefill_knee_is_where_throughput_stops_growing():
    profile = linear_profile()
    values = [[0.1, 0.1], [0.15, 0.15], [1.0, 1.0]]  # 10 tokens: 100/s; 100: 667/s; 1000: 1000/s
    knee = replace(profile, prefill=Grid([10, 100, 1000], [0, 1], values))
    assert knee.prefill_knee(0.9) == 1000
    assert knee.prefill_knee(0.6) == 100


def test_a_workload_beyond_the_profiled_grid_is_named():
    profile = replace(linear_profile(), decode=Grid([1, 8], [64, 512], [[0.01, 0.02], [0.03, 0.04]]))
    assert profile.beyond(1000, 400) == []
    (note,) = profile.beyond(1000, 900)
    assert "contexts of up to 900 tokens, decode measured to 512" in note


def test_cluster_config_and_helm_flags_of_a_topology():
    config = to_cluster_config(Topology(COLOCATED, 0, 3, decode_limits=PoolLimits(512, 32)))
    assert (config.mode, config.decode.replicas) == ("colocated", 3)
    assert config.engine.scheduler.max_num_batched_tokens == 512
    flags = helm_flags(Topology(DISAGGREGATED, 2, 1))
    assert "ray.prefill.maxReplicas=2" in flags and "ray.decodeGroups[0].replicas=1" in flags



def test_a_plan_with_limits_per_pool_writes_each_pools_engine():
    topology = Topology(DISAGGREGATED, 1, 2, prefill_limits=PoolLimits(4096, 16), decode_limits=PoolLimits(256, 64))
    config = to_cluster_config(topology)
    prefill, decode = config.engine_for("prefill").scheduler, config.engine_for("decode").scheduler
    assert (prefill.max_num_batched_tokens, prefill.max_num_seqs) == (4096, 16)
    assert (decode.max_num_batched_tokens, decode.max_num_seqs) == (256, 64)
    flags = helm_flags(topology)
    assert "cluster.prefill.engine.max_num_batched_tokens=4096" in flags
    assert "cluster.decode.engine.max_num_seqs=64" in flags


def test_a_version_1_profile_loads_with_zero_serving_latencies(tmp_path):
    profile = replace(linear_profile(), serving={"colocated": Serving(first_token_s=0.07, step_s=0.003)})
    assert load_profile(profile.save(tmp_path / "v2.json")) == profile
    old = {key: value for key, value in linear_profile().as_dict().items() if key != "serving"}
    (tmp_path / "v1.json").write_text(json.dumps({**old, "version": 1}))
    loaded = load_profile(tmp_path / "v1.json")
    assert loaded.serving_for("colocated") == Serving(0.0, 0.0) and loaded == linear_profile()
    assert load_profile(tmp_path / "v1.json").version == PROFILE_VERSION


def test_a_version_2_profile_loads_with_no_step_factor_and_no_front_door(tmp_path):
    # Version 2's serving had only the two latencies: a served step as the engine's, the front door free.
    values = {**linear_profile().as_dict(), "version": 2,
              "serving": {"colocated": {"first_token_s": 0.07, "step_s": 0.003}}}
    (tmp_path / "v2.json").write_text(json.dumps(values))
    serving = load_profile(tmp_path / "v2.json").serving_for("colocated")
    assert serving == Serving(first_token_s=0.07, step_s=0.003)
    assert (serving.step_factor, serving.front_door_idle_cores, serving.front_door_request_cpu_s,
            serving.front_door_token_cpu_s) == (1.0, 0.0, 0.0, 0.0)
    full = replace(linear_profile(), serving={"colocated": Serving(0.07, 0.003, 1.4, 0.1, 0.02, 0.001)})
    assert load_profile(full.save(tmp_path / "v3.json")) == full


@pytest.mark.parametrize("text, message", [("[1, 2]", "a workload is a JSON object"),
                                           ("{", "cannot read the workload")])
def test_profile_and_workload_files_are_read_alike(tmp_path, text, message):
    path = tmp_path / "file.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_workload(path)
    with pytest.raises(ValueError, match=message.replace("workload", "profile")):
        load_profile(path)
