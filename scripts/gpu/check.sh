#!/usr/bin/env bash
# The GPU check, run on a lent GPU machine from the repository root, with the binaries that
# scripts/gpu/bundle.sh put into .gpu/ (built elsewhere; the device tool carries .gpu):
#   1. every CUDA test binary (in parallel: they share the GPU), against the CPU caches/references;
#   2. kvcache_cuda_bench (CUDA events; ratios to the copy bandwidth measured in the same run);
#   3. PyTorch's scaled_dot_product_attention on the same shapes, when python3 has torch;
#   4. compute-sanitizer memcheck over the kernel and paged tests, when it is installed.
# Logs go to $OUT (or ./gpu-out); a summary is printed last.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
sum="$out/summary.txt"
: >"$sum"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv >>"$sum" 2>&1

start=$SECONDS
pids=()
for t in .gpu/bin/test_cuda_*; do
  n=$(basename "$t")
  (timeout "${TEST_TIMEOUT:-150}" "$t" --gtest_color=no >"$out/$n.part" 2>&1; echo "rc=$?" >>"$out/$n.part") &
  pids+=($!)
done
wait "${pids[@]}"
for f in "$out"/test_cuda_*.part; do
  n=$(basename "$f" .part)
  echo "==== $n" >>"$out/tests.log"
  cat "$f" >>"$out/tests.log"
  echo "$n: $(tail -1 "$f") $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ test' "$f" | tr -s ' ' | tr '\n' ' ')" >>"$sum"
  grep -E '^\[  FAILED  \] [a-z_]+\.[a-z_0-9/]+' "$f" | sed 's/ (.*//' | sort -u >>"$sum"
  rm -f "$f"
done
echo "tests took $((SECONDS - start)) s" >>"$sum"

start=$SECONDS
timeout "${BENCH_TIMEOUT:-180}" .gpu/bin/kvcache_cuda_bench --benchmark_counters_tabular=true \
  --benchmark_min_time="${BENCH_MIN_TIME:-0.1}" ${BENCH_FILTER:+--benchmark_filter=$BENCH_FILTER} \
  --benchmark_out="$out/bench.json" --benchmark_out_format=json >"$out/bench.txt" 2>&1
echo "bench rc=$? took $((SECONDS - start)) s" >>"$sum"

if [ -z "${SKIP_TORCH:-}" ] && command -v python3 >/dev/null; then
  start=$SECONDS
  PYTHONUNBUFFERED=1 timeout 90 python3 scripts/gpu/sdpa_baseline.py >"$out/sdpa.txt" 2>&1
  echo "sdpa rc=$? took $((SECONDS - start)) s" >>"$sum"
fi

if [ -z "${SKIP_MEMCHECK:-}" ] && command -v compute-sanitizer >/dev/null; then
  start=$SECONDS
  for n in ${MEMCHECK_TESTS:-test_cuda_kernels test_cuda_paged}; do
    (timeout "${MEMCHECK_TIMEOUT:-120}" compute-sanitizer --tool memcheck --error-exitcode 3 .gpu/bin/$n --gtest_color=no \
      >"$out/memcheck_$n.part" 2>&1; echo "rc=$?" >>"$out/memcheck_$n.part") &
  done
  wait
  for f in "$out"/memcheck_*.part; do
    echo "==== $(basename "$f" .part)" >>"$out/memcheck.log"
    cat "$f" >>"$out/memcheck.log"
    echo "$(basename "$f" .part): $(tail -1 "$f") $(grep -c 'Invalid\|ERROR SUMMARY' "$f") error lines" >>"$sum"
    rm -f "$f"
  done
  echo "memcheck took $((SECONDS - start)) s" >>"$sum"
fi

echo "================ bench"
grep -E 'copy bandwidth|BM_' "$out/bench.txt" | sed -e 's/ \+/ /g' | cut -c1-150
[ -f "$out/sdpa.txt" ] && { echo "================ sdpa"; cat "$out/sdpa.txt"; }
echo "================ summary"
cat "$sum"
