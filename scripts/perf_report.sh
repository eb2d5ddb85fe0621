#!/usr/bin/env bash
# Decode-attention performance report (DESIGN.md section 3): runs kvcache_bench once, filtered to
# the BM_read baselines and the BM_attend benches of one ISA, and prints for contiguous f16, paged
# f16 (16-token blocks; 64-token ones at 32k too, for comparison) and two-tier Q4 at 4k and 32k
# tokens (8 KV heads x 128, 32 query heads): tokens/s of one layer's decode step, K+V bytes read per
# second, the ratio to the streaming-read bandwidth (BM_read) of the same run with the same thread
# count, and the ratios paged/contiguous and two-tier/f16; then the same two ratios measured paired
# (BM_attend_paired: one step of each cache in turn, which a machine whose speed drifts disturbs
# less than separate benchmarks), with contiguous f16's ratio to a read of as many bytes taken in
# the same rotation. Each cache holds enough layers for bench::stream_bytes() of its own K+V (twice
# the L3 Google Benchmark reports, or glibc's where it finds none, at least 128 MiB; on a VM with
# 480 MiB of L3: f16 60 layers at 4k and 8 at 32k, two-tier Q4 192 and 24) and each step reads the
# next layer, so that every figure is of K+V read from memory, as in an engine's decode loop
# (bench_attend.cpp, layers_for), each cache read once by a step over every layer before any step
# is timed (first_step: a cache just filled reads slower the first time); the BM_read baseline
# reads as many bytes (256 MiB at least), from huge pages, as attention does (bench_common.hpp:
# stream_bytes, buffer). Last, the same step over
# one 4k layer kept in the L3 (BM_attend_cached): attention's speed without memory's, against the 4k
# rows from memory.
#
# usage: scripts/perf_report.sh [build-dir] [isa]
#   build-dir  a build with -DKVCACHE_BUILD_BENCH=ON (default: build; kvcache_bench is built if missing)
#   isa        scalar|avx2|avx512|neon (default: the best this CPU supports)
# Environment: KVCACHE_BENCH_MIN_TIME (seconds per benchmark and repetition, default 0.3),
#   KVCACHE_BENCH_REPETITIONS (default 5, run in random interleaved order; each figure is the best repetition, baselines included,
#   which filters out the time slices a shared machine takes away).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$repo/build}"
isa="${2:-}"
min_time="${KVCACHE_BENCH_MIN_TIME:-0.3}"
repetitions="${KVCACHE_BENCH_REPETITIONS:-5}"

if [[ ! -x "$build/bench/kvcache_bench" ]]; then
  cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCACHE_BUILD_BENCH=ON >/dev/null
  cmake --build "$build" --target kvcache_bench
fi
bench="$build/bench/kvcache_bench"

if [[ -z "$isa" ]]; then
  for candidate in avx512 avx2 neon scalar; do
    if "$bench" --benchmark_list_tests --benchmark_filter="^BM_attend/.*/$candidate/" | grep -q .; then
      isa="$candidate"
      break
    fi
  done
fi

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
"$bench" --benchmark_filter="^BM_read|^BM_attend(_cached)?/(contiguous|paged|paged_b64|two_tier)/[^/]+/$isa/|^BM_attend_paired/$isa/" \
  --benchmark_min_time="$min_time" --benchmark_repetitions="$repetitions" --benchmark_enable_random_interleaving=true --benchmark_out="$out" --benchmark_out_format=json >&2

python3 - "$out" "$isa" <<'EOF'
import json, re, subprocess, sys

