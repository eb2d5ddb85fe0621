#!/usr/bin/env bash
# All of kvcache's tests, as CI runs them (.ci/run). Installs missing Debian packages first, then
# runs these stages, each in its own build directory under build/:
#   gcc      g++ 12, Release, -Werror, CUDA backend too when nvcc is found; everything; ctest
#   clang    clang 14, Release, -Werror, no CUDA; everything; ctest
#   asan     AddressSanitizer + UndefinedBehaviorSanitizer, -O1 -g1 with asserts on, no CUDA/bench; ctest
#            (all but consumer_add_subdirectory; test_noexcept not built)
#            (sanitizer stages do not use -Werror: GCC's warnings at -O1 under instrumentation have
#            false positives; the gcc and clang stages hold the warning line)
#   tsan     ThreadSanitizer build of the tests whose name contains "threads"; ctest -R threads
#   aarch64  cross build for aarch64 and run under qemu (scripts/cross_aarch64.sh)
# Any failure fails the script, and so does a signal (after the running command ends); a summary
# of stage times and test counts is printed at the end.
#
# Environment:
#   KVCACHE_STAGES="gcc asan"  run only these stages (default: gcc clang asan tsan aarch64)
#   KVCACHE_JOBS=N             parallel build and test jobs (default 2)
#   KVCACHE_SKIP_DEPS=1        do not run scripts/install_deps.sh
#   KVCACHE_CLEAN=1            delete each stage's build directory before building
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

stages="${KVCACHE_STAGES:-gcc clang asan tsan aarch64}"
jobs="${KVCACHE_JOBS:-2}"
export CMAKE_BUILD_PARALLEL_LEVEL="$jobs"
export CTEST_PARALLEL_LEVEL="$jobs"
export CTEST_OUTPUT_ON_FAILURE=1
# The end-to-end tests on ../shared/data must run here, not skip (tests/shared_model.hpp).
export KVCACHE_REQUIRE_MODEL="${KVCACHE_REQUIRE_MODEL:-1}"

for s in $stages; do
  case "$s" in
    gcc | clang | asan | tsan | aarch64) ;;
    *) echo "test.sh: unknown stage '$s' (known: gcc clang asan tsan aarch64)" >&2; exit 2 ;;
  esac
done

banner() {
  echo
  echo "=================================================================================="
  echo "== $*"
  echo "=================================================================================="
}

summary=()
interrupted=""  # the signal that ended the run (on_signal), if one did
current_stage=""
stage_start=0
stage_cpu0=0
script_start=$SECONDS

# CPU seconds (user + system) used so far by finished child processes, in $cpu_now: with the wall
# time it shows what a stage costs on a machine that is busy with other work. (`times` must run in
# this shell, not in a $(...) subshell, to see this shell's children.)
times_file="$(mktemp)"
cpu_now=0
cpu_seconds() {
  times >"$times_file"
  cpu_now=$(tail -1 "$times_file" | awk '{ t = 0; for (i = 1; i <= 2; ++i) { split($i, a, "m"); t += a[1] * 60 + a[2] } printf "%d", t }')
}

print_summary() {
  local status=$1
  cpu_seconds
  rm -f "$times_file"
  banner "summary: stage times ($(nproc) cores, -j$jobs)"
  local line
  for line in "${summary[@]}"; do echo "$line"; done
  if [[ $status -ne 0 && -n "$current_stage" ]]; then
    printf '%-8s %-7s %5ds wall %6ds cpu   %s\n' "$current_stage" FAILED $((SECONDS - stage_start)) \
      $((cpu_now - stage_cpu0)) "$tests_line"
  fi
  printf '%-8s %-7s %5ds wall %6ds cpu\n' total "" $((SECONDS - script_start)) "$cpu_now"
  if [[ -n "$interrupted" ]]; then echo "test.sh: FAILED: interrupted by $interrupted"
  elif [[ $status -eq 0 ]]; then echo "test.sh: all stages passed"
  else echo "test.sh: FAILED"; fi
}
trap 'print_summary $?' EXIT
# A signal ends the script with a failure, never with the summary's "all stages passed": killed
# without these traps, bash ran the EXIT trap with the status of the last command that had
# finished (0), and said so. (bash runs a trap once the command it waits for has ended: a signal
# sent to this script alone lets the running build or ctest finish first; one sent to the process
# group, as Ctrl-C does, ends them too.)
on_signal() {
  interrupted=$1
  exit "$2"
}
trap 'on_signal SIGINT 130' INT
trap 'on_signal SIGTERM 143' TERM
trap 'on_signal SIGHUP 129' HUP

if [[ "${KVCACHE_SKIP_DEPS:-0}" != 1 ]]; then
  banner "dependencies (scripts/install_deps.sh)"
  "$repo/scripts/install_deps.sh"
fi

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

# nvcc on PATH, else the CUDA Toolkit's default location.
nvcc_path=""
if command -v nvcc >/dev/null 2>&1; then
  nvcc_path="$(command -v nvcc)"
elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
  nvcc_path=/usr/local/cuda/bin/nvcc
fi

pick() {  # first of the given commands that exists
  local c
  for c in "$@"; do
    if command -v "$c" >/dev/null 2>&1; then echo "$c"; return; fi
  done
  echo "$1"
}
gxx="$(pick g++-12 g++)"
clangxx="$(pick clang++-14 clang++)"

tests_line=""
# run_ctest <build dir> [ctest args...]: runs ctest, echoes everything, keeps the summary line.
run_ctest() {
  local dir=$1
  shift
  local log="$dir/ctest.log"
  local rc=0
  (cd "$dir" && ctest --output-on-failure -j "$jobs" "$@") 2>&1 | tee "$log" || rc=$?
  tests_line="$(grep -E 'tests passed|No tests were found' "$log" | tail -1 || true)"
  return "$rc"
}

