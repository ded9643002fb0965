# cuda_libs_test: a program built with the CUDA components starts and runs on CPU where the
# CUDA libraries cannot be found, and says what is missing when a GPU path loads them.
#   cmake -DPROBE=<cuda_libs_probe> -P cuda_libs_test.cmake
# 1. ldd: the probe needs no libcudart, libcublas(Lt), libnccl, libcudnn or libcuda (static runtime,
#    dlopen on first use).
# 2. As is: cuBLAS and NCCL load (when the loader knows them, as on the machines with the CUDA
#    Toolkit: ldconfig -p lists them).
# 3. Hidden: run through the dynamic loader with --inhibit-cache, so that only its default
#    directories are searched (the toolkit's lib directory comes from ld.so.conf, i.e. the
#    cache): the probe still starts and makes CPU tensors; loading cuBLAS / NCCL fails naming
#    the library; a CUDA tensor is refused with a clear error.
cmake_minimum_required(VERSION 3.25)

execute_process(COMMAND ldd ${PROBE} OUTPUT_VARIABLE needed RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ldd ${PROBE} failed")
endif()
string(REGEX MATCHALL "lib(cudart|cublas|cublasLt|nccl|cuda|cudnn[a-z_]*)\\.so[^ \t\n]*" bad "${needed}")
if(bad)
  message(FATAL_ERROR "the probe needs ${bad} to start:\n${needed}")
endif()
string(REGEX MATCH "[^ \t\n]*ld-linux[^ \t\n]*\\.so[^ \t\n]*" loader "${needed}")
if(NOT loader OR NOT EXISTS "${loader}")
  message(FATAL_ERROR "no dynamic loader found in:\n${needed}")
endif()

function(run_probe out_var)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "${ARGN}:\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the probe failed (${rc})")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

function(expect text regex what)
  if(NOT text MATCHES "${regex}")
    message(FATAL_ERROR "${what}: expected /${regex}/ in:\n${text}")
  endif()
endfunction()

execute_process(COMMAND ldconfig -p OUTPUT_VARIABLE cache)
run_probe(plain ${PROBE})
expect("${plain}" "cpu tensor: made" "as is")
if(cache MATCHES "libcublas\\.so\\.[0-9]+ ")
  expect("${plain}" "cublas: loaded" "as is, cuBLAS known to the loader")
endif()
if(cache MATCHES "libnccl\\.so\\.[0-9]+ ")
  expect("${plain}" "nccl: loaded" "as is, NCCL known to the loader")
endif()

run_probe(hidden ${loader} --inhibit-cache ${PROBE})
expect("${hidden}" "cpu tensor: made" "hidden")
expect("${hidden}" "cublas: FAILED_PRECONDITION: \\[cuBLAS\\] libcublas\\.so\\.[0-9]+ could not be loaded" "hidden")
expect("${hidden}" "nccl: FAILED_PRECONDITION: \\[NCCL\\] libnccl\\.so\\.[0-9]+ could not be loaded" "hidden")
expect("${hidden}" "devices: 0" "hidden")
expect("${hidden}" "cuda tensor: FAILED_PRECONDITION: .*cuda:0 requested but 0 CUDA devices are visible" "hidden")
message(STATUS "cuda_libs_test: OK")
