# Driven by the install_consumer test: install dtensor into a scratch prefix, then build and
# run an out-of-tree project that finds it with find_package(dtensor), also with the CUDA
# libraries hidden from the loader.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

include(${CMAKE_CURRENT_LIST_DIR}/install_steps.cmake)

install_dtensor(${BUILD_DIR} ${WORK_DIR}/prefix)
run_step(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release)
run_step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
# It starts and runs on CPU as is, and with the CUDA libraries hidden from the loader
# (--inhibit-cache: only the loader's default directories, not ld.so.conf's, where the CUDA
# Toolkit's lib directory is): the CUDA runtime is linked statically and cuBLAS / NCCL are
# loaded on first GPU use, so ldd lists none of them.
set(exe ${WORK_DIR}/build/consumer)
execute_process(COMMAND ldd ${exe} RESULT_VARIABLE rc OUTPUT_VARIABLE needed ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ldd ${exe} failed: ${err}")
endif()
message(STATUS "ldd ${exe}:\n${needed}")
string(REGEX MATCHALL "lib(cuda|cudart|cublas|cublasLt|nccl)\\.so[^ \t\n]*" bad "${needed}")
if(bad)
  message(FATAL_ERROR "the full-package consumer needs ${bad} to start")
endif()
string(REGEX MATCH "[^ \t\n]*ld-linux[^ \t\n]*\\.so[^ \t\n]*" loader "${needed}")
run_step(${exe})
run_step(${loader} --inhibit-cache ${exe})
