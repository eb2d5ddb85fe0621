# Driver of the consumer tests (cmake -P). Registered by tests/consumer.cmake.
#   MODE=package       cmake --install the kvcache build KVCACHE_BINARY_DIR into WORK_DIR/prefix,
#                      check what was installed, then configure + build + run tests/consumer
#                      against it with find_package (fmt lookups disabled: consumers need no fmt).
#   MODE=subdirectory  configure + build + run tests/consumer with add_subdirectory(KVCACHE_SOURCE_DIR).
# Other inputs: WORK_DIR, GENERATOR, CXX_COMPILER, BUILD_TYPE, SANITIZE, WERROR, HAVE_CUDA,
# CUDA_COMPILER.

foreach(var IN ITEMS MODE WORK_DIR KVCACHE_SOURCE_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "consumer/run.cmake: ${var} is not set")
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()

# Runs a command; on failure prints its output and stops.
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer (${MODE}): ${what} failed (${rc}):\n${out}")
  endif()
  message(STATUS "consumer (${MODE}): ${what}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(consumer_src "${CMAKE_CURRENT_LIST_DIR}")
set(consumer_build "${WORK_DIR}/build")

# Sanitized kvcache objects need the sanitizer runtime in the consumer's link too.
set(flag_args)
if(SANITIZE)
  list(APPEND flag_args "-DCMAKE_CXX_FLAGS=-fsanitize=${SANITIZE} -fno-omit-frame-pointer"
       "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=${SANITIZE}")
endif()
if(WERROR)
  set(WERROR ON)
else()
  set(WERROR OFF)
endif()
set(common_args -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
    "-DKVCACHE_CONSUMER_WERROR=${WERROR}" ${flag_args})

if(MODE STREQUAL "package")
  if(NOT KVCACHE_BINARY_DIR)
    message(FATAL_ERROR "consumer/run.cmake: KVCACHE_BINARY_DIR is not set")
  endif()
  set(prefix "${WORK_DIR}/prefix")
  # Make sure the installed libraries are up to date (a no-op after a full build).
  set(targets kvcache_cpu)
  if(HAVE_CUDA)
    list(APPEND targets kvcache_cuda)
  endif()
  run_step("build ${targets}" "${CMAKE_COMMAND}" --build "${KVCACHE_BINARY_DIR}" --target ${targets})
  run_step("cmake --install" "${CMAKE_COMMAND}" --install "${KVCACHE_BINARY_DIR}" --prefix "${prefix}")

  # What must be there.
  file(GLOB_RECURSE config_files "${prefix}/*/kvcacheConfig.cmake")
  list(LENGTH config_files n_config)
  if(NOT n_config EQUAL 1)
    message(FATAL_ERROR "expected one kvcacheConfig.cmake under ${prefix}, found: ${config_files}")
  endif()
  get_filename_component(config_dir "${config_files}" DIRECTORY)
  foreach(f IN ITEMS kvcacheConfigVersion.cmake kvcacheTargets.cmake)
    if(NOT EXISTS "${config_dir}/${f}")
      message(FATAL_ERROR "not installed: ${config_dir}/${f}")
    endif()
  endforeach()
  file(GLOB_RECURSE libs "${prefix}/*libkvcache_cpu.*")
  if(NOT libs)
    message(FATAL_ERROR "libkvcache_cpu was not installed under ${prefix}")
  endif()
  file(GLOB_RECURSE src_headers RELATIVE "${KVCACHE_SOURCE_DIR}/include" "${KVCACHE_SOURCE_DIR}/include/kvcache/*.hpp")
  foreach(h IN LISTS src_headers)
    if(NOT EXISTS "${prefix}/include/${h}")
      message(FATAL_ERROR "header not installed: include/${h}")
    endif()
  endforeach()

  # Consumers pay only for what they use: no fmt in the exported link interface, no fmt or CUDA
  # headers included by any installed header.
  file(GLOB target_files "${config_dir}/kvcacheTargets*.cmake")
  foreach(f IN LISTS target_files)
    file(READ "${f}" text)
    if(text MATCHES "fmt::")
      message(FATAL_ERROR "${f} references {fmt}: consumers would need fmt")
    endif()
  endforeach()
  file(GLOB_RECURSE inst_headers "${prefix}/include/kvcache/*")
  foreach(h IN LISTS inst_headers)
    file(STRINGS "${h}" bad REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"](fmt/|cuda|cuda_runtime|cuda_fp16)")
    if(bad)
      message(FATAL_ERROR "installed header ${h} includes ${bad}")
    endif()
  endforeach()

  set(cuda_args "-DKVCACHE_CONSUMER_EXPECT_CUDA=OFF")
  if(HAVE_CUDA)
    set(cuda_args "-DKVCACHE_CONSUMER_EXPECT_CUDA=ON")
    if(CUDA_COMPILER)
      get_filename_component(cuda_bin "${CUDA_COMPILER}" DIRECTORY)
      get_filename_component(cuda_root "${cuda_bin}" DIRECTORY)
      list(APPEND cuda_args "-DCUDAToolkit_ROOT=${cuda_root}")
    endif()
  else()
    # REQUIRED COMPONENTS cuda must fail at configure time, with kvcache's explanation.
    execute_process(COMMAND "${CMAKE_COMMAND}" -S "${consumer_src}" -B "${WORK_DIR}/build-require-cuda"
                            ${common_args} "-DCMAKE_PREFIX_PATH=${prefix}" -DKVCACHE_CONSUMER_REQUIRE_CUDA=ON
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    if(rc EQUAL 0 OR NOT out MATCHES "component 'cuda' is not available")
      message(FATAL_ERROR "find_package(kvcache REQUIRED COMPONENTS cuda) did not fail cleanly "
                          "(rc ${rc}):\n${out}")
    endif()
    message(STATUS "consumer (${MODE}): REQUIRED COMPONENTS cuda fails cleanly: ok")
  endif()
  run_step("configure" "${CMAKE_COMMAND}" -S "${consumer_src}" -B "${consumer_build}" ${common_args}
           "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_DISABLE_FIND_PACKAGE_fmt=ON
           -DKVCACHE_CONSUMER_MODE=package ${cuda_args})
elseif(MODE STREQUAL "subdirectory")
  # CUDA off: this checks the CPU part as a sub-project, with this build's warning policy.
  run_step("configure" "${CMAKE_COMMAND}" -S "${consumer_src}" -B "${consumer_build}" ${common_args}
           -DKVCACHE_CONSUMER_MODE=subdirectory "-DKVCACHE_SOURCE_DIR=${KVCACHE_SOURCE_DIR}"
           -DKVCACHE_CUDA=OFF "-DKVCACHE_WERROR=${WERROR}" "-DKVCACHE_SANITIZE=${SANITIZE}")
else()
  message(FATAL_ERROR "consumer/run.cmake: unknown MODE '${MODE}'")
endif()

run_step("build" "${CMAKE_COMMAND}" --build "${consumer_build}")
run_step("run" "${consumer_build}/consumer")
message(STATUS "${step_output}")
