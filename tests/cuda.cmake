# CUDA backend tests (tests/cuda/*.cpp), registered only when kvcache::cuda is built. Each file is
# its own binary linked with kvcache::cuda and the CUDA runtime. Tests that need a device start
# with KVCACHE_REQUIRE_CUDA() (tests/cuda/cuda_test_util.hpp), which GTEST_SKIP()s with
# "no CUDA device: <reason>" where no usable device/driver exists; ctest then reports the binary
# as skipped (SKIP_REGULAR_EXPRESSION) instead of passed. test_cuda_validation needs no device.
if(TARGET kvcache::cuda)
  find_package(CUDAToolkit REQUIRED)
  file(GLOB KVCACHE_CUDA_TEST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/cuda/test_*.cpp)
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