data = json.load(open(sys.argv[1]))
isa = sys.argv[2]
read = {}   # threads -> bytes/s of BM_read
read_all = {}  # threads -> every repetition's bytes/s of BM_read
rows = {}   # (cache, ctx, threads) -> (tokens/s, bytes/s, layers) of the best repetition
spread = {} # (cache, ctx, threads) -> every repetition's tokens/s
paired = {} # (ctx, threads) -> [(paged/contiguous, two-tier/f16, f16 x read), ...] per repetition
cached = {} # (cache, threads) -> (tokens/s, bytes/s) of BM_attend_cached's best repetition
for b in data["benchmarks"]:
    if b.get("run_type") == "aggregate" or b.get("error_occurred"):
        continue
    name = b["name"]
    if name.startswith("BM_read"):
        t = int(b.get("threads", 1))
        read[t] = max(read.get(t, 0.0), b["bytes_per_second"])
        read_all.setdefault(t, []).append(b["bytes_per_second"])
        continue
    m = re.match(r"BM_attend_paired/(\w+)/ctx:(\d+)/t:(\d+)", name)
    if m:
        paired.setdefault((int(m.group(2)), int(m.group(3))), []).append(
            (b["paged_over_contiguous"], b["two_tier_over_f16"], b["f16_over_read"]))
        continue
    m = re.match(r"BM_attend_cached/(\w+)/(\w+)/(\w+)/ctx:(\d+)/t:(\d+)", name)
    if m:
        key = (m.group(1) + " " + m.group(2), int(m.group(5)))
        if key not in cached or cached[key][0] < b["tokens_per_s"]:
            cached[key] = (b["tokens_per_s"], b["bytes_per_second"])
        continue
    m = re.match(r"BM_attend/(\w+)/(\w+)/(\w+)/ctx:(\d+)/t:(\d+)", name)
    if m:
        key = (m.group(1) + " " + m.group(2), int(m.group(4)), int(m.group(5)))
        spread.setdefault(key, []).append(b["tokens_per_s"])
        if key not in rows or rows[key][0] < b["tokens_per_s"]:
            rows[key] = (b["tokens_per_s"], b["bytes_per_second"], int(b.get("layers", 1)))

ctx = data.get("context", {})
# The CPU, by model name and family/model numbers: a VM's name alone ("AMD EPYC") hides which
# generation ran the figures (this project's VM moved from Zen 4 to Zen 5 between sessions).
cpu = {}
try:
    for line in open("/proc/cpuinfo"):
        k, _, v = line.partition(":")
        k = k.strip()
        if k in ("model name", "cpu family", "model", "CPU implementer", "CPU part") and k not in cpu:
            cpu[k] = v.strip()
except OSError:
    pass
cpu_text = ", ".join(f"{k} {v}" for k, v in cpu.items())
print(f"\nbest of {data['benchmarks'][0].get('repetitions', 1)} repetitions; decode attention, 1 sequence, 8 KV heads x 128, 32 query heads; ISA {isa}; "
      f"{ctx.get('num_cpus', '?')} CPUs, {ctx.get('host_name', '')}; {cpu_text}; built by {ctx.get('kvcache_compiler', 'an unrecorded compiler')}")
for t, bw in sorted(read.items()):
    print(f"streaming read (BM_read, {t} thread{'s' if t > 1 else ''}): {bw / 1e9:.2f} GB/s")
# The ratios below are only as good as this baseline: say so where it looks disturbed (its
# repetitions more than 1.5x apart, or 1 thread below a quarter of 2 threads' bandwidth).
for t, v in sorted(read_all.items()):
    if max(v) > 1.5 * min(v):
        print(f"warning: BM_read with {t} thread(s) ranged {min(v) / 1e9:.2f}-{max(v) / 1e9:.2f} GB/s over the repetitions")
if 1 in read and 2 in read and read[1] < 0.25 * read[2]:
    print("warning: BM_read with 1 thread is below a quarter of 2 threads' bandwidth: the baseline looks "
          "disturbed, so are the ratios to it; run the report again")
print()
print(f"{'cache':<16} {'context':>8} {'layers':>6} {'threads':>7} {'tokens/s':>10} {'K+V GB/s':>9} {'x read bw':>9} {'spread':>7}")
for (cache, n, t), (tps, bps, layers) in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    ratio = bps / read[t] if t in read else float("nan")
    v = spread[(cache, n, t)]
    print(f"{cache:<16} {n:>8} {layers:>6} {t:>7} {tps:>10.1f} {bps / 1e9:>9.2f} {ratio:>9.3f} {max(v) / min(v):>7.2f}")
