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
# Both hold the dev extra too (tests, lint, benchmarks): `make install` takes them. cpu-runtime.txt and
# cuda-runtime.txt are their subsets without it, at the same versions: what the images install.
set -euo pipefail
cd "$(dirname "$0")/.."
uv=${UV:-uv}
mode=${1:-lock}
unset UV_INDEX UV_INDEX_URL UV_DEFAULT_INDEX UV_EXTRA_INDEX_URL UV_FIND_LINKS UV_CONSTRAINT UV_OVERRIDE

if [ "$mode" = check ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
  cp requirements/cuda.txt requirements/cuda-runtime.txt "$out/"
  cp requirements/cpu.txt requirements/cpu-runtime.txt "$out/"
  upgrade=()
else
  out=requirements
  upgrade=(--upgrade)
fi

# The public index has no `+cpu` torch: the CPU files are resolved with the plain version, marked after.
for lock in cpu cpu-runtime; do
  [ -f "$out/$lock.txt" ] && sed -i 's/^torch==\(.*\)+cpu$/torch==\1/' "$out/$lock.txt"
done
compile=("$uv" pip compile pyproject.toml --no-config --python-version 3.11 --python-platform x86_64-manylinux_2_28
         --custom-compile-command "make lock" --quiet)
"${compile[@]}" --extra dev "${upgrade[@]}" -o "$out/cuda.txt"
"${compile[@]}" --extra dev "${upgrade[@]}" --override requirements/cpu-overrides.txt -o "$out/cpu.txt"
"${compile[@]}" --constraint "$out/cuda.txt" -o "$out/cuda-runtime.txt"
"${compile[@]}" --constraint "$out/cpu.txt" --override requirements/cpu-overrides.txt \
  --override requirements/cpu-runtime-overrides.txt -o "$out/cpu-runtime.txt"
sed -i 's/^torch==\([^+]*\)$/torch==\1+cpu/' "$out/cpu.txt" "$out/cpu-runtime.txt"

if [ "$mode" = check ]; then
  for lock in cuda cpu cuda-runtime cpu-runtime; do
    diff -u <(grep -v '^ *#' "requirements/$lock.txt") <(grep -v '^ *#' "$out/$lock.txt")  # the pins
  done
  echo "requirements/{cpu,cuda}{,-runtime}.txt: consistent with pyproject.toml and resolvable from the public index"
fi
