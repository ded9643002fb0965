# Driven by the install_core_consumer (MODE=cmake) and install_pkgconfig_consumer (MODE=make)
# tests: install dtensor into a scratch prefix, build tests/install/core_consumer, which uses
# only the core and collectives components, with find_package(dtensor COMPONENTS core
# collectives) or with pkg-config and make, check its link command and ldd: no UCX, NCCL or
# CUDA library (so it starts where they are not installed), and run it, also with the CUDA
# libraries hidden from the loader.
#
#   cmake -DMODE=cmake|make -DBUILD_DIR=<dtensor build> -DSOURCE_DIR=<core_consumer>
#         -DWORK_DIR=<scratch> -DGENERATOR=<generator> -DCXX=<compiler> -P run_core_consumer.cmake
cmake_minimum_required(VERSION 3.25)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

include(${CMAKE_CURRENT_LIST_DIR}/install_steps.cmake)

set(prefix ${WORK_DIR}/prefix)
install_dtensor(${BUILD_DIR} ${prefix})
if(MODE STREQUAL "cmake")
  run_step(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release)
  run_step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
elseif(MODE STREQUAL "make")
  find_program(MAKE_PROGRAM NAMES make gmake REQUIRED)
  file(COPY ${SOURCE_DIR}/Makefile ${SOURCE_DIR}/main.cc DESTINATION ${WORK_DIR}/build)
  run_step(${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${prefix}/lib/pkgconfig
    ${MAKE_PROGRAM} -C ${WORK_DIR}/build CXX=${CXX})
else()
  message(FATAL_ERROR "MODE must be cmake or make, not '${MODE}'")
endif()
set(exe ${WORK_DIR}/build/core_consumer)

# The link command, and the libraries the binary needs (its dependencies' included): no UCX,
# NCCL or CUDA library (the CPU components link no CUDA: dtensor/tensor/cuda_hooks.h).
if(MODE STREQUAL "cmake" AND EXISTS ${WORK_DIR}/build/CMakeFiles/core_consumer.dir/link.txt)
  file(READ ${WORK_DIR}/build/CMakeFiles/core_consumer.dir/link.txt link_line)
elseif(MODE STREQUAL "cmake")  # Ninja
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build -- -t commands core_consumer
    OUTPUT_VARIABLE link_line)
  string(REGEX MATCH "[^\n]+\n?$" link_line "${link_line}")
else()
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${prefix}/lib/pkgconfig
    ${MAKE_PROGRAM} -s -n -B -C ${WORK_DIR}/build CXX=${CXX} OUTPUT_VARIABLE link_line)
endif()
if(NOT link_line MATCHES "dtensor_core")
  message(FATAL_ERROR "no link command found for core_consumer: '${link_line}'")
endif()
message(STATUS "link: ${link_line}")
execute_process(COMMAND ldd ${exe} RESULT_VARIABLE rc OUTPUT_VARIABLE needed ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ldd ${exe} failed: ${err}")
endif()
message(STATUS "ldd ${exe}:\n${needed}")
file(READ ${prefix}/lib/cmake/dtensor/dtensorConfig.cmake config)
if(config MATCHES "set\\(dtensor_CPU_LINKS_CUDA (ON|TRUE|1)\\)")
  message(FATAL_ERROR "the package says its CPU components link CUDA (dtensor_CPU_LINKS_CUDA)")
endif()
# Library names as they appear in link commands (lib<name>.so, lib<name>.a, -l<name>).
set(refused "(lib|-l)(ucp|uct|ucs|ucm|nccl|cuda|cudart|cudart_static|cublas|cublasLt|dtensor_collectives_ucx|dtensor_collectives_nccl|dtensor_kernels_cuda)[^a-zA-Z_]")
foreach(what "link command" "ldd")
  if(what STREQUAL "ldd")
    set(text "${needed}")
  else()
    set(text "${link_line}")
  endif()
  string(REGEX MATCHALL "[^ \t\n]*(${refused})[^ \t\n]*" bad "${text}")
  if(bad)
    list(REMOVE_DUPLICATES bad)
    message(FATAL_ERROR "the core + collectives consumer's ${what} has ${bad}")
  endif()
endforeach()
# Run it as is, and with the CUDA libraries hidden from the loader (--inhibit-cache: only the
# loader's default directories, not ld.so.conf's, where the CUDA Toolkit's lib directory is).
string(REGEX MATCH "[^ \t\n]*ld-linux[^ \t\n]*\\.so[^ \t\n]*" loader "${needed}")
foreach(how "as is" "CUDA hidden")
  if(how STREQUAL "as is")
    set(cmd ${exe})
  else()
    set(cmd ${loader} --inhibit-cache ${exe})
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "${how}: ${out}${err}")
  if(NOT rc EQUAL 0 OR NOT out MATCHES "core consumer OK")
    message(FATAL_ERROR "core_consumer failed ${how} (${rc}):\n${out}\n${err}")
  endif()
endforeach()
