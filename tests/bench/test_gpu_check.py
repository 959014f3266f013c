"""The GPU check's dry run: the same code as on a GPU, on the CPU with tiny shapes (Triton in its
interpreter), writes every section's figures; a section that fails is recorded, not fatal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("device", "correctness", "decode", "prefill", "cuda_graphs", "kv_copy", "memory")


def dry_run(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=environment)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check")
    result = dry_run(out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (out / "gpu-check.md").read_text().startswith("# GPU check: cpu")
    return json.loads((out / "gpu-check.json").read_text())


def test_every_section_ran_without_error(report: dict) -> None:
    assert [name for name in SECTIONS if name in report] == list(SECTIONS)
    assert not [name for name in SECTIONS if "error" in report[name]]
    assert report["machine"]["gpu"] == "cpu" and report["machine"]["torch"] and report["machine"]["triton"]


def test_the_triton_backend_agrees_with_the_torch_backend(report: dict) -> None:
    compared = report["correctness"]["triton_vs_torch"]
    assert compared["tokens_equal"] and compared["steps_compared"] == report["correctness"]["tokens"]
    assert 0 < compared["logits_max_abs_diff"] < 0.05 * compared["logits_max_abs"]  # bf16 rounding, not zero
    assert "skipped" in report["correctness"]["graphs_vs_eager"]
    assert "skipped" in report["cuda_graphs"]


def test_decode_prefill_and_copies_are_measured(report: dict) -> None:
    rows = report["decode"]["rows"]
    assert [row["batch"] for row in rows] == [1, 4, 8]
    assert all(row["tokens_per_s"] > 0 and 0 < row["fraction_of_roofline"] < 1 for row in rows)
    assert report["device"]["copy_bandwidth_gbs"] > 0 and report["device"]["matmul_tflops"] > 0
    assert report["prefill"]["tokens_per_s"] > 0 and 0 < report["prefill"]["mfu_of_measured_matmul"] < 1
    assert report["kv_copy"]["gather_gbs"] > 0 and report["kv_copy"]["scatter_gbs"] > 0


def test_sections_past_their_deadline_skip_their_work(tmp_path: Path) -> None:
    result = dry_run(tmp_path, "--minutes", "0")  # every section starts past its deadline
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row.get("skipped") for row in report["decode"]["rows"]] == ["out of time"] * 3
    assert report["correctness"]["triton_vs_torch"]["tokens_equal"]  # a section's first item always runs


def test_a_failing_section_is_recorded_and_the_next_still_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import gpu_check

    def broken(run: gpu_check.Run) -> dict:
        raise RuntimeError("the kernel launch failed")

    monkeypatch.setitem(gpu_check.SECTIONS, "kv_copy", broken)
    run = gpu_check.Run(gpu_check.DRY, "cpu")
    report = gpu_check.Report(tmp_path, {"gpu": "cpu", "torch": "-", "triton": "-", "cuda": None, "command": "-"})
    assert not gpu_check.run_section(run, report, "kv_copy", 60)
    assert gpu_check.run_section(run, report, "memory", 60)
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    assert saved["kv_copy"]["error"] == "RuntimeError: the kernel launch failed"
    assert "after_runs" in saved["memory"]
    assert "the kernel launch failed" in (tmp_path / "gpu-check.md").read_text()
