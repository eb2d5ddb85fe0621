#!/usr/bin/env bash
# The main demo: installs missing Debian packages, builds the decode_loop example (Release, CPU,
# nothing else) in build/demo and runs it. Arguments go to decode_loop, e.g.
#   scripts/demo.sh --cache paged --steps 256
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

if [[ "${KVCACHE_SKIP_DEPS:-0}" != 1 ]]; then
  scripts/install_deps.sh
fi

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

dir=build/demo
cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DKVCACHE_CUDA=OFF \
  -DKVCACHE_BUILD_TESTS=OFF -DKVCACHE_BUILD_BENCH=OFF -DKVCACHE_BUILD_EXAMPLES=ON >/dev/null
cmake --build "$dir" -j "${KVCACHE_JOBS:-2}" --target decode_loop

echo "+ $dir/examples/decode_loop $*"
exec "$dir/examples/decode_loop" "$@"