print("(spread: the fastest repetition's tokens/s over the slowest's; above about 1.2 the machine's speed moved")
print(" during the run, and the ratios below, of best repetitions, move with it)")
print()
print(f"{'context':>8} {'threads':>7} {'paged/contiguous':>17} {'two-tier/f16':>13} {'paged_b64/contiguous':>21}")
for n in sorted({k[1] for k in rows}):
    for t in sorted({k[2] for k in rows}):
        c = rows.get(("contiguous f16", n, t))
        p = rows.get(("paged f16", n, t))
        q = rows.get(("two_tier q4", n, t))
        p64 = rows.get(("paged_b64 f16", n, t))
        if c:
            pc = f"{p[0] / c[0]:.3f}" if p else "-"
            qc = f"{q[0] / c[0]:.3f}" if q else "-"
            p64c = f"{p64[0] / c[0]:.3f}" if p64 else "-"
            print(f"{n:>8} {t:>7} {pc:>17} {qc:>13} {p64c:>21}")
print("(tokens/s ratios; targets: paged/contiguous >= 0.9 with the default 16-token blocks, two-tier/f16 >= 2.5;")
print(" paged_b64: 64-token blocks, 32k only, for comparison)")
if cached:
    # The same step with its K+V from the L3 (one 4k layer, read step after step): the speed of
    # attention itself, without memory's. "x 4k row": over the 4k row above, whose K+V comes from
    # memory; near 1 the step is bound by its own arithmetic, not by the read.
    l3 = max((c.get("size", 0) for c in ctx.get("caches", []) if c.get("type") != "Instruction"), default=0)
    if l3 == 0:  # no caches found (no /sys/.../cache): glibc's L3 size, as bench::stream_bytes() takes it
        try:
            l3 = int(subprocess.run(["getconf", "LEVEL3_CACHE_SIZE"], capture_output=True, text=True).stdout.strip() or 0)
        except (OSError, ValueError):
            l3 = 0
    print()
    print("from cache (BM_attend_cached: one 4k layer, 16 MiB of f16 K+V, read step after step from the L3;")
    print("x 4k row: its tokens/s over the row above of the same cache at 4k, read from memory; with 2")
    print("threads a part of the sequence may lie in the other core's cache, which on cores with separate")
    print("L3s reads slower than memory)")
    print(f"{'cache':<16} {'threads':>7} {'tokens/s':>10} {'K+V GB/s':>9} {'x read bw':>9} {'x 4k row':>9}")
    for (cache, t), (tps, bps) in sorted(cached.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ratio = bps / read[t] if t in read else float("nan")
        row = rows.get((cache, 4096, t))
        over = f"{tps / row[0]:.3f}" if row else "-"
        print(f"{cache:<16} {t:>7} {tps:>10.1f} {bps / 1e9:>9.2f} {ratio:>9.3f} {over:>9}")
    if 0 < l3 < 32 << 20:
        print(f"warning: the largest cache ({l3 >> 20} MiB) holds less than twice the f16 layer: these rows read")
        print("         partly from memory")
if paired:
    print()
    print("paired (BM_attend_paired: one step of each cache and a read of one f16 layer's bytes in turn,")
    print("ratios of summed step times; median and range over the repetitions; f16 x read: contiguous")
    print("f16's K+V bytes/s over the paired read's, the same thread count; target >= 0.7)")
    print(f"{'context':>8} {'threads':>7} {'paged/contiguous':>24} {'two-tier/f16':>24} {'f16 x read':>24}")
    for (n, t), rs in sorted(paired.items()):
        cols = []
        for k in range(3):
            v = sorted(r[k] for r in rs)
            cols.append(f"{v[len(v) // 2]:.3f} ({v[0]:.3f}-{v[-1]:.3f})")
        print(f"{n:>8} {t:>7} {cols[0]:>24} {cols[1]:>24} {cols[2]:>24}")
EOF
