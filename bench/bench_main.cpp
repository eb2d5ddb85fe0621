// main() of kvcache_bench. Extra option: --kvcache_report prints, after the run, every
// benchmark's GB/s and items/s and its ratio to the BM_read or BM_memcpy baseline measured in the
// same run (conventions in bench_common.hpp).
#include "bench_common.hpp"

#include <kvcache/isa.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace {

struct run_figures {
  std::string name;
  int threads = 1;
  double bytes_per_second = 0;  // 0 when not set
  double items_per_second = 0;
  double real_over_cpu = 0;  // real time / CPU time of the run (0 when CPU time is 0)
  bool copy_like = false;
  bool error = false;
};

double counter_or_zero(const benchmark::BenchmarkReporter::Run& r, const char* name) {
  const auto it = r.counters.find(name);
  return it == r.counters.end() ? 0.0 : it->second.value;
}

// Console output as usual, while keeping the figures of every (non-aggregate) run.
class collecting_reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate) continue;
      run_figures f;
      f.name = r.benchmark_name();
      f.threads = static_cast<int>(r.threads);
      f.error = r.error_occurred;
      f.bytes_per_second = counter_or_zero(r, "bytes_per_second");
      f.items_per_second = counter_or_zero(r, "items_per_second");
      f.copy_like = counter_or_zero(r, kvcache::bench::copy_like_counter) != 0.0;
      const double cpu = r.GetAdjustedCPUTime();
      f.real_over_cpu = cpu > 0 ? r.GetAdjustedRealTime() / cpu : 0.0;
      figures.push_back(std::move(f));
    }
    ConsoleReporter::ReportRuns(runs);
  }
  std::vector<run_figures> figures;
};

const run_figures* baseline(const std::vector<run_figures>& all, std::string_view prefix, int threads) {
  const run_figures* any = nullptr;
  for (const run_figures& f : all) {
    if (f.error || f.bytes_per_second <= 0 || f.name.compare(0, prefix.size(), prefix) != 0) continue;
    if (f.threads == threads) return &f;
    if (f.threads == 1) any = &f;
  }
  return any;
}

std::string si(double v) {
  char buf[32];
  if (v <= 0) return "-";
  if (v >= 1e9) std::snprintf(buf, sizeof buf, "%.3f G", v / 1e9);
  else if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.3f M", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.3f k", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

// Columns: GB/s and items/s over real time; GB/s over the run's CPU time (the thread's own time,
// excluding time descheduled: on a shared, loaded machine the closer figure for an unloaded
// core, summed over threads for multi-threaded runs); the baseline and the real-time ratio.
void print_report(const std::vector<run_figures>& all) {
  std::printf("\nkvcache report (ISA active at start: %s; ratios against baselines of this run)\n",
              std::string(kvcache::to_string(kvcache::active_isa())).c_str());
  std::printf("%-56s %9s %12s %9s  %-30s %7s %9s\n", "benchmark", "GB/s", "items/s", "cpu GB/s", "baseline",
              "ratio", "cpu ratio");
  for (const run_figures& f : all) {
    if (f.error) {
      std::printf("%-56s %9s\n", f.name.c_str(), "error");
      continue;
    }
    const run_figures* b = baseline(all, f.copy_like ? "BM_memcpy" : "BM_read", f.threads);
    const double cpu_bw = f.bytes_per_second * f.real_over_cpu;
    char ratio[16] = "-", cpu_ratio[16] = "-";
    if (f.bytes_per_second > 0 && b != nullptr) {
      std::snprintf(ratio, sizeof ratio, "%.3f", f.bytes_per_second / b->bytes_per_second);
      const double b_cpu = b->bytes_per_second * b->real_over_cpu;
      if (cpu_bw > 0 && b_cpu > 0) std::snprintf(cpu_ratio, sizeof cpu_ratio, "%.3f", cpu_bw / b_cpu);
    }
    std::printf("%-56s %9.2f %12s %9.2f  %-30s %7s %9s\n", f.name.c_str(), f.bytes_per_second / 1e9,
                si(f.items_per_second).c_str(), cpu_bw / 1e9, b != nullptr ? b->name.c_str() : "(no baseline run)",
                ratio, cpu_ratio);
  }
}

// The compiler that built the benchmarks (and, in this project's builds, the library): recorded in
// the run's context ("kvcache_compiler", with --benchmark_out also in the JSON), since the int8
// Q4 kernels' speed depends on it (session 30, Zen 5: kernels_avx512vnni.cpp built by Clang 14 ran
// the fused Q4 step 1.07-1.10x faster than built by GCC 12).
std::string compiler() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#else
  return "unknown";
#endif
}

// How the benchmarks (and, in this project's builds, the library) were compiled: recorded as
// "kvcache_build" beside Google Benchmark's own "Library was built as DEBUG" warning, which Debian's
// libbenchmark prints because that library (its timing loop, not this code) is built without
// NDEBUG; this line says whether the code being timed is optimised and without assertions.
std::string build() {
#if defined(__OPTIMIZE__) && defined(NDEBUG)
  return "optimized, NDEBUG";
#elif defined(__OPTIMIZE__)
  return "optimized, assertions on";
#else
  return "not optimized";
#endif
}

}  // namespace

int main(int argc, char** argv) {
  bool report = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--kvcache_report") == 0) report = true;
    else args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("kvcache_compiler", compiler());
  benchmark::AddCustomContext("kvcache_build", build());
  collecting_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  if (report) print_report(reporter.figures);
  benchmark::Shutdown();
  return 0;
}
