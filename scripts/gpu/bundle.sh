#!/usr/bin/env bash
# Builds the CUDA tests and bench here (nvcc, no GPU needed) and copies them, with the shared
# libraries a bare GPU machine may lack, into .gpu/ (ignored by git) for the device tool's `carry`.
# Then, on the GPU machine: scripts/gpu/check.sh (tests, bench, torch baseline, memcheck).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-cuda}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCACHE_CUDA=ON \
  -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DKVCACHE_BUILD_BENCH=ON -DKVCACHE_BUILD_TESTS=ON -DKVCACHE_WERROR=ON -DKVCACHE_CUDA_EMULATED_TESTS=OFF >/dev/null
tests=(test_cuda_validation test_cuda_kernels test_cuda_graph test_cuda_contiguous test_cuda_paged test_cuda_two_tier)
ninja -C "$build" kvcache_cuda_bench "${tests[@]}"
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
for t in "${tests[@]}"; do cp "$build/tests/$t" .gpu/bin/; done
cp "$build/cuda/kvcache_cuda_bench" .gpu/bin/
# Every non-system library the binaries load (libcudart, libbenchmark...), resolved here.
for f in .gpu/bin/*; do ldd "$f"; done | awk '/=> \// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+)\.so' | xargs -r cp -L -t .gpu/lib
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.gpu/' >> .git/info/exclude; }
du -sh .gpu