# configure_build <stage> <extra cmake args...>: fresh or incremental configure, then build all.
configure_build() {
  local dir="build/$1"
  shift
  if [[ "${KVCACHE_CLEAN:-0}" == 1 ]]; then rm -rf "$dir"; fi
  cmake -S . -B "$dir" "${generator[@]}" "$@"
  cmake --build "$dir" -j "$jobs"
}

stage_begin() {
  current_stage=$1
  stage_start=$SECONDS
  cpu_seconds
  stage_cpu0=$cpu_now
  tests_line=""
  banner "stage $1: $2"
}
stage_end() {  # stage_end [status] [note]: status passed (default) or skipped; note defaults to ctest's line
  cpu_seconds
  summary+=("$(printf '%-8s %-7s %5ds wall %6ds cpu   %s' "$current_stage" "${1:-passed}" $((SECONDS - stage_start)) \
    $((cpu_now - stage_cpu0)) "${2:-$tests_line}")")
  current_stage=""
}

for stage in $stages; do
  case "$stage" in
    gcc)
      cuda_args=(-DKVCACHE_CUDA=OFF)
      cuda_note="CUDA off (no nvcc)"
      if [[ -n "$nvcc_path" ]]; then
        cuda_args=(-DKVCACHE_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc_path" "-DCMAKE_CUDA_HOST_COMPILER=$(command -v "$gxx")")
        cuda_note="CUDA on ($nvcc_path)"
      fi
      stage_begin gcc "$("$gxx" --version | head -1), Release, -Werror, $cuda_note"
      configure_build gcc -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_COMPILER=$gxx" -DKVCACHE_WERROR=ON \
        "${cuda_args[@]}"
      run_ctest build/gcc
      stage_end
      ;;
    clang)
      stage_begin clang "$("$clangxx" --version | head -1), Release, -Werror, CUDA off"
      configure_build clang -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_COMPILER=$clangxx" -DKVCACHE_WERROR=ON \
        -DKVCACHE_CUDA=OFF
      run_ctest build/clang
      stage_end
      ;;
    asan)
      stage_begin asan "$gxx, -fsanitize=address,undefined, -O1 -g1 with asserts, CUDA, bench and test_noexcept off"
      # RelWithDebInfo without -DNDEBUG: internal asserts stay on.
      # -g1 (line tables: what the sanitizers' stack traces print) rather than -g: the AVX-512
      # kernels compiled 1.7x faster so (276 -> 159 s for kernels_avx512vnni.cpp on a slow day).
      # test_noexcept (the library built again with -fno-exceptions) is left to the other stages.
      configure_build asan -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
        "-DCMAKE_CXX_COMPILER=$gxx" -DKVCACHE_WERROR=OFF -DKVCACHE_CUDA=OFF -DKVCACHE_BUILD_BENCH=OFF \
        -DKVCACHE_SANITIZE=address,undefined -DKVCACHE_NOEXCEPT_TEST=OFF
      # consumer_add_subdirectory rebuilds the whole library under the sanitizers (150 s of the
      # stage on a slow day, when the whole script took 50 of its 60 minutes): it is left to the
      # gcc and clang stages; consumer_find_package still links a consumer with the sanitizers here.
      ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1 \
      UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        run_ctest build/asan -E '^consumer_add_subdirectory$'
      stage_end
      ;;
    tsan)
      stage_begin tsan "$gxx, -fsanitize=thread, tests whose name contains 'threads'"
      dir=build/tsan
      if [[ "${KVCACHE_CLEAN:-0}" == 1 ]]; then rm -rf "$dir"; fi
      cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" "-DCMAKE_CXX_COMPILER=$gxx" -DKVCACHE_WERROR=OFF \
        -DKVCACHE_CUDA=OFF -DKVCACHE_BUILD_BENCH=OFF -DKVCACHE_BUILD_EXAMPLES=OFF -DKVCACHE_SANITIZE=thread
      # Test names are their target names (tests/test_<name>.cpp -> test_<name>).
      mapfile -t tsan_tests < <(cd "$dir" && ctest -N -R threads | sed -n 's/^ *Test *#[0-9]*: *//p')
      if [[ ${#tsan_tests[@]} -eq 0 ]]; then
        echo "tsan: no test whose name contains 'threads' exists yet: nothing to run"
        stage_end skipped "no test named *threads* yet"
      else
        echo "tsan: building ${tsan_tests[*]}"
        cmake --build "$dir" -j "$jobs" --target "${tsan_tests[@]}"
        TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" run_ctest "$dir" -R threads
        stage_end
      fi
      ;;
    aarch64)
      stage_begin aarch64 "cross build for aarch64, tests under qemu (scripts/cross_aarch64.sh)"
      if [[ -x scripts/cross_aarch64.sh ]]; then
        if [[ "${KVCACHE_CLEAN:-0}" == 1 ]]; then rm -rf build/aarch64; fi
        mkdir -p build
        rc=0
        BUILD_DIR="$repo/build/aarch64" JOBS="$jobs" scripts/cross_aarch64.sh 2>&1 | tee build/aarch64.log || rc=$?
        if [[ $rc -ne 0 ]]; then exit "$rc"; fi
        stage_end passed "$(grep -E 'tests passed' build/aarch64.log | tail -1 || true)"
      else
        echo "aarch64: scripts/cross_aarch64.sh does not exist yet: skipped"
        stage_end skipped "no scripts/cross_aarch64.sh yet"
      fi
      ;;
  esac
done
