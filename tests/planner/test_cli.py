"""`pdserve profile --quick` on the tiny model, and `pdserve plan --write` into a config `serve` accepts."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.planner.profile import load_profile
from cluster.ray_cluster.config import load_cluster_config
from tests.planner.profiles import linear_profile


def test_profile_quick_writes_a_valid_profile_of_the_tiny_model(tmp_path):
    out = tmp_path / "profile.json"
    assert main(["profile", "--quick", "--dtype", "float32", "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.dtype == "float32" and profile.threads >= 1 and profile.machine["cores"] >= 1
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x fp32
    times = [t for grid in (profile.prefill, profile.decode) for row in grid.seconds for t in row]
    assert all(0 < t < 5 for t in times + profile.transfer_seconds)
    assert profile.step_seconds([(8, 0)], [16]) > 0


def test_plan_writes_a_cluster_config_that_serve_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the table on one line a row
    profile = linear_profile(transfer_per_token_s=1e-6).save(tmp_path / "profile.json")
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps({"arrival": "constant", "rate": 1 / 0.6, "num_requests": 30,
                                    "prompt": {"kind": "constant", "value": 1000},
                                    "output": {"kind": "constant", "value": 101}}))
    out = tmp_path / "cluster.yaml"
    assert main(["plan", "--profile", str(profile), "--workload", str(workload), "--slo-ttft", "1.5s",
                 "--slo-tpot", "15ms", "--budget", "4", "--token-budgets", "512,2048", "--max-num-seqs", "64",
                 "--write", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "choice" in printed and "runner-up" in printed and "2P+1D" in printed
    assert "no serving latencies for colocated and disaggregated" in printed  # a profile of one engine
    config = load_cluster_config(out)
    assert (config.mode, config.prefill.replicas, config.decode.replicas) == ("disaggregated", 2, 1)
    assert config.engine.scheduler.max_num_seqs == 64


@pytest.mark.parametrize("flag, value", [("--slo-tpot", "fast"), ("--budget", "x")])
def test_plan_refuses_bad_arguments_by_name(tmp_path, capsys, flag, value):
    args = {"--profile": "p.json", "--workload": "w.json", "--slo-ttft": "2s", "--slo-tpot": "200ms", "--budget": "2"}
    args[flag] = value
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *[item for pair in args.items() for item in pair]])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_plan_names_a_missing_profile(tmp_path, capsys):
    code = main(["plan", "--profile", str(tmp_path / "none.json"), "--workload", "w.json", "--slo-ttft", "2s",
                 "--slo-tpot", "200ms", "--budget", "2"])
    assert code == 2
    assert "cannot read the profile" in capsys.readouterr().err


def test_planning_loads_neither_torch_nor_ray():
    # In a fresh interpreter, as `pdserve plan` runs: the search must stay light (only `measure` loads torch).
    from tests.common.test_light_imports import HEAVY, loaded_after_import

    assert not loaded_after_import("cluster.planner.report") & {*HEAVY, "numpy"}
