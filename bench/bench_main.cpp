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

void print_report(const std::vector<run_figures>& all) {
  std::printf("\nkvcache report (ISA active at start: %s; ratios against baselines of this run)\n",
              std::string(kvcache::to_string(kvcache::active_isa())).c_str());
  std::printf("%-52s %10s %12s  %-26s %7s\n", "benchmark", "GB/s", "G items/s", "baseline", "ratio");
  for (const run_figures& f : all) {
    if (f.error) {
      std::printf("%-52s %10s\n", f.name.c_str(), "error");
      continue;
    }
    const run_figures* b = baseline(all, f.copy_like ? "BM_memcpy" : "BM_read", f.threads);
    char items[32] = "-";
    if (f.items_per_second > 0) std::snprintf(items, sizeof items, "%.3f", f.items_per_second / 1e9);
    if (f.bytes_per_second > 0 && b != nullptr)
      std::printf("%-52s %10.2f %12s  %-26s %7.3f\n", f.name.c_str(), f.bytes_per_second / 1e9, items,
                  b->name.c_str(), f.bytes_per_second / b->bytes_per_second);
    else
      std::printf("%-52s %10.2f %12s  %-26s %7s\n", f.name.c_str(), f.bytes_per_second / 1e9, items,
                  b != nullptr ? b->name.c_str() : "(no baseline run)", "-");
  }
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
  collecting_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  if (report) print_report(reporter.figures);
  benchmark::Shutdown();
  return 0;
}
