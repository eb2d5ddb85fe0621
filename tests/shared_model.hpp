#pragma once
// The tiny pretrained model of ../shared/data (llama2.c stories260K) for the end-to-end tests.
// A build tree without ../shared (the tests of an installed copy, a packager's build) skips those
// tests, saying why; scripts/test.sh sets KVCACHE_REQUIRE_MODEL=1, which turns the skip into a
// failure, so CI cannot pass without having run them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvcache::test {

inline const std::string& shared_model_path() {
  static const std::string p = std::string(KVCACHE_SHARED_DIR) + "/data/stories260K.bin";
  return p;
}

inline bool model_required() {
  const char* e = std::getenv("KVCACHE_REQUIRE_MODEL");
  return e != nullptr && *e != '\0' && std::string(e) != "0";
}

}  // namespace kvcache::test

/// First statement of a test that needs the model: skips it (or fails it under
/// KVCACHE_REQUIRE_MODEL) when the file is missing.
#define KVCACHE_NEED_MODEL()                                                                              \
  do {                                                                                                    \
    if (!std::filesystem::exists(::kvcache::test::shared_model_path())) {                                 \
      if (::kvcache::test::model_required())                                                              \
        FAIL() << "KVCACHE_REQUIRE_MODEL is set but " << ::kvcache::test::shared_model_path() << " is missing"; \
      GTEST_SKIP() << "no " << ::kvcache::test::shared_model_path()                                       \
                   << " (the tiny model of ../shared/data); set KVCACHE_REQUIRE_MODEL=1 to fail instead"; \
    }                                                                                                     \
  } while (0)
