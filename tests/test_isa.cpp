// ISA selection: parse_isa, isa_from_environment, force_isa, and a child process started with a
// bad KVCACHE_ISA (it must report the value on stderr and run on the best ISA instead).
#include <kvcache/isa.hpp>
#include <kvcache/kernels.hpp>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

using kvcache::errc;
using kvcache::isa;

constexpr isa all_isas[] = {isa::scalar, isa::avx2, isa::avx512, isa::neon};

isa best_supported() {
  for (isa i : {isa::avx512, isa::avx2, isa::neon})
    if (kvcache::isa_supported(i)) return i;
  return isa::scalar;
}

// Restores the ISA that was active when the test started.
struct restore_isa {
  isa saved = kvcache::active_isa();
  ~restore_isa() { EXPECT_TRUE(kvcache::force_isa(saved).has_value()); }
};

TEST(Isa, ParseNames) {
  for (isa i : all_isas) {
    const auto r = kvcache::parse_isa(kvcache::to_string(i));
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r.value(), i);
  }
  const auto bad = kvcache::parse_isa("sse9");
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code, errc::invalid_argument);
  EXPECT_NE(bad.error().message.find("sse9"), std::string::npos) << bad.error().message;
  EXPECT_FALSE(kvcache::parse_isa("AVX2").has_value());  // names are exact
  EXPECT_FALSE(kvcache::parse_isa("").has_value());
}

TEST(Isa, ScalarAlwaysSupportedAndFindMatchesSupported) {
  EXPECT_TRUE(kvcache::isa_supported(isa::scalar));
  for (isa i : all_isas) {
    const kvcache::kernels::table* t = kvcache::kernels::find(i);
    EXPECT_EQ(t != nullptr, kvcache::isa_supported(i)) << kvcache::to_string(i);
    if (t != nullptr) {
      EXPECT_EQ(t->which, i);
    }
  }
}

TEST(Isa, ForceEverySupportedIsaAndRefuseUnsupported) {
  restore_isa guard;
  for (isa i : all_isas) {
    SCOPED_TRACE(std::string(kvcache::to_string(i)));
    const isa before = kvcache::active_isa();
    const auto r = kvcache::force_isa(i);
    if (kvcache::isa_supported(i)) {
      ASSERT_TRUE(r.has_value()) << r.error().message;
      EXPECT_EQ(kvcache::active_isa(), i);
      EXPECT_EQ(kvcache::kernels::active().which, i);
    } else {
      ASSERT_FALSE(r.has_value());
      EXPECT_EQ(r.error().code, errc::unsupported);
      EXPECT_NE(r.error().message.find(kvcache::to_string(i)), std::string::npos) << r.error().message;
      EXPECT_EQ(kvcache::active_isa(), before) << "a refused force_isa must leave the active ISA unchanged";
    }
  }
}

TEST(Isa, UnsupportedIsaExistsOnEveryPlatform) {
  // neon on x86, the x86 ISAs on aarch64: force_isa must refuse at least one of them.
  restore_isa guard;
  ASSERT_TRUE(kvcache::force_isa(isa::scalar).has_value());
  int refused = 0;
  for (isa i : all_isas)
    if (!kvcache::force_isa(i).has_value()) {
      ++refused;
      EXPECT_EQ(kvcache::active_isa(), isa::scalar);
    } else {
      ASSERT_TRUE(kvcache::force_isa(isa::scalar).has_value());
    }
  EXPECT_GE(refused, 1);
}

TEST(IsaEnvironment, Selection) {
  const auto empty = kvcache::isa_from_environment("");
  ASSERT_TRUE(empty.has_value());
  EXPECT_EQ(empty.value(), best_supported());

  const auto scalar = kvcache::isa_from_environment("scalar");
  ASSERT_TRUE(scalar.has_value());
  EXPECT_EQ(scalar.value(), isa::scalar);

  const auto unknown = kvcache::isa_from_environment("bogus");
  ASSERT_FALSE(unknown.has_value());
  EXPECT_EQ(unknown.error().code, errc::invalid_argument);
  const std::string& m = unknown.error().message;
  EXPECT_NE(m.find("KVCACHE_ISA='bogus'"), std::string::npos) << m;
  EXPECT_NE(m.find(std::string("using ") + std::string(kvcache::to_string(best_supported()))), std::string::npos) << m;

  for (isa i : all_isas) {
    const auto r = kvcache::isa_from_environment(kvcache::to_string(i));
    if (kvcache::isa_supported(i)) {
      ASSERT_TRUE(r.has_value());
      EXPECT_EQ(r.value(), i);
    } else {
      ASSERT_FALSE(r.has_value());
      EXPECT_EQ(r.error().code, errc::unsupported);
      EXPECT_NE(r.error().message.find(kvcache::to_string(i)), std::string::npos) << r.error().message;
    }
  }
}

// Consistent with whatever KVCACHE_ISA this process was started with. When started by the test
// below (KVCACHE_ISA_CHILD set), it also prints the active ISA for the parent to check.
TEST(IsaEnvironment, StartupStateMatchesEnvironment) {
  const char* env = std::getenv("KVCACHE_ISA");
  const auto expected = kvcache::isa_from_environment(env != nullptr ? env : "");
  const kvcache::error* err = kvcache::isa_environment_error();
  if (expected.has_value()) {
    EXPECT_EQ(err, nullptr);
  } else {
    ASSERT_NE(err, nullptr);
    EXPECT_EQ(err->code, expected.error().code);
    EXPECT_EQ(err->message, expected.error().message);
  }
  if (std::getenv("KVCACHE_ISA_CHILD") != nullptr) {
    std::printf("active-isa=%s\n", std::string(kvcache::to_string(kvcache::active_isa())).c_str());
    if (err != nullptr) std::printf("env-error=%d\n", static_cast<int>(err->code));
  }
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(IsaEnvironment, ChildProcessWithBadValueReportsAndFallsBack) {
  if (std::getenv("KVCACHE_TEST_EMULATED") != nullptr)
    GTEST_SKIP() << "running under an emulator: the child would be started natively";
  if (std::getenv("KVCACHE_ISA_CHILD") != nullptr) GTEST_SKIP() << "already the child";
  const std::string dir = ::testing::TempDir();
  const std::string out = dir + "kvcache_isa_child.out", err = dir + "kvcache_isa_child.err";
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  ASSERT_FALSE(ec) << ec.message();
  for (const char* value : {"bogus", "avx512", "neon"}) {
    const auto expected = kvcache::isa_from_environment(value);
    SCOPED_TRACE(value);
    const std::string cmd = std::string("KVCACHE_ISA=") + value +
                            " KVCACHE_ISA_CHILD=1 '" + self +
                            "' --gtest_filter=IsaEnvironment.StartupStateMatchesEnvironment > " +
                            out + " 2> " + err;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(out) << slurp(err);
    const std::string o = slurp(out), e = slurp(err);
    if (expected.has_value()) {
      EXPECT_NE(o.find("active-isa=" + std::string(kvcache::to_string(expected.value()))), std::string::npos) << o;
      EXPECT_EQ(e.find("kvcache:"), std::string::npos) << e;
    } else {
      EXPECT_NE(o.find("active-isa=" + std::string(kvcache::to_string(best_supported()))), std::string::npos) << o;
      EXPECT_NE(e.find("kvcache: KVCACHE_ISA='" + std::string(value) + "'"), std::string::npos) << e;
      EXPECT_NE(o.find("env-error="), std::string::npos) << o;
    }
  }
}

}  // namespace
