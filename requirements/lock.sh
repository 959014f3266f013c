#!/usr/bin/env bash
# The locks, resolved by uv from pyproject.toml and the public index alone: uv reads no pip
# configuration, --no-config skips uv.toml files and the UV_* index variables are unset, so no local
# wheel folder or mirror takes part. Both are for CPython 3.11 on x86-64 Linux (manylinux_2_28).
#
#   requirements/lock.sh         # `make lock`: the newest versions pyproject.toml allows
#   requirements/lock.sh check   # `make check-lock`: resolve again, keeping the locked versions where
#                                # pyproject.toml still allows them; fail on any difference
#
# cuda.txt: torch as the public index has it (the CUDA 13 build) with its CUDA libraries.
# cpu.txt: the same set without torch's CUDA libraries (cpu-overrides.txt), and torch pinned to the
# CPU build of the same version (`+cpu`, from PyTorch's CPU wheel index).
set -euo pipefail
cd "$(dirname "$0")/.."
uv=${UV:-uv}
mode=${1:-lock}
unset UV_INDEX UV_INDEX_URL UV_DEFAULT_INDEX UV_EXTRA_INDEX_URL UV_FIND_LINKS UV_CONSTRAINT UV_OVERRIDE

if [ "$mode" = check ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
  cp requirements/cuda.txt "$out/cuda.txt"
  sed 's/^torch==\(.*\)+cpu$/torch==\1/' requirements/cpu.txt > "$out/cpu.txt"
  upgrade=()
else
  out=requirements
  upgrade=(--upgrade)
fi

compile=("$uv" pip compile pyproject.toml --extra dev --no-config --python-version 3.11
         --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" --quiet "${upgrade[@]}")
"${compile[@]}" -o "$out/cuda.txt"
[ -f "$out/cpu.txt" ] && sed -i 's/^torch==\(.*\)+cpu$/torch==\1/' "$out/cpu.txt"
"${compile[@]}" --override requirements/cpu-overrides.txt -o "$out/cpu.txt"
sed -i 's/^torch==\([^+]*\)$/torch==\1+cpu/' "$out/cpu.txt"

if [ "$mode" = check ]; then
  diff -u requirements/cuda.txt "$out/cuda.txt"
  diff -u requirements/cpu.txt "$out/cpu.txt"
  echo "requirements/cuda.txt and cpu.txt: consistent with pyproject.toml and resolvable from the public index"
fi
