#!/usr/bin/env bash
# Installs what kvcache's build, tests, benchmarks and cross tests need on Debian 12 (bookworm),
# skipping every package that is already installed; runs `apt-get update` only when something is
# missing. Idempotent. Works as root, or through sudo when not root.
# The CUDA Toolkit is optional and not installed here: it is used when nvcc is on PATH or at
# /usr/local/cuda/bin/nvcc.
set -euo pipefail

packages=(cmake ninja-build g++ clang libgtest-dev googletest libbenchmark-dev libfmt-dev libxxhash-dev
          qemu-user)
# Cross compiler for the aarch64 stage; an aarch64 host builds natively instead.
if [[ "$(uname -m)" == "x86_64" ]]; then
  packages+=(g++-aarch64-linux-gnu)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
if [[ $(id -u) -eq 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "install_deps: not root and no sudo: install these packages yourself: ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
