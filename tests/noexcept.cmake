# -fno-exceptions: kvcache must work for consumers that build without exceptions, and must not
# need them itself. kvcache_cpu_noexcept is kvcache::cpu's own sources (same per-ISA flags and
# definitions) compiled with -fno-exceptions; test_noexcept (tests/noexcept/noexcept_test.cpp, a
# plain program: GoogleTest's library is built with exceptions) exercises the public API through
# it, error paths included, and returns non-zero on any failed check.
# KVCACHE_NOEXCEPT_TEST=OFF leaves it out: scripts/test.sh's asan stage does (a second build of
# the library under the sanitizers was a quarter of that stage's compile time; the gcc, clang and
# aarch64 stages build and run it).
option(KVCACHE_NOEXCEPT_TEST "Build and run test_noexcept (kvcache::cpu rebuilt with -fno-exceptions)" ON)
if(NOT KVCACHE_NOEXCEPT_TEST)
  return()
endif()
get_target_property(KVCACHE_NOEXCEPT_SOURCES kvcache_cpu SOURCES)
foreach(src IN LISTS KVCACHE_NOEXCEPT_SOURCES)
  # Per-ISA flags are source properties of the top-level directory: copy them to this one.
  get_source_file_property(isa_flags ${src} DIRECTORY ${PROJECT_SOURCE_DIR} COMPILE_OPTIONS)
  if(isa_flags)
    set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "${isa_flags}")
  endif()
endforeach()
add_library(kvcache_cpu_noexcept STATIC ${KVCACHE_NOEXCEPT_SOURCES})
target_compile_definitions(kvcache_cpu_noexcept PRIVATE $<TARGET_PROPERTY:kvcache_cpu,COMPILE_DEFINITIONS>)
target_include_directories(kvcache_cpu_noexcept PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(kvcache_cpu_noexcept PUBLIC kvcache::kvcache Threads::Threads
  PRIVATE fmt::fmt-header-only)
target_compile_options(kvcache_cpu_noexcept PUBLIC -fno-exceptions)
kvcache_set_warnings(kvcache_cpu_noexcept)

file(GLOB KVCACHE_NOEXCEPT_TEST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/noexcept/*.cpp)
add_executable(test_noexcept ${KVCACHE_NOEXCEPT_TEST_SOURCES})
target_link_libraries(test_noexcept PRIVATE kvcache_cpu_noexcept)
kvcache_set_warnings(test_noexcept)
add_test(NAME test_noexcept COMMAND test_noexcept)
