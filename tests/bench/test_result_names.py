"""Result files are named by what was measured, on which kind of machine, on which day: two runs on
different CPUs or days never overwrite each other, and a reader can tell them apart from `ls`."""

from __future__ import annotations

import datetime

import pytest

from benchmarks.common import RESULTS, Cpu, machine_slug, result_name, result_path, run_date

X86 = "fpu sse sse2 avx fma"


@pytest.mark.parametrize(("model", "vendor", "flags", "slug"), [
    ("AMD EPYC", "AuthenticAMD", f"{X86} avx2", "epyc-avx2-2c"),
    ("AMD EPYC", "AuthenticAMD", f"{X86} avx2 avx512f avx512_vnni avx512_bf16", "epyc-avx512bf16-2c"),
    ("Intel(R) Xeon(R) Processor @ 2.60GHz", "GenuineIntel", f"{X86} avx2 avx512f avx512_vnni", "xeon-avx512-2c"),
    ("Intel(R) Xeon(R) Processor", "GenuineIntel", f"{X86} avx2 avx512f avx512_bf16 amx_tile amx_bf16", "xeon-amx-2c"),
    ("Intel(R) Pentium(R) Gold 7505", "GenuineIntel", X86, "intel-2c"),
])
def test_the_machine_is_the_cpu_line_its_widest_simd_and_its_cores(model: str, vendor: str, flags: str,
                                                                   slug: str) -> None:
    assert machine_slug(Cpu(model, vendor, frozenset(flags.split()), cores=2)) == slug


def test_a_result_name_carries_the_benchmark_the_machine_and_the_date() -> None:
    name = result_name("step-vs-linear", "epyc-avx512bf16-2c", datetime.date(2026, 12, 3), ".png")
    assert name == "step-vs-linear.epyc-avx512bf16-2c.2026-12-03.png"


def test_result_paths_name_this_machine_and_today() -> None:
    path = result_path("kv-transfer")
    here = machine_slug(Cpu.here())
    assert path.parent == RESULTS
    assert path.name == f"kv-transfer.{here}.{run_date().isoformat()}.json"
    assert result_path("kv-transfer", ".png").name == path.name.removesuffix(".json") + ".png"
