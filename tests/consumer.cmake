# Consumer tests: a tiny project (tests/consumer) builds against kvcache
#   consumer_find_package      via find_package from a cmake --install of this build
#   consumer_add_subdirectory  via add_subdirectory of this source tree
# Both configure, build and run the consumer with this build's compiler, build type and sanitizers.
set(KVCACHE_CONSUMER_ARGS
  -DKVCACHE_SOURCE_DIR=${PROJECT_SOURCE_DIR}
  -DGENERATOR=${CMAKE_GENERATOR}
  -DCXX_COMPILER=${CMAKE_CXX_COMPILER}
  -DBUILD_TYPE=${CMAKE_BUILD_TYPE}
  -DSANITIZE=${KVCACHE_SANITIZE}
  -DWERROR=${KVCACHE_WERROR}
  -DHAVE_CUDA=${KVCACHE_HAVE_CUDA}
  -DCUDA_COMPILER=${CMAKE_CUDA_COMPILER})

# A cross build cannot run the host-side consumer projects it would configure.
if(CMAKE_CROSSCOMPILING)
  return()
endif()

if(KVCACHE_INSTALL)
  add_test(NAME consumer_find_package
    COMMAND ${CMAKE_COMMAND} -DMODE=package -DKVCACHE_BINARY_DIR=${PROJECT_BINARY_DIR}
            -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer_find_package ${KVCACHE_CONSUMER_ARGS}
            -P ${CMAKE_CURRENT_LIST_DIR}/consumer/run.cmake)
  set_tests_properties(consumer_find_package PROPERTIES TIMEOUT 1200 LABELS consumer)
endif()

add_test(NAME consumer_add_subdirectory
  COMMAND ${CMAKE_COMMAND} -DMODE=subdirectory
          -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer_add_subdirectory ${KVCACHE_CONSUMER_ARGS}
          -P ${CMAKE_CURRENT_LIST_DIR}/consumer/run.cmake)
set_tests_properties(consumer_add_subdirectory PROPERTIES TIMEOUT 1200 LABELS consumer)
