# CUDA backend tests (tests/cuda/*.cpp), registered only when kvcache::cuda is built. Each file is
# its own binary linked with kvcache::cuda and the CUDA runtime. Tests that need a device start
# with KVCACHE_REQUIRE_CUDA() (tests/cuda/cuda_test_util.hpp), which GTEST_SKIP()s with
# "no CUDA device: <reason>" where no usable device/driver exists; ctest then reports the binary
# as skipped (SKIP_REGULAR_EXPRESSION) instead of passed. test_cuda_validation needs no device;
# test_cuda_emulated (below) needs not even nvcc.
if(TARGET kvcache::cuda)
  find_package(CUDAToolkit REQUIRED)
  file(GLOB KVCACHE_CUDA_TEST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/cuda/test_*.cpp)
  # Emulated only (below): test_cuda_emulated, test_cuda_oom (it needs the emulated runtime's
  # allocation refusal, and its operator new replacement would also see the real runtime's
  # allocations) and test_cuda_stats (it reads the emulated runtime's ledger of allocations).
  list(REMOVE_ITEM KVCACHE_CUDA_TEST_SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda/test_cuda_emulated.cpp
       ${CMAKE_CURRENT_LIST_DIR}/cuda/test_cuda_oom.cpp ${CMAKE_CURRENT_LIST_DIR}/cuda/test_cuda_stats.cpp)
  foreach(src IN LISTS KVCACHE_CUDA_TEST_SOURCES)
    get_filename_component(name ${src} NAME_WE)
    add_executable(${name} ${src})
    target_link_libraries(${name} PRIVATE kvcache::cuda kvcache::cpu CUDA::cudart GTest::gtest GTest::gtest_main)
    target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_LIST_DIR}/cuda)
    kvcache_set_warnings(${name})
    add_test(NAME ${name} COMMAND ${name})
    set_tests_properties(${name} PROPERTIES LABELS cuda SKIP_REGULAR_EXPRESSION "no CUDA device: ")
  endforeach()
endif()

# Emulated builds of the device tests: the caches' host code (cuda/*.cpp, cuda/runtime.cu) and
# the unchanged device tests, linked against an emulated CUDA runtime (tests/cuda/emu_runtime:
# a fake cuda_runtime.h with host memory as device memory, stream capture recorded into graphs)
# and the kernels run on the CPU by tests/cuda/emulator.hpp. No nvcc, no GPU: built in every
# configuration but cross builds (they test no ISA-specific code, and under qemu they would add
# minutes to the aarch64 stage); the ctest names end in _emulated (label "emulated"). They check the host logic and
# the kernels' logic end to end, not the real runtime, compiler or hardware.
if(CMAKE_CROSSCOMPILING)
  set(KVCACHE_CUDA_EMULATED_DEFAULT OFF)
else()
  set(KVCACHE_CUDA_EMULATED_DEFAULT ON)
endif()
option(KVCACHE_CUDA_EMULATED_TESTS "Build the CPU-emulated CUDA tests" ${KVCACHE_CUDA_EMULATED_DEFAULT})
if(KVCACHE_CUDA_EMULATED_TESTS)
  # test_cuda_emulated runs the CUDA kernels' source (cuda/*_kernels.cuh) on the CPU through
  # tests/cuda/emulator.hpp. It needs neither nvcc nor a GPU and links only kvcache::cpu.
  add_executable(test_cuda_emulated ${CMAKE_CURRENT_LIST_DIR}/cuda/test_cuda_emulated.cpp)
  target_link_libraries(test_cuda_emulated PRIVATE kvcache::cpu GTest::gtest GTest::gtest_main Threads::Threads)
  target_include_directories(test_cuda_emulated PRIVATE ${CMAKE_CURRENT_LIST_DIR}/cuda ${PROJECT_SOURCE_DIR}/cuda)
  kvcache_set_warnings(test_cuda_emulated)
  # '#pragma unroll' is nvcc's; no FMA contraction so float intrinsics (__fmul_rn...) stay unfused.
  # clang honours '#pragma unroll' and warns where it cannot fully unroll a loop of the emulated
  # kernels (the hints are for nvcc; the emulation's speed does not matter).
  target_compile_options(test_cuda_emulated PRIVATE -Wno-unknown-pragmas -ffp-contract=off
                         $<$<CXX_COMPILER_ID:Clang>:-Wno-pass-failed>)
  add_test(NAME test_cuda_emulated COMMAND test_cuda_emulated)
  set_tests_properties(test_cuda_emulated PROPERTIES LABELS "cuda;emulated")

  add_library(kvcache_cuda_emu STATIC
    ${CMAKE_CURRENT_LIST_DIR}/cuda/emu_runtime/runtime_emu.cpp
    ${CMAKE_CURRENT_LIST_DIR}/cuda/emu_runtime/emu_launch.cpp
    ${PROJECT_SOURCE_DIR}/cuda/contiguous_cache.cpp
    ${PROJECT_SOURCE_DIR}/cuda/paged_cache.cpp
    ${PROJECT_SOURCE_DIR}/cuda/two_tier_cache.cpp)
  target_include_directories(kvcache_cuda_emu BEFORE PUBLIC ${CMAKE_CURRENT_LIST_DIR}/cuda/emu_runtime)
  target_include_directories(kvcache_cuda_emu PRIVATE ${PROJECT_SOURCE_DIR}/cuda ${CMAKE_CURRENT_LIST_DIR}/cuda)
  target_link_libraries(kvcache_cuda_emu PUBLIC kvcache::cpu Threads::Threads)
  kvcache_set_warnings(kvcache_cuda_emu)
  target_compile_options(kvcache_cuda_emu PRIVATE -Wno-unknown-pragmas -ffp-contract=off
                         $<$<CXX_COMPILER_ID:Clang>:-Wno-pass-failed>)
  foreach(name IN ITEMS test_cuda_validation test_cuda_kernels test_cuda_graph test_cuda_contiguous
                        test_cuda_paged test_cuda_two_tier test_cuda_oom test_cuda_stats)
    add_executable(${name}_emulated ${CMAKE_CURRENT_LIST_DIR}/cuda/${name}.cpp)
    target_link_libraries(${name}_emulated PRIVATE kvcache_cuda_emu GTest::gtest GTest::gtest_main)
    target_include_directories(${name}_emulated PRIVATE ${CMAKE_CURRENT_LIST_DIR}/cuda)
    target_compile_definitions(${name}_emulated PRIVATE KVCACHE_CUDA_EMULATED)
    kvcache_set_warnings(${name}_emulated)
    add_test(NAME ${name}_emulated COMMAND ${name}_emulated)
    set_tests_properties(${name}_emulated PROPERTIES LABELS "cuda;emulated")
  endforeach()
endif()
